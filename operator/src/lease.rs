//! Leader election on a `coordination.k8s.io/v1` Lease, so that two operator
//! replicas never both write Redis and status.
//!
//! A replica takes the Lease when it is free or its holder stopped renewing for a
//! whole lease duration, and renews it every third of that duration. Writes use the
//! Lease's resourceVersion, so of two replicas racing for it exactly one wins. A
//! leader that cannot renew stops (the process exits and restarts as a follower)
//! rather than risk acting beside a new leader.

use std::future::Future;
use std::time::Duration;

use k8s_openapi::api::coordination::v1::{Lease, LeaseSpec};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::MicroTime;
use k8s_openapi::jiff::{SignedDuration, Timestamp};
use kube::api::{ObjectMeta, PostParams};
use kube::{Api, Client};

use crate::{Error, Result};

#[derive(Clone)]
pub struct LeaderElector {
    api: Api<Lease>,
    name: String,
    identity: String,
    duration: Duration,
}

impl LeaderElector {
    pub fn new(
        client: Client,
        namespace: &str,
        name: &str,
        identity: &str,
        duration: Duration,
    ) -> Self {
        Self {
            api: Api::namespaced(client, namespace),
            name: name.to_string(),
            identity: identity.to_string(),
            duration,
        }
    }

    /// Takes or renews the Lease; `Ok(false)` while another replica holds it.
    pub async fn try_acquire(&self, now: Timestamp) -> Result<bool> {
        let seconds = i32::try_from(self.duration.as_secs()).unwrap_or(i32::MAX);
        let Some(mut lease) = self.api.get_opt(&self.name).await? else {
            let lease = Lease {
                metadata: ObjectMeta {
                    name: Some(self.name.clone()),
                    ..ObjectMeta::default()
                },
                spec: Some(LeaseSpec {
                    holder_identity: Some(self.identity.clone()),
                    lease_duration_seconds: Some(seconds),
                    acquire_time: Some(MicroTime(now)),
                    renew_time: Some(MicroTime(now)),
                    lease_transitions: Some(0),
                    ..LeaseSpec::default()
                }),
            };
            return conflict_is_false(self.api.create(&PostParams::default(), &lease).await);
        };
        let spec = lease.spec.get_or_insert_with(LeaseSpec::default);
        let mine = spec.holder_identity.as_deref() == Some(self.identity.as_str());
        let held_for =
            SignedDuration::from_secs(i64::from(spec.lease_duration_seconds.unwrap_or(seconds)));
        let expired = spec
            .renew_time
            .as_ref()
            .is_none_or(|renewed| renewed.0 + held_for < now);
        if !mine && !expired && spec.holder_identity.is_some() {
            return Ok(false);
        }
        if !mine {
            spec.holder_identity = Some(self.identity.clone());
            spec.acquire_time = Some(MicroTime(now));
            spec.lease_transitions = Some(spec.lease_transitions.unwrap_or(0) + 1);
        }
        spec.lease_duration_seconds = Some(seconds);
        spec.renew_time = Some(MicroTime(now));
        conflict_is_false(
            self.api
                .replace(&self.name, &PostParams::default(), &lease)
                .await,
        )
    }

    /// Waits to become the leader, then runs `work` while renewing. Returns when
    /// `work` ends, or with [`Error::LeadershipLost`] when the Lease cannot be kept.
    pub async fn run_as_leader<F: Future<Output = ()>>(
        &self,
        work: F,
        on_change: impl Fn(bool),
    ) -> Result<()> {
        let renew_every = self.duration / 3;
        loop {
            match self.try_acquire(Timestamp::now()).await {
                Ok(true) => break,
                Ok(false) => tracing::info!(lease = %self.name, "another replica leads; waiting"),
                Err(error) => tracing::warn!(lease = %self.name, %error, "cannot read the lease"),
            }
            tokio::time::sleep(renew_every).await;
        }
        tracing::info!(lease = %self.name, identity = %self.identity, "leading");
        on_change(true);
        let renewing = async {
            loop {
                tokio::time::sleep(renew_every).await;
                match self.try_acquire(Timestamp::now()).await {
                    Ok(true) => {}
                    Ok(false) => return Err(Error::LeadershipLost(self.name.clone())),
                    Err(error) => {
                        tracing::warn!(lease = %self.name, %error, "lease renewal failed");
                        return Err(Error::LeadershipLost(self.name.clone()));
                    }
                }
            }
        };
        let result = tokio::select! {
            () = work => Ok(()),
            lost = renewing => lost,
        };
        on_change(false);
        result
    }
}

fn conflict_is_false<T>(result: std::result::Result<T, kube::Error>) -> Result<bool> {
    match result {
        Ok(_) => Ok(true),
        Err(kube::Error::Api(status)) if status.code == 409 => Ok(false),
        Err(e) => Err(e.into()),
    }
}

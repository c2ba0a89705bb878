//! Leader election on a `coordination.k8s.io/v1` Lease, so that two operator
//! replicas never both write Redis and status.
//!
//! The rules, and why:
//! - A follower judges a Lease expired by its *own* monotonic clock: the holder's
//!   record (holder, renewTime, resourceVersion) must stay unchanged for a whole
//!   lease duration since this replica last saw it change. Comparing the holder's
//!   wall-clock `renewTime` with ours would let clock skew hand the Lease to a
//!   second replica while the first still acts.
//! - A leader renews every retry period and stops leading when no renewal succeeded
//!   for the renew deadline, which is shorter than the lease duration, measured
//!   from *before* the last successful request was sent. A follower starts its
//!   count after it saw that request's result, so the old leader has stopped before
//!   anyone may take over. One failed renewal is retried, not fatal.
//! - Every API call has a timeout, so a hung connection cannot keep a leader acting
//!   past its deadline.
//! - Writes carry the Lease's resourceVersion: of two replicas racing, one wins.
//! - A leader that shuts down releases the Lease (holder cleared), so a rollout
//!   does not pause reconciles for a lease duration.
//!
//! kube-lease-manager (the maintained crate for kube 5) was considered: it judges
//! expiry by comparing the holder's `renewTime` with the local wall clock, which is
//! exactly the skew hazard above, so the election stays here.

use std::future::Future;
use std::sync::Mutex;
use std::time::Duration;

use k8s_openapi::api::coordination::v1::{Lease, LeaseSpec};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::MicroTime;
use k8s_openapi::jiff::Timestamp;
use kube::api::{ObjectMeta, PostParams};
use kube::{Api, Client};
use tokio::time::Instant;

use crate::{Error, Result};

/// The timings of an election. `renew_deadline < duration` and
/// `retry_period < renew_deadline`; [`LeaseTimings::new`] enforces both.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LeaseTimings {
    /// How long a Lease that nobody renews protects its holder.
    pub duration: Duration,
    /// How long a leader goes on without a successful renewal before it stops.
    pub renew_deadline: Duration,
    /// Time between attempts (acquire or renew); also each API call's timeout.
    pub retry_period: Duration,
}

impl LeaseTimings {
    /// client-go's proportions (15 s / 10 s / 2 s) scaled to `duration`, at least
    /// 3 seconds.
    pub fn new(duration: Duration) -> Self {
        let duration = duration.max(Duration::from_secs(3));
        Self {
            duration,
            renew_deadline: duration.mul_f64(2.0 / 3.0),
            retry_period: duration.mul_f64(2.0 / 15.0),
        }
    }
}

/// What this replica last saw of the Lease, and when (its own clock).
#[derive(Clone, Debug, PartialEq, Eq)]
struct Seen {
    holder: Option<String>,
    renew_time: Option<Timestamp>,
    resource_version: Option<String>,
    at: Instant,
}

/// The outcome of one attempt to take or keep the Lease.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Attempt {
    /// This replica holds the Lease (taken or renewed).
    Leading,
    /// Another replica holds it, and has renewed it recently enough.
    HeldBy(String),
    /// Another replica wrote the Lease between our read and our write.
    Conflict,
}

pub struct LeaderElector {
    api: Api<Lease>,
    name: String,
    identity: String,
    timings: LeaseTimings,
    seen: Mutex<Option<Seen>>,
}

impl LeaderElector {
    pub fn new(
        client: Client,
        namespace: &str,
        name: &str,
        identity: &str,
        timings: LeaseTimings,
    ) -> Self {
        Self {
            api: Api::namespaced(client, namespace),
            name: name.to_string(),
            identity: identity.to_string(),
            timings,
            seen: Mutex::new(None),
        }
    }

    /// One attempt to take or renew the Lease. `now` is written into the Lease;
    /// expiry is judged by tokio's monotonic clock.
    pub async fn try_acquire(&self, now: Timestamp) -> Result<Attempt> {
        let seconds = i32::try_from(self.timings.duration.as_secs()).unwrap_or(i32::MAX);
        let Some(mut lease) = self.call(self.api.get_opt(&self.name)).await? else {
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
            return self.written(
                self.call(self.api.create(&PostParams::default(), &lease))
                    .await,
            );
        };
        let observed_at = self.observe(&lease);
        let spec = lease.spec.get_or_insert_with(LeaseSpec::default);
        let holder = spec.holder_identity.clone().filter(|h| !h.is_empty());
        let mine = holder.as_deref() == Some(self.identity.as_str());
        if let Some(other) = holder.as_ref().filter(|_| !mine) {
            // The holder's own duration, bounded so a hostile value cannot overflow.
            let held_for = spec
                .lease_duration_seconds
                .and_then(|s| u64::try_from(s).ok())
                .map_or(self.timings.duration, |s| {
                    Duration::from_secs(s.min(24 * 3600))
                });
            if observed_at.elapsed() < held_for {
                return Ok(Attempt::HeldBy(other.clone()));
            }
        }
        if !mine {
            spec.holder_identity = Some(self.identity.clone());
            spec.acquire_time = Some(MicroTime(now));
            spec.lease_transitions = Some(spec.lease_transitions.unwrap_or(0).saturating_add(1));
        }
        spec.lease_duration_seconds = Some(seconds);
        spec.renew_time = Some(MicroTime(now));
        self.written(
            self.call(self.api.replace(&self.name, &PostParams::default(), &lease))
                .await,
        )
    }

    /// Clears the holder if it is us, so that a follower takes over at once.
    pub async fn release(&self) -> Result<()> {
        let Some(mut lease) = self.call(self.api.get_opt(&self.name)).await? else {
            return Ok(());
        };
        let spec = lease.spec.get_or_insert_with(LeaseSpec::default);
        if spec.holder_identity.as_deref() != Some(self.identity.as_str()) {
            return Ok(());
        }
        spec.holder_identity = None;
        spec.renew_time = None;
        spec.acquire_time = None;
        self.call(self.api.replace(&self.name, &PostParams::default(), &lease))
            .await?;
        Ok(())
    }

    /// Waits to lead, runs `work` while the Lease is kept, and returns when `work`
    /// ends, when `shutdown` completes (after releasing the Lease) or with
    /// [`Error::LeadershipLost`] when no renewal succeeded within the deadline.
    pub async fn run_as_leader<F: Future<Output = ()>>(
        &self,
        work: F,
        shutdown: impl Future<Output = ()>,
        on_change: impl Fn(bool),
    ) -> Result<()> {
        let mut shutdown = std::pin::pin!(shutdown);
        let mut last_renewed = loop {
            let started = Instant::now();
            match self.try_acquire(Timestamp::now()).await {
                Ok(Attempt::Leading) => break started,
                Ok(Attempt::HeldBy(holder)) => {
                    tracing::debug!(lease = %self.name, %holder, "another replica leads")
                }
                Ok(Attempt::Conflict) => {}
                Err(error) => tracing::warn!(lease = %self.name, %error, "cannot read the lease"),
            }
            tokio::select! {
                () = tokio::time::sleep(self.timings.retry_period) => {}
                () = &mut shutdown => return Ok(()),
            }
        };
        tracing::info!(lease = %self.name, identity = %self.identity, "leading");
        on_change(true);
        let renewing = async {
            loop {
                // Stops at the deadline even while an attempt hangs.
                let deadline = last_renewed + self.timings.renew_deadline;
                let attempt = async {
                    tokio::time::sleep(self.timings.retry_period).await;
                    let started = Instant::now();
                    (started, self.try_acquire(Timestamp::now()).await)
                };
                tokio::select! {
                    () = tokio::time::sleep_until(deadline) => {
                        tracing::error!(lease = %self.name, "no renewal within the deadline: stopping");
                        return Error::LeadershipLost(self.name.clone());
                    }
                    (started, result) = attempt => match result {
                        Ok(Attempt::Leading) => last_renewed = started,
                        Ok(Attempt::HeldBy(holder)) => {
                            tracing::error!(lease = %self.name, %holder, "another replica took the lease");
                            return Error::LeadershipLost(self.name.clone());
                        }
                        Ok(Attempt::Conflict) => {
                            tracing::warn!(lease = %self.name, "lease renewal conflicted; retrying")
                        }
                        Err(error) => {
                            tracing::warn!(lease = %self.name, %error, "lease renewal failed; retrying")
                        }
                    },
                }
            }
        };
        let mut work = std::pin::pin!(work);
        let result = tokio::select! {
            () = &mut work => Ok(()),
            lost = renewing => Err(lost),
            () = &mut shutdown => {
                // Reconciles in flight may finish (the controller drains on the same
                // signal) for one retry period: the last renewal plus the deadline
                // plus that stays inside the lease a follower waits out.
                let _ = tokio::time::timeout(self.timings.retry_period, &mut work).await;
                Ok(())
            }
        };
        on_change(false);
        if result.is_ok()
            && let Err(error) = self.release().await
        {
            tracing::warn!(lease = %self.name, %error, "could not release the lease");
        }
        result
    }

    /// Remembers the Lease's record and returns when this replica first saw it as
    /// it is now.
    fn observe(&self, lease: &Lease) -> Instant {
        let spec = lease.spec.as_ref();
        let now = Seen {
            holder: spec.and_then(|s| s.holder_identity.clone()),
            renew_time: spec.and_then(|s| s.renew_time.as_ref().map(|t| t.0)),
            resource_version: lease.metadata.resource_version.clone(),
            at: Instant::now(),
        };
        let mut seen = self.seen.lock().unwrap_or_else(|e| e.into_inner());
        match seen.as_ref() {
            Some(before)
                if Seen {
                    at: before.at,
                    ..now.clone()
                } == *before =>
            {
                before.at
            }
            _ => {
                *seen = Some(now.clone());
                now.at
            }
        }
    }

    fn written(&self, result: Result<Lease>) -> Result<Attempt> {
        match result {
            Ok(lease) => {
                self.observe(&lease);
                Ok(Attempt::Leading)
            }
            Err(Error::Kube(kube::Error::Api(status))) if status.code == 409 => {
                Ok(Attempt::Conflict)
            }
            Err(e) => Err(e),
        }
    }

    /// One API call, bounded by the retry period.
    async fn call<T>(
        &self,
        call: impl Future<Output = std::result::Result<T, kube::Error>>,
    ) -> Result<T> {
        match tokio::time::timeout(self.timings.retry_period, call).await {
            Ok(result) => Ok(result?),
            Err(_) => Err(Error::Timeout(format!(
                "lease {}: no answer within {:?}",
                self.name, self.timings.retry_period
            ))),
        }
    }
}

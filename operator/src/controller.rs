//! `dropgate-operator run`: the controller that keeps Redis in line with every
//! InventoryDrop in the cluster.

use std::collections::HashMap;
use std::hash::{DefaultHasher, Hash, Hasher};
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use dropgate_api::{InventoryDrop, InventoryDropStatus, Mode};
use dropgate_redis::Connection;
use futures::StreamExt;
use k8s_openapi::api::core::v1::{Namespace, Secret};
use k8s_openapi::jiff::Timestamp;
use kube::api::{Patch, PatchParams};
use kube::runtime::controller::{Action, Controller};
use kube::runtime::events::{Event as KubeEvent, EventType, Recorder, Reporter};
use kube::runtime::finalizer::{Event, finalizer};
use kube::runtime::{Predicate, WatchStreamExt, predicates, reflector, watcher};
use kube::{Api, Client, Resource, ResourceExt};
use tokio::sync::OnceCell;
use tokio_util::sync::CancellationToken;
use tracing::Instrument;

use crate::decide;
use crate::inject::webhook::Webhook;
use crate::lease::{LeaderElector, LeaseTimings};
use crate::memorystore::Memorystore;
use crate::metrics::{ErrorLabel, Metrics};
use crate::reconcile::{self, Reconciled};
use crate::{Error, Result, store};

/// Marks drops whose Redis keys must be removed before the object goes.
pub const FINALIZER: &str = "dropgate.io/cleanup";
/// The field manager of the status this operator writes by server-side apply.
pub const FIELD_MANAGER: &str = "dropgate-operator";
/// `"true"` lets a deleted drop go without removing its Redis keys (they are left
/// to their TTLs): the escape hatch when cleanup cannot succeed.
pub const SKIP_CLEANUP: &str = "dropgate.io/skip-cleanup";

/// Settings of the controller that tests and `main` choose.
#[derive(Clone, Debug)]
pub struct Settings {
    /// How often a healthy drop is reconciled again, so status REMAINING stays
    /// current and HA is re-verified.
    pub resync: Duration,
    /// First and largest delay of the exponential backoff after errors.
    pub backoff_base: Duration,
    pub backoff_max: Duration,
    /// Overrides every drop's Redis URL (like `apply --redis-url`).
    pub redis_url: Option<String>,
    /// How long an HA check that cannot be made keeps the last published mode.
    pub ha_grace: Duration,
}

impl Default for Settings {
    fn default() -> Self {
        Self {
            resync: Duration::from_secs(30),
            backoff_base: Duration::from_secs(2),
            backoff_max: Duration::from_secs(300),
            redis_url: None,
            ha_grace: Duration::from_secs(300),
        }
    }
}

/// What every reconcile shares.
pub struct Context {
    pub client: Client,
    pub memorystore: Memorystore,
    pub metrics: Arc<Metrics>,
    pub recorder: Recorder,
    pub settings: Settings,
    /// One reconnecting connection per Redis URL (and whether it is a cluster's),
    /// kept across reconciles. The map's lock is never held across a connect: a dead
    /// Redis delays only its own drops.
    redis: Mutex<HashMap<RedisTarget, Arc<OnceCell<Connection>>>>,
    /// Consecutive failures per drop, for the backoff.
    failures: Mutex<HashMap<String, u32>>,
}

impl Context {
    pub fn new(
        client: Client,
        memorystore: Memorystore,
        metrics: Arc<Metrics>,
        settings: Settings,
    ) -> Self {
        let reporter = Reporter {
            controller: FIELD_MANAGER.into(),
            instance: std::env::var("POD_NAME").ok(),
        };
        Self {
            recorder: Recorder::new(client.clone(), reporter),
            client,
            memorystore,
            metrics,
            settings,
            redis: Mutex::new(HashMap::new()),
            failures: Mutex::new(HashMap::new()),
        }
    }

    /// The connection to `url` (a cluster's when `cluster`), shared by every drop
    /// on it.
    async fn redis(&self, url: &str, cluster: bool) -> Result<Connection> {
        let cell = self
            .redis
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .entry((url.to_string(), cluster))
            .or_default()
            .clone();
        cell.get_or_try_init(|| store::connect(url, cluster))
            .await
            .cloned()
    }

    /// `--redis-url`, else `spec.redis.url`, else the Secret key `spec.redis.secretRef`.
    async fn redis_url(&self, drop: &InventoryDrop) -> Result<String> {
        if let Some(url) = self
            .settings
            .redis_url
            .as_ref()
            .or(drop.spec.redis.url.as_ref())
        {
            return Ok(url.clone());
        }
        let Some(secret_ref) = &drop.spec.redis.secret_ref else {
            return Err(Error::NoRedisUrl);
        };
        let namespace = drop.namespace().unwrap_or_else(|| "default".into());
        let secrets: Api<Secret> = Api::namespaced(self.client.clone(), &namespace);
        let problem = |problem: &str| Error::Secret {
            name: format!("{namespace}/{}", secret_ref.name),
            problem: problem.to_string(),
        };
        let secret = match secrets.get_opt(&secret_ref.name).await {
            Ok(secret) => secret.ok_or_else(|| problem("does not exist"))?,
            // The chart grants Secrets per namespace by default: say how to grant it.
            Err(kube::Error::Api(status)) if status.code == 403 => {
                return Err(problem(&format!(
                    "cannot be read: the operator may not get Secrets in namespace {namespace} (with the chart's operator.secretAccess: namespaces, add it to operator.secretNamespaces)"
                )));
            }
            Err(error) => return Err(error.into()),
        };
        let bytes = secret
            .data
            .as_ref()
            .and_then(|data| data.get(&secret_ref.key))
            .ok_or_else(|| problem(&format!("has no key {:?}", secret_ref.key)))?;
        let value = String::from_utf8(bytes.0.clone())
            .map_err(|_| problem("holds a URL that is not UTF-8"))?;
        dropgate_api::check_redis_url(&value)
            .map_err(|why| problem(&format!("key {:?} {why}", secret_ref.key)))?;
        // A Secret made with `echo` ends in a newline, which is no part of the URL.
        Ok(value.trim_end().to_string())
    }

    fn backoff(&self, key: &str) -> Duration {
        let mut failures = self.failures.lock().unwrap_or_else(|e| e.into_inner());
        let n = failures.entry(key.to_string()).or_insert(0);
        *n = n.saturating_add(1);
        let factor = 2u32.saturating_pow(n.saturating_sub(1).min(16));
        self.settings
            .backoff_base
            .saturating_mul(factor)
            .min(self.settings.backoff_max)
    }

    fn succeeded(&self, key: &str) {
        self.failures
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(key);
    }
}

fn object_key(drop: &InventoryDrop) -> String {
    format!(
        "{}/{}",
        drop.namespace().unwrap_or_default(),
        drop.name_any()
    )
}

/// A Redis URL and whether it names a cluster.
type RedisTarget = (String, bool);

/// One reconcile of one drop, wrapped in the finalizer: Apply makes Redis match,
/// Cleanup removes the drop's keys before Kubernetes deletes the object.
pub async fn reconcile(drop: Arc<InventoryDrop>, ctx: Arc<Context>) -> Result<Action> {
    let span = reconcile::span(&drop);
    let reconciled = reconcile_traced(drop, ctx).instrument(span.clone()).await;
    if reconciled.is_err() {
        span.record("otel.status_code", "ERROR");
    }
    reconciled
}

async fn reconcile_traced(drop: Arc<InventoryDrop>, ctx: Arc<Context>) -> Result<Action> {
    let started = Instant::now();
    ctx.metrics.reconciliations.inc();
    let namespace = drop.namespace().unwrap_or_else(|| "default".into());
    let api: Api<InventoryDrop> = Api::namespaced(ctx.client.clone(), &namespace);
    let result = finalizer(&api, FINALIZER, drop, |event| async {
        match event {
            Event::Apply(drop) => apply(&drop, &ctx, &api).await,
            Event::Cleanup(drop) => cleanup(&drop, &ctx).await,
        }
    })
    .await
    .map_err(|e| Error::Finalizer(Box::new(e)));
    ctx.metrics
        .duration
        .observe(started.elapsed().as_secs_f64());
    result
}

/// How soon a drop whose sale no ledger has claimed yet is reconciled again.
const CLAIM_WATCH: Duration = Duration::from_secs(2);

/// Counts the error and requeues with capped exponential backoff.
pub fn error_policy(drop: Arc<InventoryDrop>, error: &Error, ctx: Arc<Context>) -> Action {
    let label = error.metric_label();
    ctx.metrics
        .errors
        .get_or_create(&ErrorLabel { error: label })
        .inc();
    let delay = ctx.backoff(&object_key(&drop));
    tracing::warn!(drop = %object_key(&drop), %error, ?delay, "reconcile failed");
    Action::requeue(delay)
}

async fn apply(drop: &InventoryDrop, ctx: &Context, api: &Api<InventoryDrop>) -> Result<Action> {
    match reconcile_redis(drop, ctx).await {
        Ok(done) => {
            write_status(ctx, api, drop, &done.status).await?;
            // The claim is durable in status now: it may count (see DropKeys::ledger).
            let mut claim_unrecorded = false;
            if done.claim_waits
                && let Some(id) = done.status.ledger.as_deref()
                && let Err(error) = record_claim(drop, ctx, id).await
            {
                // The next reconcile's seed writes it back from status.
                tracing::warn!(drop = %object_key(drop), %error, "could not record the sale's ledger claim in Redis yet");
                claim_unrecorded = true;
            }
            // The mode is in Redis and the status written: an Event that cannot be
            // recorded is logged, not retried (a retry would not see the change).
            let mut events = Vec::new();
            if done.mode_changed()
                && let Some(mode) = done.mode()
            {
                events.push(mode_event(mode, &done));
            }
            events.extend(new_warnings(
                drop.status.as_ref(),
                &done.status,
                drop.spec.redis.require_high_availability,
            ));
            for event in events {
                if let Err(error) = publish(ctx, drop, event.type_, event.reason, event.note).await
                {
                    tracing::warn!(drop = %object_key(drop), reason = event.reason, %error, "could not record an Event");
                }
            }
            if drop.spec.redis.require_high_availability && done.status_says_unknown() {
                // An unanswered HA check that decides the mode: ask again soon,
                // backing off, but never later than the resync or half the grace
                // period (the failure policy must apply when the grace ends).
                let grace = ctx.settings.ha_grace / 2;
                let delay = ctx
                    .backoff(&object_key(drop))
                    .min(ctx.settings.resync)
                    .min(grace.max(Duration::from_secs(1)));
                return Ok(Action::requeue(delay));
            }
            ctx.succeeded(&object_key(drop));
            if done.status.ledger.is_none() || claim_unrecorded {
                // No ledger has claimed the sale yet: look again soon, so that a claim
                // (nothing is sold until it is recorded) is recorded within seconds,
                // not a resync later.
                return Ok(Action::requeue(ctx.settings.resync.min(CLAIM_WATCH)));
            }
            Ok(Action::requeue(ctx.settings.resync))
        }
        Err(error) => {
            // Say why in status before backing off; the error itself is what counts.
            let status = decide::failed_status(drop, &error, Timestamp::now());
            if let Err(e) = write_status(ctx, api, drop, &status).await {
                tracing::warn!(error = %e, "could not write the failure into status");
            }
            Err(error)
        }
    }
}

/// Writes the claim the status now holds back to Redis as recorded.
async fn record_claim(drop: &InventoryDrop, ctx: &Context, id: &str) -> Result<()> {
    let url = ctx.redis_url(drop).await?;
    let mut conn = ctx.redis(&url, drop.spec.redis.cluster).await?;
    crate::store::record_claim(&mut conn, &reconcile::keys_of(drop), id).await?;
    Ok(())
}

async fn reconcile_redis(drop: &InventoryDrop, ctx: &Context) -> Result<Reconciled> {
    reconcile::validate(drop, reconcile::Origin::ApiServer)?;
    let url = ctx.redis_url(drop).await?;
    let mut conn = ctx.redis(&url, drop.spec.redis.cluster).await?;
    let ha = reconcile::verify_ha(drop, &url, &mut conn, &ctx.memorystore).await;
    let now = Timestamp::now();
    let previous = drop.status.as_ref();
    let kept = decide::kept_mode(previous, &ha, now, ctx.settings.ha_grace);
    reconcile::reconcile(
        drop,
        &mut conn,
        ha,
        kept,
        previous,
        dropgate_api::keys::Claims::Recorded,
        now,
    )
    .await
}

/// An Event to record about a drop.
struct Note {
    type_: EventType,
    reason: &'static str,
    note: String,
}

/// The Warning Events `next` calls for that `previous` did not: an HA check that
/// went unanswered, a Redis that may evict the drop's keys.
fn new_warnings(
    previous: Option<&InventoryDropStatus>,
    next: &InventoryDropStatus,
    require_ha: bool,
) -> Vec<Note> {
    let find = |status: Option<&InventoryDropStatus>, type_: &str| {
        status.and_then(|s| s.conditions.iter().find(|c| c.type_ == type_).cloned())
    };
    let mut warnings = Vec::new();
    if let Some(ha) = find(Some(next), "HighlyAvailable")
        && require_ha
        && ha.status == "Unknown"
        && find(previous, "HighlyAvailable").is_none_or(|c| c.status != "Unknown")
    {
        warnings.push(Note {
            type_: EventType::Warning,
            reason: "HighAvailabilityUnknown",
            note: ha.message,
        });
    }
    if let Some(seeded) = find(Some(next), "Seeded")
        && seeded.reason == decide::EVICTION_POSSIBLE
        && find(previous, "Seeded").is_none_or(|c| c.reason != decide::EVICTION_POSSIBLE)
    {
        warnings.push(Note {
            type_: EventType::Warning,
            reason: decide::EVICTION_POSSIBLE,
            note: seeded.message,
        });
    }
    warnings
}

/// Removes the drop's keys. A cause that retrying cannot fix lets the drop go with
/// a Warning Event naming the keys left behind; anything else retries with backoff.
async fn cleanup(drop: &InventoryDrop, ctx: &Context) -> Result<Action> {
    // A deleted drop has no availability to alert on.
    ctx.metrics.set_high_availability(
        &drop.namespace().unwrap_or_default(),
        &drop.name_any(),
        None,
    );
    let keys = reconcile::keys_of(drop);
    let pattern = keys.pattern();
    let give_up = |cause: String| async move {
        let note = format!(
            "deleted without removing its Redis keys ({pattern}): {cause}; they are left to their TTLs (a drop without endsAt has none)"
        );
        tracing::warn!(drop = %object_key(drop), %note, "cleanup skipped");
        // A namespace being deleted refuses new Events: the drop goes anyway.
        if let Err(error) = publish(ctx, drop, EventType::Warning, "CleanupSkipped", note).await {
            tracing::warn!(drop = %object_key(drop), %error, "could not record the CleanupSkipped Event");
        }
        Ok(Action::await_change())
    };
    if drop.annotations().get(SKIP_CLEANUP).map(String::as_str) == Some("true") {
        return give_up(format!("annotation {SKIP_CLEANUP} is \"true\"")).await;
    }
    let removed = async {
        let url = ctx.redis_url(drop).await?;
        let mut conn = ctx.redis(&url, drop.spec.redis.cluster).await?;
        store::remove(&mut conn, &keys).await
    };
    let error = match removed.await {
        Ok(()) => {
            tracing::info!(drop = %object_key(drop), "removed the drop's Redis keys");
            return Ok(Action::await_change());
        }
        Err(error) => error,
    };
    if error.is_permanent() {
        return give_up(error.to_string()).await;
    }
    if drop.status.as_ref().is_none_or(|s| s.mode.is_none()) {
        return give_up(format!("it was never seeded, and {error}")).await;
    }
    if namespace_terminating(ctx, drop).await {
        return give_up(format!("its namespace is being deleted, and {error}")).await;
    }
    Err(error)
}

async fn namespace_terminating(ctx: &Context, drop: &InventoryDrop) -> bool {
    let Some(name) = drop.namespace() else {
        return false;
    };
    let namespaces: Api<Namespace> = Api::all(ctx.client.clone());
    match namespaces.get_opt(&name).await {
        Ok(Some(ns)) => ns.metadata.deletion_timestamp.is_some(),
        Ok(None) => true,
        Err(error) => {
            tracing::warn!(namespace = %name, %error, "cannot read the drop's namespace");
            false
        }
    }
}

/// Server-side apply of the status subresource under [`FIELD_MANAGER`].
async fn write_status(
    ctx: &Context,
    api: &Api<InventoryDrop>,
    drop: &InventoryDrop,
    status: &InventoryDropStatus,
) -> Result<()> {
    let patch = serde_json::json!({
        "apiVersion": "dropgate.io/v1alpha1",
        "kind": "InventoryDrop",
        "status": status,
    });
    ctx.metrics.status_patches.inc();
    api.patch_status(
        &drop.name_any(),
        &PatchParams::apply(FIELD_MANAGER).force(),
        &Patch::Apply(&patch),
    )
    .await?;
    if let Some(ha) = status
        .conditions
        .iter()
        .find(|c| c.type_ == "HighlyAvailable")
    {
        ctx.metrics.set_high_availability(
            &drop.namespace().unwrap_or_default(),
            &drop.name_any(),
            Some(&ha.status),
        );
    }
    Ok(())
}

/// The Event of a mode change: GateEnabled, FailOpenEnabled or GateClosed.
fn mode_event(mode: Mode, done: &Reconciled) -> Note {
    let (type_, reason) = match mode {
        Mode::Gate => (EventType::Normal, "GateEnabled"),
        Mode::FailOpen => (EventType::Warning, "FailOpenEnabled"),
        Mode::Closed => (EventType::Warning, "GateClosed"),
    };
    let why = done
        .status
        .conditions
        .iter()
        .find(|c| c.type_ == "FailOpen")
        .map(|c| c.message.clone())
        .unwrap_or_default();
    let from = done.previous_mode.map_or("unpublished", Mode::as_str);
    Note {
        type_,
        reason,
        note: format!("mode {from} -> {mode}: {why}"),
    }
}

async fn publish(
    ctx: &Context,
    drop: &InventoryDrop,
    type_: EventType,
    reason: &str,
    note: String,
) -> Result<()> {
    ctx.recorder
        .publish(
            &KubeEvent {
                type_,
                reason: reason.into(),
                note: Some(note),
                action: "Reconcile".into(),
                secondary: None,
            },
            &drop.object_ref(&()),
        )
        .await?;
    Ok(())
}

/// Process settings of `dropgate-operator run`.
#[derive(Clone, Debug)]
pub struct RunSettings {
    pub admin_listen: SocketAddr,
    pub lease_namespace: String,
    pub lease_name: String,
    pub identity: String,
    pub lease: LeaseTimings,
    /// Where to serve the injection webhook, and its certificate directory.
    pub webhook: Option<(SocketAddr, std::path::PathBuf)>,
    pub injection: crate::inject::Settings,
    pub controller: Settings,
}

/// What wakes a drop's reconcile from the watch: its spec (generation), its
/// finalizers, its deletion and the skip-cleanup annotation. Status writes (ours
/// included) do not: they would make every status patch trigger the next reconcile.
/// The resync and error backoff requeue on their own.
pub fn worth_a_reconcile(drop: &InventoryDrop) -> Option<u64> {
    let deletion = |d: &InventoryDrop| {
        let mut hasher = DefaultHasher::new();
        d.meta().deletion_timestamp.is_some().hash(&mut hasher);
        d.annotations().get(SKIP_CLEANUP).hash(&mut hasher);
        Some(hasher.finish())
    };
    predicates::generation
        .combine(predicates::finalizers)
        .combine(deletion)
        .hash_property(drop)
}

/// Runs the controller (while leader) and the admin server until `shutdown`
/// completes; the Lease is released on the way out.
pub async fn run(
    settings: RunSettings,
    memorystore: Memorystore,
    shutdown: CancellationToken,
) -> Result<()> {
    let admin = crate::admin::bind(settings.admin_listen)
        .await
        .map_err(Error::Admin)?;
    let client = Client::try_default().await?;
    let metrics = Arc::new(Metrics::default());
    tokio::spawn(crate::admin::serve(
        admin,
        metrics.clone(),
        shutdown.clone(),
    ));
    // Every replica answers admission, leader or not.
    if let Some((addr, cert_dir)) = settings.webhook {
        let webhook = Webhook::bind(addr, cert_dir, settings.injection)
            .await
            .map_err(Error::Webhook)?;
        tokio::spawn(webhook.run(shutdown.clone()));
    }
    let ctx = Arc::new(Context::new(
        client.clone(),
        memorystore,
        metrics.clone(),
        settings.controller,
    ));
    let elector = LeaderElector::new(
        client.clone(),
        &settings.lease_namespace,
        &settings.lease_name,
        &settings.identity,
        settings.lease,
    );
    let drops: Api<InventoryDrop> = Api::all(client);
    let (reader, writer) = reflector::store();
    let changes = watcher(drops, watcher::Config::default().any_semantic())
        .default_backoff()
        .reflect(writer)
        .applied_objects()
        .predicate_filter(worth_a_reconcile, Default::default());
    let controller = Controller::for_stream(changes, reader)
        .graceful_shutdown_on(shutdown.clone().cancelled_owned())
        .run(reconcile, error_policy, ctx)
        .for_each(|_| futures::future::ready(()));
    elector
        .run_as_leader(controller, shutdown.cancelled_owned(), |leading| {
            metrics.leader.set(i64::from(leading));
        })
        .await
}

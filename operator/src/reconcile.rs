//! One reconcile of one drop against its Redis: verify HA, decide the mode, publish
//! and seed, read the stock back, and judge the status. The controller and `apply`
//! both run exactly this.

use dropgate_api::{DropKeys, InventoryDrop, InventoryDropStatus, Mode};
use dropgate_redis::Connection;
use k8s_openapi::jiff::Timestamp;
use kube::ResourceExt;

use crate::decide::{self, Observed};
use crate::ha::{self, HaReport};
use crate::memorystore::Memorystore;
use crate::{Error, Result, store};

/// The result of one reconcile.
#[derive(Debug)]
pub struct Reconciled {
    pub status: InventoryDropStatus,
    /// The mode published before, when the drop was published; a change emits an Event.
    pub previous_mode: Option<Mode>,
    /// Why the drop is not Ready, when it is not.
    pub not_ready: Option<Error>,
    /// A sidecar's claim of the sale's ledger waits to be written back as recorded
    /// (by the next reconcile's seed, once status holds it).
    pub claim_waits: bool,
}

impl Reconciled {
    pub fn mode(&self) -> Option<Mode> {
        self.status.mode
    }

    pub fn mode_changed(&self) -> bool {
        self.previous_mode != self.status.mode
    }

    /// The HA check went unanswered (the HighlyAvailable condition is Unknown).
    pub fn status_says_unknown(&self) -> bool {
        self.status
            .conditions
            .iter()
            .any(|c| c.type_ == "HighlyAvailable" && c.status == "Unknown")
    }
}

/// Key names of `drop`, from its namespace (`default` when a manifest names none)
/// and name.
pub fn keys_of(drop: &InventoryDrop) -> DropKeys {
    let namespace = drop.namespace().unwrap_or_else(|| "default".to_string());
    DropKeys::new(&namespace, &drop.name_any())
}

/// Where an object to reconcile comes from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Origin {
    /// A manifest `apply` read: no API server judged it.
    Manifest,
    /// The API server, which judged it with the CRD's rules when it was written;
    /// one rule is ratcheted there (an object stored before it may keep a short
    /// hold, published raised: see `InventoryDropSpec::published_hold_seconds`).
    ApiServer,
}

/// Checks what Kubernetes would have checked before the object reached us.
pub fn validate(drop: &InventoryDrop, origin: Origin) -> Result<()> {
    let name = drop.name_any();
    let namespace = drop.namespace().unwrap_or_else(|| "default".to_string());
    for (field, value) in [("metadata.name", &name), ("metadata.namespace", &namespace)] {
        if !dropgate_api::keys::is_object_name(value) {
            return Err(Error::InvalidManifest(format!(
                "{field} {value:?} is not a valid Kubernetes object name"
            )));
        }
    }
    match origin {
        Origin::Manifest => drop.spec.validate()?,
        Origin::ApiServer => drop.spec.validate_stored()?,
    }
    Ok(())
}

/// The span of one reconcile of `drop` (named `namespace/name`): the HA check (and
/// its Memorystore call) and the seeding are its children; [`reconcile`], run
/// inside it, adds the mode chosen and the HA verdict it was chosen on.
pub fn span(drop: &InventoryDrop) -> tracing::Span {
    tracing::info_span!(
        "reconcile",
        dropgate.drop = %format_args!(
            "{}/{}",
            drop.namespace().as_deref().unwrap_or("default"),
            drop.name_any()
        ),
        dropgate.mode = tracing::field::Empty,
        dropgate.ha.verdict = tracing::field::Empty,
        dropgate.ha.reason = tracing::field::Empty,
        otel.status_code = tracing::field::Empty,
    )
}

/// Reconciles `drop` into the Redis behind `conn`, given what [`verify_ha`] found.
/// `previous` is the status last written, so that condition transition times carry
/// over; `kept` is the mode to keep while the HA check goes unanswered
/// ([`decide::kept_mode`]).
pub async fn reconcile(
    drop: &InventoryDrop,
    conn: &mut Connection,
    ha_report: HaReport,
    kept: Option<Mode>,
    previous: Option<&InventoryDropStatus>,
    claims: dropgate_api::keys::Claims,
    now: Timestamp,
) -> Result<Reconciled> {
    // Each caller judged the object by where it came from; this is the floor every
    // published config stands on.
    validate(drop, Origin::ApiServer)?;
    let keys = keys_of(drop);
    let spec = &drop.spec;
    let mode = decide::mode(
        &spec.gate,
        spec.redis.require_high_availability,
        &ha_report,
        kept,
    );
    // On the caller's reconcile span (see `span`).
    let span = tracing::Span::current();
    span.record("dropgate.mode", mode.as_str());
    span.record("dropgate.ha.verdict", ha_report.verdict.as_str());
    span.record("dropgate.ha.reason", ha_report.reason);
    let kept = kept.is_some()
        && spec.gate.enabled
        && spec.redis.require_high_availability
        && !ha_report.is_verified();
    let config = decide::config(drop, mode);
    let created_ms = drop
        .metadata
        .creation_timestamp
        .as_ref()
        .map(|t| t.0.as_millisecond());
    let kept_ledger = previous.and_then(|status| status.ledger.as_deref());
    let seeded = store::seed(conn, &keys, &config, created_ms, kept_ledger, claims).await?;
    let stock = store::stock(conn, &keys).await?;
    let sale_ledger = store::sale_ledger(conn, &keys).await?;
    // A claim this reconcile records in status still waits for the next seed to
    // count: look again soon.
    let claim_waits = matches!(sale_ledger, store::SaleLedger::Claimed(_));
    let ledger = sale_ledger.id().map(str::to_string);
    let eviction_policy = ha::eviction_policy(conn).await;
    tracing::info!(
        namespace = drop.namespace().as_deref().unwrap_or("default"),
        drop = %drop.name_any(),
        %mode,
        tier = ?ha_report.tier,
        created = seeded.created,
        moved = seeded.moved,
        remaining = stock.remaining,
        held = stock.held,
        "reconciled"
    );
    let previous_mode = seeded.previous_mode;
    let observed = Observed {
        mode,
        ha: ha_report,
        kept,
        seeded,
        stock,
        ledger,
        eviction_policy,
        now,
    };
    let not_ready = (!decide::ready(drop, &observed))
        .then(|| Error::HighAvailabilityMissing(observed.ha.message.clone()));
    Ok(Reconciled {
        status: decide::status(drop, &observed, previous),
        previous_mode,
        not_ready,
        claim_waits,
    })
}

/// Verifies the drop's Redis at `url`: through the Memorystore API when the drop
/// names an instance, else by `INFO replication`.
pub async fn verify_ha(
    drop: &InventoryDrop,
    url: &str,
    conn: &mut Connection,
    memorystore: &Memorystore,
) -> HaReport {
    match (&drop.spec.redis.memorystore, drop.spec.redis.cluster) {
        (Some(instance), false) => memorystore.verify(instance, url).await,
        (Some(cluster), true) => memorystore.verify_cluster(cluster, url).await,
        (None, false) => ha::replication(conn).await,
        (None, true) => ha::cluster_shards(conn).await,
    }
}

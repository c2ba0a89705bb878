//! The drops as the API server holds them: what a fallback decision checks the
//! config it holds against when Redis cannot be asked (`--watch-drops`, set by the
//! webhook).
//!
//! The operator publishes a change of a drop (a limit cut, an end moved, a pause)
//! into Redis after the API server took it. A sidecar that cannot reach Redis would
//! otherwise decide its fallback admissions on the config it read before the
//! change. So it watches its namespace's InventoryDrops (metadata only: the uid that
//! names the sale, and the spec's `metadata.generation`, which the published config
//! carries), and a fallback admission (a reserve, a cart, an extension; confirms and
//! cancels decide nothing about stock) is refused while the watch is not caught up or
//! says the drop moved past the config held (see `service::published_now`). Every
//! error restarts the watch with a full list, and nothing is trusted until that list
//! is complete: a watch that resumed where it broke off cannot tell when it has
//! caught up.
//!
//! Besides the watch (which breaks late when its connection goes silent), each
//! fallback admission waits for a read of the drop from the API server begun after
//! the admission began: a change the API server took before a buyer asked is seen,
//! whatever the watch's lag and whenever the operator publishes it.

use std::collections::HashMap;
use std::sync::atomic::AtomicI64;
use std::sync::{Arc, RwLock};
use std::time::{Duration, Instant};

use dropgate_api::{DropConfig, InventoryDrop};
use futures::StreamExt;
use kube::api::Api;
use kube::core::PartialObjectMeta;
use kube::runtime::watcher::{self, Event};
use prometheus_client::metrics::gauge::Gauge;

/// Metadata only: what the check needs, and nothing of the spec travels.
type DropMeta = PartialObjectMeta<InventoryDrop>;

/// What the API server holds of one drop.
#[derive(Clone, Debug, PartialEq, Eq)]
struct Listed {
    /// The sale's identity: under the operator a drop's `sale` is its uid.
    uid: String,
    generation: i64,
}

#[derive(Debug, Default)]
struct State {
    /// A complete list arrived and no error came since.
    caught_up: bool,
    drops: HashMap<String, Listed>,
}

/// This sidecar's watch of its namespace's InventoryDrops.
#[derive(Debug, Clone)]
pub struct DropWatch {
    state: Arc<RwLock<State>>,
    /// `caught_up` for /metrics (`dropgate_sidecar_drop_watch_caught_up`): a watch
    /// that is forbidden shows nothing else until Redis fails.
    gauge: Gauge<i64, AtomicI64>,
    api: Api<DropMeta>,
    /// Each drop's last read of the API server. A drop's lock is held across its
    /// read, so that the admissions that need one share it; other drops wait for
    /// nothing.
    reads: Arc<std::sync::Mutex<HashMap<String, ReadSlot>>>,
}

/// One drop's last read, locked across the next one.
type ReadSlot = Arc<tokio::sync::Mutex<Option<Read>>>;

/// A read of one drop in the API server.
#[derive(Debug)]
struct Read {
    began: Instant,
    ended: Instant,
    /// The drop, or none; or why the read failed (kept as an answer for
    /// [`FAILED_READ_STANDS`] after it ended, so that a silent API server costs
    /// each admission one wait at most, not one per admission queued before it).
    found: Result<Option<Listed>, String>,
}

/// Whether a config held may decide a fallback admission.
#[derive(Debug, PartialEq, Eq)]
pub enum Verdict {
    /// The API server holds the drop of the config's sale at the config's
    /// generation (or an older one: the config came from a newer object than the
    /// watch has seen yet).
    Current,
    /// It holds a newer one, or none, or the watch is not caught up: nothing may be
    /// decided on the config held. The reason, for the 503.
    Stale(String),
}

/// The longest wait between two attempts to restart a broken watch.
const RETRY_MAX: Duration = Duration::from_secs(10);
/// How long a failed read of the API server stands for the reads after it (each
/// admission meanwhile is refused at once instead of waiting [`READ_BOUND`]).
const FAILED_READ_STANDS: Duration = Duration::from_secs(1);
/// How long a decision waits for such a read.
const READ_BOUND: Duration = Duration::from_secs(1);
/// The least time between the starts of two reads of one drop.
const READ_SPACING: Duration = Duration::from_millis(100);

impl DropWatch {
    /// Connects as the pod's service account (or `KUBECONFIG`) and starts watching
    /// `namespace`. Fails when no client can be built: a sidecar told to check its
    /// fallback against the API server never falls back without that check.
    pub async fn start(namespace: &str) -> Result<Self, kube::Error> {
        let client = kube::Client::try_default().await?;
        let api: Api<DropMeta> = Api::namespaced(client, namespace);
        let watch = Self {
            state: Arc::default(),
            gauge: Gauge::default(),
            api: api.clone(),
            reads: Arc::default(),
        };
        tokio::spawn(watch.clone().run(api));
        Ok(watch)
    }

    /// The gauge of [`State::caught_up`], to register with the metrics.
    pub fn caught_up_gauge(&self) -> Gauge<i64, AtomicI64> {
        self.gauge.clone()
    }

    async fn run(self, api: Api<DropMeta>) {
        let mut retry = Duration::from_millis(250);
        loop {
            let mut events =
                std::pin::pin!(watcher::watcher(api.clone(), watcher::Config::default()));
            let mut listing: Option<HashMap<String, Listed>> = None;
            while let Some(event) = events.next().await {
                let mut state = self.state.write().unwrap_or_else(|e| e.into_inner());
                match event {
                    Ok(Event::Init) => {
                        // A new list: what was seen may have moved on unseen.
                        state.caught_up = false;
                        self.gauge.set(0);
                        listing = Some(HashMap::new());
                    }
                    Ok(Event::InitApply(object)) => {
                        if let (Some(listing), Some((name, listed))) =
                            (&mut listing, entry(&object))
                        {
                            listing.insert(name, listed);
                        }
                    }
                    Ok(Event::InitDone) => {
                        state.drops = listing.take().unwrap_or_default();
                        state.caught_up = true;
                        self.gauge.set(1);
                        retry = Duration::from_millis(250);
                    }
                    Ok(Event::Apply(_) | Event::Delete(_))
                        if crate::faults::check(crate::faults::Fault::WatchLags).is_err() => {}
                    Ok(Event::Apply(object)) => {
                        if let Some((name, listed)) = entry(&object) {
                            state.drops.insert(name, listed);
                        }
                    }
                    Ok(Event::Delete(object)) => {
                        if let Some(name) = &object.metadata.name {
                            state.drops.remove(name);
                        }
                    }
                    Err(error) => {
                        state.caught_up = false;
                        self.gauge.set(0);
                        tracing::warn!(%error, "the watch of InventoryDrops failed (forbidden: see sidecar.dropReaders): no fallback admission is decided until it has listed them again");
                        // kube's watcher would resume where it broke off, without a
                        // list that says when it has caught up: start a new one.
                        break;
                    }
                }
            }
            self.state
                .write()
                .unwrap_or_else(|e| e.into_inner())
                .caught_up = false;
            self.gauge.set(0);
            tokio::time::sleep(retry).await;
            retry = (retry * 2).min(RETRY_MAX);
        }
    }

    /// Whether `config`, held for drop `name`, may decide a fallback admission now:
    /// the watch must be caught up and agree, and so must a read of the API server
    /// begun after this check was (a watch whose connection went silent breaks only
    /// minutes later, and one that lags would let a change the API server took
    /// before this admission began go unseen). Checks waiting for a drop's read
    /// share the next one, which starts [`READ_SPACING`] after the last at the
    /// soonest; a read that failed stands for [`FAILED_READ_STANDS`] after it ended.
    pub async fn check(&self, name: &str, config: &DropConfig) -> Verdict {
        let asked = Instant::now();
        let watched = watched(
            &self.state.read().unwrap_or_else(|e| e.into_inner()),
            name,
            config,
        );
        if let Verdict::Stale(why) = watched {
            return Verdict::Stale(why);
        }
        let slot = self
            .reads
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .entry(name.to_string())
            .or_default()
            .clone();
        let mut last = slot.lock().await;
        let read = match &*last {
            Some(read) if read.began >= asked => read,
            Some(read) if read.found.is_err() && read.ended.elapsed() < FAILED_READ_STANDS => read,
            _ => {
                // Reads of one drop are spaced: the admissions that arrive
                // meanwhile wait for the next one together, so a busy fallback
                // asks the API server a few times a second per drop, not once per
                // round trip.
                if let Some(read) = &*last {
                    tokio::time::sleep_until((read.began + READ_SPACING).into()).await;
                }
                let began = Instant::now();
                let found = match tokio::time::timeout(READ_BOUND, self.api.get_opt(name)).await {
                    Ok(Ok(found)) => Ok(found.as_ref().and_then(entry).map(|(_, listed)| listed)),
                    Ok(Err(error)) => Err(format!(
                        "the API server could not be asked for drop {name} ({error})"
                    )),
                    Err(_) => Err(format!(
                        "the API server did not answer for drop {name} within {} ms",
                        READ_BOUND.as_millis()
                    )),
                };
                &*last.insert(Read {
                    began,
                    ended: Instant::now(),
                    found,
                })
            }
        };
        match &read.found {
            Ok(listed) => verdict(name, listed.as_ref(), config),
            Err(why) => Verdict::Stale(format!(
                "{why}, so this sidecar cannot tell whether the config it holds is current: nothing is decided on it; retry"
            )),
        }
    }
}

/// What the watch says of `config`, held for drop `name`.
fn watched(state: &State, name: &str, config: &DropConfig) -> Verdict {
    if !state.caught_up {
        return Verdict::Stale(format!(
            "this sidecar's watch of the API server is not caught up (see its log), so it cannot tell whether drop {name}'s config it holds is current: nothing is decided on it; retry"
        ));
    }
    verdict(name, state.drops.get(name), config)
}

/// The drop's name and what is listed of it, when it has both a uid and a generation.
fn entry(object: &DropMeta) -> Option<(String, Listed)> {
    let meta = &object.metadata;
    Some((
        meta.name.clone()?,
        Listed {
            uid: meta.uid.clone()?,
            generation: meta.generation?,
        },
    ))
}

fn verdict(name: &str, listed: Option<&Listed>, config: &DropConfig) -> Verdict {
    match listed {
        None => Verdict::Stale(format!(
            "drop {name} is not in the API server as this sidecar sees it (deleted, or not seen yet): nothing is decided on the config it holds; retry"
        )),
        Some(listed) if listed.uid != config.sale => Verdict::Stale(format!(
            "drop {name} was re-created in the API server since the config this sidecar holds was published: nothing is decided on the old sale's; retry"
        )),
        Some(listed) if listed.generation > config.generation => Verdict::Stale(format!(
            "drop {name} changed (generation {} in the API server; the config this sidecar read in Redis is of generation {}): nothing is decided on it until the change is read; retry",
            listed.generation, config.generation
        )),
        Some(_) => Verdict::Current,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(sale: &str, generation: i64) -> DropConfig {
        DropConfig {
            sku: "X".into(),
            limit: 10,
            variants: Vec::new(),
            per_user_limit: 1,
            starts_at_ms: None,
            ends_at_ms: None,
            hold_seconds: 600,
            max_hold_seconds: 600,
            paused: false,
            waitlist: None,
            permits: 10,
            acquire_timeout_ms: 1000,
            mode: dropgate_api::Mode::FailOpen,
            failure_policy: dropgate_api::FailurePolicy::Open,
            generation,
            expire_at_ms: None,
            seeded_at_ms: None,
            sale: sale.into(),
        }
    }

    fn listed(uid: &str, generation: i64) -> Listed {
        Listed {
            uid: uid.into(),
            generation,
        }
    }

    const SALE: &str = "5b8e1c1e-3f0b-4a53-9f7e-6a2f8f1d0c11";

    #[test]
    fn the_config_of_the_generation_the_api_server_holds_decides() {
        assert_eq!(
            verdict("d", Some(&listed(SALE, 3)), &config(SALE, 3)),
            Verdict::Current
        );
        // The config came from a newer object than the watch has seen yet.
        assert_eq!(
            verdict("d", Some(&listed(SALE, 3)), &config(SALE, 4)),
            Verdict::Current
        );
    }

    #[test]
    fn a_spec_changed_deleted_or_recreated_since_the_read_decides_nothing() {
        let stale = |v: Verdict, words: &str| match v {
            Verdict::Stale(why) => assert!(why.contains(words), "{why}"),
            Verdict::Current => panic!("decided on a stale config ({words})"),
        };
        stale(
            verdict("d", Some(&listed(SALE, 4)), &config(SALE, 3)),
            "generation 4",
        );
        stale(verdict("d", None, &config(SALE, 3)), "deleted");
        stale(
            verdict("d", Some(&listed("another-sale", 3)), &config(SALE, 3)),
            "re-created",
        );
    }

    #[test]
    fn nothing_is_current_before_the_first_complete_list() {
        let mut state = State::default();
        state.drops.insert("d".into(), listed(SALE, 3));
        assert!(
            matches!(watched(&state, "d", &config(SALE, 3)), Verdict::Stale(why) if why.contains("not caught up"))
        );
        state.caught_up = true;
        assert_eq!(watched(&state, "d", &config(SALE, 3)), Verdict::Current);
    }
}

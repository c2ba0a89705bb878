//! The drops as the API server holds them: what a fallback decision checks the
//! config it holds against when Redis cannot be asked (`--watch-drops`, set by the
//! webhook).
//!
//! The operator publishes a change of a drop (a limit cut, an end moved, a pause)
//! into Redis after the API server took it. A sidecar that cannot reach Redis would
//! otherwise decide its fallback admissions on the config it read before the
//! change. So it watches its namespace's InventoryDrops (metadata only: the uid that
//! names the sale, and the spec's `metadata.generation`, which the published config
//! carries), and a fallback admission is refused while the watch is not caught up
//! or says the spec moved past the config held (see
//! `service::published_now`). Every error restarts the watch with a full list, and
//! nothing is trusted until that list is complete: a watch that resumed where it
//! broke off cannot tell when it has caught up.

use std::collections::HashMap;
use std::sync::{Arc, RwLock};
use std::time::Duration;

use dropgate_api::{DropConfig, InventoryDrop};
use futures::StreamExt;
use kube::api::Api;
use kube::core::PartialObjectMeta;
use kube::runtime::watcher::{self, Event};

/// Metadata only: what the check needs, and nothing of the spec travels.
type DropMeta = PartialObjectMeta<InventoryDrop>;

/// What the API server holds of one drop.
#[derive(Clone, Debug, PartialEq, Eq)]
struct Seen {
    uid: String,
    generation: i64,
}

#[derive(Debug, Default)]
struct State {
    /// A complete list arrived and no error came since.
    caught_up: bool,
    drops: HashMap<String, Seen>,
}

/// This sidecar's watch of its namespace's InventoryDrops.
#[derive(Debug, Clone)]
pub struct DropWatch {
    state: Arc<RwLock<State>>,
}

/// Whether a config held may decide a fallback admission.
#[derive(Debug, PartialEq, Eq)]
pub enum Verdict {
    /// The API server holds the drop at the config's generation (or an older one:
    /// the config came from a newer object than the watch has seen yet).
    Current,
    /// It does not: nothing may be decided on the config held. The reason, for the
    /// 503.
    Stale(String),
}

/// The longest wait between two attempts to restart a broken watch.
const RETRY_MAX: Duration = Duration::from_secs(10);

impl DropWatch {
    /// Connects as the pod's service account (or `KUBECONFIG`) and starts watching
    /// `namespace`. Fails when no client can be built: a sidecar told to check its
    /// fallback against the API server never falls back without that check.
    pub async fn start(namespace: &str) -> Result<Self, kube::Error> {
        let client = kube::Client::try_default().await?;
        let api: Api<DropMeta> = Api::namespaced(client, namespace);
        let watch = Self {
            state: Arc::default(),
        };
        tokio::spawn(watch.clone().run(api));
        Ok(watch)
    }

    async fn run(self, api: Api<DropMeta>) {
        let mut retry = Duration::from_millis(250);
        loop {
            let mut events =
                std::pin::pin!(watcher::watcher(api.clone(), watcher::Config::default()));
            let mut listing: Option<HashMap<String, Seen>> = None;
            while let Some(event) = events.next().await {
                let mut state = self.state.write().unwrap_or_else(|e| e.into_inner());
                match event {
                    Ok(Event::Init) => {
                        // A new list: what was seen may have moved on unseen.
                        state.caught_up = false;
                        listing = Some(HashMap::new());
                    }
                    Ok(Event::InitApply(object)) => {
                        if let (Some(listing), Some((name, seen))) = (&mut listing, seen(&object)) {
                            listing.insert(name, seen);
                        }
                    }
                    Ok(Event::InitDone) => {
                        state.drops = listing.take().unwrap_or_default();
                        state.caught_up = true;
                        retry = Duration::from_millis(250);
                    }
                    Ok(Event::Apply(object)) => {
                        if let Some((name, seen)) = seen(&object) {
                            state.drops.insert(name, seen);
                        }
                    }
                    Ok(Event::Delete(object)) => {
                        if let Some(name) = &object.metadata.name {
                            state.drops.remove(name);
                        }
                    }
                    Err(error) => {
                        state.caught_up = false;
                        tracing::warn!(%error, "the watch of InventoryDrops broke: no fallback admission is decided until it has listed them again");
                        break;
                    }
                }
            }
            self.state
                .write()
                .unwrap_or_else(|e| e.into_inner())
                .caught_up = false;
            tokio::time::sleep(retry).await;
            retry = (retry * 2).min(RETRY_MAX);
        }
    }

    /// Whether `config`, held for drop `name`, may decide a fallback admission now.
    pub fn check(&self, name: &str, config: &DropConfig) -> Verdict {
        let state = self.state.read().unwrap_or_else(|e| e.into_inner());
        if !state.caught_up {
            return Verdict::Stale(format!(
                "Redis cannot be asked for drop {name}'s config, and this sidecar's watch of the API server is not caught up (see its log): nothing is decided on the config it last read; retry"
            ));
        }
        verdict(name, state.drops.get(name), config)
    }
}

/// The drop's name and what is seen of it, when it has both a uid and a generation.
fn seen(object: &DropMeta) -> Option<(String, Seen)> {
    let meta = &object.metadata;
    Some((
        meta.name.clone()?,
        Seen {
            uid: meta.uid.clone()?,
            generation: meta.generation?,
        },
    ))
}

fn verdict(name: &str, seen: Option<&Seen>, config: &DropConfig) -> Verdict {
    match seen {
        None => Verdict::Stale(format!(
            "drop {name} is not in the API server (deleted): nothing is decided on the config this sidecar last read; retry"
        )),
        Some(seen) if seen.uid != config.sale => Verdict::Stale(format!(
            "drop {name} was re-created in the API server since this sidecar read its config, and Redis cannot be asked for the new one: nothing is decided on the old sale's; retry"
        )),
        Some(seen) if seen.generation > config.generation => Verdict::Stale(format!(
            "drop {name} changed (generation {} in the API server, {} read from Redis) and Redis cannot be asked for the change: nothing is decided on the config this sidecar last read; retry",
            seen.generation, config.generation
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

    fn seen(uid: &str, generation: i64) -> Seen {
        Seen {
            uid: uid.into(),
            generation,
        }
    }

    const SALE: &str = "5b8e1c1e-3f0b-4a53-9f7e-6a2f8f1d0c11";

    #[test]
    fn the_config_of_the_generation_the_api_server_holds_decides() {
        assert_eq!(
            verdict("d", Some(&seen(SALE, 3)), &config(SALE, 3)),
            Verdict::Current
        );
        // The config came from a newer object than the watch has seen yet.
        assert_eq!(
            verdict("d", Some(&seen(SALE, 3)), &config(SALE, 4)),
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
            verdict("d", Some(&seen(SALE, 4)), &config(SALE, 3)),
            "generation 4",
        );
        stale(verdict("d", None, &config(SALE, 3)), "deleted");
        stale(
            verdict("d", Some(&seen("another-sale", 3)), &config(SALE, 3)),
            "re-created",
        );
    }

    #[test]
    fn nothing_is_current_before_the_first_complete_list() {
        let watch = DropWatch {
            state: Arc::default(),
        };
        assert!(
            matches!(watch.check("d", &config(SALE, 3)), Verdict::Stale(why) if why.contains("not caught up"))
        );
    }
}

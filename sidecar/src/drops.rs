//! The drops this sidecar serves, learned from the config hashes in Redis.
//!
//! A drop is read on its first request and kept; a background task re-reads every
//! known drop, so a mode or throttle change reaches the sidecar within one refresh
//! and a deleted drop disappears. The last config read is kept while Redis is down:
//! an outage never turns a known drop into `not_found`.

use std::collections::HashMap;
use std::sync::{Arc, RwLock};

use dropgate_api::{ConfigError, DropConfig, DropKeys};
use dropgate_redis::Connection;
use redis::AsyncCommands;

use crate::throttle::Throttle;

/// One known drop.
#[derive(Debug)]
pub struct Drop {
    pub name: String,
    namespace: String,
    pub keys: DropKeys,
    config: RwLock<DropConfig>,
    pub throttle: Throttle,
    /// This sidecar's reserves and activations of the drop, batched (see
    /// [`crate::gate::Batcher`]).
    pub gate: crate::gate::Batcher,
    /// The keys this sidecar is admitting now (a duplicate waits for them here).
    pub in_flight: crate::in_flight::InFlight,
    /// Held while this sidecar opens the gate or hands the drop to the ledger, so
    /// that concurrent requests wait for one hand-over instead of racing their own.
    pub handover: tokio::sync::Mutex<()>,
    /// The openings of the gate under [`Drop::handover`], so that requests that
    /// found it closed share one opening that began after they looked.
    pub openings: Openings,
    /// On a Redis Cluster, whether this drop's shard is reachable (see
    /// [`App::breaker`](crate::app::App::breaker)).
    pub breaker: crate::breaker::Breaker,
    /// The Redis era (see [`App::redis_era`](crate::app::App::redis_era)) at which
    /// Redis was last found in line with the ledger for this drop; `u64::MAX`: not
    /// yet by this process.
    pub verified: std::sync::atomic::AtomicU64,
    /// When asking Redis for this drop's config last failed while its breaker was
    /// open (ms since the epoch): the fallback asks again only a little later.
    pub config_unreachable_at: std::sync::atomic::AtomicI64,
}

impl Drop {
    fn new(namespace: &str, name: &str, config: DropConfig) -> Self {
        Self {
            name: name.to_string(),
            namespace: namespace.to_string(),
            keys: DropKeys::new(namespace, name),
            throttle: Throttle::new(config.permits),
            gate: crate::gate::Batcher::new(DropKeys::new(namespace, name)),
            in_flight: crate::in_flight::InFlight::default(),
            config: RwLock::new(config),
            handover: tokio::sync::Mutex::new(()),
            openings: Openings::default(),
            breaker: crate::breaker::Breaker::default(),
            verified: std::sync::atomic::AtomicU64::new(u64::MAX),
            config_unreachable_at: std::sync::atomic::AtomicI64::new(0),
        }
    }

    /// `namespace/name/sale`, the drop's key in the ledger (of the sale last read).
    pub fn ledger_key(&self) -> String {
        self.ledger_key_of(&self.config().sale)
    }

    /// The drop's key in the ledger for `sale`.
    pub fn ledger_key_of(&self, sale: &str) -> String {
        dropgate_api::keys::ledger_key(&self.namespace, &self.name, sale)
    }

    /// The config as last read.
    pub fn config(&self) -> DropConfig {
        self.config
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    fn update(&self, config: DropConfig) {
        self.throttle.resize(config.permits);
        *self.config.write().unwrap_or_else(|e| e.into_inner()) = config;
    }

    /// Takes `config`, read from Redis a moment ago, as this drop's copy unless the
    /// copy is of another sale or of a newer generation (a read that answered late
    /// never moves the copy back).
    pub fn adopt(&self, config: &DropConfig) {
        let kept = self.config();
        if config.sale == kept.sale && config.generation >= kept.generation && *config != kept {
            self.update(config.clone());
        }
    }
}

/// Why a drop could not be looked up.
#[derive(Debug, thiserror::Error)]
pub enum LookupError {
    #[error("Redis is unreachable and this sidecar has not seen the drop before: {0}")]
    Unavailable(#[from] redis::RedisError),
    #[error("the drop's config hash is unreadable: {0}")]
    Damaged(#[from] ConfigError),
}

#[derive(Debug)]
pub struct Drops {
    namespace: String,
    known: RwLock<HashMap<String, Arc<Drop>>>,
    /// The ledger keys of sales a refresh found over (the drop deleted, or its
    /// config naming a new sale), whichever path refreshed: the background task
    /// notes them in the ledger (see [`Drops::take_over`]).
    over: std::sync::Mutex<Vec<String>>,
}

impl Drops {
    pub fn new(namespace: &str) -> Self {
        Self {
            namespace: namespace.to_string(),
            known: RwLock::new(HashMap::new()),
            over: std::sync::Mutex::new(Vec::new()),
        }
    }

    pub fn namespace(&self) -> &str {
        &self.namespace
    }

    /// Whether `name` is a drop this sidecar serves (without asking Redis).
    pub fn knows(&self, name: &str) -> bool {
        self.read().contains_key(name)
    }

    /// The drop `name`: from memory when known, else read from Redis. `Ok(None)` when
    /// no config is published for it.
    pub async fn get(
        &self,
        conn: &mut Connection,
        name: &str,
    ) -> Result<Option<Arc<Drop>>, LookupError> {
        if let Some(known) = self.read().get(name) {
            return Ok(Some(known.clone()));
        }
        self.refresh(conn, name).await
    }

    /// Re-reads `name` from Redis. On a Redis error a known drop is kept as it was,
    /// and so is one whose config is gone without the operator's deletion tombstone
    /// beside it (Redis lost it: the operator publishes it again).
    pub async fn refresh(
        &self,
        conn: &mut Connection,
        name: &str,
    ) -> Result<Option<Arc<Drop>>, LookupError> {
        let keys = DropKeys::new(&self.namespace, name);
        let fields: HashMap<String, String> = match conn.hgetall(keys.config()).await {
            Ok(fields) => fields,
            Err(e) => {
                return match self.read().get(name) {
                    Some(known) => Ok(Some(known.clone())),
                    None => Err(e.into()),
                };
            }
        };
        let known = self.read().get(name).cloned();
        if fields.is_empty()
            && let Some(known) = known
        {
            let deleted: bool = match conn.exists(keys.deleted()).await {
                Ok(deleted) => deleted,
                Err(_) => return Ok(Some(known)),
            };
            if !deleted {
                return Ok(Some(known));
            }
        }
        let mut known = self.known.write().unwrap_or_else(|e| e.into_inner());
        match DropConfig::from_fields(&fields)? {
            None => {
                if let Some(gone) = known.remove(name) {
                    self.note_over(gone.ledger_key());
                }
                Ok(None)
            }
            Some(config) => {
                if let Some(existing) = known.get(name) {
                    let before = existing.config().sale;
                    if config.sale != before {
                        self.note_over(existing.ledger_key_of(&before));
                    } else if config.generation < existing.config().generation
                        && existing.config().published_by_operator()
                    {
                        // Redis lost a change this sidecar read (a failover to a
                        // replica that missed it): the copy keeps the newer config,
                        // and the gate's admissions on the older one are taken back,
                        // until the operator publishes the change again. (Outside
                        // Kubernetes nothing would: the copy follows Redis.)
                        tracing::warn!(drop = %name, redis = config.generation, read = existing.config().generation, "Redis holds an older config of the drop than this sidecar read there");
                        return Ok(Some(existing.clone()));
                    }
                    existing.update(config);
                    return Ok(Some(existing.clone()));
                }
                let added = Arc::new(Drop::new(&self.namespace, name, config));
                known.insert(name.to_string(), added.clone());
                Ok(Some(added))
            }
        }
    }

    /// The config of `name` as Redis holds it right now, read without changing what
    /// this sidecar keeps (the background refresh does that): `Ok(None)` when Redis
    /// holds none (lost with its data, or deleted). What a decision that must not
    /// rest on an older copy reads.
    pub async fn published(
        &self,
        conn: &mut Connection,
        name: &str,
    ) -> Result<Option<DropConfig>, LookupError> {
        let keys = DropKeys::new(&self.namespace, name);
        let fields: HashMap<String, String> = conn.hgetall(keys.config()).await?;
        Ok(DropConfig::from_fields(&fields)?)
    }

    /// The sales found over since the last call (see [`Drops::give_back_over`]).
    pub fn take_over(&self) -> Vec<String> {
        std::mem::take(&mut *self.over.lock().unwrap_or_else(|e| e.into_inner()))
    }

    /// Puts back sales whose end could not be noted, for the next round.
    pub fn give_back_over(&self, sales: Vec<String>) {
        self.over
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .extend(sales);
    }

    fn note_over(&self, ledger_key: String) {
        self.over
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push(ledger_key);
    }

    /// Every known drop.
    pub fn all(&self) -> Vec<Arc<Drop>> {
        self.read().values().cloned().collect()
    }

    fn read(&self) -> std::sync::RwLockReadGuard<'_, HashMap<String, Arc<Drop>>> {
        self.known.read().unwrap_or_else(|e| e.into_inner())
    }
}

/// Tickets of the gate openings one sidecar runs for a drop, one after another.
///
/// A sale's first burst finds the gate closed in hundreds of requests at once; each
/// would open it in turn (reading the config, the ledger and Redis every time). A
/// request may instead use an opening that *began* after it found the gate closed:
/// that opening read everything the request's own would have read, or later. An
/// opening that began earlier proves nothing about what the request saw (Redis may
/// have lost the gate since), so it is not shared.
#[derive(Debug, Default)]
pub struct Openings {
    /// Tickets handed out: one per opening begun.
    begun: std::sync::atomic::AtomicU64,
    /// The ticket of the last opening that left the gate open (0: none since the
    /// last hand-over), and of the last one that also rebuilt a suspect Redis.
    open: std::sync::atomic::AtomicU64,
    open_suspect: std::sync::atomic::AtomicU64,
    /// The first ticket whose rebuild clears a suspicion raised on this drop's
    /// Redis (see [`Openings::suspect`]); 0: none.
    suspected: std::sync::atomic::AtomicU64,
    /// The ticket of the last opening that rebuilt Redis: unlike `open_suspect`,
    /// never forgotten (a hand-over to the ledger does not undo a rebuild).
    rebuilt: std::sync::atomic::AtomicU64,
}

impl Openings {
    /// Taken by a request when it found the gate closed, before it waits.
    pub fn seen(&self) -> u64 {
        self.begun.load(std::sync::atomic::Ordering::Acquire)
    }

    /// Whether an opening begun after `seen` left the gate open (rebuilding
    /// Redis if `suspect`). Asked under the hand-over lock.
    pub fn opened_since(&self, seen: u64, suspect: bool) -> bool {
        let last = if suspect {
            &self.open_suspect
        } else {
            &self.open
        };
        last.load(std::sync::atomic::Ordering::Acquire) > seen
    }

    /// A new opening's ticket. Taken under the hand-over lock, before its reads.
    pub fn begin(&self) -> u64 {
        self.begun.fetch_add(1, std::sync::atomic::Ordering::AcqRel) + 1
    }

    /// The opening `ticket` left the gate open.
    pub fn opened(&self, ticket: u64, suspect: bool) {
        use std::sync::atomic::Ordering;
        self.open.store(ticket, Ordering::Release);
        if suspect {
            self.open_suspect.store(ticket, Ordering::Release);
            self.rebuilt.fetch_max(ticket, Ordering::AcqRel);
        }
    }

    /// Redis was found to have lost a write outside a check (a join the ledger
    /// recorded, gone from it): until an opening begun after now rebuilds it,
    /// every check finds it behind ([`Openings::still_suspect`]), so that a
    /// rebuild that fails or is refused now is made by the next check.
    pub fn suspect(&self) {
        use std::sync::atomic::Ordering;
        let next = self.begun.load(Ordering::Acquire) + 1;
        self.suspected.fetch_max(next, Ordering::AcqRel);
    }

    /// Whether a suspicion raised by [`Openings::suspect`] still waits for its
    /// rebuild.
    pub fn still_suspect(&self) -> bool {
        use std::sync::atomic::Ordering;
        self.rebuilt.load(Ordering::Acquire) < self.suspected.load(Ordering::Acquire)
    }

    /// The drop was handed to the ledger: no earlier opening says the gate is open.
    pub fn forget(&self) {
        use std::sync::atomic::Ordering;
        self.open.store(0, Ordering::Release);
        self.open_suspect.store(0, Ordering::Release);
    }
}

#[cfg(test)]
mod tests {
    use super::Openings;

    #[test]
    fn a_suspicion_waits_for_a_rebuild_begun_after_it() {
        let openings = Openings::default();
        assert!(!openings.still_suspect());
        // A rebuild in flight when the loss was found read Redis before it.
        let earlier = openings.begin();
        openings.suspect();
        openings.opened(earlier, true);
        assert!(openings.still_suspect());
        // An opening that did not rebuild clears nothing.
        let plain = openings.begin();
        openings.opened(plain, false);
        assert!(openings.still_suspect());
        let rebuild = openings.begin();
        openings.opened(rebuild, true);
        assert!(!openings.still_suspect());
        // A hand-over to the ledger since does not undo that rebuild.
        openings.forget();
        assert!(!openings.still_suspect());
    }
}

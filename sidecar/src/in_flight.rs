//! The keys this sidecar is admitting right now, per drop.
//!
//! A duplicate of a reserve (a client's retry, a message delivered twice) that
//! reaches the same sidecar while the first attempt is still between the gate and
//! its answer would otherwise ask Redis again and again, hearing `pending` each time,
//! until the first is activated or taken back. It waits here instead, in the
//! process, and asks Redis once the first attempt has finished (or its own wait is
//! over): the same answer, without the polls that would load the drop's Redis core
//! while it is busiest.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::Instant;

use tokio::sync::watch;

#[derive(Debug, Default)]
pub struct InFlight {
    /// Key -> the attempt's terms (who, how many, which variant) and what its
    /// duplicates wait on.
    keys: Mutex<HashMap<String, (String, watch::Sender<()>)>>,
}

/// Held by the attempt admitting a key; dropping it (answered, failed or cancelled)
/// lets the duplicates waiting for it go on.
pub struct Admitting<'a> {
    in_flight: &'a InFlight,
    key: String,
}

impl InFlight {
    /// Takes `key` for this attempt (asking for `terms`), after waiting (until
    /// `until` at the latest) for an attempt of this sidecar that has it with the
    /// same terms. Past `until`, or when that attempt asks for other terms (Redis
    /// refuses the key at once), it goes on without it, and Redis says how that
    /// other attempt stands.
    pub async fn admit(&self, key: &str, terms: &str, until: Instant) -> Option<Admitting<'_>> {
        loop {
            let mut finished = {
                let mut keys = self.lock();
                match keys.get(key) {
                    Some((theirs, sender)) if theirs == terms => sender.subscribe(),
                    Some(_) => return None,
                    None => {
                        keys.insert(key.to_string(), (terms.to_string(), watch::channel(()).0));
                        return Some(Admitting {
                            in_flight: self,
                            key: key.to_string(),
                        });
                    }
                }
            };
            // The sender is dropped when that attempt finishes: `changed` ends.
            let waited = tokio::time::timeout_at(until.into(), finished.changed()).await;
            if waited.is_err() {
                return None;
            }
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, (String, watch::Sender<()>)>> {
        // The map is whole after any panic (an insert or a remove).
        self.keys
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }
}

impl Drop for Admitting<'_> {
    fn drop(&mut self) {
        // Dropping the sender wakes every duplicate waiting for this attempt.
        self.in_flight.lock().remove(&self.key);
    }
}

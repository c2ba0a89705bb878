//! The per-drop throttle: a semaphore of `throttle.permits`, one permit held per
//! reservation this sidecar admitted, from admission until confirm, cancel or expiry.
//!
//! It bounds how many unconfirmed holds one pod keeps in flight, so a burst of
//! buyers who never confirm cannot lock the whole stock away from the ones who do.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, RwLock};
use std::time::Duration;

use tokio::sync::{OwnedSemaphorePermit, Semaphore};

#[derive(Debug)]
pub struct Throttle {
    /// Replaced whole on resize: permits of the old semaphore return to it and
    /// vanish with it, so a shrink takes effect without tracking a debt.
    semaphore: RwLock<(u32, Arc<Semaphore>)>,
    /// Permits held for admitted reservations, by idempotency key, with the hold's
    /// deadline (ms since the epoch) so that expiry elsewhere still frees them.
    held: Mutex<HashMap<String, (OwnedSemaphorePermit, i64)>>,
}

impl Throttle {
    pub fn new(permits: u32) -> Self {
        Self {
            semaphore: RwLock::new((permits, Arc::new(Semaphore::new(permits as usize)))),
            held: Mutex::new(HashMap::new()),
        }
    }

    /// Applies a changed `throttle.permits`.
    pub fn resize(&self, permits: u32) {
        let mut guard = self.semaphore.write().unwrap_or_else(|e| e.into_inner());
        if guard.0 != permits {
            *guard = (permits, Arc::new(Semaphore::new(permits as usize)));
        }
    }

    /// Waits at most `timeout` for a permit.
    pub async fn acquire(&self, timeout: Duration) -> Option<OwnedSemaphorePermit> {
        let semaphore = self
            .semaphore
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .1
            .clone();
        if let Ok(permit) = semaphore.clone().try_acquire_owned() {
            return Some(permit);
        }
        tokio::time::timeout(timeout, semaphore.acquire_owned())
            .await
            .ok()?
            .ok()
    }

    /// Keeps `permit` for the reservation `key` until [`Throttle::release`] or its
    /// deadline.
    pub fn hold(&self, key: &str, permit: OwnedSemaphorePermit, deadline_ms: i64) {
        self.lock_held()
            .insert(key.to_string(), (permit, deadline_ms));
    }

    /// Gives back the permit of `key`, if this sidecar holds one.
    pub fn release(&self, key: &str) {
        self.lock_held().remove(key);
    }

    /// Gives back every permit whose hold's deadline is at or before `now_ms`.
    pub fn release_due(&self, now_ms: i64) -> usize {
        let mut held = self.lock_held();
        let before = held.len();
        held.retain(|_, (_, deadline)| *deadline > now_ms);
        before - held.len()
    }

    /// Permits currently held for reservations.
    pub fn in_use(&self) -> usize {
        self.lock_held().len()
    }

    fn lock_held(&self) -> std::sync::MutexGuard<'_, HashMap<String, (OwnedSemaphorePermit, i64)>> {
        self.held.lock().unwrap_or_else(|e| e.into_inner())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn a_held_permit_is_freed_by_release_or_deadline() {
        let throttle = Throttle::new(1);
        let permit = throttle
            .acquire(Duration::ZERO)
            .await
            .expect("one permit free");
        throttle.hold("a", permit, 1_000);
        assert!(throttle.acquire(Duration::from_millis(50)).await.is_none());
        assert_eq!(throttle.release_due(999), 0);
        assert_eq!(throttle.release_due(1_000), 1);
        let permit = throttle
            .acquire(Duration::ZERO)
            .await
            .expect("freed by deadline");
        throttle.hold("b", permit, 5_000);
        throttle.release("b");
        assert!(throttle.acquire(Duration::ZERO).await.is_some());
    }

    #[tokio::test]
    async fn resize_applies_to_new_acquisitions() {
        let throttle = Throttle::new(1);
        let first = throttle.acquire(Duration::ZERO).await.expect("free");
        throttle.resize(2);
        let a = throttle.acquire(Duration::ZERO).await;
        let b = throttle.acquire(Duration::ZERO).await;
        assert!(a.is_some() && b.is_some());
        drop(first);
    }
}

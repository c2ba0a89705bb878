//! The per-drop throttle: a semaphore of `throttle.permits`, one permit held per
//! reservation this sidecar admitted, from admission until confirm, cancel or expiry.
//!
//! It bounds how many unconfirmed holds one pod keeps in flight, so a burst of
//! buyers who never confirm cannot lock the whole stock away from the ones who do.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tracing::Instrument;

#[derive(Debug)]
pub struct Throttle {
    /// One semaphore for the drop's life: a resize adds or removes permits on it,
    /// so permits held across a resize still count.
    semaphore: Arc<Semaphore>,
    /// The current `throttle.permits`.
    size: Mutex<u32>,
    /// Permits a shrink could not take away because they were held: each is
    /// forgotten instead of returned when it is let go. Behind a lock that a resize
    /// and every let-go permit take, so that none slips back in between.
    debt: Arc<Mutex<usize>>,
    /// Permits held for admitted reservations, by idempotency key.
    held: Mutex<HashMap<String, Held>>,
    /// Permits taken ahead for a reservation key that is about to be asked for (a
    /// cart's lines): its admission uses that permit instead of waiting for one,
    /// so a cart never finds itself without a permit halfway through its lines.
    /// By key: the attempt that took it, and the permit.
    prepaid: Mutex<HashMap<String, (String, Permit)>>,
}

/// A permit held for a reservation.
#[derive(Debug)]
struct Held {
    _permit: Permit,
    /// The hold's deadline (ms since the epoch), so that expiry elsewhere still
    /// frees it.
    deadline_ms: i64,
    /// The admission attempt whose commit's outcome is unknown, while it is: its
    /// resolution lets the permit go if the admission was never made.
    unresolved: Option<String>,
}

/// One throttle permit. Let go, it returns to the throttle, unless a shrink is
/// still owed a permit: then it pays that debt instead.
#[derive(Debug)]
pub struct Permit {
    permit: Option<OwnedSemaphorePermit>,
    debt: Arc<Mutex<usize>>,
}

impl Drop for Permit {
    fn drop(&mut self) {
        let Some(permit) = self.permit.take() else {
            return;
        };
        let mut debt = self.debt.lock().unwrap_or_else(|e| e.into_inner());
        if *debt > 0 {
            *debt -= 1;
            permit.forget();
        } else {
            // Returned to the semaphore while the lock is held: a resize sees it.
            std::mem::drop(permit);
        }
    }
}

impl Throttle {
    pub fn new(permits: u32) -> Self {
        Self {
            semaphore: Arc::new(Semaphore::new(permits as usize)),
            size: Mutex::new(permits),
            debt: Arc::new(Mutex::new(0)),
            held: Mutex::new(HashMap::new()),
            prepaid: Mutex::new(HashMap::new()),
        }
    }

    /// Applies a changed `throttle.permits` to the same semaphore: a grow first
    /// cancels what a shrink still owes, a shrink takes free permits away and owes
    /// the rest, paid as held permits are let go. Never more permits in use than
    /// the new size, once the holds from before it end.
    pub fn resize(&self, permits: u32) {
        let mut size = self.size.lock().unwrap_or_else(|e| e.into_inner());
        let mut debt = self.debt.lock().unwrap_or_else(|e| e.into_inner());
        let (old, new) = (*size as usize, permits as usize);
        if new > old {
            let paid = (*debt).min(new - old);
            *debt -= paid;
            self.semaphore.add_permits(new - old - paid);
        } else if new < old {
            let taken = self.semaphore.forget_permits(old - new);
            *debt += old - new - taken;
        }
        *size = permits;
    }

    /// Waits at most `timeout` for a permit.
    pub async fn acquire(&self, timeout: Duration) -> Option<Permit> {
        let span = tracing::debug_span!(
            "throttle wait",
            dropgate.throttle.available =
                i64::try_from(self.semaphore.available_permits()).unwrap_or(i64::MAX),
            dropgate.throttle.waited = false,
            dropgate.throttle.granted = tracing::field::Empty,
        );
        let permit = match self.semaphore.clone().try_acquire_owned() {
            Ok(permit) => Some(permit),
            Err(_) => {
                span.record("dropgate.throttle.waited", true);
                tokio::time::timeout(timeout, self.semaphore.clone().acquire_owned())
                    .instrument(span.clone())
                    .await
                    .ok()
                    .and_then(Result::ok)
            }
        };
        span.record("dropgate.throttle.granted", permit.is_some());
        Some(self.wrap(permit?))
    }

    /// `n` permits if that many are free now, without waiting (a waiter for several
    /// would be served first as permits come free, ahead of single admissions).
    pub fn try_acquire_many(&self, n: u32) -> Option<Vec<Permit>> {
        let mut permits = self.semaphore.clone().try_acquire_many_owned(n).ok()?;
        let mut each = Vec::with_capacity(n as usize);
        while permits.num_permits() > 1 {
            each.extend(permits.split(1).map(|one| self.wrap(one)));
        }
        each.push(self.wrap(permits));
        Some(each)
    }

    fn wrap(&self, permit: OwnedSemaphorePermit) -> Permit {
        Permit {
            permit: Some(permit),
            debt: self.debt.clone(),
        }
    }

    /// The permit for admitting `key`: the one taken ahead for it, if any, or one
    /// waited for at most `timeout`.
    pub async fn acquire_for(&self, key: &str, timeout: Duration) -> Option<Permit> {
        let prepaid = self.lock_prepaid().remove(key);
        match prepaid {
            Some((_, permit)) => Some(permit),
            None => self.acquire(timeout).await,
        }
    }

    /// Keeps `permit` for the next admission of `key` (see [`Throttle::acquire_for`]);
    /// one kept for `key` already is given back.
    pub fn prepay(&self, key: &str, attempt: &str, permit: Permit) {
        self.lock_prepaid()
            .insert(key.to_string(), (attempt.to_string(), permit));
    }

    /// Gives back the permit `attempt` took ahead for `key`, if it was not used
    /// (one another attempt took for the same key since is left alone).
    pub fn refund(&self, key: &str, attempt: &str) {
        let mut prepaid = self.lock_prepaid();
        if prepaid.get(key).is_some_and(|(by, _)| by == attempt) {
            prepaid.remove(key);
        }
    }

    /// Keeps `permit` for the reservation `key` until [`Throttle::release`] or its
    /// deadline.
    pub fn hold(&self, key: &str, permit: Permit, deadline_ms: i64) {
        self.keep(key, permit, deadline_ms, None);
    }

    /// Keeps `permit` for the admission `attempt` of `key`, whose commit's outcome
    /// is unknown: as [`Throttle::hold`], and [`Throttle::release_unresolved`] lets
    /// it go.
    pub fn hold_unresolved(&self, key: &str, attempt: &str, permit: Permit, deadline_ms: i64) {
        self.keep(key, permit, deadline_ms, Some(attempt.to_string()));
    }

    fn keep(&self, key: &str, permit: Permit, deadline_ms: i64, unresolved: Option<String>) {
        let held = Held {
            _permit: permit,
            deadline_ms,
            unresolved,
        };
        self.lock_held().insert(key.to_string(), held);
    }

    /// Moves the deadline of the permit held for `key` (an extended hold) to
    /// `deadline_ms`, never back; nothing when this sidecar holds none for it.
    pub fn extend(&self, key: &str, deadline_ms: i64) {
        if let Some(held) = self.lock_held().get_mut(key) {
            held.deadline_ms = held.deadline_ms.max(deadline_ms);
        }
    }

    /// Gives back the permit of `key`, if this sidecar holds one.
    pub fn release(&self, key: &str) {
        self.lock_held().remove(key);
    }

    /// Gives back the permit of `key` if it is still held for the unresolved
    /// admission `attempt` (one a later attempt of the key holds is left alone).
    pub fn release_unresolved(&self, key: &str, attempt: &str) {
        let mut held = self.lock_held();
        if held
            .get(key)
            .is_some_and(|h| h.unresolved.as_deref() == Some(attempt))
        {
            held.remove(key);
        }
    }

    /// Gives back every permit whose hold's deadline is at or before `now_ms`.
    pub fn release_due(&self, now_ms: i64) -> usize {
        let mut held = self.lock_held();
        let before = held.len();
        held.retain(|_, held| held.deadline_ms > now_ms);
        before - held.len()
    }

    /// Permits currently held for reservations.
    pub fn in_use(&self) -> usize {
        self.lock_held().len()
    }

    fn lock_prepaid(&self) -> std::sync::MutexGuard<'_, HashMap<String, (String, Permit)>> {
        self.prepaid.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn lock_held(&self) -> std::sync::MutexGuard<'_, HashMap<String, Held>> {
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
    async fn an_unresolved_admissions_permit_goes_back_only_for_that_attempt() {
        let throttle = Throttle::new(1);
        let permit = throttle.acquire(Duration::ZERO).await.expect("free");
        throttle.hold_unresolved("k", "a1", permit, i64::MAX);
        throttle.release_unresolved("k", "other");
        assert_eq!(throttle.in_use(), 1, "another attempt's resolution");
        throttle.release_unresolved("k", "a1");
        assert_eq!(throttle.in_use(), 0);
        // A later attempt of the key holds it as an admitted reservation: a late
        // resolution of the first leaves it alone.
        let permit = throttle.acquire(Duration::ZERO).await.expect("freed");
        throttle.hold("k", permit, i64::MAX);
        throttle.release_unresolved("k", "a1");
        assert_eq!(throttle.in_use(), 1);
    }

    #[tokio::test]
    async fn a_permit_taken_ahead_serves_its_key_alone_until_refunded() {
        let throttle = Throttle::new(2);
        let mut two = throttle.try_acquire_many(2).expect("both free");
        assert!(throttle.try_acquire_many(1).is_none(), "none left");
        throttle.prepay("cart:1", "a", two.remove(0));
        throttle.prepay("cart:2", "a", two.remove(0));
        assert!(
            throttle
                .acquire_for("other", Duration::ZERO)
                .await
                .is_none(),
            "both permits are kept for the cart's lines"
        );
        let used = throttle
            .acquire_for("cart:1", Duration::ZERO)
            .await
            .expect("cart:1 finds its permit");
        throttle.refund("cart:2", "b");
        assert!(
            throttle
                .acquire_for("other", Duration::ZERO)
                .await
                .is_none(),
            "another attempt's refund leaves attempt a's permit alone"
        );
        throttle.refund("cart:2", "a");
        assert!(
            throttle
                .acquire_for("other", Duration::ZERO)
                .await
                .is_some()
        );
        drop(used);
    }

    #[tokio::test]
    async fn a_grow_applies_at_once() {
        let throttle = Throttle::new(1);
        let first = throttle.acquire(Duration::ZERO).await.expect("free");
        throttle.resize(2);
        assert!(throttle.acquire(Duration::ZERO).await.is_some());
        drop(first);
    }

    #[tokio::test]
    async fn a_shrink_counts_the_permits_held_across_it() {
        let throttle = Throttle::new(3);
        for key in ["a", "b", "c"] {
            let permit = throttle.acquire(Duration::ZERO).await.expect("free");
            throttle.hold(key, permit, i64::MAX);
        }
        throttle.resize(2);
        throttle.release("a");
        assert!(
            throttle.acquire(Duration::ZERO).await.is_none(),
            "b and c are still in flight: two, the new size"
        );
        throttle.release("b");
        let d = throttle
            .acquire(Duration::ZERO)
            .await
            .expect("c alone in flight");
        assert!(throttle.acquire(Duration::ZERO).await.is_none(), "c and d");
        drop(d);
        // Grown again while c is held: the debt is gone, the size is the size.
        throttle.resize(4);
        let mut more = Vec::new();
        while let Some(permit) = throttle.acquire(Duration::ZERO).await {
            more.push(permit);
        }
        assert_eq!(more.len(), 3, "four permits, c holds one");
    }

    #[tokio::test]
    async fn a_shrink_while_nothing_is_held_takes_effect_at_once() {
        let throttle = Throttle::new(3);
        throttle.resize(1);
        let one = throttle.acquire(Duration::ZERO).await;
        assert!(one.is_some() && throttle.acquire(Duration::ZERO).await.is_none());
    }
}

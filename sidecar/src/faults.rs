//! Fault injection between the steps of a reservation's way through Redis, the
//! ledger and the outbox. Compiled in only with the `fault-injection` feature, which
//! the test suite turns on; in every other build [`check`] does nothing.

/// The points where a test can make the next step fail.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Fault {
    /// After Redis admitted, before the ledger is asked to record it.
    AfterRedisAdmit,
    /// Inside the ledger write, before its transaction commits.
    BeforeLedgerCommit,
    /// After the ledger recorded an admission, in place of its activation in Redis
    /// (the activation fails).
    AfterLedgerCommit,
    /// After an event was published to its stream, before it is marked sent.
    AfterPublishBeforeAck,
}

#[derive(Debug, thiserror::Error)]
#[error("injected fault at {0:?}")]
pub struct Injected(pub Fault);

#[cfg(feature = "fault-injection")]
mod armed {
    use std::collections::HashMap;
    use std::sync::Mutex;

    use super::Fault;

    /// How many more times each point fails.
    pub static ARMED: Mutex<Option<HashMap<Fault, u32>>> = Mutex::new(None);
    /// How far the wall clock is moved.
    pub static SKEW_MS: std::sync::atomic::AtomicI64 = std::sync::atomic::AtomicI64::new(0);
}

/// Makes the next `times` passes through `fault` fail.
#[cfg(feature = "fault-injection")]
pub fn arm(fault: Fault, times: u32) {
    let mut armed = armed::ARMED.lock().unwrap_or_else(|e| e.into_inner());
    armed
        .get_or_insert_with(Default::default)
        .insert(fault, times);
}

/// Fails if a test armed `fault`.
#[cfg(feature = "fault-injection")]
pub fn check(fault: Fault) -> Result<(), Injected> {
    let mut armed = armed::ARMED.lock().unwrap_or_else(|e| e.into_inner());
    match armed.as_mut().and_then(|map| map.get_mut(&fault)) {
        Some(left) if *left > 0 => {
            *left -= 1;
            Err(Injected(fault))
        }
        _ => Ok(()),
    }
}

#[cfg(not(feature = "fault-injection"))]
#[inline(always)]
pub fn check(_fault: Fault) -> Result<(), Injected> {
    Ok(())
}

/// Moves this process's wall clock by `ms` (a machine whose clock is off), for
/// every clock reading after it.
#[cfg(feature = "fault-injection")]
pub fn skew_clock(ms: i64) {
    armed::SKEW_MS.store(ms, std::sync::atomic::Ordering::SeqCst);
}

/// How far a test moved the wall clock (0 in every other build).
#[cfg(feature = "fault-injection")]
pub fn clock_skew_ms() -> i64 {
    armed::SKEW_MS.load(std::sync::atomic::Ordering::SeqCst)
}

#[cfg(not(feature = "fault-injection"))]
#[inline(always)]
pub fn clock_skew_ms() -> i64 {
    0
}

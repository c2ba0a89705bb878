//! Fault injection between the steps of a reservation's way through Redis, the
//! ledger and the outbox. Compiled into debug builds (the test suite's binaries) and
//! builds with the `fault-injection` feature; in a release build [`check`] does
//! nothing and `DROPGATE_FAULTS` is refused.

/// The points where a test can make the next step fail (or, for one, wait).
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
    /// A deliberate bug, for proving that the history checker catches one: the
    /// admission is answered 201 without being recorded in the ledger.
    SkipLedgerOnAdmit,
    /// A deliberate bug, for proving that the history checker catches one: a cancel
    /// that Redis made is answered 503 as if nothing had changed.
    ErrorAfterRedisCancel,
    /// The process dies (aborts, as under `kill -9`) after a cart's first line was
    /// held, before its next.
    DieMidCart,
    /// The process dies after a waitlist join was placed in Redis, before the
    /// ledger wrote it.
    DieMidJoin,
    /// The process dies after the ledger recorded a confirm or cancel, before it
    /// was finished in Redis (Redis still counts a cancelled hold's units).
    DieBeforeFinish,
    /// Finishing a recorded confirm or cancel in Redis fails (as when Redis is cut
    /// off for a moment right after the ledger recorded it), whether by its own
    /// attempt or by a call that met it prepared.
    FinishFails,
    /// A fallback transaction commits, and the COMMIT's answer is lost (as when the
    /// connection breaks just after the server committed).
    LandedCommitUnanswered,
    /// A fallback transaction's COMMIT is lost on its way: nothing lands, and no
    /// answer says so.
    LostCommitUnanswered,
    /// The watch of InventoryDrops lags: a change or deletion it receives is not
    /// taken in (as if it had not arrived yet), while the watch stays caught up.
    WatchLags,
    /// A call waits 300 ms between its Redis's check against the ledger and its
    /// gate script (as a call queued behind its drop's batch in flight waits), so
    /// that a test can fail over Redis in between.
    PauseAfterCheck,
    /// A look-up's gate reply waits 1.5 s before it is trusted (as a reply that
    /// lost the race with another call's check of Redis), so that a test can bring
    /// Redis in line meanwhile.
    PauseAfterReply,
    /// A cart's give-back waits 2.5 s between its look-up of a line it is to give
    /// back (a hold) and giving it back, so that a test can confirm the line
    /// through its own route meanwhile (long enough for that on a loaded
    /// 2-core CI machine).
    PauseBeforeGiveBack,
    /// A fallback change whose COMMIT went unanswered waits 1.5 s before it asks
    /// the ledger whether it landed, so that a test can land a duplicate meanwhile.
    PauseBeforeAsking,
}

impl Fault {
    /// The name `DROPGATE_FAULTS` uses for it.
    pub fn name(self) -> &'static str {
        match self {
            Fault::AfterRedisAdmit => "after-redis-admit",
            Fault::BeforeLedgerCommit => "before-ledger-commit",
            Fault::AfterLedgerCommit => "after-ledger-commit",
            Fault::AfterPublishBeforeAck => "after-publish-before-ack",
            Fault::SkipLedgerOnAdmit => "skip-ledger-on-admit",
            Fault::ErrorAfterRedisCancel => "error-after-redis-cancel",
            Fault::DieMidCart => "die-mid-cart",
            Fault::DieMidJoin => "die-mid-join",
            Fault::DieBeforeFinish => "die-before-finish",
            Fault::FinishFails => "finish-fails",
            Fault::LandedCommitUnanswered => "landed-commit-unanswered",
            Fault::LostCommitUnanswered => "lost-commit-unanswered",
            Fault::WatchLags => "watch-lags",
            Fault::PauseAfterCheck => "pause-after-check",
            Fault::PauseAfterReply => "pause-after-reply",
            Fault::PauseBeforeGiveBack => "pause-before-give-back",
            Fault::PauseBeforeAsking => "pause-before-asking",
        }
    }

    const ALL: [Fault; 17] = [
        Fault::AfterRedisAdmit,
        Fault::BeforeLedgerCommit,
        Fault::AfterLedgerCommit,
        Fault::AfterPublishBeforeAck,
        Fault::SkipLedgerOnAdmit,
        Fault::ErrorAfterRedisCancel,
        Fault::DieMidCart,
        Fault::DieMidJoin,
        Fault::DieBeforeFinish,
        Fault::FinishFails,
        Fault::LandedCommitUnanswered,
        Fault::LostCommitUnanswered,
        Fault::WatchLags,
        Fault::PauseAfterCheck,
        Fault::PauseAfterReply,
        Fault::PauseBeforeGiveBack,
        Fault::PauseBeforeAsking,
    ];
}

/// How often an armed point fails.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Times {
    /// The next n passes.
    Next(u32),
    /// Every k-th pass (k >= 1), for as long as the process runs.
    Every(u32),
}

/// Reads `DROPGATE_FAULTS` (`name`, `name=N` for the next N passes, `name@K` for every
/// K-th pass; comma-separated) and arms what it names. A process built without the
/// `fault-injection` feature refuses a non-empty value rather than ignore it, and a
/// name it does not know is an error too.
pub fn arm_from_env() -> Result<(), String> {
    let Ok(spec) = std::env::var("DROPGATE_FAULTS") else {
        return Ok(());
    };
    let mut armed = Vec::new();
    for item in spec.split(',').map(str::trim).filter(|s| !s.is_empty()) {
        let (name, times) = if let Some((name, n)) = item.split_once('=') {
            let n = n
                .parse()
                .map_err(|_| format!("DROPGATE_FAULTS: {item:?}: N must be a count"))?;
            (name, Times::Next(n))
        } else if let Some((name, k)) = item.split_once('@') {
            let k = k
                .parse()
                .ok()
                .filter(|k| *k >= 1)
                .ok_or_else(|| format!("DROPGATE_FAULTS: {item:?}: K must be a count >= 1"))?;
            (name, Times::Every(k))
        } else {
            (item, Times::Every(1))
        };
        let fault = Fault::ALL
            .into_iter()
            .find(|f| f.name() == name)
            .ok_or_else(|| format!("DROPGATE_FAULTS: no fault point is called {name:?}"))?;
        armed.push((fault, times));
    }
    if armed.is_empty() {
        return Ok(());
    }
    arm_all(&armed)
}

#[cfg(any(debug_assertions, feature = "fault-injection"))]
fn arm_all(armed: &[(Fault, Times)]) -> Result<(), String> {
    for (fault, times) in armed {
        arm_times(*fault, *times);
    }
    Ok(())
}

#[cfg(not(any(debug_assertions, feature = "fault-injection")))]
fn arm_all(_armed: &[(Fault, Times)]) -> Result<(), String> {
    Err("DROPGATE_FAULTS is set, but this build has no fault injection (the `fault-injection` feature)".into())
}

#[derive(Debug, thiserror::Error)]
#[error("injected fault at {0:?}")]
pub struct Injected(pub Fault);

#[cfg(any(debug_assertions, feature = "fault-injection"))]
mod armed {
    use std::collections::HashMap;
    use std::sync::Mutex;

    use super::Fault;

    /// How each point fails: how many more times, or every k-th pass (with the
    /// passes counted so far).
    pub static ARMED: Mutex<Option<HashMap<Fault, (super::Times, u64)>>> = Mutex::new(None);
    /// How far the wall clock is moved.
    pub static SKEW_MS: std::sync::atomic::AtomicI64 = std::sync::atomic::AtomicI64::new(0);
}

/// Makes the next `times` passes through `fault` fail.
#[cfg(any(debug_assertions, feature = "fault-injection"))]
pub fn arm(fault: Fault, times: u32) {
    arm_times(fault, Times::Next(times));
}

/// Arms `fault` to fail as `times` says.
#[cfg(any(debug_assertions, feature = "fault-injection"))]
pub fn arm_times(fault: Fault, times: Times) {
    let mut armed = armed::ARMED.lock().unwrap_or_else(|e| e.into_inner());
    armed
        .get_or_insert_with(Default::default)
        .insert(fault, (times, 0));
}

/// Whether the passes armed for `fault` with [`arm`] are all spent (the point was
/// passed as many times as armed): a test waits for it before acting in the pause
/// it made. (Also true once a point is disarmed with `arm(fault, 0)`.)
#[cfg(any(debug_assertions, feature = "fault-injection"))]
pub fn spent(fault: Fault) -> bool {
    let armed = armed::ARMED.lock().unwrap_or_else(|e| e.into_inner());
    matches!(
        armed.as_ref().and_then(|map| map.get(&fault)),
        Some((Times::Next(0), _))
    )
}

/// Fails if a test armed `fault`.
#[cfg(any(debug_assertions, feature = "fault-injection"))]
pub fn check(fault: Fault) -> Result<(), Injected> {
    let mut armed = armed::ARMED.lock().unwrap_or_else(|e| e.into_inner());
    match armed.as_mut().and_then(|map| map.get_mut(&fault)) {
        Some((Times::Next(left), _)) if *left > 0 => {
            *left -= 1;
            Err(Injected(fault))
        }
        Some((Times::Every(k), passes)) => {
            *passes += 1;
            if *passes % u64::from((*k).max(1)) == 0 {
                Err(Injected(fault))
            } else {
                Ok(())
            }
        }
        _ => Ok(()),
    }
}

#[cfg(not(any(debug_assertions, feature = "fault-injection")))]
#[inline(always)]
pub fn check(_fault: Fault) -> Result<(), Injected> {
    Ok(())
}

/// Moves this process's wall clock by `ms` (a machine whose clock is off), for
/// every clock reading after it.
#[cfg(any(debug_assertions, feature = "fault-injection"))]
pub fn skew_clock(ms: i64) {
    armed::SKEW_MS.store(ms, std::sync::atomic::Ordering::SeqCst);
}

/// How far a test moved the wall clock (0 in every other build).
#[cfg(any(debug_assertions, feature = "fault-injection"))]
pub fn clock_skew_ms() -> i64 {
    armed::SKEW_MS.load(std::sync::atomic::Ordering::SeqCst)
}

#[cfg(not(any(debug_assertions, feature = "fault-injection")))]
#[inline(always)]
pub fn clock_skew_ms() -> i64 {
    0
}

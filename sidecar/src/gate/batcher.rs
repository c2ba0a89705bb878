//! Natural batching of one drop's reserves and activations.
//!
//! Every answer about a drop runs a script on the one Redis core that owns the
//! drop's slot, and in a flash sale nearly all of them are for one drop. So while a
//! call for a drop is in flight, this sidecar's next requests for it wait in a
//! queue, and when the call returns the whole queue (up to [`MOST`]) goes in one
//! EVALSHA of the batch script, which decides them in arrival order exactly as one
//! call each would (batch.lua runs the same script body per request). A cart's
//! lines on the drop queue as one entry and are decided together in the same call
//! (see [`Together`]). No timer: a request that finds nothing in flight is sent at
//! once, alone, by the single script.
//!
//! The calls are made by a task of their own, so a request whose client went away
//! never leaves its queue stalled.

use std::sync::{Arc, LazyLock, Mutex};

use dropgate_api::DropKeys;
use dropgate_redis::Connection;
use redis::RedisResult;
use tokio::sync::oneshot;
use tracing::Instrument;

use super::reply::{Call, Wire};
use super::{
    ACTIVATE, ACTIVATES, Activation, GateScript, RESERVE, RESERVES, Reply, Request, ReserveRequest,
    Step, Together, line_reply, run, run_batch,
};
use crate::input::CartMode;

/// Most requests one batch decides (its script's run holds the drop's Redis core
/// for about this many single calls' work).
pub const MOST: usize = 128;

/// The queues of one drop's gate calls in this sidecar.
pub struct Batcher {
    reserves: Lane,
    activations: Lane,
}

impl std::fmt::Debug for Batcher {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Batcher")
            .field("drop", &self.reserves.keys.config())
            .finish_non_exhaustive()
    }
}

impl Batcher {
    pub fn new(keys: DropKeys) -> Self {
        let keys = Arc::new(keys);
        Self {
            reserves: Lane::new(&RESERVE, &RESERVES, keys.clone()),
            activations: Lane::new(&ACTIVATE, &ACTIVATES, keys),
        }
    }

    /// [`super::reserve`], batched with this drop's other reserves in flight.
    pub async fn reserve(
        &self,
        conn: &Connection,
        ledger: &str,
        request: &ReserveRequest,
    ) -> RedisResult<Reply> {
        one(self
            .reserves
            .call(conn, ledger, vec![request.request()], Together::Apart))
        .await?
        .reply(Call::Reserve)
    }

    /// [`super::reserve_groups`] for the lines of one cart on this drop, batched
    /// with the drop's other reserves in flight (the lines as one group).
    pub async fn reserve_cart(
        &self,
        conn: &Connection,
        ledger: &str,
        lines: &[ReserveRequest],
        mode: CartMode,
    ) -> RedisResult<Vec<RedisResult<Option<Reply>>>> {
        let requests = lines.iter().map(ReserveRequest::request).collect();
        Ok(self
            .reserves
            .call(conn, ledger, requests, Together::Cart(mode))
            .await?
            .into_iter()
            .map(line_reply)
            .collect())
    }

    /// [`super::activate`], batched with this drop's other activations in flight
    /// (a group commit's admissions activate together).
    pub async fn activate(
        &self,
        conn: &Connection,
        ledger: &str,
        key: &str,
        attempt: &str,
    ) -> RedisResult<(Activation, Step)> {
        let request = Request {
            key: key.to_string(),
            args: vec![attempt.to_string()],
        };
        one(self
            .activations
            .call(conn, ledger, vec![request], Together::Apart))
        .await?
        .activation()
    }
}

/// The one answer of a call made for one request.
async fn one(
    called: impl std::future::Future<Output = RedisResult<Vec<RedisResult<Wire>>>>,
) -> RedisResult<Wire> {
    called.await?.into_iter().next().unwrap_or_else(|| {
        Err(redis::RedisError::from((
            redis::ErrorKind::Parse,
            "a gate call answered no reply for its request",
        )))
    })
}

/// One script's queue for one drop.
struct Lane {
    single: &'static LazyLock<GateScript>,
    batch: &'static LazyLock<GateScript>,
    keys: Arc<DropKeys>,
    queue: Arc<Mutex<Queue>>,
}

#[derive(Default)]
struct Queue {
    /// Whether a task is sending this lane's calls (it takes what waits when its
    /// call returns).
    sending: bool,
    waiting: Vec<Job>,
}

/// Requests waiting for their turn (one, or a cart's lines), and where their
/// answers go.
struct Job {
    ledger: String,
    requests: Vec<Request>,
    together: Together,
    /// The caller's span: a call's client span is a child of its first request's.
    span: tracing::Span,
    answer: oneshot::Sender<RedisResult<Vec<RedisResult<Wire>>>>,
}

impl Lane {
    fn new(
        single: &'static LazyLock<GateScript>,
        batch: &'static LazyLock<GateScript>,
        keys: Arc<DropKeys>,
    ) -> Self {
        Self {
            single,
            batch,
            keys,
            queue: Arc::default(),
        }
    }

    /// `requests` decided as `together` says, in one call with whatever else waits
    /// for this lane: one answer per request.
    async fn call(
        &self,
        conn: &Connection,
        ledger: &str,
        requests: Vec<Request>,
        together: Together,
    ) -> RedisResult<Vec<RedisResult<Wire>>> {
        let (answer, answered) = oneshot::channel();
        let job = Job {
            ledger: ledger.to_string(),
            requests,
            together,
            span: tracing::Span::current(),
            answer,
        };
        let start = {
            let mut queue = lock(&self.queue);
            queue.waiting.push(job);
            !std::mem::replace(&mut queue.sending, true)
        };
        if start {
            let sender = Sender {
                single: self.single,
                batch: self.batch,
                keys: self.keys.clone(),
                queue: self.queue.clone(),
                conn: conn.clone(),
            };
            tokio::spawn(sender.send());
        }
        answered.await.unwrap_or_else(|_| {
            Err(redis::RedisError::from((
                redis::ErrorKind::Client,
                "the gate call's sender stopped before it answered",
            )))
        })
    }
}

fn lock(queue: &Mutex<Queue>) -> std::sync::MutexGuard<'_, Queue> {
    // A panic while the lock was held left nothing half-done in the queue (its
    // changes are a push or a drain).
    queue
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// The task that sends one lane's calls until nothing waits.
struct Sender {
    single: &'static LazyLock<GateScript>,
    batch: &'static LazyLock<GateScript>,
    keys: Arc<DropKeys>,
    queue: Arc<Mutex<Queue>>,
    conn: Connection,
}

impl Sender {
    async fn send(mut self) {
        let mut stopped = Stopped {
            queue: self.queue.clone(),
            armed: true,
        };
        loop {
            let jobs = {
                let mut queue = lock(&self.queue);
                if queue.waiting.is_empty() {
                    queue.sending = false;
                    stopped.armed = false;
                    return;
                }
                // One ledger per call (a sidecar has one, so this takes them all),
                // and at most MOST requests (always the first job, whatever its size).
                let ledger = queue.waiting[0].ledger.clone();
                let mut requests = 0;
                let n = queue
                    .waiting
                    .iter()
                    .take_while(|job| {
                        requests += job.requests.len();
                        job.ledger == ledger && requests <= MOST
                    })
                    .count()
                    .max(1);
                queue.waiting.drain(..n).collect::<Vec<_>>()
            };
            // A request whose caller went away (its client hung up) is not sent:
            // it would hold units nobody waits for until its pending bound.
            let jobs: Vec<Job> = jobs
                .into_iter()
                .filter(|job| !job.answer.is_closed())
                .collect();
            if jobs.is_empty() {
                continue;
            }
            self.answer(jobs).await;
        }
    }

    async fn answer(&mut self, jobs: Vec<Job>) {
        let parent = jobs[0].span.clone();
        let ledger = jobs[0].ledger.clone();
        if let [job] = jobs.as_slice()
            && let ([request], Together::Apart) = (job.requests.as_slice(), job.together)
        {
            let args: Vec<&str> = request.args.iter().map(String::as_str).collect();
            let answered = run(
                self.single,
                &mut self.conn,
                &self.keys,
                &ledger,
                &request.key,
                &args,
            )
            .instrument(parent)
            .await;
            if let Some(job) = jobs.into_iter().next() {
                let _ = job.answer.send(answered.map(|wire| vec![Ok(wire)]));
            }
            return;
        }
        let requests: Vec<Request> = jobs
            .iter()
            .flat_map(|job| job.requests.iter().cloned())
            .collect();
        let groups: Vec<(Together, usize)> = jobs
            .iter()
            .map(|job| (job.together, job.requests.len()))
            .collect();
        let answered = run_batch(
            self.batch,
            &mut self.conn,
            &self.keys,
            &ledger,
            &requests,
            &groups,
        )
        .instrument(parent)
        .await;
        match answered {
            Ok(wires) => {
                let mut wires = wires.into_iter();
                for job in jobs {
                    let mine = wires.by_ref().take(job.requests.len()).collect();
                    let _ = job.answer.send(Ok(mine));
                }
            }
            // Each request hears the call's failure, as it would have alone.
            Err(error) => {
                for job in jobs {
                    let _ = job.answer.send(Err(error.clone()));
                }
            }
        }
    }
}

/// Should the sender stop without emptying its queue (it panicked), the lane is
/// free again and the requests waiting in it hear that they were not sent.
struct Stopped {
    queue: Arc<Mutex<Queue>>,
    armed: bool,
}

impl Drop for Stopped {
    fn drop(&mut self) {
        if self.armed {
            let mut queue = lock(&self.queue);
            queue.sending = false;
            queue.waiting.clear();
        }
    }
}

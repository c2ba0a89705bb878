//! The SQL ledger behind `--database-url`: the durable record of every reservation,
//! the transactional outbox, lock fences, and the fallback gate's stock.
//!
//! `sqlite://FILE` (the default) is an embedded, per-pod ledger: the fallback path
//! it backs is per pod too, so more than one replica needs PostgreSQL
//! (`postgres://...`), shared by every sidecar of the shop. Both run the same code
//! and the same migrations (`sidecar/migrations`) through sqlx's `Any` driver.
//!
//! - this module: opening, and [`Ledger::record`], which writes a reservation change
//!   with its outbox event in one transaction. Concurrent records share one
//!   transaction (group commit: a writer task takes everything that arrived while
//!   the previous commit ran), so durability costs one commit per batch.
//! - [`authority`]: who decides admissions for each drop (the gate at an epoch, or
//!   the ledger), checked by every durable admission.
//! - [`fallback`]: the ledger's own gate, used when Redis is not, and the reads
//!   that replay and rebuild Redis from the ledger.
//! - [`outbox`]: canonical event JSON, the dispatcher, the consumer's dedup helper.
//! - [`fences`]: lock fence high-water marks and fenced writes.

pub mod authority;
pub mod carts;
pub mod fallback;
pub mod fences;
pub mod outbox;
pub mod retention;
pub mod waitlist;

use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use sqlx::any::{AnyPoolOptions, AnyRow};

use crate::clock::now_ms;
use crate::reservation::{Change, State, Stock, Terms};
use sqlx::{Any, AnyPool, Row, Transaction};
use tokio::sync::{mpsc, oneshot};
use tracing::Instrument;

/// The query parameters sqlx's PostgreSQL driver reads (it ignores others).
const POSTGRES_PARAMETERS: &[&str] = &[
    "sslmode",
    "ssl-mode",
    "sslrootcert",
    "ssl-root-cert",
    "ssl-ca",
    "sslcert",
    "ssl-cert",
    "sslkey",
    "ssl-key",
    "statement-cache-capacity",
    "host",
    "hostaddr",
    "port",
    "dbname",
    "user",
    "password",
    "application_name",
    "options",
];

/// The first query parameter of a PostgreSQL URL that the driver would ignore
/// (`options[name]` is one it reads). An unparsable URL is left to the driver.
fn unknown_postgres_parameter(url: &str) -> Option<String> {
    let parsed = url::Url::parse(url).ok()?;
    parsed
        .query_pairs()
        .map(|(key, _)| key.into_owned())
        .find(|key| {
            let read = POSTGRES_PARAMETERS.contains(&key.as_str())
                || (key.starts_with("options[") && key.ends_with(']'));
            !read
        })
}

#[derive(Debug, thiserror::Error)]
pub enum LedgerError {
    #[error("--database-url must start with sqlite:// or postgres:// (got {0:?})")]
    Scheme(String),
    /// A PostgreSQL URL's query parameter the driver does not read: it would be
    /// ignored (a typo, or a libpq setting such as `sslpassword` that is not
    /// supported), and the driver would log its value.
    #[error(
        "--database-url has the query parameter `{0}`, which the PostgreSQL driver does not read: remove it (the driver knows {POSTGRES_PARAMETERS:?})"
    )]
    Parameter(String),
    #[error("cannot open the ledger at {url}: {source}")]
    Open {
        url: String,
        #[source]
        source: sqlx::Error,
    },
    #[error("ledger migrations failed: {0}")]
    Migrate(#[from] sqlx::migrate::MigrateError),
    #[error("the ledger failed: {0}")]
    Sql(#[from] sqlx::Error),
    /// The fallback gate was asked to decide while the ledger is not the drop's
    /// authority (another sidecar reopened the gate, or never left it).
    #[error("the ledger is not deciding admissions for this drop: {0}")]
    NotAuthority(String),
    #[error("the ledger lost a race {0} times in a row")]
    Contended(usize),
    /// The ledger holds a newer generation of the drop than the caller's config.
    #[error("the ledger holds generation {0} of the drop, newer than this sidecar's config")]
    StaleConfig(i64),
    /// The fallback gate's COMMIT was not answered, and the ledger could not be
    /// asked whether it landed: a retry of the same key finds out.
    #[error(
        "the ledger's commit failed without saying whether it landed, and the ledger cannot be asked ({0}): retry the same key to learn which"
    )]
    CommitUnknown(String),
    /// A waitlist join at a position another join of the drop holds: Redis handed
    /// the position out twice (it lost the other join).
    #[error("position {0} of the drop's lines is another join's in the ledger")]
    PositionTaken(i64),
    /// A change Redis decided on generation `decided_on` of the drop's config,
    /// older than the newest the ledger has seen: Redis lost a change of it.
    #[error(
        "decided on generation {decided_on} of the drop's config, older than generation {newest} the ledger has seen"
    )]
    ConfigBehind { decided_on: i64, newest: i64 },
}

/// Why a change the Redis gate made was not recorded. Each is about that change
/// alone: the others of its group commit are recorded.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum RecordError {
    /// The ledger's authority for the drop is not the gate at the epoch the change
    /// was made under: a stale gate (the fallback took over, or a rebuild began).
    #[error(
        "the gate was not the authority for this drop when it decided (epoch {epoch}; the ledger: {current})"
    )]
    NotAuthority { epoch: i64, current: String },
    /// Admitting it would take the ledger's count below zero: Redis admitted a unit
    /// that the ledger holds for someone else (Redis is behind the ledger).
    #[error("the ledger's count has only {available} units left for this drop")]
    SoldOut { available: i64 },
    /// The key's record in the ledger says something else than the change (the
    /// key was used by another reservation, or the record moved on): the ledger's
    /// word stands, and nothing was written.
    #[error("the ledger's record of this key says {}", state.as_str())]
    KeyUsed { state: State },
    /// Redis numbered the change with a number the ledger already holds: it lost
    /// acknowledged writes.
    #[error("Redis handed out change number {0} a second time: it lost acknowledged writes")]
    SeqReused(i64),
    /// The change's attempt was judged dead before it was recorded (its admission
    /// taken back, or its confirm or cancel fenced off): recording it now would make
    /// a change that nobody holds in Redis.
    #[error("this attempt was given up before the ledger recorded it")]
    GivenUp,
    /// The change reached the ledger's writer after its deadline: whoever resolves
    /// the key decides its fate, not a commit this late.
    #[error("the ledger could not record the change within its deadline")]
    Late,
    /// A gate admission or extension decided on a config of the sale older than
    /// one the ledger has seen: Redis lost a change (a failover to a replica that
    /// missed it) that a sidecar sharing this ledger had read. The operator
    /// publishes it again; until then nothing is decided on the older one.
    #[error(
        "Redis decided it on an older config of the drop (generation {generation}) than the ledger has seen (generation {newest}): Redis lost that change, and the operator publishes it again"
    )]
    ConfigBehind { generation: i64, newest: i64 },
    /// The commit failed where its outcome cannot be known (at COMMIT, or it did not
    /// finish within the deadline): it may have landed. Nothing may be undone on its
    /// word; the key is resolved from the ledger once its bound passes.
    #[error("the ledger's commit failed without saying whether it landed ({0})")]
    Unknown(String),
    #[error("the ledger failed: {0}")]
    Failed(String),
}

/// The outbox event's type for a change to `state`.
pub(super) fn event(state: State) -> &'static str {
    match state {
        State::Active => "admitted",
        State::Confirmed => "confirmed",
        State::Cancelled => "cancelled",
        State::Expired => "expired",
        // Refused by `Ledger::record` before it is written.
        State::Pending => "pending",
    }
}

/// A change waiting for the writer, who answers on the sender and names the group
/// commit that took it on the waiting request's span.
type Pending = (
    Change,
    oneshot::Sender<Result<(), RecordError>>,
    tracing::Span,
);

/// A cart's write waiting for the writer (see [`carts::CartWrite`]).
type PendingCart = (
    std::sync::Arc<carts::CartWrite>,
    oneshot::Sender<Result<carts::CartWritten, LedgerError>>,
);

type PendingAllOrNothing = (
    Vec<Change>,
    carts::CartWrite,
    oneshot::Sender<Result<carts::CartCommit, LedgerError>>,
);

/// What waits for the writer's next group commit. (Nearly all are changes: boxing
/// them to make the rare cart write's variant no smaller would cost every
/// admission an allocation.)
#[allow(clippy::large_enum_variant)]
enum Queued {
    Change(Pending),
    Cart(PendingCart),
    /// Changes and a cart's write to commit all or nothing, in a transaction of
    /// their own (see [`Ledger::record_with_cart`]).
    AllOrNothing(PendingAllOrNothing),
}

/// Whether one of a transaction's changes may be refused while the others commit.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Atomicity {
    /// Each change has its own verdict (a group commit of unrelated requests).
    PerChange,
    /// A change refused, or a cart's move not made, rolls everything back.
    AllOrNothing,
}

/// Which database is behind the `Any` pool: the few statements that differ.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Backend {
    Sqlite,
    Postgres,
}

impl Backend {
    /// OpenTelemetry's `db.system` name.
    fn system(self) -> &'static str {
        match self {
            Backend::Sqlite => "sqlite",
            Backend::Postgres => "postgresql",
        }
    }
}

/// An open ledger.
#[derive(Debug, Clone)]
pub struct Ledger {
    pool: AnyPool,
    writer: mpsc::Sender<Queued>,
    backend: Backend,
    /// This ledger's identity, made on first open: sidecars sharing a PostgreSQL
    /// ledger share it, per-pod ledgers each have their own.
    id: String,
    /// How long each group commit took (for `/metrics`).
    commit_seconds: Histogram,
}

pub use authority::{Authority, Holder, LastChange};
pub use fallback::{Landed, Recorded};
pub use waitlist::{WaitRow, WaitState};

/// Most changes one group commit takes.
const BATCH: usize = 512;

/// How long the ledger's commit of a change may take (its deadline): past an
/// admission's permit wait plus this, a pending admission is one its sidecar never
/// finished (it died, or the ledger stalled), and a retry of the same key or a
/// sweeper resolves it from the ledger; a prepared confirm or cancel likewise
/// past this alone. The writer refuses a change whose deadline has passed.
pub const COMMIT_DEADLINE_MS: u64 = dropgate_api::COMMIT_DEADLINE_MS as u64;

/// How long a statement may wait for a lock, and run, and how long a caller waits
/// for a connection: within [`COMMIT_DEADLINE_MS`], so that a stalled ledger fails a
/// change in time for it to be refused and undone, instead of committing it after
/// its admission was judged dead.
const LOCK_TIMEOUT_MS: u64 = 1_200;
const STATEMENT_TIMEOUT_MS: u64 = 1_500;
/// How long PostgreSQL keeps a transaction whose client went quiet: a commit this
/// process gave up on (see `commit_in_time`) releases its locks then.
const IDLE_IN_TRANSACTION_MS: u64 = 10_000;
const ACQUIRE_TIMEOUT: std::time::Duration = std::time::Duration::from_millis(1_500);
const _: () =
    assert!(LOCK_TIMEOUT_MS < STATEMENT_TIMEOUT_MS && STATEMENT_TIMEOUT_MS < COMMIT_DEADLINE_MS);

impl Ledger {
    /// Opens the ledger (creating a SQLite file), runs the migrations, and starts
    /// the group-commit writer.
    pub async fn open(url: &str) -> Result<Self, LedgerError> {
        sqlx::any::install_default_drivers();
        let failed = |source| LedgerError::Open {
            url: dropgate_api::redact_url(url),
            source,
        };
        let backend = if url.starts_with("sqlite:") {
            Backend::Sqlite
        } else {
            Backend::Postgres
        };
        let (url, connections) = if url.starts_with("sqlite:") {
            // One connection: SQLite has one writer anyway, and a single connection
            // never meets SQLITE_BUSY between the writer task and the fallback gate.
            let create = if url.contains("mode=") {
                url.to_string()
            } else if url.contains('?') {
                format!("{url}&mode=rwc")
            } else {
                format!("{url}?mode=rwc")
            };
            (create, 1)
        } else if url.starts_with("postgres:") || url.starts_with("postgresql:") {
            if let Some(unknown) = unknown_postgres_parameter(url) {
                return Err(LedgerError::Parameter(unknown));
            }
            (url.to_string(), 16)
        } else {
            return Err(LedgerError::Scheme(dropgate_api::redact_url(url)));
        };
        let pool = AnyPoolOptions::new()
            .max_connections(connections)
            .acquire_timeout(ACQUIRE_TIMEOUT)
            .after_connect(|conn, _| {
                Box::pin(async move {
                    let settings = if conn.backend_name() == "SQLite" {
                        vec![
                            "PRAGMA journal_mode = WAL".to_string(),
                            "PRAGMA synchronous = FULL".to_string(),
                            format!("PRAGMA busy_timeout = {LOCK_TIMEOUT_MS}"),
                        ]
                    } else {
                        vec![
                            format!("SET lock_timeout = {LOCK_TIMEOUT_MS}"),
                            format!("SET statement_timeout = {STATEMENT_TIMEOUT_MS}"),
                            // A commit given up on mid-way (the network cut without a
                            // reset) must not hold the drop's rows for hours.
                            format!(
                                "SET idle_in_transaction_session_timeout = {IDLE_IN_TRANSACTION_MS}"
                            ),
                        ]
                    };
                    for setting in settings {
                        sqlx::query(sqlx::AssertSqlSafe(setting))
                            .execute(&mut *conn)
                            .await?;
                    }
                    Ok(())
                })
            })
            .connect(&url)
            .await
            .map_err(failed)?;
        sqlx::migrate!("./migrations").run(&pool).await?;
        let id = ledger_id(&pool).await?;
        let (writer, queue) = mpsc::channel(BATCH * 4);
        let commit_seconds = Histogram::new(exponential_buckets(0.000_25, 2.0, 14));
        tokio::spawn(group_commit(
            pool.clone(),
            backend,
            queue,
            commit_seconds.clone(),
        ));
        Ok(Self {
            pool,
            writer,
            backend,
            id,
            commit_seconds,
        })
    }

    /// The group commits' durations, to register with the sidecar's metrics.
    pub fn commit_seconds(&self) -> Histogram {
        self.commit_seconds.clone()
    }

    pub fn pool(&self) -> &AnyPool {
        &self.pool
    }

    /// This ledger's identity: what Redis's [`dropgate_api::DropKeys::ledger`] names
    /// for a sale this ledger records.
    pub fn id(&self) -> &str {
        &self.id
    }

    /// Whether this is a SQLite ledger: one per pod, unless only one pod sells.
    pub fn is_per_pod(&self) -> bool {
        self.backend == Backend::Sqlite
    }

    /// Records a change the Redis gate made, with its outbox event, durably: it
    /// returns after the transaction holding it committed. Recording the same change
    /// twice changes nothing. In the same transaction the ledger checks that the
    /// gate is its authority for the drop at the change's epoch, and that an
    /// admission fits its own count of the drop's stock: a stale or wrong Redis is
    /// refused here, whatever it answered.
    pub async fn record(&self, change: Change) -> Result<(), RecordError> {
        if change.state == State::Pending {
            return Err(RecordError::Failed(
                "a pending admission is never recorded".into(),
            ));
        }
        let span = tracing::debug_span!(
            "ledger commit",
            otel.kind = "client",
            otel.status_code = tracing::field::Empty,
            db.system = self.backend.system(),
            db.system.name = self.backend.system(),
            db.operation.name = "COMMIT",
            dropgate.ledger.batch = tracing::field::Empty,
            dropgate.ledger.batch_size = tracing::field::Empty,
        );
        let (done, wait) = oneshot::channel();
        let gone = || RecordError::Failed("the ledger's writer stopped".into());
        let recorded = async {
            self.writer
                .send(Queued::Change((change, done, tracing::Span::current())))
                .await
                .map_err(|_| gone())?;
            wait.await.map_err(|_| gone())?
        }
        .instrument(span.clone())
        .await;
        // A refusal (sold out, not the authority, ...) is the ledger doing its job;
        // only a commit that could not be made is an error.
        if let Err(RecordError::Failed(_) | RecordError::Unknown(_)) = &recorded {
            span.record("otel.status_code", "ERROR");
        }
        recorded
    }

    /// Makes a cart's write in the writer's next group commit.
    async fn write_cart(&self, write: carts::CartWrite) -> Result<carts::CartWritten, LedgerError> {
        let (done, wait) = oneshot::channel();
        let gone = || LedgerError::Sql(sqlx::Error::Protocol("the ledger's writer stopped".into()));
        let write = std::sync::Arc::new(write);
        self.writer
            .send(Queued::Cart((write.clone(), done)))
            .await
            .map_err(|_| gone())?;
        match wait.await.map_err(|_| gone())? {
            // The group commit may or may not have landed (its COMMIT failed, or it
            // outlasted its deadline): the write is made again on its own, which
            // waits for that commit's locks and tells the two apart (each write
            // names its attempt), so that the caller's answer is true either way.
            // Should that fail too, or not end within the commit deadline, the
            // outcome stays unknown, and the caller's answer says so.
            Err(LedgerError::CommitUnknown(why)) => {
                tracing::debug!(%why, "a cart's write is made again after a commit of unknown outcome");
                let again = async {
                    let mut tx = self.pool.begin().await?;
                    let written = write.apply_again(&mut tx).await?;
                    tx.commit().await?;
                    Ok::<_, sqlx::Error>(written)
                };
                let deadline = std::time::Duration::from_millis(COMMIT_DEADLINE_MS);
                match tokio::time::timeout(deadline, again).await {
                    Ok(Ok(written)) => Ok(written),
                    Ok(Err(e)) => Err(LedgerError::CommitUnknown(format!(
                        "{why}; made again, it failed: {e}"
                    ))),
                    Err(_) => Err(LedgerError::CommitUnknown(format!(
                        "{why}; made again, it did not end within {COMMIT_DEADLINE_MS} ms"
                    ))),
                }
            }
            other => other,
        }
    }
}

/// Reads this ledger's id, making one on first open.
async fn ledger_id(pool: &AnyPool) -> Result<String, sqlx::Error> {
    sqlx::query(
        "INSERT INTO ledger_meta (name, value) VALUES ('id', $1) ON CONFLICT (name) DO NOTHING",
    )
    .bind(format!("{:016x}", rand::random::<u64>()))
    .execute(pool)
    .await?;
    sqlx::query("SELECT value FROM ledger_meta WHERE name = 'id'")
        .fetch_one(pool)
        .await?
        .try_get(0)
}

/// Why a group commit did not commit.
enum CommitError {
    Sql(sqlx::Error),
    /// The batch's admissions do not fit the ledger's count of this drop's stock.
    Overdrawn(String),
    /// COMMIT itself failed, or the commit outlasted the deadline: it may have
    /// landed.
    Unknown(String),
}

impl From<sqlx::Error> for CommitError {
    fn from(error: sqlx::Error) -> Self {
        CommitError::Sql(error)
    }
}

/// The writer task: one transaction for everything that queued up while the last
/// commit ran (changes and carts' writes). A batch that fails is retried write by
/// write, so that one bad change cannot fail the others.
async fn group_commit(
    pool: AnyPool,
    backend: Backend,
    mut queue: mpsc::Receiver<Queued>,
    commit_seconds: Histogram,
) {
    let mut number: u64 = 0;
    while let Some(first) = queue.recv().await {
        let mut queued = vec![first];
        while queued.len() < BATCH {
            match queue.try_recv() {
                Ok(next) => queued.push(next),
                Err(_) => break,
            }
        }
        let mut batch: Vec<Pending> = Vec::with_capacity(queued.len());
        let mut cart_writes: Vec<PendingCart> = Vec::new();
        let mut all_or_nothing: Vec<PendingAllOrNothing> = Vec::new();
        for item in queued {
            match item {
                Queued::Change(pending) => batch.push(pending),
                // A cart write whose caller went away is not made: nothing of it
                // is written yet, and nobody would hear what it came to.
                Queued::Cart((_, done)) if done.is_closed() => {}
                Queued::Cart(pending) => cart_writes.push(pending),
                Queued::AllOrNothing((.., done)) if done.is_closed() => {}
                Queued::AllOrNothing(pending) => all_or_nothing.push(pending),
            }
        }
        number = commit_round(&pool, backend, batch, cart_writes, &commit_seconds, number).await;
        // Each in a transaction of its own, after this round's batch (which it would
        // otherwise hold up past its changes' deadlines): a refusal in it rolls back
        // only its own changes.
        for (changes, write, done) in all_or_nothing {
            let _ = done.send(
                commit_all_or_nothing(&pool, backend, &changes, &write, &commit_seconds).await,
            );
        }
    }
}

/// One round of the writer: `batch` and `cart_writes` in one group commit (each
/// change past its deadline refused first), retried write by write if it fails;
/// returns the writer's commit number after it.
async fn commit_round(
    pool: &AnyPool,
    backend: Backend,
    batch: Vec<Pending>,
    mut cart_writes: Vec<PendingCart>,
    commit_seconds: &Histogram,
    mut number: u64,
) -> u64 {
    // A change past its deadline is not begun: its key is someone else's to
    // resolve by now (see `RecordError::Late`).
    let now = now_ms();
    let (late, on_time): (Vec<Pending>, Vec<Pending>) = batch
        .into_iter()
        .partition(|(change, ..)| change.deadline_ms.is_some_and(|due| due <= now));
    for (_, done, _) in late {
        let _ = done.send(Err(RecordError::Late));
    }
    let mut batch = on_time;
    if batch.is_empty() && cart_writes.is_empty() {
        return number;
    }
    // Two commits writing the same carts lock their rows in one order.
    cart_writes.sort_by(|(a, _), (b, _)| a.row().cmp(&b.row()));
    // Which group commit took each waiting request's change, for its trace: a
    // number of this process's writer (it starts at 1 with the process), and
    // how many changes that commit held.
    number += 1;
    for (_, _, span) in &batch {
        name_batch(span, number, batch.len());
    }
    let changes: Vec<&Change> = batch.iter().map(|(c, _, _)| c).collect();
    let writes: Vec<&carts::CartWrite> = cart_writes.iter().map(|(w, _)| &**w).collect();
    let started = std::time::Instant::now();
    let committed = commit_in_time(pool, backend, &changes, &writes, Atomicity::PerChange).await;
    commit_seconds.observe(started.elapsed().as_secs_f64());
    match committed {
        Ok((verdicts, written)) => {
            for ((_, done, _), verdict) in batch.into_iter().zip(verdicts) {
                let _ = done.send(verdict);
            }
            for ((_, done), written) in cart_writes.into_iter().zip(written) {
                let _ = done.send(Ok(written));
            }
        }
        // The batch may have landed: re-committing its changes one by one
        // could not tell them apart from changes of others.
        Err(CommitError::Unknown(why)) => {
            for (_, done, _) in batch {
                let _ = done.send(Err(RecordError::Unknown(why.clone())));
            }
            for (_, done) in cart_writes {
                let _ = done.send(Err(LedgerError::CommitUnknown(why.clone())));
            }
        }
        Err(e) if batch.len() + cart_writes.len() == 1 => {
            if let Some((change, done, _)) = batch.pop() {
                let _ = done.send(Err(single_failure(pool, &change, e).await));
            } else if let Some((_, done)) = cart_writes.pop() {
                let _ = done.send(Err(cart_failure(e)));
            }
        }
        Err(_) => {
            for (change, done, span) in batch {
                // The retries take time: one whose deadline passed meanwhile is
                // not begun either.
                if change.deadline_ms.is_some_and(|due| due <= now_ms()) {
                    let _ = done.send(Err(RecordError::Late));
                    continue;
                }
                number += 1;
                name_batch(&span, number, 1);
                let verdict = match commit_in_time(
                    pool,
                    backend,
                    &[&change],
                    &[],
                    Atomicity::PerChange,
                )
                .await
                {
                    Ok((mut verdicts, _)) => verdicts.pop().unwrap_or(Ok(())),
                    Err(e) => Err(single_failure(pool, &change, e).await),
                };
                let _ = done.send(verdict);
            }
            for (write, done) in cart_writes {
                number += 1;
                let written = match commit_in_time(
                    pool,
                    backend,
                    &[],
                    &[&*write],
                    Atomicity::PerChange,
                )
                .await
                {
                    Ok((_, mut written)) => written.pop().ok_or_else(|| {
                        LedgerError::Sql(sqlx::Error::Protocol(
                            "a cart's write came back with no result".into(),
                        ))
                    }),
                    Err(e) => Err(cart_failure(e)),
                };
                let _ = done.send(written);
            }
        }
    }
    number
}

/// Commits `changes` and the cart's `write` all or nothing (see
/// [`Ledger::record_with_cart`]).
async fn commit_all_or_nothing(
    pool: &AnyPool,
    backend: Backend,
    changes: &[Change],
    write: &carts::CartWrite,
    commit_seconds: &Histogram,
) -> Result<carts::CartCommit, LedgerError> {
    // Past a change's deadline its key is someone else's to resolve: not begun.
    let now = now_ms();
    if changes
        .iter()
        .any(|c| c.deadline_ms.is_some_and(|due| due <= now))
    {
        return Ok(carts::CartCommit::LineRefused(RecordError::Late));
    }
    let changes: Vec<&Change> = changes.iter().collect();
    let started = std::time::Instant::now();
    let committed =
        commit_in_time(pool, backend, &changes, &[write], Atomicity::AllOrNothing).await;
    commit_seconds.observe(started.elapsed().as_secs_f64());
    match committed {
        Ok((verdicts, written)) => {
            if let Some(refusal) = verdicts.into_iter().find_map(Result::err) {
                return Ok(carts::CartCommit::LineRefused(refusal));
            }
            match written.first() {
                Some(carts::CartWritten::Moved(true)) => Ok(carts::CartCommit::Committed),
                Some(carts::CartWritten::Moved(false)) => Ok(carts::CartCommit::CartMoved),
                _ => Err(carts::mixed_up()),
            }
        }
        Err(CommitError::Unknown(why)) => Err(LedgerError::CommitUnknown(why)),
        // A change number Redis handed out twice (it lost writes): refused as the
        // change would be alone, so that the caller rebuilds Redis.
        Err(CommitError::Sql(sqlx::Error::Database(db))) if db.is_unique_violation() => {
            Ok(carts::CartCommit::LineRefused(RecordError::SeqReused(
                changes.iter().find_map(|c| c.seq).unwrap_or(0),
            )))
        }
        Err(CommitError::Sql(e)) => Err(LedgerError::Sql(e)),
        Err(CommitError::Overdrawn(drop_key)) => Err(LedgerError::Sql(sqlx::Error::Protocol(
            format!("a cart's changes were refused for the stock of {drop_key}"),
        ))),
    }
}

/// What a cart's write that failed on its own is told.
fn cart_failure(error: CommitError) -> LedgerError {
    match error {
        CommitError::Sql(e) => LedgerError::Sql(e),
        CommitError::Unknown(why) => LedgerError::CommitUnknown(why),
        // (A cart's write moves no stock.)
        CommitError::Overdrawn(drop_key) => LedgerError::Sql(sqlx::Error::Protocol(format!(
            "a cart's write was refused for the stock of {drop_key}"
        ))),
    }
}

/// Names the group commit `number` of `size` changes on a waiting request's span.
fn name_batch(span: &tracing::Span, number: u64, size: usize) {
    span.record(
        "dropgate.ledger.batch",
        i64::try_from(number).unwrap_or(i64::MAX),
    );
    span.record(
        "dropgate.ledger.batch_size",
        i64::try_from(size).unwrap_or(i64::MAX),
    );
}

/// What a change that failed on its own is told.
async fn single_failure(pool: &AnyPool, change: &Change, error: CommitError) -> RecordError {
    match error {
        CommitError::Overdrawn(drop_key) => {
            let available = sqlx::query("SELECT available FROM stock WHERE drop_key = $1")
                .bind(drop_key)
                .fetch_optional(pool)
                .await
                .ok()
                .flatten()
                .and_then(|row| row.try_get::<i64, _>(0).ok())
                .unwrap_or(0);
            RecordError::SoldOut { available }
        }
        CommitError::Sql(sqlx::Error::Database(db)) if db.is_unique_violation() => {
            RecordError::SeqReused(change.seq.unwrap_or(0))
        }
        CommitError::Sql(e) => RecordError::Failed(e.to_string()),
        CommitError::Unknown(why) => RecordError::Unknown(why),
    }
}

/// [`commit`] within [`COMMIT_DEADLINE_MS`]: the ledger's own timeouts fail a
/// statement well within it, but a connection that stops answering (a network cut
/// with no reset) fails nothing. A commit given up on this way may have landed.
async fn commit_in_time(
    pool: &AnyPool,
    backend: Backend,
    changes: &[&Change],
    cart_writes: &[&carts::CartWrite],
    atomicity: Atomicity,
) -> Result<Committed, CommitError> {
    let deadline = std::time::Duration::from_millis(COMMIT_DEADLINE_MS);
    // PostgreSQL breaks a deadlock by failing one of its transactions, which it
    // rolls back whole (a failed statement, never the COMMIT): it is begun again,
    // as PostgreSQL advises, within the same deadline.
    let started = std::time::Instant::now();
    let committed = async {
        let mut tries = 0;
        loop {
            tries += 1;
            match commit(pool, backend, changes, cart_writes, atomicity).await {
                // Not begun again past a change's own deadline (its resolver may
                // have claimed the key in the ledger by then), nor when a try
                // that waits for a lock could not end within the commit's: the
                // deadlock is then answered as what it is, a rollback, and the
                // batch committed change by change.
                Err(CommitError::Sql(sqlx::Error::Database(db)))
                    if tries < 3
                        && db.code().as_deref() == Some(DEADLOCK_DETECTED)
                        && started.elapsed()
                            + std::time::Duration::from_millis(STATEMENT_TIMEOUT_MS)
                            < deadline
                        && !changes
                            .iter()
                            .any(|c| c.deadline_ms.is_some_and(|due| due <= now_ms())) =>
                {
                    tracing::debug!(tries, "a group commit met a deadlock: begun again");
                }
                other => return other,
            }
        }
    };
    match tokio::time::timeout(deadline, committed).await {
        Ok(committed) => committed,
        Err(_) => Err(CommitError::Unknown(format!(
            "the commit did not finish within {COMMIT_DEADLINE_MS} ms"
        ))),
    }
}

/// PostgreSQL's SQLSTATE for a transaction it failed to break a deadlock.
const DEADLOCK_DETECTED: &str = "40P01";

/// One group commit: per drop, the authority row (read with a shared lock on
/// PostgreSQL, so a hand-over waits for commits in flight and they for it) and the
/// stock row moved once by the batch's net units, refused if that would take it
/// below zero; per change, the reservation row and the outbox event; then the
/// carts' writes. Returns each change's verdict and each cart write's result. With
/// [`Atomicity::PerChange`] a change refused (a stale epoch, say) is left out and
/// the rest commit; with [`Atomicity::AllOrNothing`] a refusal, or a cart's move
/// not made, rolls the whole transaction back (the verdicts and writes returned
/// say which).
async fn commit(
    pool: &AnyPool,
    backend: Backend,
    changes: &[&Change],
    cart_writes: &[&carts::CartWrite],
    atomicity: Atomicity,
) -> Result<Committed, CommitError> {
    let now = now_ms();
    let mut tx = pool.begin().await?;
    // Each drop once, with the newest config any of its changes carries, in the
    // order of their keys: two transactions locking the rows of the same drops
    // take them in the same order.
    let mut newest: Vec<(&str, &Change)> = Vec::new();
    for change in changes {
        match newest.iter_mut().find(|(key, _)| *key == change.drop_key) {
            Some(entry) if entry.1.stock.generation < change.stock.generation => entry.1 = change,
            Some(_) => {}
            None => newest.push((&change.drop_key, change)),
        }
    }
    newest.sort_by(|a, b| a.0.cmp(b.0));
    let mut drops: Vec<(&str, Option<Authority>)> = Vec::with_capacity(newest.len());
    for (drop_key, _) in &newest {
        drops.push((
            drop_key,
            authority::read_in(&mut tx, backend, drop_key, true).await?,
        ));
    }
    // The newest generation of each drop's config that the ledger has seen.
    let mut seen: Vec<(&str, i64)> = Vec::with_capacity(drops.len());
    for ((drop_key, authority), (_, newest)) in drops.iter().zip(&newest) {
        // A drop the gate does not decide has every change refused below: its
        // rows are left alone (the fallback's transactions hold them).
        if !authority
            .as_ref()
            .is_some_and(|a| matches!(a.holder, Holder::Gate | Holder::Replaying))
        {
            continue;
        }
        // Locked, on PostgreSQL, from here to the commit: a peer's note of a newer
        // generation committed after an unlocked read would let this batch record
        // on the older terms.
        let (generation, _) = ensure_stock(&mut tx, drop_key, &newest.stock).await?;
        seen.push((drop_key, generation));
    }
    // At most one event per change.
    let mut ids = EventIds::for_events(changes.len());
    let mut verdicts = Vec::with_capacity(changes.len());
    let mut units: Vec<(&str, i64)> = Vec::new();
    let mut variant_units: Vec<(&str, &str, i64)> = Vec::new();
    let mut buyers: Vec<(&str, &str, i64)> = Vec::new();
    let admitted = |change: &Change| {
        let authority = drops
            .iter()
            .find(|(key, _)| *key == change.drop_key)
            .and_then(|(_, authority)| authority.as_ref());
        authority::admits_gate(authority, change.epoch)?;
        let newest = seen
            .iter()
            .find(|(key, _)| *key == change.drop_key)
            .map_or(0, |(_, generation)| *generation);
        decided_on_a_lost_change(change, newest)
    };
    // The batch's new admissions (most of a rush) first, a statement per table for
    // all of them; what one of them finds in its key's way is then decided on its
    // own below, as every other change is.
    let fresh = new_admissions(&mut tx, &mut ids, changes, &admitted, now).await?;
    for (i, change) in changes.iter().enumerate() {
        if let Err(refusal) = admitted(change) {
            verdicts.push(Err(refusal));
            continue;
        }
        let moved = if fresh[i] {
            -change.quantity
        } else {
            match apply_gate_change(&mut tx, &mut ids, change, now).await? {
                Ok(moved) => moved,
                Err(refusal) => {
                    verdicts.push(Err(refusal));
                    continue;
                }
            }
        };
        if moved != 0 {
            match units.iter_mut().find(|(key, _)| *key == change.drop_key) {
                Some(entry) => entry.1 += moved,
                None => units.push((&change.drop_key, moved)),
            }
            if let Some(variant) = change.variant.as_deref() {
                match variant_units
                    .iter_mut()
                    .find(|(key, v, _)| *key == change.drop_key && *v == variant)
                {
                    Some(entry) => entry.2 += moved,
                    None => variant_units.push((&change.drop_key, variant, moved)),
                }
            }
            match buyers
                .iter_mut()
                .find(|(key, user, _)| *key == change.drop_key && *user == change.user)
            {
                Some(entry) => entry.2 -= moved,
                None => buyers.push((&change.drop_key, &change.user, -moved)),
            }
        }
        verdicts.push(Ok(()));
    }
    for (drop_key, moved) in units {
        // Returns always apply (they pay a deficit back after a cut); admissions
        // only while the count stays at or above zero.
        let applied = sqlx::query(
            "UPDATE stock SET available = available + $1 \
             WHERE drop_key = $2 AND ($3 >= 0 OR available + $4 >= 0)",
        )
        .bind(moved)
        .bind(drop_key)
        .bind(moved)
        .bind(moved)
        .execute(&mut *tx)
        .await?;
        if applied.rows_affected() != 1 {
            return Err(CommitError::Overdrawn(drop_key.to_string()));
        }
    }
    for (drop_key, variant, moved) in variant_units {
        // As for the drop; a variant the ledger has no row for yet (no change knew
        // its quantity) is not checked here: Redis's count decided it.
        let applied = sqlx::query(
            "UPDATE variant_stock SET available = available + $1 \
             WHERE drop_key = $2 AND variant = $3 AND ($4 >= 0 OR available + $5 >= 0)",
        )
        .bind(moved)
        .bind(drop_key)
        .bind(variant)
        .bind(moved)
        .bind(moved)
        .execute(&mut *tx)
        .await?;
        if applied.rows_affected() != 1
            && moved < 0
            && variant_row(&mut tx, drop_key, variant).await?.is_some()
        {
            return Err(CommitError::Overdrawn(drop_key.to_string()));
        }
    }
    move_buyers(&mut tx, &buyers).await?;
    // Carts' rows last: they lock nothing a change's statements take after them.
    let mut written = Vec::with_capacity(cart_writes.len());
    for write in cart_writes {
        written.push(write.apply(&mut tx).await?);
    }
    if atomicity == Atomicity::AllOrNothing
        && (verdicts.iter().any(Result::is_err)
            || written
                .iter()
                .any(|w| matches!(w, carts::CartWritten::Moved(false))))
    {
        // (Dropping the transaction rolls it back.)
        return Ok((verdicts, written));
    }
    if !changes.is_empty() {
        crate::faults::check(crate::faults::Fault::BeforeLedgerCommit)
            .map_err(|e| sqlx::Error::Protocol(e.to_string()))?;
    }
    tx.commit()
        .await
        .map_err(|e| CommitError::Unknown(e.to_string()))?;
    Ok((verdicts, written))
}

/// A group commit's verdict on each change, and what each cart's write came to.
type Committed = (Vec<Result<(), RecordError>>, Vec<carts::CartWritten>);

/// Records the new admissions among `changes` (an admission, not an offer, whose
/// key no other change of the batch names, under an authority that `admitted`
/// passes) with one multi-row INSERT of their reservation rows and one of their
/// events. Returns, per change, whether it was recorded here: a key that already
/// has a row (a retry, a key used before) wrote nothing, and is left to
/// [`apply_gate_change`] like any other change.
async fn new_admissions(
    tx: &mut Transaction<'static, Any>,
    ids: &mut EventIds,
    changes: &[&Change],
    admitted: &impl Fn(&Change) -> Result<(), RecordError>,
    now: i64,
) -> Result<Vec<bool>, sqlx::Error> {
    let mut named: std::collections::HashMap<(&str, &str), usize> = Default::default();
    for change in changes {
        *named.entry((&change.drop_key, &change.key)).or_default() += 1;
    }
    let candidates: Vec<usize> = (0..changes.len())
        .filter(|&i| {
            let change = changes[i];
            change.state == State::Active
                && !change.extension
                && !change.offered
                && admitted(change).is_ok()
                && named[&(change.drop_key.as_str(), change.key.as_str())] == 1
        })
        .collect();
    let by_key: std::collections::HashMap<(&str, &str), usize> = candidates
        .iter()
        .map(|&i| ((changes[i].drop_key.as_str(), changes[i].key.as_str()), i))
        .collect();
    let mut fresh = vec![false; changes.len()];
    if candidates.is_empty() {
        return Ok(fresh);
    }
    for run in row_runs(candidates.len()) {
        let sql = format!(
            "INSERT INTO reservations \
             (drop_key, res_key, user_id, quantity, state, path, expires_at_ms, updated_at_ms, replayed, seq, attempt, variant, admitted_at_ms) \
             VALUES {} ON CONFLICT (drop_key, res_key) DO UPDATE SET \
             user_id = excluded.user_id, quantity = excluded.quantity, variant = excluded.variant, state = excluded.state, path = excluded.path, \
             expires_at_ms = excluded.expires_at_ms, updated_at_ms = excluded.updated_at_ms, admitted_at_ms = excluded.admitted_at_ms, \
             replayed = excluded.replayed, seq = excluded.seq, attempt = excluded.attempt, fenced_attempt = NULL, changed_by = NULL \
             WHERE reservations.state = 'abandoned' AND reservations.attempt IS DISTINCT FROM excluded.attempt \
             RETURNING drop_key, res_key",
            placeholders(run.len(), 13)
        );
        let mut insert = sqlx::query(sqlx::AssertSqlSafe(sql));
        for &i in &candidates[run] {
            let change = changes[i];
            insert = insert
                .bind(&change.drop_key)
                .bind(&change.key)
                .bind(&change.user)
                .bind(change.quantity)
                .bind(change.state.as_str())
                .bind("gate")
                .bind(change.expires_at_ms)
                .bind(now)
                .bind(1_i64)
                .bind(change.seq)
                .bind(change.attempt.as_deref())
                .bind(change.variant.as_deref().unwrap_or(""))
                .bind(change.admitted_at_ms.unwrap_or(now));
        }
        for row in &insert.fetch_all(&mut **tx).await? {
            let (drop_key, key): (String, String) = (row.try_get(0)?, row.try_get(1)?);
            if let Some(&i) = by_key.get(&(drop_key.as_str(), key.as_str())) {
                fresh[i] = true;
            }
        }
    }
    let mut events = Vec::with_capacity(candidates.len());
    // The events in the batch's order, as one change at a time would have numbered
    // them.
    for &i in &candidates {
        if fresh[i] {
            events.push(event_row(changes[i], "gate", now)?);
        }
    }
    write_event_rows(tx, ids, &events, now).await?;
    Ok(fresh)
}

/// Moves each buyer's count by what the batch moved it, in one statement.
async fn move_buyers(
    tx: &mut Transaction<'static, Any>,
    buyers: &[(&str, &str, i64)],
) -> Result<(), sqlx::Error> {
    if buyers.is_empty() {
        return Ok(());
    }
    for run in row_runs(buyers.len()) {
        let sql = format!(
            "INSERT INTO buyers (drop_key, user_id, held) VALUES {} \
             ON CONFLICT (drop_key, user_id) DO UPDATE SET held = buyers.held + excluded.held",
            placeholders(run.len(), 3)
        );
        let mut upsert = sqlx::query(sqlx::AssertSqlSafe(sql));
        for (drop_key, user, held) in &buyers[run] {
            upsert = upsert.bind(*drop_key).bind(*user).bind(*held);
        }
        upsert.execute(&mut **tx).await?;
    }
    Ok(())
}

/// The longest run of rows one multi-row statement writes.
const MAX_RUN: usize = 64;

/// Splits `n` rows into runs of 64, 32, 16, 8, 4, 2 or 1 rows, largest first: a
/// multi-row statement then comes in at most seven texts per table, which stay
/// in each connection's prepared-statement cache (a text per batch size would
/// push each other out of it in a rush, and every batch would be prepared anew).
pub(super) fn row_runs(n: usize) -> Vec<std::ops::Range<usize>> {
    let mut runs = Vec::new();
    let mut start = 0;
    while start < n {
        let size = (n - start).min(MAX_RUN);
        let size = 1 << size.ilog2();
        runs.push(start..start + size);
        start += size;
    }
    runs
}

/// `rows` groups of `columns` numbered parameters: `($1, $2), ($3, $4)`.
fn placeholders(rows: usize, columns: usize) -> String {
    let mut sql = String::with_capacity(rows * columns * 5);
    for r in 0..rows {
        if r > 0 {
            sql.push_str(", ");
        }
        sql.push('(');
        for c in 0..columns {
            if c > 0 {
                sql.push_str(", ");
            }
            sql.push('$');
            sql.push_str(&(r * columns + c + 1).to_string());
        }
        sql.push(')');
    }
    sql
}

/// Refuses a gate admission or extension (a change an attempt decided just now)
/// that Redis decided on an older generation of the sale's config than `newest`,
/// the newest the ledger has seen (noted by any sidecar sharing it): a stale view
/// never decides, and a sidecar that never read the lost change (one started after
/// the failover) cannot tell by itself. Only between generations the API server
/// numbers: outside Kubernetes nothing publishes a lost change again.
fn decided_on_a_lost_change(change: &Change, newest: i64) -> Result<(), RecordError> {
    // What Redis read in the step, else this sidecar's view (an extension's step
    // names no limit, so its stock is this sidecar's config).
    let generation = change.decided_on.unwrap_or(change.stock.generation);
    if change.state == State::Active
        && change.attempt.is_some()
        && dropgate_api::config::lost_since(generation, newest)
    {
        return Err(RecordError::ConfigBehind { generation, newest });
    }
    Ok(())
}

/// Writes a change the Redis gate decided: the reservation row and the outbox
/// event, only if the change is new (a transition from a state that allows it).
/// Returns the units it moves in the drop's stock (negative for an admission), or
/// why it cannot be recorded: the key's record says something else (Redis forgot
/// it, as after its marker's TTL, or was never told), and then nothing is written.
async fn apply_gate_change(
    tx: &mut Transaction<'static, Any>,
    ids: &mut EventIds,
    change: &Change,
    now: i64,
) -> Result<Result<i64, RecordError>, sqlx::Error> {
    if change.extension {
        return record_extension(tx, ids, change, now).await;
    }
    if change.state == State::Active {
        // An offer to a waitlist's head is recorded only while its entry waits
        // here: a buyer who left first keeps their word (the offer is undone).
        if change.offered
            && !waitlist::serve(tx, &change.drop_key, &change.key, now).await?
            && fallback::read(tx, &change.drop_key, &change.key)
                .await?
                .is_none()
        {
            return Ok(Err(RecordError::GivenUp));
        }
        if insert_reservation(tx, change, "gate", true, now).await? {
            write_event(tx, ids, change, "gate", now).await?;
            return Ok(Ok(-change.quantity));
        }
        if fallback::abandoned_by(tx, &change.drop_key, &change.key, change.attempt.as_deref())
            .await?
        {
            return Ok(Err(RecordError::GivenUp));
        }
        // The key has a record. The same attempt's admission recorded again is
        // nothing new; anything else (another reservation under a used key, or the
        // same reservation made durable by another attempt of the key) is the key's
        // record: its answer is that
        // record's (`already_reserved`), not a second 201.
        let existing = fallback::read(tx, &change.drop_key, &change.key).await?;
        let attempt = fallback::attempt_of(tx, &change.drop_key, &change.key).await?;
        let same = existing.as_ref().is_some_and(|row| {
            row.user == change.user
                && row.quantity == change.quantity
                && row.variant == change.variant
                && row.state.holds_units()
                && change.seq.is_none_or(|seq| row.seq == seq)
                && (change.attempt.is_none() || attempt == change.attempt)
        });
        return Ok(if same {
            Ok(0)
        } else {
            Err(RecordError::KeyUsed {
                state: existing.map_or(State::Expired, |row| row.state),
            })
        });
    }
    // An expiry stands only for a hold whose deadline it is: Redis expiring a hold
    // at a deadline the ledger has moved on from (an extension it lost in a
    // failover) is refused, and the ledger's record replayed into it. (A pending
    // admission's expiry is at its pending bound, not the hold's.)
    let due_at =
        (change.state == State::Expired && !change.from_pending).then_some(change.expires_at_ms);
    if let Some(held) = transition(tx, change, true, now, due_at).await? {
        // A partial confirm gives back what it does not keep; a cancel or expiry
        // what the ledger's row held (not what the gate's marker said: a Redis put
        // back from an older copy may hold a partial confirm's units whole).
        if change.state.holds_units() {
            write_event(tx, ids, change, "gate", now).await?;
            return Ok(Ok(change.released));
        }
        let returned = Change {
            quantity: held,
            ..change.clone()
        };
        write_event(tx, ids, &returned, "gate", now).await?;
        return Ok(Ok(held));
    }
    if fallback::fenced_off(tx, &change.drop_key, &change.key, change.attempt.as_deref()).await? {
        return Ok(Err(RecordError::GivenUp));
    }
    match fallback::read(tx, &change.drop_key, &change.key).await? {
        // Another change got there first: this attempt's preparation was made on a
        // Redis that had not seen it (a replica promoted without the first cancel),
        // and its caller must hear `already_*`, not that it moved the reservation.
        Some(row) if row.state == change.state && change.attempt.is_some() => {
            Ok(Err(RecordError::KeyUsed { state: row.state }))
        }
        // Recorded before (a healing record of an earlier answer): nothing new,
        // but the row names this change as the last Redis made.
        Some(row) if row.state == change.state => {
            note_seq(tx, change).await?;
            Ok(Ok(0))
        }
        // The ledger's record went elsewhere (it expired a hold whose confirm Redis
        // made but could not record, or extended the hold past the deadline Redis
        // expired it at): the ledger's word stands.
        Some(row) => Ok(Err(RecordError::KeyUsed { state: row.state })),
        // A reservation this ledger never saw admitted (another pod's SQLite
        // ledger): keep its record and event, with no stock effect here. A pending
        // admission that expired before any ledger recorded it is nobody's news.
        None => {
            if !change.from_pending && insert_reservation(tx, change, "gate", true, now).await? {
                write_event(tx, ids, change, "gate", now).await?;
            }
            Ok(Ok(0))
        }
    }
}

/// Records an extension the Redis gate prepared: the active hold's deadline moves
/// forward, with its event; a ledger that has it at or past that deadline already
/// has nothing new. Moves no units.
async fn record_extension(
    tx: &mut Transaction<'static, Any>,
    ids: &mut EventIds,
    change: &Change,
    now: i64,
) -> Result<Result<i64, RecordError>, sqlx::Error> {
    if extend_hold(tx, change, true, now).await? {
        write_event(tx, ids, change, "gate", now).await?;
        return Ok(Ok(0));
    }
    if fallback::fenced_off(tx, &change.drop_key, &change.key, change.attempt.as_deref()).await? {
        return Ok(Err(RecordError::GivenUp));
    }
    match fallback::read(tx, &change.drop_key, &change.key).await? {
        Some(row) if row.state == State::Active && row.expires_at_ms >= change.expires_at_ms => {
            note_seq(tx, change).await?;
            Ok(Ok(0))
        }
        // Confirmed, cancelled or expired here: nothing is held to extend.
        Some(row) => Ok(Err(RecordError::KeyUsed { state: row.state })),
        // A reservation this ledger never saw admitted (another pod's SQLite
        // ledger): keep its record and event, with no stock effect here, as for a
        // confirm.
        None => {
            if insert_reservation(tx, change, "gate", true, now).await? {
                write_event(tx, ids, change, "gate", now).await?;
            }
            Ok(Ok(0))
        }
    }
}

/// Notes Redis's number for a change the ledger had already (its row was where
/// the change moves it): the row's `seq` names the last change Redis made to the
/// key, so a call that meets this change still prepared in Redis finishes it as
/// recorded (`service::settle::finish_if_recorded`). Never moved back to an older
/// change's number.
async fn note_seq(tx: &mut Transaction<'static, Any>, change: &Change) -> Result<(), sqlx::Error> {
    let Some(seq) = change.seq else {
        return Ok(());
    };
    sqlx::query(
        "UPDATE reservations SET seq = $1, changed_by = $5 WHERE drop_key = $2 AND res_key = $3 AND (seq IS NULL OR seq < $4)",
    )
    .bind(seq)
    .bind(&change.drop_key)
    .bind(&change.key)
    .bind(seq)
    .bind(change.attempt.as_deref())
    .execute(&mut **tx)
    .await?;
    Ok(())
}

/// Moves an active hold's deadline forward to the change's (never back), unless
/// the change's attempt was fenced off; true when moved.
pub(super) async fn extend_hold(
    tx: &mut Transaction<'static, Any>,
    change: &Change,
    replayed: bool,
    now: i64,
) -> Result<bool, sqlx::Error> {
    let moved = sqlx::query(
        "UPDATE reservations SET expires_at_ms = $1, updated_at_ms = $2, replayed = $3, seq = CASE WHEN seq IS NULL OR $4 > seq THEN $4 ELSE seq END, \
         changed_by = CASE WHEN seq IS NULL OR $4 > seq THEN $8 ELSE changed_by END \
         WHERE drop_key = $5 AND res_key = $6 AND state = 'active' AND expires_at_ms < $7 \
         AND (fenced_attempt IS NULL OR fenced_attempt IS DISTINCT FROM $8)",
    )
    .bind(change.expires_at_ms)
    .bind(now)
    .bind(i64::from(replayed))
    .bind(change.seq)
    .bind(&change.drop_key)
    .bind(&change.key)
    .bind(change.expires_at_ms)
    .bind(change.attempt.as_deref())
    .execute(&mut **tx)
    .await?;
    Ok(moved.rows_affected() == 1)
}

/// Creates the drop's stock row (limit minus what is held) or moves it to the
/// limit of a newer generation by the difference, keeping that generation's terms
/// when the change knows them. A change carrying an older generation (a sidecar
/// whose config is stale) never moves it. Returns the row's generation and terms
/// after: the newest the ledger has seen.
///
/// The row is locked for the rest of the transaction on PostgreSQL (SQLite has one
/// writer at a time): whatever decides on the drop's stock and terms (a group
/// commit, a fallback sale, settle or expiry) or moves them (a config noted, a
/// hand-over) takes it before any variant or reservation row, so that a peer's
/// newer config cannot land between a read and its commit, and every transaction
/// locks in one order (authority, stock, variants, reservations, carts).
pub(super) async fn ensure_stock(
    tx: &mut Transaction<'static, Any>,
    drop_key: &str,
    stock: &Stock,
) -> Result<(i64, Option<Terms>), sqlx::Error> {
    let (limit, generation) = (stock.limit, stock.generation);
    let terms = stock.terms;
    // The row exists on every call but the first: a key look-up, not a scan.
    let current = stock_row_locked(tx, drop_key).await?;
    // A change from an older generation than the ledger's describes variants that
    // may be gone: it neither creates nor moves their rows. A drop without variants
    // looks for rows to retire only when its generation moves (it had some before).
    let fresh = current.is_none_or(|(stored, _)| generation >= stored);
    let moving = current.is_some_and(|(stored, _)| generation > stored);
    let has_variants = stock.variants.as_ref().is_some_and(|v| !v.is_empty());
    // A move locks the drop's row before its variants' rows, the order in which
    // every group commit and fallback sale takes them (on PostgreSQL the other
    // order deadlocks with them).
    if fresh && has_variants && !moving {
        ensure_variant_stock(tx, drop_key, stock).await?;
    }
    if let Some((stored, stored_terms)) = current {
        if generation > stored {
            let moved = sqlx::query(
                "UPDATE stock SET available = available + ($1 - lim), lim = $2, generation = $3, \
                 starts_at_ms = $4, ends_at_ms = $5, per_user_limit = $6, hold_seconds = $7, paused = $8, \
                 max_hold_seconds = $9 \
                 WHERE drop_key = $10 AND generation < $11",
            )
            .bind(limit)
            .bind(limit)
            .bind(generation)
            .bind(terms.and_then(|t| t.starts_at_ms))
            .bind(terms.and_then(|t| t.ends_at_ms))
            .bind(terms.map(|t| t.per_user_limit))
            .bind(terms.map(|t| t.hold_seconds))
            .bind(terms.map(|t| i64::from(t.paused)))
            .bind(terms.map(|t| t.max_hold_seconds))
            .bind(drop_key)
            .bind(generation)
            .execute(&mut **tx)
            .await?;
            // Another transaction moved the row past this generation after it was
            // read (possible only where the read above took no lock): that one is
            // the newest the ledger has seen, and this change moves nothing.
            if moved.rows_affected() == 0 {
                return Ok(stock_row(tx, drop_key)
                    .await?
                    .unwrap_or((stored, stored_terms)));
            }
            ensure_variant_stock(tx, drop_key, stock).await?;
            return Ok((generation, terms));
        }
        if generation == stored && stored_terms.is_none() && terms.is_some() {
            set_terms(tx, drop_key, generation, terms).await?;
            return Ok((stored, terms));
        }
        return Ok((stored, stored_terms));
    }
    sqlx::query(
        "INSERT INTO stock (drop_key, lim, available, generation, starts_at_ms, ends_at_ms, per_user_limit, \
         hold_seconds, paused, max_hold_seconds) \
         SELECT $1, $2, $3 - COALESCE(SUM(quantity), 0), $4, $5, $6, $7, $8, $9, $10 FROM reservations \
         WHERE drop_key = $11 AND state IN ('active', 'confirmed') \
         ON CONFLICT (drop_key) DO NOTHING",
    )
    .bind(drop_key)
    .bind(limit)
    .bind(limit)
    .bind(generation)
    .bind(terms.and_then(|t| t.starts_at_ms))
    .bind(terms.and_then(|t| t.ends_at_ms))
    .bind(terms.map(|t| t.per_user_limit))
    .bind(terms.map(|t| t.hold_seconds))
    .bind(terms.map(|t| i64::from(t.paused)))
    .bind(terms.map(|t| t.max_hold_seconds))
    .bind(drop_key)
    .execute(&mut **tx)
    .await?;
    // Locked as the read above would have: a transaction that met another's row
    // here (two sidecars making the drop's first commits at once) inserted nothing
    // and so holds no lock on it; unlocked, it would take the outbox's sequence
    // before the stock row, the order that deadlocks with the row's maker.
    Ok(stock_row_locked(tx, drop_key)
        .await?
        .unwrap_or((generation, terms)))
}

/// Locks the drop's stock row, if it has one, as [`ensure_stock`] does: for a
/// transaction that moves a reservation of the drop without deciding on its terms
/// (an expiry, a fallback cart before its lines).
pub(super) async fn lock_stock(
    tx: &mut Transaction<'static, Any>,
    drop_key: &str,
) -> Result<(), sqlx::Error> {
    stock_row_locked(tx, drop_key).await.map(|_| ())
}

/// The variants' stock rows, as [`ensure_stock`] keeps the drop's: created (limit
/// minus what the variant's reservations hold) for a variant the ledger has not
/// seen, moved by the difference to a newer generation's quantity; a variant the
/// newer generation no longer has keeps its holds at limit 0 (it sells nothing
/// more). A change that does not know the variants (`stock.variants` is `None`)
/// moves none of them.
async fn ensure_variant_stock(
    tx: &mut Transaction<'static, Any>,
    drop_key: &str,
    stock: &Stock,
) -> Result<(), sqlx::Error> {
    let Some(variants) = stock.variants.as_deref() else {
        return Ok(());
    };
    if stock.generation == 0 {
        return Ok(());
    }
    let rows: Vec<AnyRow> =
        sqlx::query("SELECT variant, lim, generation FROM variant_stock WHERE drop_key = $1")
            .bind(drop_key)
            .fetch_all(&mut **tx)
            .await?;
    let mut stored = Vec::with_capacity(rows.len());
    for row in &rows {
        stored.push((
            row.try_get::<String, _>(0)?,
            row.try_get::<i64, _>(1)?,
            row.try_get::<i64, _>(2)?,
        ));
    }
    for variant in variants {
        match stored.iter().find(|(name, ..)| *name == variant.name) {
            Some((_, _, at)) if *at < stock.generation => {
                sqlx::query(
                    "UPDATE variant_stock SET available = available + ($1 - lim), lim = $2, generation = $3 \
                     WHERE drop_key = $4 AND variant = $5 AND generation < $6",
                )
                .bind(variant.quantity)
                .bind(variant.quantity)
                .bind(stock.generation)
                .bind(drop_key)
                .bind(&variant.name)
                .bind(stock.generation)
                .execute(&mut **tx)
                .await?;
            }
            Some(_) => {}
            None => {
                sqlx::query(
                    "INSERT INTO variant_stock (drop_key, variant, lim, available, generation) \
                     SELECT $1, $2, $3, $4 - COALESCE(SUM(quantity), 0), $5 FROM reservations \
                     WHERE drop_key = $6 AND variant = $7 AND state IN ('active', 'confirmed') \
                     ON CONFLICT (drop_key, variant) DO NOTHING",
                )
                .bind(drop_key)
                .bind(&variant.name)
                .bind(variant.quantity)
                .bind(variant.quantity)
                .bind(stock.generation)
                .bind(drop_key)
                .bind(&variant.name)
                .execute(&mut **tx)
                .await?;
            }
        }
    }
    for (name, _, at) in &stored {
        if *at < stock.generation && !variants.iter().any(|v| v.name == *name) {
            sqlx::query(
                "UPDATE variant_stock SET available = available - lim, lim = 0, generation = $1 \
                 WHERE drop_key = $2 AND variant = $3 AND generation < $4",
            )
            .bind(stock.generation)
            .bind(drop_key)
            .bind(name)
            .bind(stock.generation)
            .execute(&mut **tx)
            .await?;
        }
    }
    Ok(())
}

/// What the ledger's stock row for `variant` of the drop holds for sale; `None`
/// when it keeps none (no change told it of the variant yet).
pub(super) async fn variant_row(
    tx: &mut Transaction<'static, Any>,
    drop_key: &str,
    variant: &str,
) -> Result<Option<i64>, sqlx::Error> {
    sqlx::query("SELECT available FROM variant_stock WHERE drop_key = $1 AND variant = $2")
        .bind(drop_key)
        .bind(variant)
        .fetch_optional(&mut **tx)
        .await?
        .map(|row| row.try_get(0))
        .transpose()
}

/// The stock row's generation and terms (`None` terms: not known at it).
async fn stock_row(
    tx: &mut Transaction<'static, Any>,
    drop_key: &str,
) -> Result<Option<(i64, Option<Terms>)>, sqlx::Error> {
    read_stock_row(tx, drop_key, STOCK_ROW).await
}

/// [`stock_row`], locked for the rest of the transaction on PostgreSQL (SQLite has
/// one writer at a time).
async fn stock_row_locked(
    tx: &mut Transaction<'static, Any>,
    drop_key: &str,
) -> Result<Option<(i64, Option<Terms>)>, sqlx::Error> {
    let sql = if tx.backend_name() == <sqlx::Postgres as sqlx::Database>::NAME {
        STOCK_ROW_FOR_UPDATE
    } else {
        STOCK_ROW
    };
    read_stock_row(tx, drop_key, sql).await
}

const STOCK_ROW: &str = "SELECT generation, starts_at_ms, ends_at_ms, per_user_limit, hold_seconds, paused, \
     max_hold_seconds FROM stock WHERE drop_key = $1";
const STOCK_ROW_FOR_UPDATE: &str = "SELECT generation, starts_at_ms, ends_at_ms, per_user_limit, hold_seconds, paused, \
     max_hold_seconds FROM stock WHERE drop_key = $1 FOR UPDATE";

async fn read_stock_row(
    tx: &mut Transaction<'static, Any>,
    drop_key: &str,
    sql: &'static str,
) -> Result<Option<(i64, Option<Terms>)>, sqlx::Error> {
    let row: Option<AnyRow> = sqlx::query(sql)
        .bind(drop_key)
        .fetch_optional(&mut **tx)
        .await?;
    row.map(|row| {
        let per_user_limit: Option<i64> = row.try_get(3)?;
        let hold_seconds: Option<i64> = row.try_get(4)?;
        let terms = match (per_user_limit, hold_seconds) {
            (Some(per_user_limit), Some(hold_seconds)) => Some(Terms {
                starts_at_ms: row.try_get(1)?,
                ends_at_ms: row.try_get(2)?,
                per_user_limit,
                hold_seconds,
                // Written before the pause existed: not paused.
                paused: row.try_get::<Option<i64>, _>(5)?.is_some_and(|p| p != 0),
                // Written before extensions existed: none allowed.
                max_hold_seconds: row.try_get::<Option<i64>, _>(6)?.unwrap_or(hold_seconds),
            }),
            _ => None,
        };
        Ok((row.try_get(0)?, terms))
    })
    .transpose()
}

async fn set_terms(
    tx: &mut Transaction<'static, Any>,
    drop_key: &str,
    generation: i64,
    terms: Option<Terms>,
) -> Result<(), sqlx::Error> {
    sqlx::query(
        "UPDATE stock SET starts_at_ms = $1, ends_at_ms = $2, per_user_limit = $3, hold_seconds = $4, \
         paused = $5, max_hold_seconds = $6 WHERE drop_key = $7 AND generation = $8",
    )
    .bind(terms.and_then(|t| t.starts_at_ms))
    .bind(terms.and_then(|t| t.ends_at_ms))
    .bind(terms.map(|t| t.per_user_limit))
    .bind(terms.map(|t| t.hold_seconds))
    .bind(terms.map(|t| i64::from(t.paused)))
    .bind(terms.map(|t| t.max_hold_seconds))
    .bind(drop_key)
    .bind(generation)
    .execute(&mut **tx)
    .await?;
    Ok(())
}

/// Inserts a reservation unless its key holds one; true when inserted. A row
/// another attempt left `abandoned` (no reservation: the claim of an admission
/// judged dead) is replaced; one the change's own attempt left is not.
async fn insert_reservation(
    tx: &mut Transaction<'static, Any>,
    change: &Change,
    path: &str,
    replayed: bool,
    now: i64,
) -> Result<bool, sqlx::Error> {
    let inserted = sqlx::query(
        "INSERT INTO reservations \
         (drop_key, res_key, user_id, quantity, state, path, expires_at_ms, updated_at_ms, replayed, seq, attempt, variant, admitted_at_ms) \
         VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13) ON CONFLICT (drop_key, res_key) DO UPDATE SET \
         user_id = excluded.user_id, quantity = excluded.quantity, variant = excluded.variant, state = excluded.state, path = excluded.path, \
         expires_at_ms = excluded.expires_at_ms, updated_at_ms = excluded.updated_at_ms, admitted_at_ms = excluded.admitted_at_ms, \
         replayed = excluded.replayed, seq = excluded.seq, attempt = excluded.attempt, fenced_attempt = NULL, changed_by = NULL \
         WHERE reservations.state = 'abandoned' AND reservations.attempt IS DISTINCT FROM excluded.attempt",
    )
    .bind(&change.drop_key)
    .bind(&change.key)
    .bind(&change.user)
    .bind(change.quantity)
    .bind(change.state.as_str())
    .bind(path)
    .bind(change.expires_at_ms)
    .bind(now)
    .bind(i64::from(replayed))
    .bind(change.seq)
    .bind(change.attempt.as_deref())
    .bind(change.variant.as_deref().unwrap_or(""))
    .bind(change.admitted_at_ms.unwrap_or(now))
    .execute(&mut **tx)
    .await?;
    Ok(inserted.rows_affected() == 1)
}

/// Moves a reservation to the change's state if it is in a state that allows it
/// (confirm and expire from active, cancel from active or confirmed), unless the
/// change's attempt was fenced off (judged dead); true when moved. Only forward, so
/// a late or repeated change moves nothing. A partial confirm keeps the change's
/// quantity of a row that holds it plus what the change releases. Returns the
/// row's quantity after the move, `None` when nothing moved. With `due_at`, only
/// a row whose deadline is at or before it moves: an expiry decided on a read
/// must not land on a hold another pod extended meanwhile (PostgreSQL checks the
/// condition again on the row it waited for).
async fn transition(
    tx: &mut Transaction<'static, Any>,
    change: &Change,
    replayed: bool,
    now: i64,
    due_at: Option<i64>,
) -> Result<Option<i64>, sqlx::Error> {
    let sql = match change.state {
        State::Active | State::Pending => return Ok(None),
        State::Confirmed | State::Expired => {
            "UPDATE reservations SET state = $1, updated_at_ms = $2, replayed = $3, seq = CASE WHEN seq IS NULL OR $4 > seq THEN $4 ELSE seq END, \
             changed_by = CASE WHEN seq IS NULL OR $4 > seq THEN $7 ELSE changed_by END, quantity = quantity - $8 \
             WHERE drop_key = $5 AND res_key = $6 AND state = 'active' \
             AND (fenced_attempt IS NULL OR fenced_attempt IS DISTINCT FROM $7) \
             AND ($9 = 0 OR quantity = $10) AND ($11 = 0 OR expires_at_ms <= $12) RETURNING quantity"
        }
        // A give-back of a hold never refunds: a confirmed row is left as it is,
        // and the change is refused as the key's record going elsewhere.
        State::Cancelled if change.hold_only => {
            "UPDATE reservations SET state = $1, updated_at_ms = $2, replayed = $3, seq = CASE WHEN seq IS NULL OR $4 > seq THEN $4 ELSE seq END, \
             changed_by = CASE WHEN seq IS NULL OR $4 > seq THEN $7 ELSE changed_by END, quantity = quantity - $8 \
             WHERE drop_key = $5 AND res_key = $6 AND state = 'active' \
             AND (fenced_attempt IS NULL OR fenced_attempt IS DISTINCT FROM $7) \
             AND ($9 = 0 OR quantity = $10) AND ($11 = 0 OR expires_at_ms <= $12) RETURNING quantity"
        }
        State::Cancelled => {
            "UPDATE reservations SET state = $1, updated_at_ms = $2, replayed = $3, seq = CASE WHEN seq IS NULL OR $4 > seq THEN $4 ELSE seq END, \
             changed_by = CASE WHEN seq IS NULL OR $4 > seq THEN $7 ELSE changed_by END, quantity = quantity - $8 \
             WHERE drop_key = $5 AND res_key = $6 AND state IN ('active', 'confirmed') \
             AND (fenced_attempt IS NULL OR fenced_attempt IS DISTINCT FROM $7) \
             AND ($9 = 0 OR quantity = $10) AND ($11 = 0 OR expires_at_ms <= $12) RETURNING quantity"
        }
    };
    let query = sqlx::query(sql)
        .bind(change.state.as_str())
        .bind(now)
        .bind(i64::from(replayed))
        .bind(change.seq)
        .bind(&change.drop_key)
        .bind(&change.key)
        .bind(change.attempt.as_deref())
        .bind(change.released)
        .bind(change.released)
        .bind(change.quantity + change.released)
        .bind(i64::from(due_at.is_some()))
        .bind(due_at.unwrap_or(0));
    match query.fetch_optional(&mut **tx).await? {
        Some(row) => Ok(Some(row.try_get(0)?)),
        None => Ok(None),
    }
}

/// Moves `units` of a change in the fallback stock and the buyer's count:
/// negative takes them (admission), positive returns them.
async fn adjust_holdings(
    tx: &mut Transaction<'static, Any>,
    change: &Change,
    units: i64,
) -> Result<(), sqlx::Error> {
    sqlx::query("UPDATE stock SET available = available + $1 WHERE drop_key = $2")
        .bind(units)
        .bind(&change.drop_key)
        .execute(&mut **tx)
        .await?;
    if let Some(variant) = &change.variant {
        move_variant(tx, &change.drop_key, variant, units).await?;
    }
    move_buyer(tx, &change.drop_key, &change.user, -units).await
}

/// Moves a variant's stock by `units` unconditionally (a row not there yet is
/// created by the next change that knows the variant's quantity).
async fn move_variant(
    tx: &mut Transaction<'static, Any>,
    drop_key: &str,
    variant: &str,
    units: i64,
) -> Result<(), sqlx::Error> {
    sqlx::query(
        "UPDATE variant_stock SET available = available + $1 WHERE drop_key = $2 AND variant = $3",
    )
    .bind(units)
    .bind(drop_key)
    .bind(variant)
    .execute(&mut **tx)
    .await?;
    Ok(())
}

/// Moves what `user` holds of a drop by `held` units (one upsert).
async fn move_buyer(
    tx: &mut Transaction<'static, Any>,
    drop_key: &str,
    user: &str,
    held: i64,
) -> Result<(), sqlx::Error> {
    sqlx::query(
        "INSERT INTO buyers (drop_key, user_id, held) VALUES ($1, $2, $3) \
         ON CONFLICT (drop_key, user_id) DO UPDATE SET held = buyers.held + excluded.held",
    )
    .bind(drop_key)
    .bind(user)
    .bind(held)
    .execute(&mut **tx)
    .await?;
    Ok(())
}

/// Outbox ids taken from the sequence a block at a time: one statement per
/// transaction instead of one per event (an unused id leaves a gap, which orders
/// nothing differently). The block is taken at the transaction's first event: in a
/// group commit, after the batch's new admissions are inserted and before its other
/// changes' rows are locked. A PostgreSQL deadlock this order meets with another
/// transaction fails the batch, which is then committed change by change.
pub(super) struct EventIds {
    /// Ids to take when the first is wanted.
    size: i64,
    next: i64,
    last: i64,
}

impl EventIds {
    /// Room for `count` events (more are taken a block at a time again).
    pub(super) fn for_events(count: usize) -> Self {
        Self {
            size: i64::try_from(count.max(1)).unwrap_or(i64::MAX),
            next: 1,
            last: 0,
        }
    }

    async fn take(&mut self, tx: &mut Transaction<'static, Any>) -> Result<i64, sqlx::Error> {
        if self.next > self.last {
            let row: AnyRow = sqlx::query(
                "UPDATE sequences SET next_value = next_value + $1 WHERE name = 'outbox' RETURNING next_value",
            )
            .bind(self.size)
            .fetch_one(&mut **tx)
            .await?;
            self.last = row.try_get(0)?;
            self.next = self.last - self.size + 1;
        }
        self.next += 1;
        Ok(self.next - 1)
    }
}

/// The version of the events' payload (sidecar/events.schema.json): a consumer
/// checks it before it reads a field. A field added keeps it; a field removed or
/// given another meaning makes it the next one.
pub const EVENT_SCHEMA_VERSION: i64 = 1;

/// Appends the change's event to the outbox (once: the event id is the drop, the
/// key and the transition). Redis's number for the change is unique per drop: a
/// second change with the same number fails the transaction (Redis lost writes).
async fn write_event(
    tx: &mut Transaction<'static, Any>,
    ids: &mut EventIds,
    change: &Change,
    path: &str,
    now: i64,
) -> Result<(), sqlx::Error> {
    let row = event_row(change, path, now)?;
    write_event_rows(tx, ids, std::slice::from_ref(&row), now).await
}

/// An outbox row as [`write_event`] writes it, before its id is taken.
struct EventRow {
    event_id: String,
    drop_key: String,
    payload: String,
    seq: Option<i64>,
    /// The change's attempt, where it has one (see migration 0014).
    attempt: Option<String>,
}

/// The id of `change`'s event of `kind`: one per reservation and kind, so a
/// change written twice is one event, and the id says whether a change landed.
/// A hold may be extended more than once: each deadline is its own event.
pub(super) fn event_id(change: &Change, kind: &str) -> String {
    if change.extension {
        format!(
            "{}/{}/{kind}/{}",
            change.drop_key, change.key, change.expires_at_ms
        )
    } else {
        format!("{}/{}/{kind}", change.drop_key, change.key)
    }
}

/// The outbox row of `change`'s event.
fn event_row(change: &Change, path: &str, now: i64) -> Result<EventRow, sqlx::Error> {
    let kind = if change.extension {
        "extended"
    } else if change.offered && change.state == State::Active {
        "offered"
    } else {
        event(change.state)
    };
    let event_id = event_id(change, kind);
    let drop = dropgate_api::keys::ledger_drop(&change.drop_key);
    let sale = dropgate_api::keys::ledger_sale(&change.drop_key);
    let mut event_body = serde_json::json!({
        "schemaVersion": EVENT_SCHEMA_VERSION,
        "at": now,
        "drop": drop,
        "eventId": event_id,
        "key": change.key,
        "path": path,
        "quantity": change.quantity,
        "sale": sale,
        "type": kind,
        "user": change.user,
    });
    if let Some(fields) = event_body.as_object_mut() {
        // A drop with variants: the event names the reservation's.
        if let Some(variant) = &change.variant {
            fields.insert("variant".into(), variant.as_str().into());
        }
        // A partial confirm: the units it gave back.
        if change.released > 0 {
            fields.insert("released".into(), change.released.into());
        }
        // An extension: the hold's new deadline (ms since the epoch).
        if change.extension {
            fields.insert("expiresAt".into(), change.expires_at_ms.into());
        }
    }
    let payload = outbox::canonical(&event_body).map_err(|e| sqlx::Error::Encode(Box::new(e)))?;
    Ok(EventRow {
        event_id,
        drop_key: change.drop_key.clone(),
        payload,
        seq: change.seq,
        attempt: change.attempt.clone(),
    })
}

/// Writes `rows` to the outbox in one statement, their ids taken in order (an
/// event already written under its id is left as it was).
async fn write_event_rows(
    tx: &mut Transaction<'static, Any>,
    ids: &mut EventIds,
    rows: &[EventRow],
    now: i64,
) -> Result<(), sqlx::Error> {
    if rows.is_empty() {
        return Ok(());
    }
    let mut numbered = Vec::with_capacity(rows.len());
    for row in rows {
        numbered.push((ids.take(tx).await?, row));
    }
    // (sent_at_ms is left NULL: not sent yet.)
    for run in row_runs(numbered.len()) {
        let sql = format!(
            "INSERT INTO outbox (id, event_id, drop_key, payload, created_at_ms, seq, attempt) \
             VALUES {} ON CONFLICT (event_id) DO NOTHING",
            placeholders(run.len(), 7)
        );
        let mut insert = sqlx::query(sqlx::AssertSqlSafe(sql));
        for (id, row) in &numbered[run] {
            insert = insert
                .bind(*id)
                .bind(row.event_id.as_str())
                .bind(row.drop_key.as_str())
                .bind(row.payload.as_str())
                .bind(now)
                .bind(row.seq)
                .bind(row.attempt.as_deref());
        }
        insert.execute(&mut **tx).await?;
    }
    Ok(())
}

#[cfg(test)]
mod run_tests {
    use super::{placeholders, row_runs};

    #[test]
    fn rows_go_in_runs_of_powers_of_two_largest_first() {
        assert!(row_runs(0).is_empty());
        let sizes = |n| row_runs(n).iter().map(|r| r.len()).collect::<Vec<_>>();
        assert_eq!(sizes(1), [1]);
        assert_eq!(sizes(37), [32, 4, 1]);
        assert_eq!(sizes(64), [64]);
        assert_eq!(sizes(200), [64, 64, 64, 8]);
        // Every row once, in order.
        for n in 0..300 {
            let runs = row_runs(n);
            let covered: Vec<usize> = runs.into_iter().flatten().collect();
            assert_eq!(covered, (0..n).collect::<Vec<_>>());
        }
    }

    #[test]
    fn placeholders_number_every_column_of_every_row() {
        assert_eq!(placeholders(2, 3), "($1, $2, $3), ($4, $5, $6)");
        assert_eq!(placeholders(1, 1), "($1)");
    }
}

#[cfg(test)]
mod url_tests {
    use super::unknown_postgres_parameter;

    #[test]
    fn a_parameter_the_driver_would_ignore_is_named() {
        assert_eq!(
            unknown_postgres_parameter("postgres://u@h/x?sslpassword=s3cr3t&sslmode=require"),
            Some("sslpassword".into())
        );
        for known in [
            "postgres://u:p@h/x",
            "postgres://u@h/x?sslmode=verify-full&sslrootcert=/ca.pem&application_name=shop",
            "postgresql://h/x?options[statement_timeout]=5s",
        ] {
            assert_eq!(unknown_postgres_parameter(known), None, "{known}");
        }
    }
}

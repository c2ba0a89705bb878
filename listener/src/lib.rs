//! HTTP/1.1 listeners that hold against slow and hostile clients.
//!
//! Every port dropgate serves (the sidecar's API and its probe port, the operator's
//! admin port and its webhook) goes through [`serve`], which bounds what a client
//! can hold, whatever it sends or fails to send:
//!
//! - **Connections**: at most [`Limits::max_connections`] at once, and at most
//!   [`Limits::max_per_peer`] from one address (past it, a new one is closed at once),
//!   so one client cannot take every slot from the kubelet or the API server. A full
//!   listener makes room for a new connection by closing the one that has waited
//!   longest for a request (a silent client, a trickling head or body, an idle
//!   kept-alive connection), once it has waited a second; until then, and while
//!   every connection is being answered, new ones wait: the first few hundred
//!   accepted, each slot going to the address that holds the fewest (a probe is
//!   not queued behind an attacker's reconnects), the rest in the kernel's queue.
//! - **Time**: the handshake (TLS, for the webhook) and each request head get
//!   [`Limits::head_timeout`]; the same timer runs while a kept-alive connection
//!   waits for its next request, so it is also the idle timeout. A body must arrive
//!   within [`Limits::body_timeout`] after its head. A connection is closed after
//!   its request in flight once it is [`Limits::max_age`] old.
//! - **Memory**: each connection's read buffer is capped, a body larger than
//!   [`Limits::max_body`] is refused (by its `Content-Length` before reading it), and
//!   the body bytes held across all connections never pass [`Limits::body_budget`].
//!
//! A handler sees the request with its whole body already read (bodies here are a
//! few KB), so no handler can be held by a trickling body either. Refusals (413, 408)
//! are answered in the server's own format through a function it passes in.

use std::collections::HashMap;
use std::convert::Infallible;
use std::future::Future;
use std::io;
use std::net::{IpAddr, SocketAddr};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use http::{Request, Response, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper_util::rt::{TokioIo, TokioTimer};
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{Semaphore, watch};

/// What one listener lets its clients hold.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Limits {
    /// Connections served at once.
    pub max_connections: usize,
    /// Connections one peer address may hold at once.
    pub max_per_peer: usize,
    /// Time for the handshake, for each request head, and for the wait between
    /// requests on a kept-alive connection.
    pub head_timeout: Duration,
    /// Time for a request's body once its head arrived.
    pub body_timeout: Duration,
    /// The largest body read.
    pub max_body: usize,
    /// Body bytes held at once over all connections.
    pub body_budget: usize,
    /// How long a connection may live; then it ends after its request in flight.
    pub max_age: Duration,
    /// Whether a full listener may close a kept-alive connection that waits for its
    /// next request (a client reusing it at that moment loses that request), not
    /// only one that never sent a request: for ports whose clients are not the app
    /// (probes, scrapes), never for the API or the webhook, whose callers reuse
    /// their connections (past `head_timeout` idle, they are closed anyway).
    pub evict_idle: bool,
    /// How many new connections the kernel queues while every slot is taken and the
    /// process's own queue of accepted ones (a few hundred, served fairest first)
    /// is full. The sidecar's API: 4096, for a burst of the app's own new
    /// connections (one per waiting buyer; past the queue, handshakes are dropped
    /// and on loopback some come back as resets). Ports whose callers are few
    /// (probes, scrapes, the API server calling the webhook): 1024.
    pub accept_queue: u32,
    /// How long a connection that has not sent a request yet must have waited before
    /// a full listener may close it: long for the API, whose client may be slow to
    /// write the request it connected for when the app itself is loaded (it is on
    /// the pod's loopback), short where callers are probes.
    pub evict_silent_after: Duration,
}

/// Per-connection read buffer cap: a request head is at most this long.
const MAX_BUF: usize = 16 * 1024;

/// How long a kept-alive connection must have waited for its next request before a
/// full listener may close it (where [`Limits::evict_idle`]): one a client is about
/// to reuse is not cut under its request, whose answer would be lost.
const EVICTABLE_AFTER: std::time::Duration = std::time::Duration::from_millis(1000);
/// How often a full listener looks for such a connection.
const EVICT_EVERY: std::time::Duration = std::time::Duration::from_millis(100);

/// How a refusal of the listener itself (a body too large or too slow) is answered,
/// in the server's own format: a status and a sentence for a person.
pub type Refuse<B> = fn(StatusCode, String) -> Response<B>;

/// Serves `handler` on `listener` within `limits` until `shutdown` completes, then
/// lets the requests in flight finish (for at most a head and a body timeout) and
/// returns. `handshake` turns an accepted TCP stream into the stream HTTP is
/// spoken on ([`plain`], or a TLS acceptor); it runs within the head timeout.
pub async fn serve<H, Fut, B, A, AFut, IO>(
    listener: TcpListener,
    limits: Limits,
    handshake: A,
    handler: H,
    refuse: Refuse<B>,
    shutdown: impl Future<Output = ()>,
) where
    H: Fn(Request<Full<Bytes>>) -> Fut + Clone + Send + Sync + 'static,
    Fut: Future<Output = Response<B>> + Send + 'static,
    B: hyper::body::Body<Data = Bytes> + Send + 'static,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
    A: Fn(TcpStream) -> AFut + Clone + Send + Sync + 'static,
    AFut: Future<Output = io::Result<IO>> + Send + 'static,
    IO: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let slots = Arc::new(Semaphore::new(limits.max_connections));
    let budget = Arc::new(Semaphore::new(
        limits.body_budget.min(Semaphore::MAX_PERMITS),
    ));
    let peers = Peers::default();
    let waiting = Waiting::default();
    let (stop, stopping) = watch::channel(false);
    let mut shutdown = std::pin::pin!(shutdown);
    let mut next_id: u64 = 0;
    let mut start = |arrival: Arrival, slot: tokio::sync::OwnedSemaphorePermit| {
        next_id += 1;
        let Arrival {
            stream,
            peer,
            peer_slot,
        } = arrival;
        let connection = Connection {
            limits,
            handler: handler.clone(),
            refuse,
            budget: budget.clone(),
            peer,
            state: Arc::new(State {
                id: next_id,
                waiting: waiting.clone(),
                close: tokio::sync::Notify::new(),
                in_request: std::sync::atomic::AtomicBool::new(false),
                place: Mutex::new(None),
            }),
        };
        connection.state.wait_for_request(false);
        let (handshake, stopping) = (handshake.clone(), stopping.clone());
        tokio::spawn(async move {
            let _slots = (slot, peer_slot);
            let state = connection.state.clone();
            let _registered = Registered(state.clone());
            let handshaken = tokio::select! {
                io = tokio::time::timeout(limits.head_timeout, handshake(stream)) => io,
                () = state.close.notified() => return,
            };
            let io = match handshaken {
                Ok(Ok(io)) => io,
                Ok(Err(error)) => {
                    tracing::debug!(%peer, %error, "handshake failed");
                    return;
                }
                Err(_) => {
                    tracing::debug!(%peer, "handshake timed out");
                    return;
                }
            };
            connection.run(io, stopping).await;
        });
    };
    let mut lobby = Lobby::default();
    let mut room = tokio::time::interval(EVICT_EVERY);
    room.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        // Slots freed go to the lobby first, the least represented address first.
        while !lobby.0.is_empty() {
            let Ok(slot) = slots.clone().try_acquire_owned() else {
                break;
            };
            if let Some(arrival) = lobby.fairest(&peers) {
                start(arrival, slot);
            }
        }
        tokio::select! {
            accepted = listener.accept(), if lobby.has_room() => {
                let (stream, peer) = match accepted {
                    Ok(accepted) => accepted,
                    Err(error) => {
                        // Out of file descriptors, say: wait instead of spinning.
                        tracing::warn!(%error, "accept failed");
                        tokio::time::sleep(Duration::from_millis(100)).await;
                        continue;
                    }
                };
                let Some(peer_slot) = peers.enter(peer.ip(), limits.max_per_peer) else {
                    tracing::debug!(%peer, "connection refused: this address holds its share of connections");
                    continue;
                };
                let arrival = Arrival { stream, peer, peer_slot };
                if lobby.0.is_empty()
                    && let Ok(slot) = slots.clone().try_acquire_owned()
                {
                    start(arrival, slot);
                    continue;
                }
                lobby.0.push_back(arrival);
                if lobby.0.len() > LOBBY {
                    lobby.close_most_crowded(&peers);
                }
            }
            slot = slots.clone().acquire_owned(), if !lobby.0.is_empty() => {
                if let (Ok(slot), Some(arrival)) = (slot, lobby.fairest(&peers)) {
                    start(arrival, slot);
                }
            }
            // Full, and someone waits: room is made by closing the connection that
            // has waited longest for a request (not one a client is about to reuse).
            _ = room.tick(), if !lobby.0.is_empty() => {
                if waiting.evict_oldest(&limits) {
                    tracing::debug!("listener full: closed the connection that waited longest for a request");
                }
            }
            () = &mut shutdown => break,
        }
    }
    let _ = stop.send(true);
    // Every connection holds a slot: all slots back means all connections ended.
    let drained = limits.head_timeout + limits.body_timeout;
    let all = u32::try_from(limits.max_connections).unwrap_or(u32::MAX);
    let _ = tokio::time::timeout(drained, slots.acquire_many(all)).await;
}

/// A TCP listener on `addr` whose kernel accept queue holds
/// [`Limits::accept_queue`] connections (the kernel caps it at its `somaxconn`):
/// pass the same `limits` to [`serve`].
pub fn bind(addr: SocketAddr, limits: &Limits) -> io::Result<TcpListener> {
    let socket = if addr.is_ipv4() {
        tokio::net::TcpSocket::new_v4()?
    } else {
        tokio::net::TcpSocket::new_v6()?
    };
    socket.set_reuseaddr(true)?;
    socket.bind(addr)?;
    socket.listen(limits.accept_queue)
}

/// An accepted stream spoken as it is (no TLS).
pub async fn plain(stream: TcpStream) -> io::Result<TcpStream> {
    Ok(stream)
}

/// The future a [`warp_handler`] answers with.
pub type WarpAnswer = std::pin::Pin<Box<dyn Future<Output = warp::reply::Response> + Send>>;

/// A handler serving a warp filter.
pub fn warp_handler(
    filter: warp::filters::BoxedFilter<(warp::reply::Response,)>,
) -> impl Fn(Request<Full<Bytes>>) -> WarpAnswer + Clone + Send + Sync + 'static {
    let service = warp::service(filter);
    move |request| {
        let mut service = service.clone();
        Box::pin(async move {
            match tower_service::Service::call(&mut service, request).await {
                Ok(response) => response,
                Err(never) => match never {},
            }
        })
    }
}

/// How many connections each peer address holds, and how often it connected lately.
#[derive(Clone, Default)]
struct Peers(Arc<Mutex<PeerCounts>>);

#[derive(Default)]
struct PeerCounts {
    held: HashMap<IpAddr, usize>,
    /// Each address's arrivals, decayed by half every [`ARRIVALS_HALF_LIFE`] (and
    /// when it was last decayed): a client that reconnects over and over (a flood)
    /// weighs more than one that connects now and then (a kubelet's probe), even
    /// when each holds one connection right now.
    arrivals: HashMap<IpAddr, (f64, std::time::Instant)>,
}

/// How fast an address's arrivals are forgotten.
const ARRIVALS_HALF_LIFE: Duration = Duration::from_secs(2);
/// Past this many addresses remembered, those whose arrivals have faded are
/// forgotten (and past [`ARRIVALS_FORGET_ALL`], all of them: memory stays bounded
/// whatever number of addresses connect).
const ARRIVALS_PRUNE_AT: usize = 4096;
const ARRIVALS_FORGET_ALL: usize = 65_536;

fn decayed((count, at): (f64, std::time::Instant), now: std::time::Instant) -> f64 {
    let halvings =
        now.saturating_duration_since(at).as_secs_f64() / ARRIVALS_HALF_LIFE.as_secs_f64();
    count * 0.5_f64.powf(halvings)
}

/// One peer's connection, counted until it is dropped.
struct PeerSlot {
    peers: Peers,
    ip: IpAddr,
}

impl Peers {
    fn lock(&self) -> std::sync::MutexGuard<'_, PeerCounts> {
        self.0.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The connections `ip` holds (served or waiting), and how often it came back
    /// lately: its arrivals beyond one, whole.
    fn weight(&self, ip: IpAddr) -> (usize, u64) {
        let counts = self.lock();
        let held = counts.held.get(&ip).copied().unwrap_or(0);
        let arrivals = counts
            .arrivals
            .get(&ip)
            .map_or(0.0, |a| decayed(*a, std::time::Instant::now()));
        (held, (arrivals - 1.0).max(0.0).floor() as u64)
    }

    fn enter(&self, ip: IpAddr, max: usize) -> Option<PeerSlot> {
        let mut counts = self.lock();
        let now = std::time::Instant::now();
        if counts.arrivals.len() >= ARRIVALS_PRUNE_AT {
            counts.arrivals.retain(|_, a| decayed(*a, now) >= 0.5);
            if counts.arrivals.len() >= ARRIVALS_FORGET_ALL {
                counts.arrivals.clear();
            }
        }
        // Every arrival counts, a refused one too.
        let arrived = counts.arrivals.entry(ip).or_insert((0.0, now));
        *arrived = (decayed(*arrived, now) + 1.0, now);
        let count = counts.held.entry(ip).or_insert(0);
        if *count >= max {
            return None;
        }
        *count += 1;
        Some(PeerSlot {
            peers: self.clone(),
            ip,
        })
    }
}

impl Drop for PeerSlot {
    fn drop(&mut self) {
        let held = &mut self.peers.lock().held;
        if let Some(count) = held.get_mut(&self.ip) {
            *count = count.saturating_sub(1);
            if *count == 0 {
                held.remove(&self.ip);
            }
        }
    }
}

/// Connections accepted while the listener is full: at most this many wait for a
/// slot in the process rather than in the kernel's queue, which serves first come
/// first: an attacker reconnecting thousands of times would keep a probe's handshake
/// out of it. Here the next slot goes to the address holding the fewest
/// connections.
const LOBBY: usize = 256;

/// A connection accepted, not yet served.
struct Arrival {
    stream: TcpStream,
    peer: SocketAddr,
    peer_slot: PeerSlot,
}

impl Arrival {
    /// How much this connection weighs on a full listener, lightest served first
    /// and heaviest closed first: the connections its address holds; then whether
    /// it has sent nothing yet (a client with a request to make sends it at once,
    /// a flood's silent connection never does); then how often its address came
    /// back lately (a flood reconnects the moment it is closed, a kubelet's probe
    /// comes every few seconds).
    fn weight(&self, peers: &Peers) -> (usize, bool, u64) {
        let (held, again) = peers.weight(self.peer.ip());
        (held, !self.has_sent(), again)
    }

    /// Whether bytes wait to be read on it (looked at without waiting or reading).
    fn has_sent(&self) -> bool {
        let mut byte = [0u8; 1];
        let mut buf = tokio::io::ReadBuf::new(&mut byte);
        let mut cx = std::task::Context::from_waker(std::task::Waker::noop());
        matches!(
            self.stream.poll_peek(&mut cx, &mut buf),
            std::task::Poll::Ready(Ok(n)) if n > 0
        )
    }
}

/// The connections waiting for a slot, oldest first.
#[derive(Default)]
struct Lobby(std::collections::VecDeque<Arrival>);

impl Lobby {
    /// Whether another connection may be accepted: room, or other addresses to be
    /// fair to (a full lobby then closes the newest connection of the address that
    /// holds the most). A lobby full of one address's connections (the app on the
    /// pod's loopback, on the API port) stops accepting: the kernel queues the rest.
    fn has_room(&self) -> bool {
        self.0.len() < LOBBY || self.0.iter().any(|a| a.peer.ip() != self.0[0].peer.ip())
    }

    /// Takes the lightest connection (see [`Arrival::weight`]; the oldest of those).
    fn fairest(&mut self, peers: &Peers) -> Option<Arrival> {
        let (at, _) = self
            .0
            .iter()
            .enumerate()
            .min_by_key(|(at, a)| (a.weight(peers), *at))?;
        self.0.remove(at)
    }

    /// Closes the heaviest connection (see [`Arrival::weight`]; the newest of those).
    fn close_most_crowded(&mut self, peers: &Peers) {
        let most = self
            .0
            .iter()
            .enumerate()
            .max_by_key(|(at, a)| (a.weight(peers), *at))
            .map(|(at, _)| at);
        if let Some(closed) = most.and_then(|at| self.0.remove(at)) {
            tracing::debug!(peer = %closed.peer, "listener full: closed a new connection of the address holding the most");
        }
    }
}

/// The connections waiting for a request, those that never sent one first, oldest
/// first: whom a full listener closes to make room.
#[derive(Clone, Default)]
struct Waiting(Arc<Mutex<WaitingSince>>);

/// Where a connection stands among the waiting: whether it was answered before
/// (kept alive), since when it waits, its id.
type Place = (bool, std::time::Instant, u64);

/// The waiting connections by [`Place`].
type WaitingSince = std::collections::BTreeMap<Place, Arc<State>>;

impl Waiting {
    /// Asks the connection that has waited longest to close: one that never sent a
    /// request (silent, or trickling its head or body) before any other, once it
    /// waited [`Limits::evict_silent_after`]; a kept-alive one only where
    /// [`Limits::evict_idle`] (a client reusing it could lose its next request in
    /// the race), once it waited [`EVICTABLE_AFTER`]. False when none may go.
    fn evict_oldest(&self, limits: &Limits) -> bool {
        let oldest = {
            let mut waiting = self.0.lock().unwrap_or_else(|e| e.into_inner());
            let may_go = |served: bool, since: &std::time::Instant| {
                if served {
                    limits.evict_idle && since.elapsed() >= EVICTABLE_AFTER
                } else {
                    since.elapsed() >= limits.evict_silent_after
                }
            };
            // Silent ones first (the map's order), then the longest idle.
            let silent = waiting
                .iter()
                .next()
                .filter(|((served, since, _), _)| !*served && may_go(false, since))
                .map(|(place, _)| *place);
            // The first kept-alive one: every key of a silent one (false, at most
            // now, ..) is below (false, tomorrow, MAX), and every kept-alive one above.
            let idle = || {
                let tomorrow = std::time::Instant::now() + std::time::Duration::from_secs(86_400);
                waiting
                    .range((
                        std::ops::Bound::Excluded((false, tomorrow, u64::MAX)),
                        std::ops::Bound::Unbounded,
                    ))
                    .next()
                    .filter(|((served, since, _), _)| may_go(*served, since))
                    .map(|(place, _)| *place)
            };
            match silent.or_else(idle) {
                Some(place) => waiting.remove_entry(&place),
                None => None,
            }
        };
        match oldest {
            Some((_, state)) => {
                state.close.notify_one();
                true
            }
            None => false,
        }
    }
}

/// Where one connection stands, for eviction.
struct State {
    id: u64,
    waiting: Waiting,
    /// Told when the listener wants this connection's slot.
    close: tokio::sync::Notify,
    /// Whether a request is being answered on it (its body read): then it is never
    /// cut off.
    in_request: std::sync::atomic::AtomicBool,
    /// Its place among the waiting, while it waits.
    place: Mutex<Option<Place>>,
}

impl State {
    /// It waits for a request: a first one (`served` false), or the next one on a
    /// kept-alive connection.
    fn wait_for_request(self: &Arc<Self>, served: bool) {
        self.in_request
            .store(false, std::sync::atomic::Ordering::Release);
        let place = (served, std::time::Instant::now(), self.id);
        let mut waiting = self.waiting.0.lock().unwrap_or_else(|e| e.into_inner());
        let mut mine = self.place.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(old) = mine.replace(place) {
            waiting.remove(&old);
        }
        waiting.insert(place, self.clone());
    }

    fn begin_request(&self) {
        self.in_request
            .store(true, std::sync::atomic::Ordering::Release);
        self.leave();
    }

    fn leave(&self) {
        let mut waiting = self.waiting.0.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(old) = self.place.lock().unwrap_or_else(|e| e.into_inner()).take() {
            waiting.remove(&old);
        }
    }
}

/// Takes a connection out of [`Waiting`] when its task ends, however it ends.
struct Registered(Arc<State>);

impl Drop for Registered {
    fn drop(&mut self) {
        self.0.leave();
    }
}

/// One accepted connection and what its requests are served with.
struct Connection<H, B> {
    limits: Limits,
    handler: H,
    refuse: Refuse<B>,
    budget: Arc<Semaphore>,
    peer: SocketAddr,
    state: Arc<State>,
}

impl<H, Fut, B> Connection<H, B>
where
    H: Fn(Request<Full<Bytes>>) -> Fut + Clone + Send + Sync + 'static,
    Fut: Future<Output = Response<B>> + Send + 'static,
    B: hyper::body::Body<Data = Bytes> + Send + 'static,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    async fn run<IO>(self, io: IO, mut stopping: watch::Receiver<bool>)
    where
        IO: AsyncRead + AsyncWrite + Unpin + Send + 'static,
    {
        let (limits, peer, state) = (self.limits, self.peer, self.state.clone());
        let this = Arc::new(self);
        let service = hyper::service::service_fn(move |request: Request<Incoming>| {
            let this = this.clone();
            async move {
                let answer = this.answer(request).await;
                this.state.wait_for_request(true);
                Ok::<_, Infallible>(answer)
            }
        });
        let mut builder = hyper::server::conn::http1::Builder::new();
        builder
            .timer(TokioTimer::new())
            .header_read_timeout(limits.head_timeout)
            .max_buf_size(MAX_BUF)
            .keep_alive(true);
        let connection = builder.serve_connection(TokioIo::new(io), service);
        let mut connection = std::pin::pin!(connection);
        let aged = tokio::time::sleep(limits.max_age);
        let mut aged = std::pin::pin!(aged);
        let ended = loop {
            tokio::select! {
                ended = connection.as_mut() => break Some(ended),
                () = aged.as_mut() => break None,
                _ = stopping.wait_for(|stop| *stop) => break None,
                () = state.close.notified() => {
                    if !state.in_request.load(std::sync::atomic::Ordering::Acquire) {
                        // Evicted while it waited for a head: nothing is lost.
                        return;
                    }
                }
            }
        };
        let ended = match ended {
            Some(ended) => ended,
            None => {
                // Old, or the server stops: end after the request in flight, within
                // the time one request may take.
                connection.as_mut().graceful_shutdown();
                match tokio::time::timeout(
                    limits.head_timeout + limits.body_timeout,
                    connection.as_mut(),
                )
                .await
                {
                    Ok(ended) => ended,
                    Err(_) => return,
                }
            }
        };
        if let Err(error) = ended {
            tracing::debug!(%peer, %error, "connection ended");
        }
    }

    /// Reads the request's body within the limits, then asks the handler.
    async fn answer(&self, request: Request<Incoming>) -> Response<B> {
        let (parts, body) = request.into_parts();
        let declared = parts
            .headers
            .get(http::header::CONTENT_LENGTH)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.parse::<u64>().ok());
        if declared.is_some_and(|n| n > self.limits.max_body as u64) {
            return self.too_large();
        }
        let read = tokio::time::timeout(self.limits.body_timeout, self.read_body(body)).await;
        let (bytes, _held) = match read {
            Ok(Ok(read)) => read,
            Ok(Err(BodyError::TooLarge)) => return self.too_large(),
            Ok(Err(BodyError::Broken(error))) => {
                return (self.refuse)(
                    StatusCode::BAD_REQUEST,
                    format!("the body could not be read: {error}"),
                );
            }
            Err(_) => {
                return (self.refuse)(
                    StatusCode::REQUEST_TIMEOUT,
                    format!(
                        "the request's body did not arrive within {} ms",
                        self.limits.body_timeout.as_millis()
                    ),
                );
            }
        };
        // From here on the request is served whatever knocks: until its body was
        // read, a full listener could still close it to make room.
        self.state.begin_request();
        (self.handler)(Request::from_parts(parts, Full::new(bytes))).await
    }

    fn too_large(&self) -> Response<B> {
        (self.refuse)(
            StatusCode::PAYLOAD_TOO_LARGE,
            format!("the body must be at most {} bytes", self.limits.max_body),
        )
    }

    /// The whole body, holding its bytes' share of the budget until the answer.
    async fn read_body(
        &self,
        mut body: Incoming,
    ) -> Result<(Bytes, Option<tokio::sync::SemaphorePermit<'_>>), BodyError> {
        let mut bytes = BytesMut::new();
        let mut held: Option<tokio::sync::SemaphorePermit<'_>> = None;
        while let Some(frame) = body.frame().await {
            let frame = frame.map_err(|e| BodyError::Broken(e.to_string()))?;
            let Ok(data) = frame.into_data() else {
                continue;
            };
            if bytes.len() + data.len() > self.limits.max_body {
                return Err(BodyError::TooLarge);
            }
            let more = u32::try_from(data.len()).map_err(|_| BodyError::TooLarge)?;
            let permit = self
                .budget
                .acquire_many(more)
                .await
                .map_err(|e| BodyError::Broken(e.to_string()))?;
            match held.as_mut() {
                Some(held) => held.merge(permit),
                None => held = Some(permit),
            }
            bytes.extend_from_slice(&data);
        }
        Ok((bytes.freeze(), held))
    }
}

enum BodyError {
    TooLarge,
    Broken(String),
}

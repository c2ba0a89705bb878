//! A Redis Cluster client for what dropgate sends: every command about a drop names
//! keys in the drop's one hash slot, so it goes to the primary serving that slot,
//! over one multiplexed connection per node.
//!
//! Why not redis-rs's `ClusterConnection`: while it refreshes its slot map after a
//! node dies it holds every request, for every shard, until the refresh succeeds,
//! and a refresh keeps failing while the dead primary is still listed. A failover
//! on one shard paused the drops on all the others for seconds, and under load the
//! connection never recovered. Here a node's trouble stays with the slots it
//! serves: the slot map is read anew in the background and requests to healthy
//! nodes go on meanwhile.
//!
//! What it follows: MOVED (the slot's new primary, remembered until the next map),
//! ASK (once, on a connection of its own, after ASKING), TRYAGAIN and CLUSTERDOWN
//! (again after a pause). A node it cannot connect to is asked again, with the map
//! re-read, until the call's deadline. A request that failed after it was sent is
//! never sent again: whether it ran is unknown, and the caller decides.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, Instant};

use redis::aio::{ConnectionLike, MultiplexedConnection};
use redis::{
    Arg, AsyncConnectionConfig, Cmd, ConnectionAddr, ConnectionInfo, ErrorKind, Pipeline,
    RedisError, RedisResult, ServerErrorKind, Value,
};

/// How many MOVED / ASK redirections one call follows before it gives up.
const MAX_REDIRECTS: usize = 5;
/// The first pause before asking again after TRYAGAIN, CLUSTERDOWN or a node that
/// could not be reached; each further one doubles, up to [`MAX_PAUSE`].
const FIRST_PAUSE: Duration = Duration::from_millis(10);
const MAX_PAUSE: Duration = Duration::from_millis(200);
/// The slot map is read at most this often on account of errors.
const MIN_REFRESH_INTERVAL: Duration = Duration::from_millis(100);

/// A Redis Cluster, known from one seed address (a discovery endpoint works).
pub struct ClusterLink {
    /// The address the client was given, with the credentials and TLS settings
    /// every node shares.
    seed: ConnectionInfo,
    seed_node: Node,
    config: AsyncConnectionConfig,
    /// The longest one call may take, its redirections and pauses included.
    deadline: Duration,
    slots: RwLock<SlotMap>,
    nodes: Mutex<HashMap<Node, Arc<tokio::sync::Mutex<NodeLink>>>>,
    /// Held while the map is read, so that one read runs at a time.
    refresh: tokio::sync::Mutex<Option<Instant>>,
    refresh_queued: AtomicBool,
}

/// A node's address.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
struct Node {
    host: String,
    port: u16,
}

impl std::fmt::Display for Node {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}:{}", self.host, self.port)
    }
}

/// One node's connection; `generation` counts the connections made, so that an
/// error on one that was replaced since does not drop its successor.
#[derive(Default)]
struct NodeLink {
    generation: u64,
    conn: Option<MultiplexedConnection>,
}

/// Which slots each primary serves, as `CLUSTER SLOTS` last said, and the slots
/// MOVED has said more recently.
#[derive(Default, Debug, PartialEq)]
struct SlotMap {
    /// Sorted by `start`.
    ranges: Vec<SlotRange>,
    /// Every node listed, primaries first: where the next map is asked for.
    nodes: Vec<Node>,
    moved: HashMap<u16, Node>,
}

#[derive(Debug, PartialEq)]
struct SlotRange {
    start: u16,
    end: u16,
    primary: Node,
}

/// A request that failed before it was sent (nothing ran: it may be sent again)
/// or after (it may have run).
enum Failed {
    NotSent(RedisError),
    Sent(RedisError),
}

impl Failed {
    fn into_error(self) -> RedisError {
        match self {
            Failed::NotSent(error) | Failed::Sent(error) => error,
        }
    }
}

/// Where a request goes.
#[derive(Debug, PartialEq)]
enum Target {
    /// The primary serving this slot.
    Slot(u16),
    /// Every primary (loading a script, reading INFO).
    EveryPrimary,
    /// Any node that answers (TIME, PING, CLUSTER ...).
    AnyNode,
}

/// A command or a pipeline, as `ConnectionLike` hands them over.
#[derive(Clone, Copy)]
pub(crate) enum Request<'a> {
    Cmd(&'a Cmd),
    Pipeline {
        pipeline: &'a Pipeline,
        offset: usize,
        count: usize,
    },
}

impl Request<'_> {
    /// Sends it on `conn`. The cluster's refusals (MOVED, ASK, TRYAGAIN,
    /// CLUSTERDOWN) come back as errors, also from inside a pipeline or a
    /// transaction (where EXEC only says EXECABORT): they are where the client
    /// decides to send it again.
    async fn send(self, conn: &mut MultiplexedConnection) -> RedisResult<Value> {
        match self {
            Request::Cmd(cmd) => match conn.req_packed_command(cmd).await? {
                Value::ServerError(error) if cluster_refusal(&error) => Err(error.into()),
                answered => Ok(answered),
            },
            Request::Pipeline {
                pipeline,
                offset,
                count,
            } => {
                // Every reply, the skipped ones too: a transaction's queued commands
                // are the ones that say MOVED.
                let mut replies = conn
                    .req_packed_commands(pipeline, 0, offset + count)
                    .await?;
                if let Some(error) = replies.iter().find_map(|reply| match reply {
                    Value::ServerError(error) if cluster_refusal(error) => Some(error.clone()),
                    _ => None,
                }) {
                    return Err(error.into());
                }
                Ok(Value::Array(replies.split_off(offset.min(replies.len()))))
            }
        }
    }

    fn target(self) -> Target {
        match self {
            Request::Cmd(cmd) => target(cmd),
            // A pipeline about a drop goes where its first command about a key goes.
            Request::Pipeline { pipeline, .. } => pipeline
                .cmd_iter()
                .map(target)
                .find(|target| matches!(target, Target::Slot(_)))
                .unwrap_or(Target::AnyNode),
        }
    }
}

impl ClusterLink {
    /// A client of the cluster `seed` belongs to; nothing is connected yet.
    pub(crate) fn new(
        seed: ConnectionInfo,
        connect: Duration,
        response: Duration,
    ) -> RedisResult<Self> {
        let seed_node = match seed.addr() {
            ConnectionAddr::Tcp(host, port) | ConnectionAddr::TcpTls { host, port, .. } => Node {
                host: host.clone(),
                port: *port,
            },
            _ => {
                return Err(RedisError::from((
                    ErrorKind::InvalidClientConfig,
                    "a Redis Cluster is reached over TCP (redis:// or rediss://)",
                )));
            }
        };
        Ok(ClusterLink {
            seed,
            seed_node,
            config: AsyncConnectionConfig::new()
                .set_connection_timeout(Some(connect))
                .set_response_timeout(Some(response)),
            deadline: response * 3 + connect,
            slots: RwLock::new(SlotMap::default()),
            nodes: Mutex::new(HashMap::new()),
            refresh: tokio::sync::Mutex::new(None),
            refresh_queued: AtomicBool::new(false),
        })
    }

    /// Reads the slot map now (the first use, or a check that the cluster answers).
    pub(crate) async fn connect(&self) -> RedisResult<()> {
        self.refresh(true).await
    }

    /// Runs `request` where its keys live, within the deadline.
    pub(crate) async fn run(self: &Arc<Self>, request: Request<'_>) -> RedisResult<Value> {
        self.run_on(request.target(), request).await
    }

    /// Runs `request` on the primary serving `key`'s slot.
    pub(crate) async fn run_on_slot_of(
        self: &Arc<Self>,
        key: &[u8],
        request: Request<'_>,
    ) -> RedisResult<Value> {
        self.run_on(Target::Slot(slot(key)), request).await
    }

    async fn run_on(self: &Arc<Self>, target: Target, request: Request<'_>) -> RedisResult<Value> {
        let give_up = Instant::now() + self.deadline;
        let call = async {
            match target {
                Target::Slot(slot) => self.on_slot(slot, request, give_up).await,
                Target::EveryPrimary => self.on_every_primary(request).await,
                Target::AnyNode => self.on_any_node(request).await,
            }
        };
        match tokio::time::timeout_at(give_up.into(), call).await {
            Ok(answered) => answered,
            Err(_) => Err(RedisError::from(std::io::Error::new(
                std::io::ErrorKind::TimedOut,
                format!(
                    "the Redis Cluster did not answer within {:?}",
                    self.deadline
                ),
            ))),
        }
    }

    async fn on_slot(
        self: &Arc<Self>,
        slot: u16,
        request: Request<'_>,
        give_up: Instant,
    ) -> RedisResult<Value> {
        let mut pause = FIRST_PAUSE;
        let mut redirects = 0;
        let mut asking: Option<Node> = None;
        loop {
            let answered = match asking.take() {
                Some(node) => self.send_asking(&node, request).await,
                None => {
                    let node = self.primary_of(slot).await?;
                    self.on_node(&node, request).await
                }
            };
            let (error, sent) = match answered {
                Ok(value) => return Ok(value),
                Err(Failed::NotSent(error)) => (error, false),
                Err(Failed::Sent(error)) => (error, true),
            };
            match redirect(&error) {
                Some((kind, node)) if redirects < MAX_REDIRECTS => {
                    redirects += 1;
                    if kind == ServerErrorKind::Moved {
                        self.moved(slot, node);
                        self.refresh_soon();
                    } else {
                        asking = Some(node);
                    }
                    continue;
                }
                _ => {}
            }
            // Nothing ran: a node not reached (a replica may be taking over, the map
            // is being read anew), or a refusal that says so.
            let again = !sent
                || matches!(
                    error.kind(),
                    ErrorKind::Server(ServerErrorKind::TryAgain | ServerErrorKind::ClusterDown)
                );
            if !again || Instant::now() + pause >= give_up {
                return Err(error);
            }
            tokio::time::sleep(pause).await;
            pause = (pause * 2).min(MAX_PAUSE);
        }
    }

    /// Every primary that answers runs it; the first answer is returned (for INFO,
    /// a map from node to answer, as redis-rs's cluster client gives it). Fails only
    /// if none answered: a node that is down has no drop to serve anyway.
    async fn on_every_primary(self: &Arc<Self>, request: Request<'_>) -> RedisResult<Value> {
        let primaries = self.primaries().await?;
        let is_info = matches!(request, Request::Cmd(cmd) if name(cmd).as_deref() == Some("INFO"));
        let mut last_error = None;
        let mut answered = Vec::new();
        for node in &primaries {
            match self.on_node(node, request).await {
                Ok(value) => {
                    answered.push((Value::BulkString(node.to_string().into_bytes()), value))
                }
                Err(failed) => last_error = Some(failed.into_error()),
            }
        }
        if answered.is_empty() {
            return Err(last_error.unwrap_or_else(|| no_node("no primary is known")));
        }
        if is_info {
            return Ok(Value::Map(answered));
        }
        Ok(answered.swap_remove(0).1)
    }

    async fn on_any_node(self: &Arc<Self>, request: Request<'_>) -> RedisResult<Value> {
        let mut nodes = self.slots_read().nodes.clone();
        if nodes.is_empty() {
            self.refresh(true).await?;
            nodes = self.slots_read().nodes.clone();
        }
        let mut last_error = None;
        for node in &nodes {
            match self.on_node(node, request).await {
                Ok(value) => return Ok(value),
                Err(Failed::NotSent(error)) => last_error = Some(error),
                Err(Failed::Sent(error)) if lost_connection(&error) => last_error = Some(error),
                Err(Failed::Sent(error)) => return Err(error),
            }
        }
        Err(last_error.unwrap_or_else(|| no_node("no node is known")))
    }

    /// Sends `request` to `node` on its shared connection. A connection that broke
    /// or timed out is dropped (the next request connects anew) and the map read
    /// anew: the node may have died, a replica may be taking over.
    async fn on_node(self: &Arc<Self>, node: &Node, request: Request<'_>) -> Result<Value, Failed> {
        let (generation, mut conn) = match self.node_connection(node).await {
            Ok(linked) => linked,
            Err(error) => {
                self.refresh_soon();
                return Err(Failed::NotSent(error));
            }
        };
        let answered = request.send(&mut conn).await;
        if answered.as_ref().is_err_and(lost_connection) {
            self.forget(node, generation).await;
            self.refresh_soon();
        }
        answered.map_err(Failed::Sent)
    }

    /// ASK: this one request goes to `node`, right after ASKING, on a connection of
    /// its own (ASKING holds for the next command on its connection only, and a
    /// shared connection interleaves other requests). Only while a slot migrates.
    async fn send_asking(&self, node: &Node, request: Request<'_>) -> Result<Value, Failed> {
        let mut conn = async {
            let mut conn = redis::Client::open(at(&self.seed, node))?
                .get_multiplexed_async_connection_with_config(&self.config)
                .await?;
            redis::cmd("ASKING").query_async::<()>(&mut conn).await?;
            Ok(conn)
        }
        .await
        .map_err(Failed::NotSent)?;
        request.send(&mut conn).await.map_err(Failed::Sent)
    }

    async fn primary_of(&self, slot: u16) -> RedisResult<Node> {
        if let Some(node) = self.slots_read().primary(slot) {
            return Ok(node.clone());
        }
        self.refresh(true).await?;
        self.slots_read().primary(slot).cloned().ok_or_else(|| {
            RedisError::from((
                ErrorKind::Server(ServerErrorKind::ClusterDown),
                "no primary serves the slot",
                format!("slot {slot}"),
            ))
        })
    }

    async fn primaries(&self) -> RedisResult<Vec<Node>> {
        if self.slots_read().ranges.is_empty() {
            self.refresh(true).await?;
        }
        Ok(self.slots_read().primaries())
    }

    fn moved(&self, slot: u16, node: Node) {
        self.slots
            .write()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .moved
            .insert(slot, node);
    }

    fn slots_read(&self) -> std::sync::RwLockReadGuard<'_, SlotMap> {
        // Nothing panics while holding it; a poisoned lock still holds a valid map.
        self.slots
            .read()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    async fn node_connection(&self, node: &Node) -> RedisResult<(u64, MultiplexedConnection)> {
        let link = {
            let mut nodes = self
                .nodes
                .lock()
                .unwrap_or_else(|poisoned| poisoned.into_inner());
            Arc::clone(nodes.entry(node.clone()).or_default())
        };
        // Only this node's callers wait while it is connected to.
        let mut link = link.lock().await;
        if let Some(conn) = &link.conn {
            return Ok((link.generation, conn.clone()));
        }
        let conn = redis::Client::open(at(&self.seed, node))?
            .get_multiplexed_async_connection_with_config(&self.config)
            .await?;
        link.generation += 1;
        link.conn = Some(conn.clone());
        Ok((link.generation, conn))
    }

    async fn forget(&self, node: &Node, generation: u64) {
        let link = self
            .nodes
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .get(node)
            .cloned();
        if let Some(link) = link {
            let mut link = link.lock().await;
            if link.generation == generation {
                link.conn = None;
            }
        }
    }

    /// Reads the map anew in the background, unless a read is queued or running.
    fn refresh_soon(self: &Arc<Self>) {
        if self.refresh_queued.swap(true, Ordering::AcqRel) {
            return;
        }
        let link = Arc::clone(self);
        tokio::spawn(async move {
            let read = link.refresh(false).await;
            link.refresh_queued.store(false, Ordering::Release);
            if let Err(error) = read {
                tracing::debug!(%error, "the Redis Cluster's slot map could not be read");
            }
        });
    }

    /// Reads `CLUSTER SLOTS` from the first node that answers: the nodes of the
    /// last map (primaries first), then the seed. Unless `now`, not again within
    /// [`MIN_REFRESH_INTERVAL`] of the last read.
    async fn refresh(&self, now: bool) -> RedisResult<()> {
        let mut last = self.refresh.lock().await;
        if !now && last.is_some_and(|at| at.elapsed() < MIN_REFRESH_INTERVAL) {
            return Ok(());
        }
        let mut candidates = self.slots_read().nodes.clone();
        if !candidates.contains(&self.seed_node) {
            candidates.push(self.seed_node.clone());
        }
        let mut last_error = None;
        for node in &candidates {
            let read = async {
                let (generation, mut conn) = self.node_connection(node).await?;
                let answered = redis::cmd("CLUSTER")
                    .arg("SLOTS")
                    .query_async::<Value>(&mut conn)
                    .await;
                if answered.as_ref().is_err_and(lost_connection) {
                    self.forget(node, generation).await;
                }
                answered
            };
            match read.await {
                Ok(reply) => match SlotMap::parse(&reply, node) {
                    Some(map) => {
                        *self
                            .slots
                            .write()
                            .unwrap_or_else(|poisoned| poisoned.into_inner()) = map;
                        *last = Some(Instant::now());
                        return Ok(());
                    }
                    None => {
                        last_error = Some(RedisError::from((
                            ErrorKind::Parse,
                            "CLUSTER SLOTS answered something that is not a slot map",
                            node.to_string(),
                        )))
                    }
                },
                Err(error) => last_error = Some(error),
            }
        }
        Err(last_error.unwrap_or_else(|| no_node("no node to ask for the slot map")))
    }
}

impl SlotMap {
    /// A `CLUSTER SLOTS` reply, asked of `asked`: each range is `[start, end,
    /// [host, port, id, ...], ...]`, its primary first. `None` unless it is one with
    /// at least one range.
    fn parse(reply: &Value, asked: &Node) -> Option<SlotMap> {
        let Value::Array(entries) = reply else {
            return None;
        };
        let mut map = SlotMap::default();
        let mut replicas = Vec::new();
        for entry in entries {
            let Value::Array(parts) = entry else {
                return None;
            };
            let (Some(Value::Int(start)), Some(Value::Int(end))) = (parts.first(), parts.get(1))
            else {
                return None;
            };
            let (Ok(start), Ok(end)) = (u16::try_from(*start), u16::try_from(*end)) else {
                return None;
            };
            let mut nodes = parts.iter().skip(2).filter_map(|node| node_of(node, asked));
            let primary = nodes.next()?;
            replicas.extend(nodes);
            if !map.nodes.contains(&primary) {
                map.nodes.push(primary.clone());
            }
            map.ranges.push(SlotRange {
                start,
                end,
                primary,
            });
        }
        for replica in replicas {
            if !map.nodes.contains(&replica) {
                map.nodes.push(replica);
            }
        }
        map.ranges.sort_by_key(|range| range.start);
        (!map.ranges.is_empty()).then_some(map)
    }

    fn primary(&self, slot: u16) -> Option<&Node> {
        if let Some(node) = self.moved.get(&slot) {
            return Some(node);
        }
        let at = self.ranges.partition_point(|range| range.end < slot);
        self.ranges
            .get(at)
            .filter(|range| range.start <= slot)
            .map(|range| &range.primary)
    }

    fn primaries(&self) -> Vec<Node> {
        let mut primaries: Vec<Node> = Vec::new();
        for range in &self.ranges {
            if !primaries.contains(&range.primary) {
                primaries.push(range.primary.clone());
            }
        }
        primaries
    }
}

/// A node's `[host, port, ...]` in `CLUSTER SLOTS`; a node that does not know its
/// own address says "" (or "?"), meaning the node that was asked.
fn node_of(value: &Value, asked: &Node) -> Option<Node> {
    let Value::Array(fields) = value else {
        return None;
    };
    let host = match fields.first()? {
        Value::BulkString(bytes) => String::from_utf8_lossy(bytes).into_owned(),
        Value::SimpleString(text) => text.clone(),
        _ => return None,
    };
    let Value::Int(port) = fields.get(1)? else {
        return None;
    };
    let port = u16::try_from(*port).ok()?;
    let host = if host.is_empty() || host == "?" {
        asked.host.clone()
    } else {
        host
    };
    Some(Node { host, port })
}

/// Where a command goes: the slot of its first key for a command about keys.
fn target(cmd: &Cmd) -> Target {
    let args: Vec<&[u8]> = cmd
        .args_iter()
        .filter_map(|arg| match arg {
            Arg::Simple(bytes) => Some(bytes),
            _ => None,
        })
        .collect();
    let Some(name) = args.first().map(|name| name.to_ascii_uppercase()) else {
        return Target::AnyNode;
    };
    match name.as_slice() {
        b"EVALSHA" | b"EVAL" | b"EVALSHA_RO" | b"EVAL_RO" | b"FCALL" | b"FCALL_RO" => {
            let keys = args
                .get(2)
                .and_then(|n| std::str::from_utf8(n).ok())
                .and_then(|n| n.parse::<usize>().ok())
                .unwrap_or(0);
            match args.get(3) {
                Some(key) if keys > 0 => Target::Slot(slot(key)),
                _ => Target::AnyNode,
            }
        }
        b"SCRIPT" | b"INFO" => Target::EveryPrimary,
        b"TIME" | b"PING" | b"ECHO" | b"CLUSTER" | b"SCAN" | b"CONFIG" | b"CLIENT" | b"HELLO"
        | b"DBSIZE" | b"COMMAND" | b"WAIT" | b"MULTI" | b"EXEC" | b"DISCARD" | b"ASKING" => {
            Target::AnyNode
        }
        _ => match args.get(1) {
            Some(key) => Target::Slot(slot(key)),
            None => Target::AnyNode,
        },
    }
}

fn name(cmd: &Cmd) -> Option<String> {
    match cmd.args_iter().next()? {
        Arg::Simple(bytes) => Some(String::from_utf8_lossy(bytes).to_ascii_uppercase()),
        _ => None,
    }
}

/// The hash slot of `key` (CRC16-XMODEM of its hash tag, or of the key without
/// one, modulo 16384), as the Redis Cluster specification defines it.
pub(crate) fn slot(key: &[u8]) -> u16 {
    let tagged = key
        .iter()
        .position(|&b| b == b'{')
        .and_then(|open| {
            let rest = &key[open + 1..];
            let close = rest.iter().position(|&b| b == b'}')?;
            (close > 0).then(|| &rest[..close])
        })
        .unwrap_or(key);
    crc16_xmodem(tagged) % 16384
}

fn crc16_xmodem(bytes: &[u8]) -> u16 {
    let mut crc: u16 = 0;
    for &byte in bytes {
        crc ^= u16::from(byte) << 8;
        for _ in 0..8 {
            crc = if crc & 0x8000 != 0 {
                (crc << 1) ^ 0x1021
            } else {
                crc << 1
            };
        }
    }
    crc
}

/// `seed`'s settings (credentials, TLS) at `node`'s address.
fn at(seed: &ConnectionInfo, node: &Node) -> ConnectionInfo {
    let (host, port) = (node.host.clone(), node.port);
    let addr = match seed.addr().clone() {
        ConnectionAddr::TcpTls {
            insecure,
            tls_params,
            ..
        } => ConnectionAddr::TcpTls {
            host,
            port,
            insecure,
            tls_params,
        },
        _ => ConnectionAddr::Tcp(host, port),
    };
    seed.clone().set_addr(addr)
}

fn redirect(error: &RedisError) -> Option<(ServerErrorKind, Node)> {
    let kind = match error.kind() {
        ErrorKind::Server(kind @ (ServerErrorKind::Moved | ServerErrorKind::Ask)) => kind,
        _ => return None,
    };
    let (addr, _) = error.redirect_node()?;
    let (host, port) = addr.rsplit_once(':')?;
    Some((
        kind,
        Node {
            host: host.to_string(),
            port: port.parse().ok()?,
        },
    ))
}

fn cluster_refusal(error: &redis::ServerError) -> bool {
    matches!(
        error.kind(),
        Some(
            ServerErrorKind::Moved
                | ServerErrorKind::Ask
                | ServerErrorKind::TryAgain
                | ServerErrorKind::ClusterDown
        )
    )
}

/// The connection broke or did not answer in time: the request may have run.
fn lost_connection(error: &RedisError) -> bool {
    error.is_io_error() || error.is_connection_dropped() || error.is_timeout()
}

fn no_node(why: &'static str) -> RedisError {
    RedisError::from((
        ErrorKind::Io,
        "the Redis Cluster is not reachable",
        why.to_string(),
    ))
}

#[cfg(test)]
mod tests {
    use redis::cluster_routing::{Route, Slot, SlotAddr};

    use super::*;

    fn node(host: &str, port: u16) -> Node {
        Node {
            host: host.to_string(),
            port,
        }
    }

    fn listed(host: &str, port: i64) -> Value {
        Value::Array(vec![
            Value::BulkString(host.as_bytes().to_vec()),
            Value::Int(port),
            Value::BulkString(b"id".to_vec()),
        ])
    }

    fn range(start: i64, end: i64, nodes: Vec<Value>) -> Value {
        let mut parts = vec![Value::Int(start), Value::Int(end)];
        parts.extend(nodes);
        Value::Array(parts)
    }

    #[test]
    fn slots_are_the_specifications_and_redis_rs_agrees() {
        assert_eq!(slot(b"foo"), 12182);
        assert_eq!(slot(b"{foo}.bar"), 12182);
        // An empty tag is no tag: the whole key is hashed.
        assert_eq!(slot(b"{}foo"), crc16_xmodem(b"{}foo") % 16384);
        for key in [
            "dropgate:{shop/sale}:config",
            "lock:{a}",
            "x{y}z{w}",
            "{",
            "}{",
        ] {
            assert_eq!(
                Route::new(slot(key.as_bytes()), SlotAddr::Master),
                Route::with_slot(Slot::for_key(key), SlotAddr::Master),
                "{key}"
            );
        }
    }

    #[test]
    fn a_command_goes_to_its_first_keys_slot_a_script_to_its_first_key() {
        let key = "dropgate:{shop/sale}:config";
        let mut get = redis::cmd("HGET");
        get.arg(key).arg("mode");
        assert_eq!(target(&get), Target::Slot(slot(key.as_bytes())));
        let mut script = redis::cmd("EVALSHA");
        script
            .arg("0123abcd")
            .arg(2)
            .arg(key)
            .arg("other")
            .arg("{not-a-key}");
        assert_eq!(target(&script), Target::Slot(slot(key.as_bytes())));
        let mut keyless = redis::cmd("EVALSHA");
        keyless.arg("0123abcd").arg(0).arg("{arg}");
        assert_eq!(target(&keyless), Target::AnyNode);
        let mut load = redis::cmd("SCRIPT");
        load.arg("LOAD").arg("return 1");
        assert_eq!(target(&load), Target::EveryPrimary);
        assert_eq!(target(&redis::cmd("TIME")), Target::AnyNode);
        let mut shards = redis::cmd("cluster");
        shards.arg("shards");
        assert_eq!(target(&shards), Target::AnyNode);

        let mut pipe = redis::pipe();
        pipe.atomic()
            .cmd("PING")
            .cmd("GET")
            .arg(key)
            .cmd("GET")
            .arg("elsewhere");
        let request = Request::Pipeline {
            pipeline: &pipe,
            offset: 0,
            count: 3,
        };
        assert_eq!(request.target(), Target::Slot(slot(key.as_bytes())));
    }

    #[test]
    fn the_slot_map_names_each_slots_primary_and_every_node_to_ask() {
        let asked = node("10.0.0.9", 7000);
        let reply = Value::Array(vec![
            range(
                5461,
                10922,
                vec![listed("10.0.0.2", 7001), listed("10.0.0.5", 7004)],
            ),
            range(
                0,
                5460,
                vec![listed("10.0.0.1", 7000), listed("10.0.0.4", 7003)],
            ),
            range(
                10923,
                16383,
                vec![listed("", 7002), listed("10.0.0.6", 7005)],
            ),
        ]);
        let mut map = SlotMap::parse(&reply, &asked).expect("a map");
        assert_eq!(map.primary(0), Some(&node("10.0.0.1", 7000)));
        assert_eq!(map.primary(5460), Some(&node("10.0.0.1", 7000)));
        assert_eq!(map.primary(5461), Some(&node("10.0.0.2", 7001)));
        // "" is the node that was asked.
        assert_eq!(map.primary(16383), Some(&node("10.0.0.9", 7002)));
        assert_eq!(map.primaries().len(), 3);
        assert_eq!(map.nodes.len(), 6);
        assert!(map.primaries().iter().all(|p| map.nodes[..3].contains(p)));
        // MOVED overrides the map for that slot only.
        map.moved.insert(100, node("10.0.0.4", 7003));
        assert_eq!(map.primary(100), Some(&node("10.0.0.4", 7003)));
        assert_eq!(map.primary(101), Some(&node("10.0.0.1", 7000)));

        // A gap in the map is a slot nobody serves.
        let partial = Value::Array(vec![range(0, 99, vec![listed("10.0.0.1", 7000)])]);
        let partial = SlotMap::parse(&partial, &asked).expect("a map");
        assert_eq!(partial.primary(100), None);
        for unreadable in [
            Value::Nil,
            Value::Array(vec![]),
            Value::Array(vec![range(0, 70_000, vec![listed("h", 1)])]),
            Value::Array(vec![range(0, 10, vec![])]),
        ] {
            assert_eq!(SlotMap::parse(&unreadable, &asked), None, "{unreadable:?}");
        }
    }

    #[test]
    fn moved_and_ask_name_the_node_to_go_to() {
        let moved = redis::RedisError::from((
            ErrorKind::Server(ServerErrorKind::Moved),
            "key moved",
            "3999 127.0.0.1:6381".to_string(),
        ));
        let parsed = redis::parse_redis_value(b"-MOVED 3999 127.0.0.1:6381\r\n");
        let from_wire = match parsed {
            Ok(Value::ServerError(error)) => RedisError::from(error),
            other => panic!("{other:?}"),
        };
        for error in [moved, from_wire] {
            assert_eq!(
                redirect(&error).map(|(_, node)| node),
                Some(node("127.0.0.1", 6381)),
                "{error:?}"
            );
        }
        let ask = redis::parse_redis_value(b"-ASK 3999 10.0.0.3:7002\r\n");
        let Ok(Value::ServerError(ask)) = ask else {
            panic!("{ask:?}")
        };
        assert_eq!(
            redirect(&RedisError::from(ask)),
            Some((ServerErrorKind::Ask, node("10.0.0.3", 7002)))
        );
    }

    #[test]
    fn another_node_keeps_the_seeds_credentials_and_tls() {
        let seed = redis::IntoConnectionInfo::into_connection_info(
            "rediss://:secret@discovery.example:6379",
        )
        .expect("a URL");
        let other = at(&seed, &node("10.0.0.7", 6380));
        assert!(matches!(
            other.addr(),
            ConnectionAddr::TcpTls { host, port: 6380, .. } if host == "10.0.0.7"
        ));
        assert_eq!(other.redis_settings().password(), Some("secret"));
        let plain = redis::IntoConnectionInfo::into_connection_info("redis://10.0.0.1:7000")
            .expect("a URL");
        assert!(matches!(
            at(&plain, &node("10.0.0.2", 7001)).addr(),
            ConnectionAddr::Tcp(host, 7001) if host == "10.0.0.2"
        ));
    }
}

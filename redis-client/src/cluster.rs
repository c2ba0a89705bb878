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
//! ASK (the one request, right behind ASKING), TRYAGAIN and CLUSTERDOWN (again after
//! a pause). A node it cannot connect to is asked again, with the map re-read,
//! until the call's budget is spent. A request that failed after it was sent (the
//! connection broke, the reply was late) is never sent again: whether it ran is
//! unknown, and the caller decides.
//!
//! Routing: a script goes to its first key's slot, MGET is split by slot, SCRIPT
//! goes to every node (replicas too: Redis does not replicate SCRIPT LOAD, and a
//! promoted replica must have the gate's scripts), INFO to every primary, commands
//! without keys (TIME, PING, CLUSTER ...) to any
//! node, and any other command to the slot of its key (its first argument, or the
//! one after STREAMS or a subcommand where that is where Redis puts it); a MOVED
//! for another slot is followed all the same.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, LockResult, Mutex, RwLock};
use std::time::{Duration, Instant};

use redis::aio::{ConnectionLike, MultiplexedConnection};
use redis::{
    Arg, AsyncConnectionConfig, Cmd, ConnectionAddr, ConnectionInfo, ErrorKind, Pipeline,
    RedisError, RedisResult, ServerErrorKind, Value,
};

/// How many MOVED / ASK redirections one request follows before it gives up.
const MAX_REDIRECTS: usize = 5;
/// The first pause before asking again after TRYAGAIN, CLUSTERDOWN or a node that
/// could not be reached; each further one doubles, up to [`MAX_PAUSE`].
const FIRST_PAUSE: Duration = Duration::from_millis(10);
const MAX_PAUSE: Duration = Duration::from_millis(200);
/// The slot map is read at most this often on account of errors.
const MIN_REFRESH_INTERVAL: Duration = Duration::from_millis(100);

/// A Redis Cluster, known from one seed address (a discovery endpoint works).
pub struct ClusterClient {
    /// The address the client was given, with the credentials and TLS settings
    /// every node shares.
    seed: ConnectionInfo,
    seed_node: Node,
    config: AsyncConnectionConfig,
    /// The longest one call may take, its redirections and pauses included.
    budget: Duration,
    slots: RwLock<SlotMap>,
    connections: Mutex<HashMap<Node, Arc<tokio::sync::Mutex<NodeConnection>>>>,
    /// When the map was last read; held while it is read, so one read runs at a time.
    last_refresh: tokio::sync::Mutex<Option<Instant>>,
    refresh_queued: AtomicBool,
    /// Nodes that could not be reached or broke off lately, and when: asked last
    /// by calls that may go to any node.
    troubled: Mutex<HashMap<Node, Instant>>,
    /// Per slot, how many times the node serving it changed (in a map read or by
    /// a redirection): the node now serving it may have been a replica that
    /// missed writes (see [`ClusterClient::changes_of_slot`]).
    owner_changes: Box<[AtomicU64]>,
    /// Per node, how many connections were made to it: what answers after a
    /// reconnection may be another server under the same address.
    generations: Mutex<HashMap<Node, u64>>,
}

/// How many slots a Redis Cluster has.
const SLOTS: usize = 16_384;

/// How long a node that could not be reached is asked last.
const TROUBLE_MEMORY: Duration = Duration::from_secs(5);

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

/// One node's shared connection; `generation` counts the connections made, so
/// that an error on one that was replaced since does not drop its successor.
#[derive(Default)]
struct NodeConnection {
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
    /// The slot's primary per MOVED, and when MOVED said so: an override learned
    /// while a map was being read outlives that map.
    moved: HashMap<u16, (Node, Instant)>,
}

#[derive(Debug, PartialEq)]
struct SlotRange {
    start: u16,
    end: u16,
    primary: Node,
}

/// Where a request goes.
#[derive(Debug, PartialEq)]
enum Target {
    /// The primary serving this slot.
    Slot(u16),
    /// MGET: each key's slot, the answers put back in order.
    EachKeysSlot,
    /// Every primary (reading INFO).
    EveryPrimary,
    /// Every node, replicas too (loading a script: Redis does not replicate SCRIPT
    /// LOAD, and a replica promoted by a failover must have the gate's scripts).
    EveryNode,
    /// Any node that answers (TIME, PING, CLUSTER ...).
    AnyNode,
}

/// A command or a pipeline, as `ConnectionLike` hands them over: a transaction
/// (MULTI ... EXEC) is a pipeline whose replies before `offset` are skipped.
#[derive(Clone, Copy)]
pub(crate) enum Request<'a> {
    Cmd(&'a Cmd),
    Pipeline {
        pipeline: &'a Pipeline,
        offset: usize,
        count: usize,
    },
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

impl Request<'_> {
    fn is_plain_pipeline(self) -> bool {
        matches!(self, Request::Pipeline { offset: 0, .. })
    }

    /// Sends it on `conn`, right behind ASKING if `asking` (in one write, so that
    /// no other request on the shared connection comes between). The replies come
    /// back as Redis gave them, refusals included: a command's reply, or every
    /// reply of a pipeline (a transaction's queued ones too, which are where MOVED
    /// shows: EXEC only says EXECABORT).
    async fn send(self, conn: &mut MultiplexedConnection, asking: bool) -> RedisResult<Value> {
        match (self, asking) {
            (Request::Cmd(cmd), false) => conn.req_packed_command(cmd).await,
            (Request::Cmd(cmd), true) => {
                let mut both = redis::pipe();
                both.cmd("ASKING").add_command(cmd.clone());
                let mut replies = conn.req_packed_commands(&both, 0, 2).await?;
                Ok(replies.pop().unwrap_or(Value::Nil))
            }
            (
                Request::Pipeline {
                    pipeline,
                    offset,
                    count,
                },
                false,
            ) => Ok(Value::Array(
                conn.req_packed_commands(pipeline, 0, offset + count)
                    .await?,
            )),
            (Request::Pipeline { pipeline, .. }, true) if self.is_plain_pipeline() => {
                // ASKING holds for the next command only.
                let mut asked = redis::pipe();
                for cmd in pipeline.cmd_iter() {
                    asked.cmd("ASKING").add_command(cmd.clone());
                }
                let replies = conn.req_packed_commands(&asked, 0, asked.len()).await?;
                Ok(Value::Array(
                    replies.into_iter().skip(1).step_by(2).collect(),
                ))
            }
            (
                Request::Pipeline {
                    pipeline,
                    offset,
                    count,
                },
                true,
            ) => {
                // Within MULTI, ASKING holds until EXEC.
                let mut asked = redis::pipe();
                asked.cmd("ASKING").cmd("MULTI");
                for cmd in pipeline.cmd_iter() {
                    asked.add_command(cmd.clone());
                }
                asked.cmd("EXEC");
                let mut replies = conn
                    .req_packed_commands(&asked, 0, offset + count + 1)
                    .await?;
                replies.remove(0);
                Ok(Value::Array(replies))
            }
        }
    }

    /// The refusal that sends the whole request elsewhere or again, if any: the
    /// command's, a transaction's (nothing in it ran), or a plain pipeline's when
    /// every command in it was refused (its slot moved).
    fn refusal(self, answered: &Value) -> Option<RedisError> {
        let refused = |reply: &Value| match reply {
            Value::ServerError(error) if cluster_refusal(error) => Some(error.clone()),
            _ => None,
        };
        match (self, answered) {
            (Request::Cmd(_), reply) => refused(reply),
            (Request::Pipeline { .. }, Value::Array(replies)) if self.is_plain_pipeline() => {
                let all: Option<Vec<_>> = replies.iter().map(refused).collect();
                all.and_then(|mut all| all.pop())
            }
            (Request::Pipeline { .. }, Value::Array(replies)) => replies.iter().find_map(refused),
            _ => None,
        }
        .map(RedisError::from)
    }

    /// The answer the caller asked for: a pipeline's replies from `offset` on.
    fn answer(self, answered: Value) -> Value {
        match (self, answered) {
            (Request::Pipeline { offset, .. }, Value::Array(mut replies)) => {
                Value::Array(replies.split_off(offset.min(replies.len())))
            }
            (_, answered) => answered,
        }
    }

    fn target(self) -> Target {
        match self {
            Request::Cmd(cmd) => target(cmd),
            // A pipeline about a drop goes where its first command about a key goes
            // (an MGET in it: where its first key goes).
            Request::Pipeline { pipeline, .. } => pipeline
                .cmd_iter()
                .find_map(|cmd| match target(cmd) {
                    Target::Slot(slot) => Some(Target::Slot(slot)),
                    Target::EachKeysSlot => {
                        simple_args(cmd).nth(1).map(|key| Target::Slot(slot(key)))
                    }
                    _ => None,
                })
                .unwrap_or(Target::AnyNode),
        }
    }
}

impl ClusterClient {
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
        if seed.redis_settings().db() != 0 {
            return Err(RedisError::from((
                ErrorKind::InvalidClientConfig,
                "a Redis Cluster has database 0 only: drop the database from the URL",
            )));
        }
        Ok(ClusterClient {
            seed,
            seed_node,
            config: AsyncConnectionConfig::new()
                .set_connection_timeout(Some(connect))
                .set_response_timeout(Some(response)),
            budget: response * 3 + connect,
            slots: RwLock::new(SlotMap::default()),
            connections: Mutex::new(HashMap::new()),
            last_refresh: tokio::sync::Mutex::new(None),
            refresh_queued: AtomicBool::new(false),
            owner_changes: (0..SLOTS).map(|_| AtomicU64::new(0)).collect(),
            generations: Mutex::new(HashMap::new()),
            troubled: Mutex::new(HashMap::new()),
        })
    }

    /// Reads the slot map now (the first use, or a check that the cluster answers).
    pub(crate) async fn connect(self: &Arc<Self>) -> RedisResult<()> {
        self.refresh(true).await
    }

    /// Runs `request` where its keys live, within the budget.
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
        let give_up = Instant::now() + self.budget;
        let call = async {
            match (target, request) {
                (Target::Slot(slot), _) => self.on_slot(slot, request, give_up).await,
                (Target::EachKeysSlot, Request::Cmd(cmd)) => self.split_by_slot(cmd, give_up).await,
                (Target::EveryPrimary, _) => {
                    let primaries = self.primaries().await?;
                    self.on_each(&primaries, request).await
                }
                (Target::EveryNode, _) => {
                    // A node in trouble lately (frozen, say) is not waited for: if it
                    // is promoted later, it loads the script on its first NOSCRIPT.
                    let nodes = self.known_nodes().await?;
                    let healthy = self.healthy(&nodes);
                    self.on_each(if healthy.is_empty() { &nodes } else { &healthy }, request)
                        .await
                }
                (Target::AnyNode | Target::EachKeysSlot, _) => self.on_any_node(request).await,
            }
        };
        match tokio::time::timeout_at(give_up.into(), call).await {
            Ok(answered) => answered,
            Err(_) => Err(RedisError::from(std::io::Error::new(
                std::io::ErrorKind::TimedOut,
                format!("the Redis Cluster did not answer within {:?}", self.budget),
            ))),
        }
    }

    /// Sends `request` to the primary of `slot` until it is answered, following
    /// redirections; a plain pipeline's commands that were refused one by one (a
    /// slot mid-migration answers ASK for the keys that left) are then sent again
    /// each on its own.
    async fn on_slot(
        self: &Arc<Self>,
        slot: u16,
        request: Request<'_>,
        give_up: Instant,
    ) -> RedisResult<Value> {
        let answered = self.whole_on_slot(slot, request, give_up).await?;
        let Request::Pipeline { pipeline, .. } = request else {
            return Ok(answered);
        };
        let Value::Array(mut replies) = answered else {
            return Ok(answered);
        };
        if request.is_plain_pipeline() {
            for (reply, cmd) in replies.iter_mut().zip(pipeline.cmd_iter()) {
                if matches!(reply, Value::ServerError(error) if cluster_refusal(error)) {
                    let own = match target(cmd) {
                        Target::Slot(own) => own,
                        _ => slot,
                    };
                    *reply = Box::pin(self.whole_on_slot(own, Request::Cmd(cmd), give_up)).await?;
                }
            }
        }
        Ok(Value::Array(replies))
    }

    /// Sends `request` as a whole to the primary of `slot` until it is answered
    /// without a refusal, within `give_up`.
    async fn whole_on_slot(
        self: &Arc<Self>,
        slot: u16,
        request: Request<'_>,
        give_up: Instant,
    ) -> RedisResult<Value> {
        let mut pause = FIRST_PAUSE;
        // Redirections in a row; a pause (TRYAGAIN after an ASK, say) starts anew.
        let mut redirects = 0;
        // Where a redirection said to go next, and whether ASKING goes first.
        let mut redirected: Option<(Node, bool)> = None;
        loop {
            let (node, asked) = match redirected.take() {
                Some((node, asking)) => (Ok(node), asking),
                None => (self.primary_of(slot).await, false),
            };
            let answered = match &node {
                Ok(node) => self.on_node(node, request, asked).await,
                Err(error) => Err(Failed::NotSent(error.clone())),
            };
            let (error, sent) = match answered {
                Ok(answered) => match request.refusal(&answered) {
                    None => return Ok(request.answer(answered)),
                    Some(refusal) => (refusal, true),
                },
                Err(Failed::NotSent(error)) => (error, false),
                Err(Failed::Sent(error)) => (error, true),
            };
            if let (Some((kind, moved_slot, to)), Ok(from)) = (redirect(&error), &node)
                && redirects < MAX_REDIRECTS
            {
                redirects += 1;
                let to = to.unwrap_or_else(|| from.clone());
                let asking = kind == ServerErrorKind::Ask;
                if !asking {
                    // The slot MOVED names is the one to remember, and the node it
                    // names the one to ask next, whatever slot this call was routed by.
                    self.remember_moved(moved_slot, to.clone());
                    self.refresh_soon();
                }
                redirected = Some((to, asking));
                continue;
            }
            // Nothing ran: a node not reached (a replica may be taking over; the map
            // is being read anew), or a refusal that says to ask again.
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
            redirects = 0;
        }
    }

    /// MGET over keys in several slots: one MGET per slot, at once, the answers put
    /// back in the keys' order.
    async fn split_by_slot(self: &Arc<Self>, cmd: &Cmd, give_up: Instant) -> RedisResult<Value> {
        let keys: Vec<&[u8]> = simple_args(cmd).skip(1).collect();
        let mut by_slot: Vec<(u16, Vec<usize>)> = Vec::new();
        for (at, key) in keys.iter().enumerate() {
            let slot = slot(key);
            match by_slot.iter_mut().find(|(s, _)| *s == slot) {
                Some((_, positions)) => positions.push(at),
                None => by_slot.push((slot, vec![at])),
            }
        }
        let parts: Vec<Cmd> = by_slot
            .iter()
            .map(|(_, positions)| {
                let mut part = redis::cmd("MGET");
                for &at in positions {
                    part.arg(keys[at]);
                }
                part
            })
            .collect();
        let answers = futures::future::join_all(
            by_slot
                .iter()
                .zip(&parts)
                .map(|((slot, _), part)| self.on_slot(*slot, Request::Cmd(part), give_up)),
        )
        .await;
        let mut values = vec![Value::Nil; keys.len()];
        for ((_, positions), answer) in by_slot.iter().zip(answers) {
            match answer? {
                Value::Array(found) if found.len() == positions.len() => {
                    for (&at, value) in positions.iter().zip(found) {
                        values[at] = value;
                    }
                }
                Value::ServerError(error) => return Err(error.into()),
                other => {
                    return Err(RedisError::from((
                        ErrorKind::UnexpectedReturnType,
                        "MGET answered something else than one value per key",
                        format!("{other:?}"),
                    )));
                }
            }
        }
        Ok(Value::Array(values))
    }

    /// Each of `nodes` that answers runs it (at once); the first answer is
    /// returned, or for INFO a map from node to answer (as redis-rs's cluster client
    /// gives it). A node that cannot be reached is left out, with a warning: a
    /// primary has no slot to serve until a replica takes over (which loads a script
    /// on its first NOSCRIPT). Fails only if none answered.
    async fn on_each(self: &Arc<Self>, nodes: &[Node], request: Request<'_>) -> RedisResult<Value> {
        let answers =
            futures::future::join_all(nodes.iter().map(|node| self.on_node(node, request, false)))
                .await;
        let is_info =
            matches!(request, Request::Cmd(cmd) if command_name(cmd).as_deref() == Some("INFO"));
        let mut last_error = None;
        let mut answered = Vec::new();
        for (node, answer) in nodes.iter().zip(answers) {
            match answer {
                Ok(value) => {
                    answered.push((Value::BulkString(node.to_string().into_bytes()), value))
                }
                Err(failed) => {
                    let error = failed.into_error();
                    tracing::warn!(%node, %error, "a Redis Cluster node did not answer");
                    last_error = Some(error);
                }
            }
        }
        if answered.is_empty() {
            return Err(last_error.unwrap_or_else(|| no_node("no node is known")));
        }
        if is_info {
            return Ok(Value::Map(answered));
        }
        Ok(answered.swap_remove(0).1)
    }

    /// The first node that can be reached answers; one that answered with an
    /// error, or broke off after the request was sent, is not asked again.
    async fn on_any_node(self: &Arc<Self>, request: Request<'_>) -> RedisResult<Value> {
        let mut nodes = self.known_nodes().await?;
        if !nodes.contains(&self.seed_node) {
            nodes.push(self.seed_node.clone());
        }
        let mut last_error = None;
        for node in &self.troubled_last(nodes) {
            match self.on_node(node, request, false).await {
                Ok(value) => return Ok(request.answer(value)),
                Err(Failed::NotSent(error)) => last_error = Some(error),
                Err(Failed::Sent(error)) => return Err(error),
            }
        }
        Err(last_error.unwrap_or_else(|| no_node("no node is known")))
    }

    /// Sends `request` to `node` on its shared connection. A connection that broke
    /// or timed out is dropped (the next request connects anew) and the map read
    /// anew: the node may have died, a replica may be taking over.
    async fn on_node(
        self: &Arc<Self>,
        node: &Node,
        request: Request<'_>,
        asking: bool,
    ) -> Result<Value, Failed> {
        let (generation, mut conn) = match self.node_connection(node).await {
            Ok(shared) => shared,
            Err(error) => {
                self.trouble(node, true);
                self.refresh_soon();
                return Err(Failed::NotSent(error));
            }
        };
        let answered = request.send(&mut conn, asking).await;
        match &answered {
            Err(error) if lost_connection(error) => {
                self.trouble(node, true);
                self.forget(node, generation).await;
                self.refresh_soon();
            }
            // A script missing where the map says the slot is: the map may be behind
            // a failover (the new primary never loaded it).
            Ok(Value::ServerError(error)) if error.kind() == Some(ServerErrorKind::NoScript) => {
                self.trouble(node, false);
                self.refresh_soon();
            }
            _ => self.trouble(node, false),
        }
        answered.map_err(Failed::Sent)
    }

    /// Notes that `node` could not be reached or broke off (`true`), or answered.
    fn trouble(&self, node: &Node, troubled: bool) {
        let mut troubled_nodes = unpoisoned(self.troubled.lock());
        if troubled {
            troubled_nodes.insert(node.clone(), Instant::now());
        } else if !troubled_nodes.is_empty() {
            troubled_nodes.remove(node);
        }
    }

    fn in_trouble(&self, node: &Node) -> bool {
        unpoisoned(self.troubled.lock())
            .get(node)
            .is_some_and(|at| at.elapsed() < TROUBLE_MEMORY)
    }

    /// `nodes`, the ones in trouble lately moved to the end.
    fn troubled_last(&self, mut nodes: Vec<Node>) -> Vec<Node> {
        nodes.sort_by_key(|node| self.in_trouble(node));
        nodes
    }

    fn healthy(&self, nodes: &[Node]) -> Vec<Node> {
        nodes
            .iter()
            .filter(|node| !self.in_trouble(node))
            .cloned()
            .collect()
    }

    async fn primary_of(self: &Arc<Self>, slot: u16) -> RedisResult<Node> {
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

    async fn primaries(self: &Arc<Self>) -> RedisResult<Vec<Node>> {
        if self.slots_read().ranges.is_empty() {
            self.refresh(true).await?;
        }
        Ok(self.slots_read().primaries())
    }

    /// Every node of the map, and the nodes MOVED named since.
    async fn known_nodes(self: &Arc<Self>) -> RedisResult<Vec<Node>> {
        if self.slots_read().nodes.is_empty() {
            self.refresh(true).await?;
        }
        let slots = self.slots_read();
        let mut nodes = slots.nodes.clone();
        for (node, _) in slots.moved.values() {
            if !nodes.contains(node) {
                nodes.push(node.clone());
            }
        }
        Ok(nodes)
    }

    fn remember_moved(&self, slot: u16, node: Node) {
        let mut slots = unpoisoned(self.slots.write());
        if slots.primary(slot) != Some(&node) {
            self.owner_changed(slot);
        }
        slots.moved.insert(slot, (node, Instant::now()));
    }

    fn owner_changed(&self, slot: u16) {
        if let Some(changes) = self.owner_changes.get(usize::from(slot)) {
            changes.fetch_add(1, Ordering::AcqRel);
        }
    }

    /// A number that changes whenever the Redis serving `key`'s slot may have
    /// changed under the client's calls: another node serves it (a map read, a
    /// redirection), or the client connected to its node again. A caller that
    /// trusts what the slot holds only as far as it checked it checks again when
    /// this moved. Changes elsewhere in the cluster leave it alone.
    pub fn changes_of_slot(&self, key: &[u8]) -> u64 {
        let slot = slot(key);
        // Read under the map's lock, which every change of the slot's node holds
        // while it counts it: the count and the node are of the same map.
        let slots = self.slots_read();
        let owner_changes = self
            .owner_changes
            .get(usize::from(slot))
            .map_or(0, |changes| changes.load(Ordering::Acquire));
        let generation = slots
            .primary(slot)
            .and_then(|node| unpoisoned(self.generations.lock()).get(node).copied())
            .unwrap_or(0);
        (owner_changes << 32) | (generation & 0xffff_ffff)
    }

    fn slots_read(&self) -> std::sync::RwLockReadGuard<'_, SlotMap> {
        unpoisoned(self.slots.read())
    }

    fn shared(&self, node: &Node) -> Arc<tokio::sync::Mutex<NodeConnection>> {
        let mut connections = unpoisoned(self.connections.lock());
        Arc::clone(connections.entry(node.clone()).or_default())
    }

    async fn node_connection(
        self: &Arc<Self>,
        node: &Node,
    ) -> RedisResult<(u64, MultiplexedConnection)> {
        let shared = self.shared(node);
        // Only this node's callers wait while it is connected to, at most the
        // connection timeout.
        let mut shared = shared.lock().await;
        if let Some(conn) = &shared.conn {
            return Ok((shared.generation, conn.clone()));
        }
        let conn = redis::Client::open(settings_for(&self.seed, node))?
            .get_multiplexed_async_connection_with_config(&self.config)
            .await?;
        shared.generation += 1;
        shared.conn = Some(conn.clone());
        unpoisoned(self.generations.lock()).insert(node.clone(), shared.generation);
        Ok((shared.generation, conn))
    }

    async fn forget(&self, node: &Node, generation: u64) {
        let shared = self.shared(node);
        let mut shared = shared.lock().await;
        if shared.generation == generation {
            shared.conn = None;
        }
    }

    /// Reads the map anew in the background, unless a read is queued or running.
    fn refresh_soon(self: &Arc<Self>) {
        if self.refresh_queued.swap(true, Ordering::AcqRel) {
            return;
        }
        let client = Arc::clone(self);
        tokio::spawn(async move {
            let read = client.refresh(false).await;
            client.refresh_queued.store(false, Ordering::Release);
            if let Err(error) = read {
                tracing::debug!(%error, "the Redis Cluster's slot map could not be read");
            }
        });
    }

    /// Reads `CLUSTER SLOTS` from the first node that answers: the seed (a
    /// discovery endpoint follows the cluster wherever its nodes went), then the
    /// nodes of the last map, primaries first. Unless `force`, not again within
    /// [`MIN_REFRESH_INTERVAL`] of the last read.
    async fn refresh(self: &Arc<Self>, force: bool) -> RedisResult<()> {
        let mut last_refresh = self.last_refresh.lock().await;
        if let Some(at) = *last_refresh
            && !force
        {
            // Deferred, never skipped: what asked for it (a MOVED, a NOSCRIPT) may
            // be newer than the last read.
            tokio::time::sleep(MIN_REFRESH_INTERVAL.saturating_sub(at.elapsed())).await;
        }
        let began = Instant::now();
        let mut candidates = vec![self.seed_node.clone()];
        for node in &self.slots_read().nodes {
            if !candidates.contains(node) {
                candidates.push(node.clone());
            }
        }
        // A failed read counts too: reads asked for while the cluster is out of
        // reach come at most every MIN_REFRESH_INTERVAL.
        *last_refresh = Some(began);
        let mut last_error = None;
        let mut seed_not_a_cluster = None;
        for node in &self.troubled_last(candidates) {
            let read = async {
                let (generation, mut conn) = self
                    .node_connection(node)
                    .await
                    .inspect_err(|_| self.trouble(node, true))?;
                let answered = redis::cmd("CLUSTER")
                    .arg("SLOTS")
                    .query_async::<Value>(&mut conn)
                    .await;
                if answered.as_ref().is_err_and(lost_connection) {
                    self.trouble(node, true);
                    self.forget(node, generation).await;
                }
                answered
            };
            match read.await {
                Ok(reply) => match SlotMap::parse(&reply, node) {
                    Some(mut map) => {
                        let mut slots = unpoisoned(self.slots.write());
                        map.moved = std::mem::take(&mut slots.moved);
                        map.moved.retain(|_, (_, learned)| *learned > began);
                        for slot in 0..SLOTS as u16 {
                            if slots.primary(slot) != map.primary(slot) {
                                self.owner_changed(slot);
                            }
                        }
                        *slots = map;
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
                // A Redis that is no cluster says so. Only the seed's word counts
                // in the end: a node's address may since belong to another Redis.
                Err(error) if error.detail().is_some_and(|d| d.contains(CLUSTER_DISABLED)) => {
                    let not_a_cluster = RedisError::from((
                        ErrorKind::InvalidClientConfig,
                        NOT_A_CLUSTER,
                        format!("{node} has cluster support disabled"),
                    ));
                    if *node == self.seed_node {
                        seed_not_a_cluster = Some(not_a_cluster);
                    } else {
                        last_error = Some(not_a_cluster);
                    }
                }
                Err(error) => last_error = Some(error),
            }
        }
        if let Some(not_a_cluster) = seed_not_a_cluster {
            return Err(not_a_cluster);
        }
        Err(last_error.unwrap_or_else(|| no_node("no node to ask for the slot map")))
    }
}

impl SlotMap {
    /// A `CLUSTER SLOTS` reply, asked of `asked`: each range is `[start, end,
    /// [host, port, id, ...], ...]`, its primary first. `None` unless every range
    /// reads, with a primary, and there is at least one.
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
            let primary = node_of(parts.get(2)?, asked)?;
            // A replica whose address is unknown is only not asked for the map.
            replicas.extend(parts.iter().skip(3).filter_map(|node| node_of(node, asked)));
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
        if let Some((node, _)) = self.moved.get(&slot) {
            return Some(node);
        }
        let at = self.ranges.partition_point(|range| range.end < slot);
        self.ranges
            .get(at)
            .filter(|range| range.start <= slot)
            .map(|range| &range.primary)
    }

    /// The primaries of the map and the ones MOVED named since.
    fn primaries(&self) -> Vec<Node> {
        let mut primaries: Vec<Node> = Vec::new();
        let moved = self.moved.values().map(|(node, _)| node);
        for node in self.ranges.iter().map(|range| &range.primary).chain(moved) {
            if !primaries.contains(node) {
                primaries.push(node.clone());
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

fn simple_args(cmd: &Cmd) -> impl Iterator<Item = &[u8]> {
    cmd.args_iter().filter_map(|arg| match arg {
        Arg::Simple(bytes) => Some(bytes),
        _ => None,
    })
}

fn command_name(cmd: &Cmd) -> Option<String> {
    simple_args(cmd)
        .next()
        .map(|name| String::from_utf8_lossy(name).to_ascii_uppercase())
}

/// Where a command goes (see the module's comment).
fn target(cmd: &Cmd) -> Target {
    let args: Vec<&[u8]> = simple_args(cmd).collect();
    let Some(name) = command_name(cmd) else {
        return Target::AnyNode;
    };
    match name.as_str() {
        "EVALSHA" | "EVAL" | "EVALSHA_RO" | "EVAL_RO" | "FCALL" | "FCALL_RO" => {
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
        "MGET" => Target::EachKeysSlot,
        "SCRIPT" => Target::EveryNode,
        "INFO" => Target::EveryPrimary,
        "TIME" | "PING" | "ECHO" | "CLUSTER" | "SCAN" | "CONFIG" | "CLIENT" | "HELLO"
        | "DBSIZE" | "COMMAND" | "WAIT" | "MULTI" | "EXEC" | "DISCARD" | "ASKING" => {
            Target::AnyNode
        }
        // The key follows STREAMS, or a subcommand.
        "XREAD" | "XREADGROUP" => match args
            .iter()
            .position(|arg| arg.eq_ignore_ascii_case(b"STREAMS"))
        {
            Some(at) => args
                .get(at + 1)
                .map_or(Target::AnyNode, |key| Target::Slot(slot(key))),
            None => Target::AnyNode,
        },
        "XGROUP" | "XINFO" | "OBJECT" | "MEMORY" => args
            .get(2)
            .map_or(Target::AnyNode, |key| Target::Slot(slot(key))),
        _ => args
            .get(1)
            .map_or(Target::AnyNode, |key| Target::Slot(slot(key))),
    }
}

/// What is between the first `{` and the next `}`, if that is not empty.
fn hash_tag(key: &[u8]) -> Option<&[u8]> {
    let open = key.iter().position(|&b| b == b'{')?;
    let rest = &key[open + 1..];
    let close = rest.iter().position(|&b| b == b'}')?;
    (close > 0).then(|| &rest[..close])
}

/// The hash slot of `key` (CRC16-XMODEM of its hash tag, or of the key without
/// one, modulo 16384), as the Redis Cluster specification defines it.
pub(crate) fn slot(key: &[u8]) -> u16 {
    crc16_xmodem(hash_tag(key).unwrap_or(key)) % 16384
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
fn settings_for(seed: &ConnectionInfo, node: &Node) -> ConnectionInfo {
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

/// MOVED or ASK: its kind, the slot it names and the node to go to (`None`: the
/// node that answered, which did not know its own address).
fn redirect(error: &RedisError) -> Option<(ServerErrorKind, u16, Option<Node>)> {
    let kind = match error.kind() {
        ErrorKind::Server(kind @ (ServerErrorKind::Moved | ServerErrorKind::Ask)) => kind,
        _ => return None,
    };
    let (addr, slot) = error.redirect_node()?;
    let (host, port) = addr.rsplit_once(':')?;
    let port = port.parse().ok()?;
    let to = (!host.is_empty() && host != "?").then(|| Node {
        host: host.to_string(),
        port,
    });
    Some((kind, slot, to))
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

/// What a Redis without cluster support answers to CLUSTER commands.
const CLUSTER_DISABLED: &str = "cluster support disabled";
const NOT_A_CLUSTER: &str = "the Redis is not a Redis Cluster: connect to it as one Redis";

/// Whether `error` says that the Redis given as a cluster is not one.
pub fn is_not_a_cluster(error: &RedisError) -> bool {
    error.kind() == ErrorKind::InvalidClientConfig && error.to_string().contains(NOT_A_CLUSTER)
}

/// Whether `error` is a cluster's redirection (MOVED or ASK). Through a connection
/// to one Redis it says that the Redis is a cluster node; this client follows them,
/// so through it one means the client gave up.
pub fn is_cluster_redirect(error: &RedisError) -> bool {
    matches!(
        error.kind(),
        ErrorKind::Server(ServerErrorKind::Moved | ServerErrorKind::Ask)
    )
}

/// A lock's content whatever panicked while it was held: nothing here panics while
/// holding one, and each write leaves a whole value.
fn unpoisoned<T>(locked: LockResult<T>) -> T {
    locked.unwrap_or_else(|poisoned| poisoned.into_inner())
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
        assert_eq!(target(&load), Target::EveryNode);
        assert_eq!(target(&redis::cmd("INFO")), Target::EveryPrimary);
        assert_eq!(target(&redis::cmd("TIME")), Target::AnyNode);
        let mut shards = redis::cmd("cluster");
        shards.arg("shards");
        assert_eq!(target(&shards), Target::AnyNode);

        let mut mget = redis::cmd("MGET");
        mget.arg(key).arg("dropgate:{shop/other}:remaining");
        assert_eq!(target(&mget), Target::EachKeysSlot);
        // A key is where Redis puts it, whatever the values hold.
        let mut read = redis::cmd("XREADGROUP");
        read.arg("GROUP")
            .arg("g")
            .arg("c")
            .arg("STREAMS")
            .arg(key)
            .arg(">");
        assert_eq!(target(&read), Target::Slot(slot(key.as_bytes())));
        let mut set = redis::cmd("SET");
        set.arg("plain").arg("{tagged}");
        assert_eq!(target(&set), Target::Slot(slot(b"plain")));
        let mut info = redis::cmd("XINFO");
        info.arg("STREAM").arg(key);
        assert_eq!(target(&info), Target::Slot(slot(key.as_bytes())));
        let mut in_pipe = redis::pipe();
        in_pipe.cmd("MGET").arg(key).arg("other");
        let request = Request::Pipeline {
            pipeline: &in_pipe,
            offset: 0,
            count: 1,
        };
        assert_eq!(request.target(), Target::Slot(slot(key.as_bytes())));

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
        map.moved
            .insert(100, (node("10.0.0.4", 7003), Instant::now()));
        assert_eq!(map.primary(100), Some(&node("10.0.0.4", 7003)));
        assert_eq!(map.primary(101), Some(&node("10.0.0.1", 7000)));
        assert!(map.primaries().contains(&node("10.0.0.4", 7003)));

        // A range without a readable primary makes no map (a replica is no primary).
        let headless = Value::Array(vec![range(
            0,
            16383,
            vec![Value::Nil, listed("10.0.0.4", 7003)],
        )]);
        assert_eq!(SlotMap::parse(&headless, &asked), None);

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
                redirect(&error),
                Some((ServerErrorKind::Moved, 3999, Some(node("127.0.0.1", 6381)))),
                "{error:?}"
            );
        }
        let reply = |wire: &[u8]| match redis::parse_redis_value(wire) {
            Ok(Value::ServerError(error)) => RedisError::from(error),
            other => panic!("{other:?}"),
        };
        assert_eq!(
            redirect(&reply(b"-ASK 12 10.0.0.3:7002\r\n")),
            Some((ServerErrorKind::Ask, 12, Some(node("10.0.0.3", 7002))))
        );
        // A node that does not know its own address: the one that answered.
        assert_eq!(
            redirect(&reply(b"-MOVED 12 :7002\r\n")),
            Some((ServerErrorKind::Moved, 12, None))
        );
        assert_eq!(redirect(&reply(b"-TRYAGAIN keys moving\r\n")), None);
    }

    #[test]
    fn a_cluster_url_is_tcp_on_database_0() {
        let client = |url: &str| {
            ClusterClient::new(
                redis::IntoConnectionInfo::into_connection_info(url).expect("a URL"),
                Duration::from_secs(1),
                Duration::from_secs(1),
            )
        };
        assert!(client("redis://10.0.0.1:7000").is_ok());
        assert!(client("redis://10.0.0.1:7000/0").is_ok());
        let error = client("redis://10.0.0.1:7000/2").err().expect("refused");
        assert!(error.to_string().contains("database 0"), "{error}");
        assert!(client("redis+unix:///tmp/redis.sock").is_err());
    }

    #[test]
    fn another_node_keeps_the_seeds_credentials_and_tls() {
        let seed = redis::IntoConnectionInfo::into_connection_info(
            "rediss://:secret@discovery.example:6379",
        )
        .expect("a URL");
        let other = settings_for(&seed, &node("10.0.0.7", 6380));
        assert!(matches!(
            other.addr(),
            ConnectionAddr::TcpTls { host, port: 6380, .. } if host == "10.0.0.7"
        ));
        assert_eq!(other.redis_settings().password(), Some("secret"));
        let plain = redis::IntoConnectionInfo::into_connection_info("redis://10.0.0.1:7000")
            .expect("a URL");
        assert!(matches!(
            settings_for(&plain, &node("10.0.0.2", 7001)).addr(),
            ConnectionAddr::Tcp(host, 7001) if host == "10.0.0.2"
        ));
    }
}

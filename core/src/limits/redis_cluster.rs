//! The Redis Cluster sync backend: the same ledger as [`super::redis`], with budgets spread over
//! the cluster's masters by slot.
//!
//! Runs where [`RedisBackend`] runs (off the request path, once per sync interval per worker;
//! one instance per worker, `!Send`). [`exchange`](SyncBackend::exchange) takes the worker's
//! batch, maps each budget key to its slot (CRC16 of the key's hash tag), splits the batch by
//! the master that serves the slot, and runs each master's part as one pipelined round trip on
//! that master's connection — all masters at once. It returns one [`BudgetState`] per budget, in
//! order, or an error for the whole batch (the caller then keeps its local view for every
//! budget, as with a single Redis).
//!
//! The slot map comes from `CLUSTER SLOTS`, asked of any known node (the seeds first time), and
//! is refreshed after a `MOVED` reply or a failed master. A `MOVED` budget is retried at once at
//! the node the reply names; an `ASK` budget (a slot being migrated) is retried there behind
//! `ASKING`, without changing the map. One retry per exchange; everything within the deadline.
//!
//! Errors are those of [`RedisBackend`] (one failed master fails the batch), plus
//! [`SyncError::Protocol`] for a slot no master serves, a budget redirected twice, or a cluster
//! answer it can't parse (a hostname where an IP was expected: no DNS is resolved here).

use std::future::Future;
use std::net::{IpAddr, SocketAddr};
use std::pin::Pin;
use std::task::Poll;
use std::time::{Duration, Instant};

use redis_protocol::redis_keyslot;
use redis_protocol::resp2::types::BytesFrame;

use super::redis::{budget_state, RedisBackend, RedisSettings};
use super::sync::{BudgetState, BudgetSync, SyncBackend, SyncError};

/// Slots in a Redis Cluster.
const SLOTS: usize = 16384;

/// A slot no known master serves.
const NO_MASTER: u16 = u16::MAX;

/// Where and how to reach the cluster. `Debug` leaves the password out.
#[derive(Clone, PartialEq, Eq)]
pub(crate) struct RedisClusterSettings {
    /// Nodes to ask for the slot map when none is known (any subset of the cluster).
    pub(crate) seeds: Vec<SocketAddr>,
    /// `AUTH` password for every node; none: no `AUTH`.
    pub(crate) password: Option<String>,
    /// ACL user for `AUTH`; only used with a password.
    pub(crate) username: Option<String>,
    /// Limit on each TCP connect.
    pub(crate) connect_timeout: Duration,
}

impl std::fmt::Debug for RedisClusterSettings {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RedisClusterSettings")
            .field("seeds", &self.seeds)
            .field("password", &self.password.as_ref().map(|_| "<redacted>"))
            .field("username", &self.username)
            .field("connect_timeout", &self.connect_timeout)
            .finish()
    }
}

impl RedisClusterSettings {
    /// No auth, a 1 s connect timeout.
    pub(crate) fn new(seeds: Vec<SocketAddr>) -> RedisClusterSettings {
        RedisClusterSettings {
            seeds,
            password: None,
            username: None,
            connect_timeout: Duration::from_secs(1),
        }
    }

    fn node(&self, addr: SocketAddr) -> RedisSettings {
        RedisSettings {
            password: self.password.clone(),
            username: self.username.clone(),
            connect_timeout: self.connect_timeout,
            ..RedisSettings::new(addr)
        }
    }
}

/// Counters of the cluster client, for metrics and tests.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct RedisClusterStats {
    /// Slot maps loaded.
    pub(crate) refreshes: u64,
    /// Budgets redirected by `MOVED`.
    pub(crate) moved: u64,
    /// Budgets redirected by `ASK`.
    pub(crate) asked: u64,
}

/// One worker's Redis Cluster ledger client (see the module doc).
pub(crate) struct RedisClusterBackend {
    settings: RedisClusterSettings,
    /// Every node seen (seeds and masters), each with its own connection and backoff.
    nodes: Vec<(SocketAddr, RedisBackend)>,
    /// Slot → index in `nodes` of the master serving it (`NO_MASTER`: unknown).
    slots: Vec<u16>,
    /// Reload the slot map before the next exchange.
    stale: bool,
    stats: RedisClusterStats,
}

/// What became of one budget at one node.
enum Outcome {
    State(BudgetState),
    Moved(SocketAddr),
    Ask(SocketAddr),
}

/// The budgets (indices into the batch) sent to one node in one round.
#[derive(Default, Clone)]
struct Group {
    plain: Vec<usize>,
    asking: Vec<usize>,
}

impl RedisClusterBackend {
    /// A backend that loads the slot map and connects on its first exchange.
    pub(crate) fn new(settings: RedisClusterSettings) -> RedisClusterBackend {
        RedisClusterBackend {
            settings,
            nodes: Vec::new(),
            slots: vec![NO_MASTER; SLOTS],
            stale: true,
            stats: RedisClusterStats::default(),
        }
    }

    /// Counters since creation.
    #[cfg(test)]
    pub(crate) fn stats(&self) -> RedisClusterStats {
        self.stats
    }

    /// The traffic counters of the connection to `addr`, if it is a known node.
    #[cfg(test)]
    pub(crate) fn node_stats(&self, addr: SocketAddr) -> Option<super::redis::RedisStats> {
        self.nodes
            .iter()
            .find(|(a, _)| *a == addr)
            .map(|(_, b)| b.stats())
    }

    /// The index of `addr` in `nodes`, added when new. Fails only past `NO_MASTER` nodes.
    fn node_index(&mut self, addr: SocketAddr) -> Result<u16, SyncError> {
        if let Some(i) = self.nodes.iter().position(|(a, _)| *a == addr) {
            return u16::try_from(i).map_err(|_| too_many_nodes());
        }
        let i = u16::try_from(self.nodes.len())
            .ok()
            .filter(|&i| i != NO_MASTER)
            .ok_or_else(too_many_nodes)?;
        self.nodes
            .push((addr, RedisBackend::new(self.settings.node(addr))));
        Ok(i)
    }

    /// Load the slot map from the first node that answers: known nodes, then the seeds.
    async fn refresh(&mut self, until: Instant) -> Result<(), SyncError> {
        let mut candidates: Vec<SocketAddr> = self.nodes.iter().map(|(a, _)| *a).collect();
        for seed in &self.settings.seeds {
            if !candidates.contains(seed) {
                candidates.push(*seed);
            }
        }
        let mut last = SyncError::Unavailable("no cluster node configured".into());
        for addr in candidates {
            let i = usize::from(self.node_index(addr)?);
            let Some((_, node)) = self.nodes.get_mut(i) else {
                continue;
            };
            let left = until.saturating_duration_since(Instant::now());
            let ranges = match node.command(&[b"CLUSTER", b"SLOTS"], left).await {
                Ok(frame) => parse_slots(&frame, addr.ip()),
                Err(e) => Err(e),
            };
            match ranges {
                Ok(ranges) => {
                    let mut slots = vec![NO_MASTER; SLOTS];
                    for (start, end, master) in ranges {
                        let m = self.node_index(master)?;
                        if let Some(range) = slots.get_mut(start..=end) {
                            range.fill(m);
                        }
                    }
                    self.slots = slots;
                    self.stale = false;
                    self.stats.refreshes += 1;
                    return Ok(());
                }
                Err(SyncError::Timeout) => return Err(SyncError::Timeout),
                Err(e) => last = e,
            }
        }
        Err(last)
    }

    async fn exchange_inner(
        &mut self,
        core: &str,
        lease_ttl_ms: u64,
        batch: &[BudgetSync],
        out: &mut Vec<BudgetState>,
        until: Instant,
    ) -> Result<(), SyncError> {
        if self.stale {
            self.refresh(until).await?;
        }
        let mut groups: Vec<Group> = vec![Group::default(); self.nodes.len()];
        for (i, b) in batch.iter().enumerate() {
            let slot = redis_keyslot(b.key.as_bytes());
            let master = self
                .slots
                .get(usize::from(slot))
                .copied()
                .unwrap_or(NO_MASTER);
            match groups.get_mut(usize::from(master)) {
                Some(g) => g.plain.push(i),
                None => {
                    self.stale = true;
                    return Err(SyncError::Protocol(format!("slot {slot} is not served")));
                }
            }
        }

        let mut states: Vec<Option<BudgetState>> = vec![None; batch.len()];
        for round in 0..2 {
            let results = self
                .run_groups(core, lease_ttl_ms, batch, &groups, until)
                .await;
            let mut retry: Vec<Group> = Vec::new();
            for result in results {
                let outcomes = match result {
                    Ok(o) => o,
                    Err(e) => {
                        // The master may have failed over: ask for the map again next time.
                        self.stale = true;
                        return Err(e);
                    }
                };
                for (i, outcome) in outcomes {
                    let (to, asking) = match outcome {
                        Outcome::State(s) => {
                            if let Some(slot) = states.get_mut(i) {
                                *slot = Some(s);
                            }
                            continue;
                        }
                        Outcome::Moved(to) => {
                            self.stats.moved += 1;
                            self.stale = true;
                            (to, false)
                        }
                        Outcome::Ask(to) => {
                            self.stats.asked += 1;
                            (to, true)
                        }
                    };
                    if round == 1 {
                        return Err(SyncError::Protocol(format!(
                            "budget {:?} redirected twice",
                            batch.get(i).map_or("", |b| b.key.as_str())
                        )));
                    }
                    let n = usize::from(self.node_index(to)?);
                    if retry.len() <= n {
                        retry.resize(n + 1, Group::default());
                    }
                    if let Some(g) = retry.get_mut(n) {
                        if asking {
                            g.asking.push(i);
                        } else {
                            g.plain.push(i);
                        }
                    }
                }
            }
            if retry.is_empty() {
                break;
            }
            groups = retry;
        }
        // The map is refreshed lazily, before the next exchange: this one already went to the
        // nodes the redirects named.
        out.clear();
        for s in states {
            match s {
                Some(s) => out.push(s),
                None => return Err(SyncError::Protocol("a budget got no reply".into())),
            }
        }
        Ok(())
    }

    /// Run every node's group at once; one result per node that had budgets.
    async fn run_groups(
        &mut self,
        core: &str,
        lease_ttl_ms: u64,
        batch: &[BudgetSync],
        groups: &[Group],
        until: Instant,
    ) -> Vec<Result<Vec<(usize, Outcome)>, SyncError>> {
        let mut runs = Vec::new();
        for ((addr, node), group) in self.nodes.iter_mut().zip(groups) {
            if group.plain.is_empty() && group.asking.is_empty() {
                continue;
            }
            let addr = *addr;
            runs.push(async move {
                let mut outcomes = Vec::with_capacity(group.plain.len() + group.asking.len());
                for (list, asking) in [(&group.plain, false), (&group.asking, true)] {
                    if list.is_empty() {
                        continue;
                    }
                    let left = until.saturating_duration_since(Instant::now());
                    let budgets = list.iter().filter_map(|&i| batch.get(i));
                    let replies = node
                        .script_replies(core, lease_ttl_ms, budgets, asking, left)
                        .await?;
                    for (&i, frame) in list.iter().zip(replies) {
                        outcomes.push((i, outcome(frame, addr)?));
                    }
                }
                Ok(outcomes)
            });
        }
        join_all(runs).await
    }
}

impl SyncBackend for RedisClusterBackend {
    async fn exchange(
        &mut self,
        node: &str,
        lease_ttl_ms: u64,
        batch: &[BudgetSync],
        out: &mut Vec<BudgetState>,
        deadline: Duration,
    ) -> Result<(), SyncError> {
        out.clear();
        if batch.is_empty() {
            return Ok(());
        }
        // Each node's round trip is bounded by what is left of the deadline (and drops its own
        // connection when it passes), so the whole exchange ends by `until`.
        let until = Instant::now() + deadline;
        let res = self
            .exchange_inner(node, lease_ttl_ms, batch, out, until)
            .await;
        if res.is_err() {
            out.clear();
        }
        res
    }
}

fn too_many_nodes() -> SyncError {
    SyncError::Protocol("too many cluster nodes".into())
}

/// One script reply from the node at `from`: a state, or where the budget's slot lives now.
fn outcome(frame: &BytesFrame, from: SocketAddr) -> Result<Outcome, SyncError> {
    if let BytesFrame::Error(e) = frame {
        // "MOVED <slot> <host>:<port>" / "ASK <slot> <host>:<port>"
        let mut words = e.split(' ');
        let kind = words.next();
        if let (Some(kind @ ("MOVED" | "ASK")), Some(_slot), Some(to)) =
            (kind, words.next(), words.next())
        {
            let to = parse_endpoint(to, from.ip())
                .ok_or_else(|| SyncError::Protocol(format!("unusable redirect: {e}")))?;
            return Ok(if kind == "MOVED" {
                Outcome::Moved(to)
            } else {
                Outcome::Ask(to)
            });
        }
    }
    budget_state(frame).map(Outcome::State)
}

/// `ip:port` (`[v6]:port` too); an empty host means the node that answered.
fn parse_endpoint(s: &str, default_ip: IpAddr) -> Option<SocketAddr> {
    if let Ok(addr) = s.parse() {
        return Some(addr);
    }
    let port = s.strip_prefix(':')?.parse().ok()?;
    Some(SocketAddr::new(default_ip, port))
}

/// `CLUSTER SLOTS` → (first slot, last slot, master) ranges. An empty or unknown host (Redis
/// answers "" for the node asked when it doesn't know its own address) means `asked`.
fn parse_slots(
    frame: &BytesFrame,
    asked: IpAddr,
) -> Result<Vec<(usize, usize, SocketAddr)>, SyncError> {
    let bad = |what: &str| SyncError::Protocol(format!("CLUSTER SLOTS: {what}"));
    let BytesFrame::Array(entries) = frame else {
        return Err(bad("not an array"));
    };
    let mut ranges = Vec::with_capacity(entries.len());
    for entry in entries {
        let BytesFrame::Array(parts) = entry else {
            return Err(bad("an entry is not an array"));
        };
        let (Some(BytesFrame::Integer(start)), Some(BytesFrame::Integer(end)), Some(master)) =
            (parts.first(), parts.get(1), parts.get(2))
        else {
            return Err(bad("an entry lacks its range or master"));
        };
        let BytesFrame::Array(master) = master else {
            return Err(bad("a master is not an array"));
        };
        let (Some(host), Some(BytesFrame::Integer(port))) = (master.first(), master.get(1)) else {
            return Err(bad("a master lacks its host or port"));
        };
        let host = match host {
            BytesFrame::BulkString(b) | BytesFrame::SimpleString(b) => {
                String::from_utf8_lossy(b).into_owned()
            }
            _ => return Err(bad("a master's host is not a string")),
        };
        let ip = if host.is_empty() || host == "?" {
            asked
        } else {
            host.parse::<IpAddr>()
                .map_err(|_| bad(&format!("host {host:?} is not an IP address")))?
        };
        let port = u16::try_from(*port).map_err(|_| bad("port out of range"))?;
        let (Ok(start), Ok(end)) = (usize::try_from(*start), usize::try_from(*end)) else {
            return Err(bad("negative slot"));
        };
        if start > end || end >= SLOTS {
            return Err(bad("slot range out of bounds"));
        }
        ranges.push((start, end, SocketAddr::new(ip, port)));
    }
    Ok(ranges)
}

/// Poll every future until all are done; outputs in order. (The masters' round trips run
/// concurrently on this worker's runtime.)
async fn join_all<F: Future>(futures: Vec<F>) -> Vec<F::Output> {
    let mut futures: Vec<Pin<Box<F>>> = futures.into_iter().map(Box::pin).collect();
    let mut outputs: Vec<Option<F::Output>> = futures.iter().map(|_| None).collect();
    std::future::poll_fn(|cx| {
        let mut pending = false;
        for (f, o) in futures.iter_mut().zip(outputs.iter_mut()) {
            if o.is_none() {
                match f.as_mut().poll(cx) {
                    Poll::Ready(v) => *o = Some(v),
                    Poll::Pending => pending = true,
                }
            }
        }
        if pending {
            Poll::Pending
        } else {
            Poll::Ready(())
        }
    })
    .await;
    outputs.into_iter().flatten().collect()
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]

    use super::super::ledger::conformance::{self, block_on, budget, state};
    use super::super::ledger::InProcessLedger;
    use super::super::redis::testing::{free_port, Server};
    use super::*;

    const DEADLINE: Duration = Duration::from_secs(1);

    /// Three masters on loopback, each serving a third of the slots, formed with CLUSTER
    /// ADDSLOTSRANGE + MEET (no redis-cli needed).
    struct Cluster {
        servers: Vec<Server>,
        /// An admin connection per server, for the test's own commands.
        admin: Vec<RedisBackend>,
        ids: Vec<String>,
    }

    impl Cluster {
        async fn start() -> Cluster {
            let dir = std::env::temp_dir();
            let mut servers = Vec::new();
            let mut buses = Vec::new();
            for _ in 0..3 {
                let port = free_port();
                let bus = free_port();
                let conf = dir.join(format!("sluice-test-nodes-{port}.conf"));
                let _ = std::fs::remove_file(&conf);
                let mut s = Server {
                    child: None,
                    port,
                    extra: vec![
                        "--cluster-enabled".into(),
                        "yes".into(),
                        "--cluster-config-file".into(),
                        conf.to_string_lossy().into_owned(),
                        "--cluster-port".into(),
                        bus.to_string(),
                        "--cluster-node-timeout".into(),
                        "5000".into(),
                    ],
                };
                s.restart();
                servers.push(s);
                buses.push(bus);
            }
            let mut admin: Vec<RedisBackend> = servers.iter().map(Server::backend).collect();
            let ranges = [("0", "5460"), ("5461", "10922"), ("10923", "16383")];
            let mut ids = Vec::new();
            for (a, (from, to)) in admin.iter_mut().zip(ranges) {
                cmd(a, &["CLUSTER", "ADDSLOTSRANGE", from, to]).await;
                ids.push(text(&cmd(a, &["CLUSTER", "MYID"]).await));
            }
            for (s, bus) in servers.iter().zip(&buses).skip(1) {
                let (port, bus) = (s.port.to_string(), bus.to_string());
                cmd(
                    &mut admin[0],
                    &["CLUSTER", "MEET", "127.0.0.1", &port, &bus],
                )
                .await;
            }
            // Formed when every node knows all three and sees every slot served.
            let until = Instant::now() + Duration::from_secs(20);
            for a in admin.iter_mut() {
                loop {
                    let info = text(&cmd(a, &["CLUSTER", "INFO"]).await);
                    let slots = cmd(a, &["CLUSTER", "SLOTS"]).await;
                    let ranges = match slots {
                        BytesFrame::Array(r) => r.len(),
                        _ => 0,
                    };
                    if info.contains("cluster_state:ok")
                        && info.contains("cluster_known_nodes:3")
                        && ranges == 3
                    {
                        break;
                    }
                    assert!(Instant::now() < until, "cluster did not form: {info}");
                    monoio::time::sleep(Duration::from_millis(50)).await;
                }
            }
            Cluster {
                servers,
                admin,
                ids,
            }
        }

        fn seeds(&self) -> Vec<SocketAddr> {
            vec![self.servers[0].addr()]
        }

        /// Which server serves `slot` (by the ranges given at start).
        fn owner(slot: u16) -> usize {
            match slot {
                0..=5460 => 0,
                5461..=10922 => 1,
                _ => 2,
            }
        }
    }

    impl Drop for Cluster {
        fn drop(&mut self) {
            for s in &mut self.servers {
                s.stop();
                let conf = std::env::temp_dir().join(format!("sluice-test-nodes-{}.conf", s.port));
                let _ = std::fs::remove_file(conf);
            }
        }
    }

    async fn cmd(b: &mut RedisBackend, args: &[&str]) -> BytesFrame {
        let args: Vec<&[u8]> = args.iter().map(|a| a.as_bytes()).collect();
        b.command(&args, DEADLINE).await.unwrap()
    }

    fn text(f: &BytesFrame) -> String {
        match f {
            BytesFrame::BulkString(b) | BytesFrame::SimpleString(b) => {
                String::from_utf8_lossy(b).into_owned()
            }
            other => panic!("not a string: {other:?}"),
        }
    }

    /// A hash-tagged key whose slot the given server serves, and that no other test key uses.
    fn key_on(server: usize, name: &str) -> String {
        (0..)
            .map(|i| format!("{{{name}{i}}}"))
            .find(|k| Cluster::owner(redis_keyslot(k.as_bytes())) == server)
            .unwrap()
    }

    async fn exchange(
        b: &mut RedisClusterBackend,
        node: &str,
        batch: &[BudgetSync],
    ) -> Result<Vec<BudgetState>, SyncError> {
        let mut out = Vec::new();
        b.exchange(node, 60_000, batch, &mut out, DEADLINE).await?;
        Ok(out)
    }

    #[test]
    fn cluster_same_answers_slots_and_split_batches() {
        block_on(async {
            let mut cluster = Cluster::start().await;
            // Our slot function agrees with the server's, hash tags included.
            for key in [
                "plain", "{tag}a", "{tag}b", "a{}b", "{}x", "x{y", "{conf:a}",
            ] {
                let slot = cmd(&mut cluster.admin[0], &["CLUSTER", "KEYSLOT", key]).await;
                assert_eq!(
                    slot,
                    BytesFrame::Integer(i64::from(redis_keyslot(key.as_bytes()))),
                    "{key}"
                );
            }

            let mut redis = RedisClusterBackend::new(RedisClusterSettings::new(cluster.seeds()));
            let mut local = InProcessLedger::new();
            let from_cluster = conformance::scenario(&mut redis, "cconf").await.unwrap();
            let from_local = conformance::scenario(&mut local, "cconf").await.unwrap();
            assert_eq!(from_cluster, from_local);
            assert_eq!(redis.stats().refreshes, 1);

            // 300 budgets over all three masters: one write to each, all at once.
            let batch: Vec<BudgetSync> = (0..300)
                .map(|i| budget(&format!("{{split{i}}}"), 1_000, i, i + 1, 0))
                .collect();
            // Once to connect to every master, then measured.
            exchange(&mut redis, "n", &batch).await.unwrap();
            let before: Vec<_> = cluster
                .servers
                .iter()
                .map(|s| redis.node_stats(s.addr()).unwrap())
                .collect();
            let out = exchange(&mut redis, "n", &batch).await.unwrap();
            let expect: Vec<BudgetState> = (0..300).map(|i| state(i + 1, i, 0)).collect();
            assert_eq!(out, expect);
            for (s, b) in cluster.servers.iter().zip(before) {
                let after = redis.node_stats(s.addr()).unwrap();
                assert_eq!(after.writes - b.writes, 1, "{}", s.addr());
            }
            // Each budget landed on its own master.
            for b in batch.iter().step_by(37) {
                let owner = Cluster::owner(redis_keyslot(b.key.as_bytes()));
                let n = cmd(&mut cluster.admin[owner], &["EXISTS", &b.key]).await;
                assert_eq!(n, BytesFrame::Integer(1), "{}", b.key);
            }
        });
    }

    #[test]
    fn cluster_follows_moved_and_ask() {
        block_on(async {
            let mut cluster = Cluster::start().await;
            let mut redis = RedisClusterBackend::new(RedisClusterSettings::new(cluster.seeds()));
            let warm = key_on(2, "warm");
            exchange(&mut redis, "n", &[budget(&warm, 10, 0, 1, 0)])
                .await
                .unwrap();
            assert_eq!(redis.stats().refreshes, 1);

            // MOVED: an empty slot of server 0 is handed to server 1 behind the client's back.
            let moved = key_on(0, "moved");
            let slot = redis_keyslot(moved.as_bytes()).to_string();
            let (from, to) = (cluster.ids[0].clone(), cluster.ids[1].clone());
            // Importing first, so that taking the slot bumps server 1's config epoch and
            // server 0's older claim can't win it back by gossip.
            cmd(
                &mut cluster.admin[1],
                &["CLUSTER", "SETSLOT", &slot, "IMPORTING", &from],
            )
            .await;
            for i in [1, 0, 2] {
                cmd(
                    &mut cluster.admin[i],
                    &["CLUSTER", "SETSLOT", &slot, "NODE", &to],
                )
                .await;
            }
            let out = exchange(
                &mut redis,
                "n",
                &[budget(&moved, 10, 2, 3, 0), budget(&warm, 10, 0, 1, 0)],
            )
            .await
            .unwrap();
            assert_eq!(out, vec![state(3, 2, 0), state(1, 0, 0)]);
            assert_eq!(redis.stats().moved, 1);
            assert_eq!(
                cmd(&mut cluster.admin[1], &["EXISTS", &moved]).await,
                BytesFrame::Integer(1)
            );
            // The map is reloaded before the next exchange, which goes straight to server 1.
            exchange(&mut redis, "n", &[budget(&moved, 10, 2, 3, 0)])
                .await
                .unwrap();
            assert_eq!(redis.stats().moved, 1);
            assert_eq!(redis.stats().refreshes, 2);

            // ASK: a slot of server 0 being migrated to server 2; the key is not on 0 yet.
            let asked = key_on(0, "asked");
            let slot = redis_keyslot(asked.as_bytes()).to_string();
            let (from, to) = (cluster.ids[0].clone(), cluster.ids[2].clone());
            cmd(
                &mut cluster.admin[2],
                &["CLUSTER", "SETSLOT", &slot, "IMPORTING", &from],
            )
            .await;
            cmd(
                &mut cluster.admin[0],
                &["CLUSTER", "SETSLOT", &slot, "MIGRATING", &to],
            )
            .await;
            let refreshes = redis.stats().refreshes;
            let out = exchange(&mut redis, "n", &[budget(&asked, 10, 1, 4, 0)])
                .await
                .unwrap();
            assert_eq!(out, vec![state(4, 1, 0)]);
            assert_eq!(redis.stats().asked, 1);
            // (The importing node shows the key only to a client that says ASKING.)
            cmd(&mut cluster.admin[2], &["ASKING"]).await;
            assert_eq!(
                cmd(&mut cluster.admin[2], &["EXISTS", &asked]).await,
                BytesFrame::Integer(1)
            );
            // ASK does not change the map.
            exchange(&mut redis, "n", &[budget(&warm, 10, 0, 1, 0)])
                .await
                .unwrap();
            assert_eq!(redis.stats().refreshes, refreshes);
        });
    }

    #[test]
    fn cluster_master_down_fails_the_batch_within_the_deadline() {
        block_on(async {
            let mut cluster = Cluster::start().await;
            let mut redis = RedisClusterBackend::new(RedisClusterSettings::new(cluster.seeds()));
            let batch = [
                budget(&key_on(0, "d"), 10, 0, 1, 0),
                budget(&key_on(2, "d"), 10, 0, 1, 0),
            ];
            exchange(&mut redis, "n", &batch).await.unwrap();
            cluster.servers[2].stop();
            let t = Instant::now();
            let err = exchange(&mut redis, "n", &batch).await.unwrap_err();
            assert!(
                matches!(err, SyncError::Unavailable(_) | SyncError::Timeout),
                "{err:?}"
            );
            assert!(t.elapsed() < DEADLINE + Duration::from_millis(100));
            // Budgets on the live masters still work (the map is reloaded from server 0).
            let out = exchange(&mut redis, "n", &batch[..1]).await.unwrap();
            assert_eq!(out, vec![state(1, 0, 0)]);
        });
    }

    #[test]
    fn redirect_and_slot_parsing() {
        let from: SocketAddr = "10.0.0.1:7000".parse().unwrap();
        let moved = BytesFrame::Error("MOVED 3999 127.0.0.1:6381".into());
        assert!(
            matches!(outcome(&moved, from), Ok(Outcome::Moved(a)) if a == "127.0.0.1:6381".parse().unwrap())
        );
        let ask = BytesFrame::Error("ASK 3999 :6382".into());
        assert!(
            matches!(outcome(&ask, from), Ok(Outcome::Ask(a)) if a == "10.0.0.1:6382".parse().unwrap())
        );
        let host = BytesFrame::Error("MOVED 1 redis-1.internal:6379".into());
        assert!(matches!(outcome(&host, from), Err(SyncError::Protocol(_))));
        let other = BytesFrame::Error("ERR boom".into());
        assert!(matches!(outcome(&other, from), Err(SyncError::Protocol(_))));

        let entry = |s: i64, e: i64, host: &str, port: i64| {
            BytesFrame::Array(vec![
                BytesFrame::Integer(s),
                BytesFrame::Integer(e),
                BytesFrame::Array(vec![
                    BytesFrame::BulkString(host.to_owned().into()),
                    BytesFrame::Integer(port),
                ]),
            ])
        };
        let ip: IpAddr = "10.0.0.1".parse().unwrap();
        let ok = BytesFrame::Array(vec![entry(0, 10, "", 7000), entry(11, 16383, "::1", 7001)]);
        let ranges = parse_slots(&ok, ip).unwrap();
        assert_eq!(
            ranges,
            vec![
                (0, 10, "10.0.0.1:7000".parse().unwrap()),
                (11, 16383, "[::1]:7001".parse().unwrap())
            ]
        );
        for bad in [
            BytesFrame::Array(vec![entry(0, 16384, "1.2.3.4", 1)]),
            BytesFrame::Array(vec![entry(5, 4, "1.2.3.4", 1)]),
            BytesFrame::Array(vec![entry(0, 1, "host.name", 1)]),
            BytesFrame::Array(vec![entry(0, 1, "1.2.3.4", 70_000)]),
            BytesFrame::Integer(1),
        ] {
            assert!(parse_slots(&bad, ip).is_err(), "{bad:?}");
        }
    }
}

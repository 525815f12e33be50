//! The Redis sync backend: the ledger every Sluice node shares, one Redis hash per budget.
//!
//! Runs off the request path, once per sync interval per worker (and when a request is waiting
//! for a lease). Each worker owns one [`RedisBackend`] (`!Send`, one TCP connection, no locks).
//! [`exchange`](SyncBackend::exchange) takes the worker's batch of [`BudgetSync`]s and sends one
//! `EVALSHA` per budget — all of them in one write — then reads every reply and returns one
//! [`BudgetState`] per budget, in order. The script ([`LEDGER_SCRIPT`]) applies the ledger
//! semantics of [`super::sync`] atomically to its single key, `KEYS[1]` (the budget key, which
//! carries a hash tag), so every command touches one slot and the batch is Redis-Cluster-safe.
//!
//! The whole round trip — connecting and the handshake included, and the one retry after a
//! `NOSCRIPT` reply (Redis restarted or its script cache was flushed) — runs within the caller's
//! deadline. Errors:
//! - [`SyncError::Unavailable`]: can't connect, the connection broke, or the backend is in
//!   reconnect backoff (then it fails at once, without touching the network);
//! - [`SyncError::Timeout`]: the deadline passed;
//! - [`SyncError::Protocol`]: an error reply (a failed `AUTH`, a script error), a reply of the
//!   wrong shape, an undecodable or oversized reply ([`MAX_REPLY_BYTES`]).
//!
//! A broken, timed-out or desynchronised connection is dropped (a half-read pipeline can't be
//! resumed) and the next connect waits out an exponential backoff ([`BACKOFF_MIN`] doubling to
//! [`BACKOFF_MAX`], reset by the next successful exchange). An error reply to a command leaves the
//! connection in sync, so it is kept.
//!
//! Numbers travel as integers. The script computes in Lua doubles, exact up to 2^53, so every
//! value sent is capped at 2^53 − 1 (≈ 9·10^15 tokens: far beyond any budget).

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use bytes::BytesMut;
use monoio::buf::IoBufMut;
use monoio::io::{AsyncReadRent, AsyncWriteRentExt};
use monoio::net::TcpStream;
use redis_protocol::resp2::decode::decode_bytes_mut;
use redis_protocol::resp2::encode::extend_encode_borrowed;
use redis_protocol::resp2::types::{BorrowedFrame, BytesFrame};

use super::sync::{BudgetState, BudgetSync, SyncBackend, SyncError};

/// The largest reply (one frame, or the unparsed rest of a pipeline) accepted before the
/// connection is dropped: ledger replies are a few dozen bytes each.
pub(crate) const MAX_REPLY_BYTES: usize = 1 << 20;

/// First reconnect delay after a failure.
pub(crate) const BACKOFF_MIN: Duration = Duration::from_millis(50);

/// Longest reconnect delay: short, so a recovered Redis is found within it plus one interval
/// and one timeout (the down-policy applies meanwhile). A reconnect attempt is one TCP connect
/// per worker: four a second per worker is nothing to a Redis that is back.
pub(crate) const BACKOFF_MAX: Duration = crate::config::limits::RECONNECT_BACKOFF_MAX;

/// Bytes reserved for each socket read.
const READ_CHUNK: usize = 16 * 1024;

/// The largest integer the script's Lua doubles hold exactly.
const MAX_EXACT: u64 = (1 << 53) - 1;

/// The ledger script: one exchange for one budget (see [`super::sync`]), run atomically by Redis.
///
/// `KEYS[1]` is the budget's hash; `ARGV` = node, limit, spent, lease, floor, key_ttl_ms,
/// lease_ttl_ms, shortfall, shortfall_ttl_ms. The hash holds, per node, `s:<node>` (spent),
/// `l:<node>` (lease), `e:<node>` (the lease's expiry, ms since the epoch by the Redis clock),
/// `w:<node>` (what its waiting requests lack) and `x:<node>` (that shortfall's expiry).
/// A sliding rate window adds `KEYS[2]`, the previous window's hash (same hash tag, so the same
/// slot), and `ARGV[10..12]` = max, overlap_ms, window_ms: the previous window's spend and live
/// leases, weighted by the overlap and rounded up, come off the limit (read-only on `KEYS[2]`).
/// Returns `{granted, spent_total, leased_others, wanted_others, prev_total}`. Numbers are stored with `%d`, so they stay plain
/// decimal integers whatever number-to-string conversion the Redis version applies (Lua's own
/// keeps only 14 significant digits).
pub(crate) const LEDGER_SCRIPT: &str = r#"
local key, node = KEYS[1], ARGV[1]
local limit, spent, want, floor = tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4]), tonumber(ARGV[5])
local key_ttl, lease_ttl = tonumber(ARGV[6]), tonumber(ARGV[7])
local shortfall, shortfall_ttl = tonumber(ARGV[8]), tonumber(ARGV[9])
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)

-- A sliding window: the previous window's spend and live leases, weighted by its overlap.
local prev_total = 0
if KEYS[2] then
  local prev = redis.call('HGETALL', KEYS[2])
  local pleases, pexpiries = {}, {}
  for i = 1, #prev, 2 do
    local kind, who, v = string.sub(prev[i], 1, 2), string.sub(prev[i], 3), tonumber(prev[i + 1])
    if kind == 's:' then prev_total = prev_total + v
    elseif kind == 'l:' then pleases[who] = v elseif kind == 'e:' then pexpiries[who] = v end
  end
  for who, v in pairs(pleases) do
    local e = pexpiries[who]
    if e ~= nil and e > now then prev_total = prev_total + v end
  end
  local max, overlap, window = tonumber(ARGV[10]), tonumber(ARGV[11]), tonumber(ARGV[12])
  if overlap > window then overlap = window end
  -- ceil(prev_total * overlap / window), exact in doubles below 2^53.
  local w = prev_total * overlap
  local weighted = math.floor(w / window)
  if weighted * window < w then weighted = weighted + 1 end
  local cap = max - weighted
  if cap < 0 then cap = 0 end
  if cap < limit then limit = cap end
end

local fields = redis.call('HGETALL', key)
local own, spent_total, leased_others, wanted_others = 0, 0, 0, 0
local leases, expiries, shorts, short_expiries = {}, {}, {}, {}
for i = 1, #fields, 2 do
  local kind, who, v = string.sub(fields[i], 1, 2), string.sub(fields[i], 3), tonumber(fields[i + 1])
  if kind == 's:' then
    if who == node then own = v else spent_total = spent_total + v end
  elseif who ~= node then
    if kind == 'l:' then leases[who] = v elseif kind == 'e:' then expiries[who] = v
    elseif kind == 'w:' then shorts[who] = v elseif kind == 'x:' then short_expiries[who] = v end
  end
end

-- 1. Monotonic spend: keep the largest value seen.
if spent > own then
  own = spent
  redis.call('HSET', key, 's:' .. node, string.format('%d', spent))
end
spent_total = spent_total + own

-- 2 and 3. Drop the other nodes' lapsed leases (and shortfalls), sum the live ones.
local function sum_live(values, expires, value_kind, expiry_kind)
  local total = 0
  for who, v in pairs(values) do
    local e = expires[who]
    if e ~= nil and e > now then
      total = total + v
    else
      redis.call('HDEL', key, value_kind .. who, expiry_kind .. who)
    end
  end
  return total
end
leased_others = sum_live(leases, expiries, 'l:', 'e:')
wanted_others = sum_live(shorts, short_expiries, 'w:', 'x:')
local available = limit - spent_total - leased_others
if available < 0 then available = 0 end

-- 4. What was asked as far as it fits, never below the floor.
local granted = math.max(floor, math.min(want, available))

-- 5. This node's lease, renewed (deleted when 0).
if granted > 0 then
  redis.call('HSET', key, 'l:' .. node, string.format('%d', granted),
    'e:' .. node, string.format('%d', now + lease_ttl))
else
  redis.call('HDEL', key, 'l:' .. node, 'e:' .. node)
end
-- ... and what this node's waiting requests still lack (deleted when 0).
local short = math.min(shortfall, math.max(want - granted, 0))
if short > 0 then
  redis.call('HSET', key, 'w:' .. node, string.format('%d', short),
    'x:' .. node, string.format('%d', now + shortfall_ttl))
else
  redis.call('HDEL', key, 'w:' .. node, 'x:' .. node)
end

-- 6. The whole budget's lifetime (0: forever).
if key_ttl > 0 then
  redis.call('PEXPIRE', key, string.format('%d', key_ttl))
else
  redis.call('PERSIST', key)
end
return {granted, spent_total, leased_others, wanted_others, prev_total}
"#;

/// Where and how to reach Redis. `Debug` leaves the password out.
#[derive(Clone, PartialEq, Eq)]
pub(crate) struct RedisSettings {
    /// Resolved once, when the config is loaded.
    pub(crate) addr: SocketAddr,
    /// `AUTH` password; none: no `AUTH`.
    pub(crate) password: Option<String>,
    /// ACL user for `AUTH` (Redis 6+); only used with a password.
    pub(crate) username: Option<String>,
    /// Database to `SELECT` (0: none sent).
    pub(crate) db: u32,
    /// Limit on the TCP connect alone (the exchange deadline bounds it too).
    pub(crate) connect_timeout: Duration,
}

impl std::fmt::Debug for RedisSettings {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RedisSettings")
            .field("addr", &self.addr)
            .field("password", &self.password.as_ref().map(|_| "<redacted>"))
            .field("username", &self.username)
            .field("db", &self.db)
            .field("connect_timeout", &self.connect_timeout)
            .finish()
    }
}

impl RedisSettings {
    /// No auth, database 0, a 1 s connect timeout.
    pub(crate) fn new(addr: SocketAddr) -> RedisSettings {
        RedisSettings {
            addr,
            password: None,
            username: None,
            db: 0,
            connect_timeout: Duration::from_secs(1),
        }
    }
}

/// Counters of one backend's traffic, for metrics and tests.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct RedisStats {
    /// TCP connects tried.
    pub(crate) connect_attempts: u64,
    /// Connections that completed the handshake.
    pub(crate) connects: u64,
    /// Pipelined writes (one per round trip).
    pub(crate) writes: u64,
    /// Complete round trips: a write and all of its replies read.
    pub(crate) round_trips: u64,
    /// `SCRIPT LOAD`s (one per connect, plus one per `NOSCRIPT` retry).
    pub(crate) script_loads: u64,
}

/// One worker's Redis ledger client (see the module doc).
pub(crate) struct RedisBackend {
    settings: RedisSettings,
    conn: Option<Conn>,
    /// The script's SHA1, as `SCRIPT LOAD` returned it (the same on every server).
    sha: Option<String>,
    backoff: Backoff,
    stats: RedisStats,
    /// Replies of the last round trip, reused between exchanges.
    frames: Vec<BytesFrame>,
}

impl RedisBackend {
    /// A backend that connects on its first exchange.
    pub(crate) fn new(settings: RedisSettings) -> RedisBackend {
        RedisBackend {
            settings,
            conn: None,
            sha: None,
            backoff: Backoff::default(),
            stats: RedisStats::default(),
            frames: Vec::new(),
        }
    }

    /// Traffic counters since creation.
    #[cfg(test)]
    pub(crate) fn stats(&self) -> RedisStats {
        self.stats
    }

    /// Whether a connection is open now.
    #[cfg(test)]
    pub(crate) fn is_connected(&self) -> bool {
        self.conn.is_some()
    }

    /// Run one arbitrary command on the backend's connection within `deadline` (health checks,
    /// tests). An error reply is returned as [`SyncError::Protocol`].
    pub(crate) async fn command(
        &mut self,
        args: &[&[u8]],
        deadline: Duration,
    ) -> Result<BytesFrame, SyncError> {
        self.check_backoff()?;
        let res = monoio::time::timeout(deadline, self.command_inner(args)).await;
        self.settle(res)
    }

    async fn command_inner(&mut self, args: &[&[u8]]) -> Result<BytesFrame, SyncError> {
        self.ensure_connected().await?;
        let Some(conn) = self.conn.as_mut() else {
            return Err(SyncError::Unavailable("not connected".into()));
        };
        let frames: Vec<BorrowedFrame> = args.iter().map(|a| bulk(a)).collect();
        conn.wbuf.clear();
        encode(&mut conn.wbuf, &frames)?;
        if let Err(e) = conn.round_trip(1, &mut self.frames, &mut self.stats).await {
            self.conn = None;
            return Err(e);
        }
        match self.frames.pop() {
            Some(BytesFrame::Error(e)) => Err(SyncError::Protocol(format!("error reply: {e}"))),
            Some(frame) => Ok(frame),
            None => Err(SyncError::Protocol("no reply".into())),
        }
    }

    /// Fail fast while in reconnect backoff (no connection and the delay not yet over).
    fn check_backoff(&self) -> Result<(), SyncError> {
        if self.conn.is_some() {
            return Ok(());
        }
        match self.backoff.until {
            Some(until) if Instant::now() < until => Err(SyncError::Unavailable(format!(
                "reconnecting in {} ms after: {}",
                until.saturating_duration_since(Instant::now()).as_millis(),
                self.backoff.reason
            ))),
            _ => Ok(()),
        }
    }

    /// Turn the outcome of a deadline-bounded operation into the caller's result: a timeout
    /// drops the connection (its pipeline is half-read), any lost connection starts the
    /// backoff, a complete round trip resets it.
    fn settle<T>(
        &mut self,
        res: Result<Result<T, SyncError>, monoio::time::error::Elapsed>,
    ) -> Result<T, SyncError> {
        let res = res.unwrap_or(Err(SyncError::Timeout));
        if matches!(res, Err(SyncError::Timeout)) {
            self.conn = None;
        }
        match (&res, self.conn.is_some()) {
            (Err(e), false) => self.backoff.fail(Instant::now(), e),
            // A live connection, even after an error reply: the server is reachable.
            (_, true) => self.backoff.reset(),
            (Ok(_), false) => {}
        }
        res
    }

    /// Connect, authenticate, select the database and load the script (one round trip after
    /// the TCP connect), unless connected already.
    async fn ensure_connected(&mut self) -> Result<(), SyncError> {
        if self.conn.is_some() {
            return Ok(());
        }
        self.stats.connect_attempts += 1;
        let addr = self.settings.addr;
        let stream =
            match monoio::time::timeout(self.settings.connect_timeout, TcpStream::connect(addr))
                .await
            {
                Ok(Ok(s)) => s,
                Ok(Err(e)) => {
                    return Err(SyncError::Unavailable(format!("connect to {addr}: {e}")))
                }
                Err(_) => {
                    return Err(SyncError::Unavailable(format!(
                        "connect to {addr}: timed out after {} ms",
                        self.settings.connect_timeout.as_millis()
                    )))
                }
            };
        // Each batch is one small write followed by a wait for replies: Nagle would only delay it.
        let _ = stream.set_nodelay(true);
        let mut conn = Conn::new(stream);

        let mut expect = Vec::with_capacity(3);
        if let Some(password) = &self.settings.password {
            match &self.settings.username {
                Some(user) => encode(
                    &mut conn.wbuf,
                    &[
                        bulk(b"AUTH"),
                        bulk(user.as_bytes()),
                        bulk(password.as_bytes()),
                    ],
                )?,
                None => encode(&mut conn.wbuf, &[bulk(b"AUTH"), bulk(password.as_bytes())])?,
            }
            expect.push("AUTH");
        }
        if self.settings.db != 0 {
            encode(
                &mut conn.wbuf,
                &[
                    bulk(b"SELECT"),
                    BorrowedFrame::Integer(i64::from(self.settings.db)),
                ],
            )?;
            expect.push("SELECT");
        }
        encode_script_load(&mut conn.wbuf)?;
        conn.round_trip(expect.len() + 1, &mut self.frames, &mut self.stats)
            .await?;
        for (frame, what) in self.frames.iter().zip(&expect) {
            match frame {
                BytesFrame::SimpleString(_) => {}
                // Never echo the password; Redis's message names the problem (WRONGPASS…).
                BytesFrame::Error(e) => {
                    return Err(SyncError::Protocol(format!("{what} failed: {e}")))
                }
                other => {
                    return Err(SyncError::Protocol(format!(
                        "{what}: unexpected reply {}",
                        describe(other)
                    )))
                }
            }
        }
        let sha = self
            .frames
            .last()
            .map(script_sha)
            .unwrap_or_else(|| Err(SyncError::Protocol("no SCRIPT LOAD reply".into())))?;
        self.stats.script_loads += 1;
        self.stats.connects += 1;
        self.sha = Some(sha);
        self.conn = Some(conn);
        Ok(())
    }

    /// Run the ledger script for each of `budgets` in one pipelined round trip (plus one more
    /// with the script reloaded when Redis no longer knew it), within `deadline`. Returns the
    /// replies, one per budget in order, error replies included: the caller maps them (a
    /// cluster client reroutes `MOVED` / `ASK` ones). With `asking`, each call is preceded by
    /// `ASKING` (a cluster slot being imported by this node).
    pub(crate) async fn script_replies<'a, I>(
        &mut self,
        node: &str,
        lease_ttl_ms: u64,
        budgets: I,
        asking: bool,
        deadline: Duration,
    ) -> Result<&[BytesFrame], SyncError>
    where
        I: Iterator<Item = &'a BudgetSync> + Clone,
    {
        self.check_backoff()?;
        let res = monoio::time::timeout(
            deadline,
            self.script_replies_inner(node, lease_ttl_ms, budgets, asking),
        )
        .await;
        self.settle(res)?;
        Ok(&self.frames)
    }

    async fn script_replies_inner<'a, I>(
        &mut self,
        node: &str,
        lease_ttl_ms: u64,
        budgets: I,
        asking: bool,
    ) -> Result<(), SyncError>
    where
        I: Iterator<Item = &'a BudgetSync> + Clone,
    {
        self.ensure_connected().await?;
        let (Some(conn), Some(sha)) = (self.conn.as_mut(), self.sha.as_deref()) else {
            return Err(SyncError::Unavailable("not connected".into()));
        };
        let per_budget = if asking { 2 } else { 1 };
        let encode_all = |buf: &mut BytesMut| -> Result<usize, SyncError> {
            let mut n = 0;
            for b in budgets.clone() {
                if asking {
                    encode(buf, &[bulk(b"ASKING")])?;
                }
                encode_evalsha(buf, sha, node, lease_ttl_ms, b)?;
                n += 1;
            }
            Ok(n)
        };
        conn.wbuf.clear();
        let count = encode_all(&mut conn.wbuf)?;
        if let Err(e) = conn
            .round_trip(count * per_budget, &mut self.frames, &mut self.stats)
            .await
        {
            self.conn = None;
            return Err(e);
        }
        if self.frames.iter().any(is_noscript) {
            // Redis lost the script (restart, SCRIPT FLUSH, failover). Load it and run the whole
            // batch again in the same write: the exchange is idempotent (spend is a maximum, the
            // lease absolute), so budgets whose first run succeeded are not counted twice.
            conn.wbuf.clear();
            encode_script_load(&mut conn.wbuf)?;
            encode_all(&mut conn.wbuf)?;
            self.stats.script_loads += 1;
            if let Err(e) = conn
                .round_trip(count * per_budget + 1, &mut self.frames, &mut self.stats)
                .await
            {
                self.conn = None;
                return Err(e);
            }
            if self.frames.is_empty() {
                return Err(SyncError::Protocol("no SCRIPT LOAD reply".into()));
            }
            let loaded = script_sha(&self.frames.remove(0))?;
            if loaded != sha {
                return Err(SyncError::Protocol(format!(
                    "SCRIPT LOAD returned {loaded}, expected {sha}"
                )));
            }
        }
        if asking {
            // Keep the script's replies, drop the ASKING ones (+OK) before each.
            let mut i = 0;
            self.frames.retain(|_| {
                i += 1;
                i % 2 == 0
            });
        }
        Ok(())
    }
}

impl SyncBackend for RedisBackend {
    async fn warm_up(&mut self, deadline: Duration) {
        // Connecting sends AUTH, SELECT and SCRIPT LOAD; a PING rides along.
        let _ = self.command(&[b"PING"], deadline).await;
    }

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
        let replies = self
            .script_replies(node, lease_ttl_ms, batch.iter(), false, deadline)
            .await?;
        out.reserve(replies.len());
        for frame in replies {
            match budget_state(frame) {
                Ok(s) => out.push(s),
                Err(e) => {
                    out.clear();
                    return Err(e);
                }
            }
        }
        Ok(())
    }
}

/// One TCP connection and its buffers.
struct Conn {
    stream: TcpStream,
    /// Bytes read and not yet decoded.
    rbuf: BytesMut,
    /// The pipeline being built.
    wbuf: BytesMut,
}

impl Conn {
    fn new(stream: TcpStream) -> Conn {
        Conn {
            stream,
            rbuf: BytesMut::with_capacity(READ_CHUNK),
            wbuf: BytesMut::with_capacity(READ_CHUNK),
        }
    }

    /// Send `wbuf` in one write, then read exactly `replies` frames into `frames`. Any error
    /// leaves the connection unusable (the caller drops it).
    async fn round_trip(
        &mut self,
        replies: usize,
        frames: &mut Vec<BytesFrame>,
        stats: &mut RedisStats,
    ) -> Result<(), SyncError> {
        frames.clear();
        let wbuf = std::mem::take(&mut self.wbuf);
        stats.writes += 1;
        let (res, mut wbuf) = self.stream.write_all(wbuf).await;
        wbuf.clear();
        self.wbuf = wbuf;
        if let Err(e) = res {
            return Err(SyncError::Unavailable(format!("write: {e}")));
        }
        self.read_replies(replies, frames).await?;
        stats.round_trips += 1;
        Ok(())
    }

    async fn read_replies(
        &mut self,
        replies: usize,
        frames: &mut Vec<BytesFrame>,
    ) -> Result<(), SyncError> {
        loop {
            while frames.len() < replies {
                match decode_bytes_mut(&mut self.rbuf) {
                    Ok(Some((frame, _, _))) => frames.push(frame),
                    Ok(None) => break,
                    Err(e) => return Err(SyncError::Protocol(format!("undecodable reply: {e:?}"))),
                }
            }
            if frames.len() == replies {
                // RESP2 sends nothing unasked: more bytes mean the stream is out of step.
                if !self.rbuf.is_empty() {
                    return Err(SyncError::Protocol(
                        "unexpected bytes after the replies".into(),
                    ));
                }
                return Ok(());
            }
            if self.rbuf.len() >= MAX_REPLY_BYTES {
                return Err(SyncError::Protocol(format!(
                    "reply larger than {MAX_REPLY_BYTES} bytes"
                )));
            }
            self.rbuf.reserve(READ_CHUNK);
            let rbuf = std::mem::take(&mut self.rbuf);
            let len = rbuf.len();
            let (res, slice) = self.stream.read(rbuf.slice_mut(len..)).await;
            self.rbuf = slice.into_inner();
            match res {
                Ok(0) => return Err(SyncError::Unavailable("connection closed by Redis".into())),
                Ok(_) => {}
                Err(e) => return Err(SyncError::Unavailable(format!("read: {e}"))),
            }
        }
    }
}

/// Reconnect delay state.
struct Backoff {
    /// The delay the next failure starts.
    next: Duration,
    /// No connect before this.
    until: Option<Instant>,
    /// Why the last connection was lost (reported while waiting).
    reason: String,
}

impl Default for Backoff {
    fn default() -> Backoff {
        Backoff {
            next: BACKOFF_MIN,
            until: None,
            reason: String::new(),
        }
    }
}

impl Backoff {
    fn fail(&mut self, now: Instant, why: &SyncError) {
        self.until = Some(now + self.next);
        self.next = (self.next * 2).min(BACKOFF_MAX);
        self.reason = why.to_string();
    }

    fn reset(&mut self) {
        self.next = BACKOFF_MIN;
        self.until = None;
    }
}

fn bulk(b: &[u8]) -> BorrowedFrame<'_> {
    BorrowedFrame::BulkString(b)
}

/// Append one command (an array of bulk strings; integers are sent as bulk strings too).
fn encode(buf: &mut BytesMut, args: &[BorrowedFrame<'_>]) -> Result<(), SyncError> {
    extend_encode_borrowed(buf, &BorrowedFrame::Array(args), true)
        .map(|_| ())
        .map_err(|e| SyncError::Protocol(format!("encode: {e:?}")))
}

fn encode_script_load(buf: &mut BytesMut) -> Result<(), SyncError> {
    encode(
        buf,
        &[
            bulk(b"SCRIPT"),
            bulk(b"LOAD"),
            bulk(LEDGER_SCRIPT.as_bytes()),
        ],
    )
}

fn encode_evalsha(
    buf: &mut BytesMut,
    sha: &str,
    node: &str,
    lease_ttl_ms: u64,
    b: &BudgetSync,
) -> Result<(), SyncError> {
    // MAX_EXACT < i64::MAX, so the conversion can't fail after the cap.
    let int = |v: u64| BorrowedFrame::Integer(i64::try_from(v.min(MAX_EXACT)).unwrap_or(0));
    let shortfall_ttl = super::ledger::shortfall_ttl_ms(lease_ttl_ms);
    match &b.slide {
        None => encode(
            buf,
            &[
                bulk(b"EVALSHA"),
                bulk(sha.as_bytes()),
                bulk(b"1"),
                bulk(b.key.as_bytes()),
                bulk(node.as_bytes()),
                int(b.limit),
                int(b.spent),
                int(b.lease),
                int(b.floor),
                int(b.key_ttl_ms),
                int(lease_ttl_ms),
                int(b.shortfall),
                int(shortfall_ttl),
            ],
        ),
        Some(slide) => encode(
            buf,
            &[
                bulk(b"EVALSHA"),
                bulk(sha.as_bytes()),
                bulk(b"2"),
                bulk(b.key.as_bytes()),
                bulk(slide.prev_key.as_bytes()),
                bulk(node.as_bytes()),
                int(b.limit),
                int(b.spent),
                int(b.lease),
                int(b.floor),
                int(b.key_ttl_ms),
                int(lease_ttl_ms),
                int(b.shortfall),
                int(shortfall_ttl),
                int(slide.max),
                int(slide.overlap_ms.min(slide.window_ms)),
                int(slide.window_ms.max(1)),
            ],
        ),
    }
}

fn is_noscript(frame: &BytesFrame) -> bool {
    matches!(frame, BytesFrame::Error(e) if e.starts_with("NOSCRIPT"))
}

/// The SHA1 in a `SCRIPT LOAD` reply.
fn script_sha(frame: &BytesFrame) -> Result<String, SyncError> {
    match frame {
        BytesFrame::BulkString(b) if b.len() == 40 && b.iter().all(u8::is_ascii_hexdigit) => {
            Ok(String::from_utf8_lossy(b).into_owned())
        }
        BytesFrame::Error(e) => Err(SyncError::Protocol(format!("SCRIPT LOAD failed: {e}"))),
        other => Err(SyncError::Protocol(format!(
            "SCRIPT LOAD: unexpected reply {}",
            describe(other)
        ))),
    }
}

/// One script reply: `{granted, spent_total, leased_others, wanted_others, prev_total}`.
pub(crate) fn budget_state(frame: &BytesFrame) -> Result<BudgetState, SyncError> {
    let num = |f: &BytesFrame| match f {
        BytesFrame::Integer(i) => u64::try_from(*i).ok(),
        _ => None,
    };
    match frame {
        BytesFrame::Array(items) => match items.as_slice() {
            [g, s, l, w, p] => match (num(g), num(s), num(l), num(w), num(p)) {
                (
                    Some(granted),
                    Some(spent_total),
                    Some(leased_others),
                    Some(wanted_others),
                    Some(prev_total),
                ) => Ok(BudgetState {
                    granted,
                    spent_total,
                    leased_others,
                    wanted_others,
                    prev_total,
                }),
                _ => Err(SyncError::Protocol(
                    "ledger reply holds a non-integer or negative value".into(),
                )),
            },
            _ => Err(SyncError::Protocol(format!(
                "ledger reply has {} elements, expected 5",
                items.len()
            ))),
        },
        BytesFrame::Error(e) => Err(SyncError::Protocol(format!("ledger script failed: {e}"))),
        other => Err(SyncError::Protocol(format!(
            "ledger: unexpected reply {}",
            describe(other)
        ))),
    }
}

/// A short description of a reply for error messages (never its whole content).
fn describe(frame: &BytesFrame) -> String {
    match frame {
        BytesFrame::SimpleString(s) | BytesFrame::BulkString(s) => {
            let head = String::from_utf8_lossy(&s[..s.len().min(40)]).into_owned();
            format!("string {head:?} ({} bytes)", s.len())
        }
        BytesFrame::Error(e) => format!("error {:?}", e.chars().take(80).collect::<String>()),
        BytesFrame::Integer(i) => format!("integer {i}"),
        BytesFrame::Array(a) => format!("array of {}", a.len()),
        BytesFrame::Null => "null".into(),
    }
}

/// A real `redis-server` for tests (this module's and the cluster client's).
#[cfg(test)]
pub(crate) mod testing {
    // Tests: unwraps state expectations; sleeps run on the test thread, not on a worker.
    #![allow(clippy::unwrap_used, clippy::expect_used, clippy::disallowed_methods)]

    use std::io::{BufRead, BufReader, Write};
    use std::net::{SocketAddr, TcpListener, TcpStream as StdStream};
    use std::process::{Child, Command, Stdio};
    use std::thread;
    use std::time::{Duration, Instant};

    use super::{RedisBackend, RedisSettings};

    /// A `redis-server` of our own on a free loopback port, killed (by PID) when dropped.
    pub(crate) struct Server {
        pub(crate) child: Option<Child>,
        pub(crate) port: u16,
        pub(crate) extra: Vec<String>,
    }

    pub(crate) fn free_port() -> u16 {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap().port()
    }

    impl Server {
        pub(crate) fn start(extra: &[&str]) -> Server {
            let mut s = Server {
                child: None,
                port: free_port(),
                extra: extra.iter().map(|s| s.to_string()).collect(),
            };
            s.restart();
            s
        }

        /// (Re)start on the same port, empty (no persistence), and wait until it answers.
        pub(crate) fn restart(&mut self) {
            let child = Command::new("redis-server")
                .args(["--port", &self.port.to_string(), "--bind", "127.0.0.1"])
                .args(["--save", "", "--appendonly", "no"])
                .args(["--enable-debug-command", "local"])
                .args(["--dir", &std::env::temp_dir().to_string_lossy()])
                .args(&self.extra)
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .spawn()
                .expect("redis-server must be installed (scripts/test.sh installs it)");
            self.child = Some(child);
            let until = Instant::now() + Duration::from_secs(10);
            while Instant::now() < until {
                if let Ok(mut s) = StdStream::connect(self.addr()) {
                    let _ = s.set_read_timeout(Some(Duration::from_secs(1)));
                    let mut line = String::new();
                    let answered = s.write_all(b"PING\r\n").is_ok()
                        && BufReader::new(s).read_line(&mut line).is_ok();
                    // +PONG, or -NOAUTH with requirepass: either way it is serving.
                    if answered && (line.starts_with('+') || line.starts_with('-')) {
                        return;
                    }
                }
                thread::sleep(Duration::from_millis(20));
            }
            panic!("redis-server on port {} did not come up", self.port);
        }

        pub(crate) fn stop(&mut self) {
            if let Some(mut c) = self.child.take() {
                let _ = c.kill();
                let _ = c.wait();
            }
        }

        pub(crate) fn addr(&self) -> SocketAddr {
            SocketAddr::from(([127, 0, 0, 1], self.port))
        }

        pub(crate) fn backend(&self) -> RedisBackend {
            RedisBackend::new(RedisSettings::new(self.addr()))
        }
    }

    impl Drop for Server {
        fn drop(&mut self) {
            self.stop();
        }
    }
}

#[cfg(test)]
mod tests {
    // Tests: unwraps state expectations; sleeps run on the test thread, not on a worker.
    #![allow(clippy::unwrap_used, clippy::expect_used, clippy::disallowed_methods)]

    use std::io::{BufRead, BufReader, Read, Write};
    use std::net::{TcpListener, TcpStream as StdStream};
    use std::thread;

    use super::super::ledger::conformance::{self, block_on, budget};
    use super::super::ledger::InProcessLedger;
    use super::testing::{free_port, Server};
    use super::*;

    const DEADLINE: Duration = Duration::from_millis(500);

    async fn exchange(
        b: &mut RedisBackend,
        node: &str,
        batch: &[BudgetSync],
        deadline: Duration,
    ) -> Result<Vec<BudgetState>, SyncError> {
        let mut out = Vec::new();
        b.exchange(node, 60_000, batch, &mut out, deadline).await?;
        Ok(out)
    }

    /// Settings are passed around and may be printed with `{:?}`: never their password.
    #[test]
    fn debug_leaves_the_password_out() {
        let mut settings = RedisSettings::new(SocketAddr::from(([127, 0, 0, 1], 6379)));
        settings.password = Some("hunter2-redis".into());
        settings.username = Some("sluice".into());
        let shown = format!("{settings:?}");
        assert!(
            !shown.contains("hunter2-redis") && shown.contains("sluice"),
            "{shown}"
        );
        let mut cluster =
            super::super::redis_cluster::RedisClusterSettings::new(vec![settings.addr]);
        cluster.password = settings.password.clone();
        let shown = format!("{cluster:?}");
        assert!(
            !shown.contains("hunter2-redis") && shown.contains("<redacted>"),
            "{shown}"
        );
    }

    #[test]
    fn same_answers_as_the_in_process_ledger() {
        let server = Server::start(&[]);
        let mut redis = server.backend();
        let mut local = InProcessLedger::new();
        let (from_redis, from_local) = block_on(async {
            let r = conformance::scenario(&mut redis, "conf").await.unwrap();
            let l = conformance::scenario(&mut local, "conf").await.unwrap();
            (r, l)
        });
        assert_eq!(from_redis, from_local);
        // One connection served the whole scenario, one round trip per exchange.
        let stats = redis.stats();
        assert_eq!(stats.connects, 1);
        assert_eq!(stats.writes, stats.round_trips);
    }

    #[test]
    fn large_numbers_travel_exactly() {
        let server = Server::start(&[]);
        let mut b = server.backend();
        // 15 digits: more than Lua's own number-to-string conversion keeps.
        let big = 123_456_789_012_345u64;
        block_on(async {
            let batch = [budget("{big}", big * 4, big, big, 0)];
            let out = exchange(&mut b, "n", &batch, DEADLINE).await.unwrap();
            assert_eq!(out, vec![conformance::state(big, big, 0)]);
            let batch = [budget("{big}", big * 4, big + 1, big, 0)];
            let out = exchange(&mut b, "m", &batch, DEADLINE).await.unwrap();
            // available = 4·big − (2·big + 1) − big = big − 1: exact to the unit.
            assert_eq!(out, vec![conformance::state(big - 1, 2 * big + 1, big)]);
            // Values past 2^53 are capped rather than mangled.
            let batch = [budget("{huge}", u64::MAX, 0, u64::MAX, 0)];
            let out = exchange(&mut b, "n", &batch, DEADLINE).await.unwrap();
            assert_eq!(out[0].granted, MAX_EXACT);
        });
    }

    #[test]
    fn noscript_reloads_and_retries_within_the_exchange() {
        let server = Server::start(&[]);
        let mut b = server.backend();
        block_on(async {
            let out = exchange(&mut b, "n", &[budget("{ns}", 10, 1, 2, 0)], DEADLINE)
                .await
                .unwrap();
            assert_eq!(out, vec![conformance::state(2, 1, 0)]);
            let ok = b.command(&[b"SCRIPT", b"FLUSH"], DEADLINE).await.unwrap();
            assert_eq!(ok, BytesFrame::SimpleString("OK".into()));
            let before = b.stats();
            let batch = [budget("{ns}", 10, 3, 2, 0), budget("{ns2}", 10, 0, 4, 0)];
            let out = exchange(&mut b, "n", &batch, DEADLINE).await.unwrap();
            assert_eq!(
                out,
                vec![conformance::state(2, 3, 0), conformance::state(4, 0, 0)]
            );
            let after = b.stats();
            assert_eq!(after.script_loads, before.script_loads + 1, "reloaded once");
            assert_eq!(after.connects, before.connects, "on the same connection");
            assert_eq!(after.round_trips, before.round_trips + 2);
            // Loaded again: the next exchange is a single round trip.
            exchange(&mut b, "n", &batch, DEADLINE).await.unwrap();
            assert_eq!(b.stats().round_trips, after.round_trips + 1);
        });
    }

    #[test]
    fn restart_is_survived_and_the_ledger_refilled() {
        let mut server = Server::start(&[]);
        let mut a = server.backend();
        let mut b = server.backend();
        block_on(async {
            let out = exchange(&mut a, "a", &[budget("{r}", 100, 10, 5, 0)], DEADLINE)
                .await
                .unwrap();
            assert_eq!(out, vec![conformance::state(5, 10, 0)]);
            let out = exchange(&mut b, "b", &[budget("{r}", 100, 20, 5, 0)], DEADLINE)
                .await
                .unwrap();
            assert_eq!(out, vec![conformance::state(5, 30, 5)]);

            server.stop();
            let t = Instant::now();
            let err = exchange(&mut a, "a", &[budget("{r}", 100, 10, 5, 0)], DEADLINE)
                .await
                .unwrap_err();
            assert!(
                matches!(err, SyncError::Unavailable(_) | SyncError::Timeout),
                "{err:?}"
            );
            assert!(t.elapsed() < DEADLINE + Duration::from_millis(100));
            assert!(!a.is_connected());

            // In backoff: fails at once, without even trying to connect.
            let attempts = a.stats().connect_attempts;
            let t = Instant::now();
            let err = exchange(&mut a, "a", &[budget("{r}", 100, 10, 5, 0)], DEADLINE)
                .await
                .unwrap_err();
            assert!(
                matches!(err, SyncError::Unavailable(ref m) if m.contains("reconnecting")),
                "{err:?}"
            );
            assert!(t.elapsed() < Duration::from_millis(20));
            assert_eq!(a.stats().connect_attempts, attempts);

            // Back, empty: each node's next exchange refills its spend; nothing counts twice.
            server.restart();
            let t = Instant::now();
            let out = loop {
                match exchange(&mut a, "a", &[budget("{r}", 100, 12, 5, 0)], DEADLINE).await {
                    Ok(out) => break out,
                    Err(_) if t.elapsed() < Duration::from_secs(5) => {
                        monoio::time::sleep(Duration::from_millis(10)).await
                    }
                    Err(e) => panic!("no reconnect within 5 s: {e:?}"),
                }
            };
            assert_eq!(out, vec![conformance::state(5, 12, 0)]);
            let out = loop {
                match exchange(&mut b, "b", &[budget("{r}", 100, 20, 5, 0)], DEADLINE).await {
                    Ok(out) => break out,
                    Err(_) if t.elapsed() < Duration::from_secs(5) => {
                        monoio::time::sleep(Duration::from_millis(10)).await
                    }
                    Err(e) => panic!("no reconnect within 5 s: {e:?}"),
                }
            };
            assert_eq!(out, vec![conformance::state(5, 32, 5)]);
        });
    }

    #[test]
    fn backoff_doubles_while_redis_is_down_and_resets_on_success() {
        let port = free_port();
        let mut b = RedisBackend::new(RedisSettings::new(SocketAddr::from(([127, 0, 0, 1], port))));
        let batch = [budget("{down}", 1, 0, 1, 0)];
        block_on(async {
            let mut expect_attempts = 0;
            for delay in [50u64, 100, 200, 400].map(Duration::from_millis) {
                let err = exchange(&mut b, "n", &batch, DEADLINE).await.unwrap_err();
                let failed = Instant::now();
                assert!(matches!(err, SyncError::Unavailable(_)), "{err:?}");
                expect_attempts += 1;
                assert_eq!(b.stats().connect_attempts, expect_attempts);
                // Halfway through the delay it doesn't try (checked only when this thread
                // really woke up well before the delay's end: the machine may be busy).
                monoio::time::sleep(delay / 2).await;
                if failed.elapsed() + Duration::from_millis(10) < delay {
                    let err = exchange(&mut b, "n", &batch, DEADLINE).await.unwrap_err();
                    assert!(
                        matches!(err, SyncError::Unavailable(ref m) if m.contains("reconnecting"))
                    );
                    assert_eq!(
                        b.stats().connect_attempts,
                        expect_attempts,
                        "retried before {delay:?}"
                    );
                }
                // Once it is over, the next exchange tries again (the loop's next turn).
                monoio::time::sleep(delay / 2 + Duration::from_millis(5)).await;
            }
            // Up now: the next try connects, and the delay starts over at the minimum.
            let mut server = Server {
                child: None,
                port,
                extra: Vec::new(),
            };
            server.restart();
            exchange(&mut b, "n", &batch, DEADLINE).await.unwrap();
            server.stop();
            assert!(exchange(&mut b, "n", &batch, DEADLINE).await.is_err());
            monoio::time::sleep(BACKOFF_MIN + Duration::from_millis(10)).await;
            let attempts = b.stats().connect_attempts;
            assert!(exchange(&mut b, "n", &batch, DEADLINE).await.is_err());
            assert_eq!(b.stats().connect_attempts, attempts + 1);
        });
    }

    #[test]
    fn slow_redis_times_out_within_the_deadline() {
        let server = Server::start(&[]);
        let mut b = server.backend();
        block_on(async {
            exchange(&mut b, "n", &[budget("{slow}", 10, 0, 1, 0)], DEADLINE)
                .await
                .unwrap();
            let addr = server.addr();
            let sleeper = thread::spawn(move || {
                let mut s = StdStream::connect(addr).unwrap();
                s.write_all(b"DEBUG SLEEP 0.5\r\n").unwrap();
                let mut line = String::new();
                BufReader::new(s).read_line(&mut line).unwrap();
                line
            });
            // Let the sleep start before the exchange is sent.
            monoio::time::sleep(Duration::from_millis(100)).await;
            let deadline = Duration::from_millis(150);
            let t = Instant::now();
            let err = exchange(&mut b, "n", &[budget("{slow}", 10, 0, 1, 0)], deadline)
                .await
                .unwrap_err();
            let took = t.elapsed();
            assert_eq!(err, SyncError::Timeout);
            assert!(
                took >= deadline && took < deadline + Duration::from_millis(100),
                "{took:?}"
            );
            assert!(!b.is_connected(), "a half-read pipeline is dropped");
            assert_eq!(sleeper.join().unwrap(), "+OK\r\n");
            monoio::time::sleep(BACKOFF_MIN).await;
            let out = exchange(&mut b, "n", &[budget("{slow}", 10, 0, 1, 0)], DEADLINE)
                .await
                .unwrap();
            assert_eq!(out, vec![conformance::state(1, 0, 0)]);
        });
    }

    /// A TCP relay that holds every chunk from the client for `delay` before passing it on:
    /// each client round trip costs at least `delay`. Serves one connection.
    fn delaying_proxy(to: SocketAddr, delay: Duration) -> SocketAddr {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        thread::spawn(move || {
            let (mut client, _) = listener.accept().unwrap();
            let mut server = StdStream::connect(to).unwrap();
            let (mut c2, mut s2) = (client.try_clone().unwrap(), server.try_clone().unwrap());
            thread::spawn(move || {
                let _ = std::io::copy(&mut s2, &mut c2);
            });
            let mut buf = vec![0u8; 64 * 1024];
            while let Ok(n) = client.read(&mut buf) {
                if n == 0 {
                    break;
                }
                thread::sleep(delay);
                if server.write_all(&buf[..n]).is_err() {
                    break;
                }
            }
            let _ = server.shutdown(std::net::Shutdown::Both);
        });
        addr
    }

    #[test]
    fn a_batch_of_200_is_one_write_and_one_round_trip() {
        let server = Server::start(&[]);
        let delay = Duration::from_millis(50);
        let mut b = RedisBackend::new(RedisSettings::new(delaying_proxy(server.addr(), delay)));
        let batch: Vec<BudgetSync> = (0..200)
            .map(|i| budget(&format!("{{p{i}}}"), 1_000, i, i + 1, 0))
            .collect();
        block_on(async {
            // Connect and load the script first.
            exchange(&mut b, "n", &batch[..1], Duration::from_secs(2))
                .await
                .unwrap();
            let before = b.stats();
            let t = Instant::now();
            let out = exchange(&mut b, "n", &batch, Duration::from_secs(5))
                .await
                .unwrap();
            let took = t.elapsed();
            let after = b.stats();
            assert_eq!(after.writes - before.writes, 1);
            assert_eq!(after.round_trips - before.round_trips, 1);
            // 200 sequential round trips through the relay would take 200 × 50 ms.
            assert!(took < delay * 8, "took {took:?}");
            let expect: Vec<BudgetState> =
                (0..200).map(|i| conformance::state(i + 1, i, 0)).collect();
            assert_eq!(out, expect);
        });
    }

    #[test]
    fn auth_and_select() {
        let server = Server::start(&["--requirepass", "s3cret"]);
        let settings = |password: Option<&str>, username: Option<&str>, db: u32| RedisSettings {
            password: password.map(str::to_owned),
            username: username.map(str::to_owned),
            db,
            ..RedisSettings::new(server.addr())
        };
        block_on(async {
            let batch = [budget("{auth}", 10, 1, 1, 0)];
            // No password: the script load is refused.
            let mut b = RedisBackend::new(settings(None, None, 0));
            let err = exchange(&mut b, "n", &batch, DEADLINE).await.unwrap_err();
            assert!(
                matches!(err, SyncError::Protocol(ref m) if m.contains("NOAUTH")),
                "{err:?}"
            );
            // A wrong password: AUTH fails, and the message does not carry it.
            let mut b = RedisBackend::new(settings(Some("wrong"), None, 0));
            let err = exchange(&mut b, "n", &batch, DEADLINE).await.unwrap_err();
            assert!(
                matches!(err, SyncError::Protocol(ref m) if m.starts_with("AUTH failed") && !m.contains("wrong")),
                "{err:?}"
            );
            assert!(!b.is_connected());
            // The password, then user + password, in database 3.
            let mut b = RedisBackend::new(settings(Some("s3cret"), None, 0));
            exchange(&mut b, "n", &batch, DEADLINE).await.unwrap();
            let mut b3 = RedisBackend::new(settings(Some("s3cret"), Some("default"), 3));
            exchange(&mut b3, "n", &[budget("{db3}", 10, 1, 1, 0)], DEADLINE)
                .await
                .unwrap();
            assert_eq!(exists(&mut b3, "{db3}").await, BytesFrame::Integer(1));
            assert_eq!(exists(&mut b, "{db3}").await, BytesFrame::Integer(0));
            assert_eq!(exists(&mut b, "{auth}").await, BytesFrame::Integer(1));
        });
    }

    async fn exists(b: &mut RedisBackend, key: &str) -> BytesFrame {
        b.command(&[b"EXISTS", key.as_bytes()], DEADLINE)
            .await
            .unwrap()
    }

    /// A fake server: answers each chunk it reads with the next of `replies`, then waits for
    /// the client to close.
    fn fake_server(replies: Vec<Vec<u8>>) -> SocketAddr {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        thread::spawn(move || {
            let (mut s, _) = listener.accept().unwrap();
            let mut buf = vec![0u8; 64 * 1024];
            for reply in replies {
                if matches!(s.read(&mut buf), Ok(0) | Err(_)) || s.write_all(&reply).is_err() {
                    return;
                }
            }
            while matches!(s.read(&mut buf), Ok(n) if n > 0) {}
        });
        addr
    }

    fn sha_reply() -> Vec<u8> {
        format!("$40\r\n{}\r\n", "a".repeat(40)).into_bytes()
    }

    #[test]
    fn oversized_and_malformed_replies_are_refused() {
        let batch = [budget("{x}", 10, 0, 1, 0)];
        let mut huge = b"$2097152\r\n".to_vec();
        huge.resize(huge.len() + (2 << 20), b'x');
        huge.extend_from_slice(b"\r\n");
        let cases: Vec<(Vec<u8>, &str)> = vec![
            (huge, "larger than"),
            (b"?what\r\n".to_vec(), "undecodable"),
            (b":1\r\n:2\r\n".to_vec(), "unexpected bytes"),
        ];
        for (reply, expect) in cases {
            let addr = fake_server(vec![sha_reply(), reply]);
            let mut b = RedisBackend::new(RedisSettings::new(addr));
            let err = block_on(exchange(&mut b, "n", &batch, DEADLINE)).unwrap_err();
            assert!(
                matches!(err, SyncError::Protocol(ref m) if m.contains(expect)),
                "{expect}: {err:?}"
            );
            assert!(
                !b.is_connected(),
                "{expect}: a stream out of step is dropped"
            );
        }
    }

    #[test]
    fn wrong_shapes_are_protocol_errors_on_a_kept_connection() {
        let batch = [budget("{x}", 10, 0, 1, 0)];
        let addr = fake_server(vec![
            sha_reply(),
            b":5\r\n".to_vec(),
            b"*2\r\n:1\r\n:2\r\n".to_vec(),
            b"*5\r\n:1\r\n:-2\r\n:3\r\n:0\r\n:0\r\n".to_vec(),
            b"-ERR user_script:1: boom\r\n".to_vec(),
            b"*5\r\n:1\r\n:2\r\n:3\r\n:0\r\n:0\r\n".to_vec(),
        ]);
        let mut b = RedisBackend::new(RedisSettings::new(addr));
        block_on(async {
            for expect in ["integer 5", "2 elements", "negative", "boom"] {
                let err = exchange(&mut b, "n", &batch, DEADLINE).await.unwrap_err();
                assert!(
                    matches!(err, SyncError::Protocol(ref m) if m.contains(expect)),
                    "{expect}: {err:?}"
                );
                assert!(b.is_connected());
            }
            let out = exchange(&mut b, "n", &batch, DEADLINE).await.unwrap();
            assert_eq!(out, vec![conformance::state(1, 2, 3)]);
            assert_eq!(b.stats().connects, 1);
        });
    }

    #[test]
    fn an_unreachable_address_is_unavailable_within_the_connect_timeout() {
        // A non-routable address (TEST-NET-1): the SYN goes nowhere.
        let mut settings = RedisSettings::new(SocketAddr::from(([192, 0, 2, 1], 6379)));
        settings.connect_timeout = Duration::from_millis(100);
        let mut b = RedisBackend::new(settings);
        let t = Instant::now();
        let err = block_on(exchange(
            &mut b,
            "n",
            &[budget("{x}", 1, 0, 1, 0)],
            DEADLINE,
        ))
        .unwrap_err();
        assert!(matches!(err, SyncError::Unavailable(_)), "{err:?}");
        assert!(t.elapsed() < Duration::from_millis(300));
    }
}

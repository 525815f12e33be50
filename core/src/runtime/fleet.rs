//! Breakers shared by the fleet (`[routing] share_breakers`): one thread per process that, every
//! `limits.sync_interval_ms`, tells the limits Redis which backends this node's breakers hold
//! open, and opens its own breakers for backends another node found failing — so one node's
//! discovery protects every node within an interval or two.
//!
//! Started by the runtime; the control thread hands it a new plan on each reload
//! ([`Fleet::replan`]); with sharing off the plan is empty and the thread idles. It runs off the
//! workers with blocking sockets bounded by timeouts (connect: `limits.redis.connect_timeout_ms`;
//! each exchange: one second), so Redis being slow or down delays only the sharing — each node's
//! own breakers work as before.
//!
//! In Redis each backend has one key, `{<key_prefix>:breakers}:<identity>` (one hash slot, so a
//! Redis Cluster keeps them on one node; a `MOVED` reply is followed), holding the Unix time in
//! ms its breaker is open until, expiring then. Per interval, in one pipelined round trip:
//! - a breaker this node opened (a trip of its own, or a re-trip after a failed half-open probe)
//!   is `SET` with its open time;
//! - a breaker this node closed after having published or adopted it is `DEL`eted, so the fleet
//!   sees the recovery;
//! - every key is read (`MGET`): a key that says open while this node's breaker is closed opens
//!   it until then (not a trip of its own: its back-off is not raised, and it is not published
//!   again). Past that time the backend goes half-open here, and this node's own probe decides.

use std::io::{Read as _, Write as _};
use std::net::{SocketAddr, TcpStream};
use std::sync::{mpsc, Arc};
use std::time::{Duration, Instant};

use bytes::BytesMut;
use redis_protocol::resp2::decode::decode_bytes_mut;
use redis_protocol::resp2::encode::extend_encode_borrowed;
use redis_protocol::resp2::types::{BorrowedFrame, BytesFrame};

use crate::config::limits::RedisSettings;
use crate::config::Snapshot;
use crate::upstream::health::{BackendHealth, HealthTable};

/// One backend's breaker as the fleet knows it.
struct Entry {
    key: String,
    health: Arc<BackendHealth>,
    /// The open time (Unix ms) this node last wrote or adopted; 0: none.
    shared_until: u64,
    /// The local open time ([`mono_ms`](crate::sys::time::mono_ms)) a fleet key set here, while
    /// it stands; 0: none.
    adopted: u64,
}

#[derive(Default)]
struct Plan {
    redis: Option<RedisSettings>,
    interval: Duration,
    entries: Vec<Entry>,
}

/// The handle the control thread keeps.
pub(crate) struct Fleet {
    plans: mpsc::Sender<Plan>,
}

/// The most one exchange (connect excluded) may take.
const IO_TIMEOUT: Duration = Duration::from_secs(1);
/// The largest reply accepted: a few bytes per backend.
const MAX_REPLY: usize = 1 << 20;

impl Fleet {
    pub(crate) fn start(snapshot: &Snapshot, health: &HealthTable) -> std::io::Result<Fleet> {
        let (plans, receiver) = mpsc::channel();
        let fleet = Fleet { plans };
        fleet.replan(snapshot, health);
        std::thread::Builder::new()
            .name("sluice-fleet".into())
            .spawn(move || run(&receiver))?;
        Ok(fleet)
    }

    /// Share what `snapshot` says, for the backends of `health`.
    pub(crate) fn replan(&self, snapshot: &Snapshot, health: &HealthTable) {
        let redis = snapshot
            .limits
            .sync
            .redis
            .clone()
            .filter(|_| snapshot.routing.share_breakers);
        let mut entries = Vec::new();
        if let Some(redis) = &redis {
            for cluster in &snapshot.clusters {
                for backend in &cluster.backends {
                    let Some(h) = health.shared(backend.id) else {
                        continue;
                    };
                    entries.push(Entry {
                        key: key_of(&redis.key_prefix, health.identity(backend.id)),
                        health: h,
                        shared_until: 0,
                        adopted: 0,
                    });
                }
            }
        }
        // The thread ends with the process; a send cannot fail before that.
        let _ = self.plans.send(Plan {
            redis,
            interval: snapshot.limits.sync.interval,
            entries,
        });
    }
}

fn key_of(prefix: &str, identity: u64) -> String {
    format!("{{{prefix}:breakers}}:{identity:016x}")
}

fn run(plans: &mpsc::Receiver<Plan>) {
    let mut plan = Plan::default();
    let mut conn: Option<Conn> = None;
    let mut next = Instant::now();
    let mut failing = false;
    loop {
        let wait = if plan.redis.is_some() {
            next.saturating_duration_since(Instant::now())
        } else {
            Duration::from_secs(3600)
        };
        match plans.recv_timeout(wait) {
            Ok(new) => {
                plan = new;
                conn = None;
                continue;
            }
            Err(mpsc::RecvTimeoutError::Timeout) => {}
            Err(mpsc::RecvTimeoutError::Disconnected) => return,
        }
        next = Instant::now() + plan.interval.max(Duration::from_millis(10));
        let Some(redis) = plan.redis.as_ref() else {
            continue;
        };
        match exchange(&mut conn, redis, &mut plan.entries) {
            Ok(()) if failing => {
                failing = false;
                eprintln!("sluice: breaker sharing: Redis reachable again");
            }
            Ok(()) => {}
            Err(e) => {
                conn = None;
                if !failing {
                    failing = true;
                    eprintln!("sluice: breaker sharing: {e} (each node's breakers still work)");
                }
            }
        }
    }
}

/// One round trip: this node's news out, the fleet's state in.
fn exchange(
    conn: &mut Option<Conn>,
    redis: &RedisSettings,
    entries: &mut [Entry],
) -> Result<(), String> {
    let now_mono = crate::sys::time::mono_ms();
    let now_unix = crate::sys::time::unix_ms();
    let mut out = BytesMut::new();
    let mut writes = 0;
    // Per entry, what this exchange tells the fleet: Some(until) a SET, Some(0) a DEL.
    let mut told = vec![None; entries.len()];
    for (entry, told) in entries.iter().zip(told.iter_mut()) {
        let until = entry.health.open_until();
        if until == 0 {
            if entry.shared_until != 0 {
                encode(&mut out, &[b"DEL", entry.key.as_bytes()])?;
                writes += 1;
                *told = Some(0);
            }
            continue;
        }
        // Open here: published when it is a trip newer than what the fleet was told or had (a
        // clock's rounding aside). Half-open (its open time past) is nothing new.
        let ttl = until.saturating_sub(now_mono);
        let until_unix = now_unix + ttl;
        if ttl > 0 && until_unix > entry.shared_until + 100 {
            let value = until_unix.to_string();
            let ttl = ttl.to_string();
            encode(
                &mut out,
                &[
                    b"SET",
                    entry.key.as_bytes(),
                    value.as_bytes(),
                    b"PX",
                    ttl.as_bytes(),
                ],
            )?;
            writes += 1;
            *told = Some(until_unix);
        }
    }
    let mut mget: Vec<&[u8]> = Vec::with_capacity(entries.len() + 1);
    mget.push(b"MGET");
    mget.extend(entries.iter().map(|e| e.key.as_bytes()));
    encode(&mut out, &mget)?;
    let replies = round_trip(conn, redis, &out, writes + 1)?;
    // What was told is what the fleet now has, whatever the breaker did meanwhile (a close
    // during the round trip is told by the next exchange's DEL).
    for (entry, told) in entries.iter_mut().zip(&told) {
        if let Some(until) = told {
            entry.shared_until = *until;
            if *until != 0 {
                entry.adopted = 0;
            }
        }
    }
    let Some(BytesFrame::Array(values)) = replies.last() else {
        return Err("MGET: unexpected reply".into());
    };
    for (entry, value) in entries.iter_mut().zip(values) {
        let until_unix = match value {
            BytesFrame::BulkString(b) => std::str::from_utf8(b)
                .ok()
                .and_then(|s| s.parse::<u64>().ok()),
            _ => None,
        }
        .filter(|&u| u > now_unix);
        match until_unix {
            Some(until_unix) => {
                let until = now_mono + (until_unix - now_unix);
                if entry.health.open_from_fleet(until) {
                    entry.shared_until = until_unix;
                    entry.adopted = until;
                }
            }
            // The node that opened it saw the backend recover (or its time ran out): a breaker
            // held open only by the fleet's word goes half-open here, and a request decides.
            None if entry.adopted != 0 => {
                entry.health.end_fleet_open(entry.adopted, now_mono);
                entry.adopted = 0;
                entry.shared_until = 0;
            }
            None => {}
        }
    }
    Ok(())
}

fn encode(out: &mut BytesMut, args: &[&[u8]]) -> Result<(), String> {
    let frames: Vec<BorrowedFrame<'_>> =
        args.iter().map(|a| BorrowedFrame::BulkString(a)).collect();
    extend_encode_borrowed(out, &BorrowedFrame::Array(&frames), true)
        .map(|_| ())
        .map_err(|e| format!("encode: {e:?}"))
}

/// A blocking connection to the limits Redis (this thread's own).
struct Conn {
    stream: TcpStream,
    addr: SocketAddr,
}

/// Send `request` (`replies` commands) and read their replies, connecting (and following one
/// `MOVED`) as needed.
fn round_trip(
    conn: &mut Option<Conn>,
    redis: &RedisSettings,
    request: &[u8],
    replies: usize,
) -> Result<Vec<BytesFrame>, String> {
    let mut target = conn.as_ref().map_or(redis.address, |c| c.addr);
    for _ in 0..2 {
        if conn.as_ref().is_none_or(|c| c.addr != target) {
            *conn = Some(connect(redis, target)?);
        }
        let Some(c) = conn.as_mut() else {
            return Err("not connected".into());
        };
        let frames = send(&mut c.stream, request, replies)?;
        // A Redis Cluster whose slot for the breakers moved: go there.
        let moved = frames.iter().find_map(|f| match f {
            BytesFrame::Error(e) if e.starts_with("MOVED ") => {
                e.split_whitespace().nth(2).and_then(|a| a.parse().ok())
            }
            _ => None,
        });
        match moved {
            Some(addr) => target = addr,
            None => {
                if let Some(BytesFrame::Error(e)) =
                    frames.iter().find(|f| matches!(f, BytesFrame::Error(_)))
                {
                    return Err(format!("Redis answered an error: {e}"));
                }
                return Ok(frames);
            }
        }
    }
    Err("Redis moved the breakers' slot twice in one exchange".into())
}

fn connect(redis: &RedisSettings, addr: SocketAddr) -> Result<Conn, String> {
    let mut stream =
        TcpStream::connect_timeout(&addr, redis.connect_timeout.max(Duration::from_millis(1)))
            .map_err(|e| format!("connect to {addr}: {e}"))?;
    let _ = stream.set_nodelay(true);
    let mut hello = BytesMut::new();
    let mut expect = 0;
    if let Some(password) = &redis.password {
        match &redis.username {
            Some(user) => encode(&mut hello, &[b"AUTH", user.as_bytes(), password.as_bytes()])?,
            None => encode(&mut hello, &[b"AUTH", password.as_bytes()])?,
        }
        expect += 1;
    }
    // A cluster has only database 0.
    if redis.db != 0 && redis.cluster_seeds.is_none() {
        let db = redis.db.to_string();
        encode(&mut hello, &[b"SELECT", db.as_bytes()])?;
        expect += 1;
    }
    if expect > 0 {
        for frame in send(&mut stream, &hello, expect)? {
            if let BytesFrame::Error(e) = frame {
                // Never the password: Redis's message names the problem.
                return Err(format!("AUTH / SELECT failed: {e}"));
            }
        }
    }
    Ok(Conn { stream, addr })
}

/// Write `request` and read `replies` frames, within [`IO_TIMEOUT`] in all.
fn send(stream: &mut TcpStream, request: &[u8], replies: usize) -> Result<Vec<BytesFrame>, String> {
    let deadline = Instant::now() + IO_TIMEOUT;
    let left = || {
        deadline
            .checked_duration_since(Instant::now())
            .filter(|d| !d.is_zero())
            .ok_or_else(|| "Redis did not answer within 1 s".to_string())
    };
    stream
        .set_write_timeout(Some(left()?))
        .and_then(|()| stream.write_all(request))
        .map_err(|e| format!("write: {e}"))?;
    let mut buf = BytesMut::with_capacity(4096);
    let mut frames = Vec::with_capacity(replies);
    let mut chunk = [0u8; 8192];
    while frames.len() < replies {
        match decode_bytes_mut(&mut buf) {
            Ok(Some((frame, _, _))) => {
                frames.push(frame);
                continue;
            }
            Ok(None) => {}
            Err(e) => return Err(format!("bad reply: {e:?}")),
        }
        if buf.len() > MAX_REPLY {
            return Err("reply too large".into());
        }
        stream
            .set_read_timeout(Some(left()?))
            .map_err(|e| format!("read: {e}"))?;
        match stream.read(&mut chunk) {
            Ok(0) => return Err("Redis closed the connection".into()),
            Ok(n) => buf.extend_from_slice(&chunk[..n]),
            Err(e) => return Err(format!("read: {e}")),
        }
    }
    Ok(frames)
}

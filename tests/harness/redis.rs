//! redis-server: a real one on a free port, and a small RESP client to look inside it.

use std::io::{self, BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use crate::client::IO_TIMEOUT;
use crate::process::{die_with_parent, free_port, kill_child, TempDir, STARTUP_TIMEOUT};

/// The `redis-server` binary: `/usr/bin/redis-server` (the Debian package `scripts/test.sh`
/// installs), else whatever `redis-server` is on the PATH.
pub fn redis_server_bin() -> PathBuf {
    let debian = PathBuf::from("/usr/bin/redis-server");
    if debian.is_file() {
        debian
    } else {
        PathBuf::from("redis-server")
    }
}

/// How a [`Redis`] runs.
#[derive(Clone, Debug, Default)]
pub struct RedisOpts {
    /// `--appendonly yes --appendfsync always`: every write is on disk (in the instance's temp
    /// dir) before it is acknowledged, so data survives [`Redis::kill`] + [`Redis::restart`].
    /// Off: `--save "" --appendonly no`, nothing is persisted.
    pub appendonly: bool,
    /// More `redis-server` arguments, e.g. `["--maxmemory", "10mb"]`.
    pub extra_args: Vec<String>,
}

/// A running `redis-server` on a free 127.0.0.1 port, with its own temp dir. Killed (by PID)
/// on drop, and with the test process. [`Redis::cmd`] and friends talk to it over one kept
/// connection (reopened after a restart).
pub struct Redis {
    child: Option<Child>,
    pub port: u16,
    pub addr: SocketAddr,
    opts: RedisOpts,
    dir: TempDir,
    conn: Mutex<Option<RedisClient>>,
}

impl Redis {
    /// Start a non-persistent Redis (`--save "" --appendonly no`).
    pub fn start() -> Redis {
        Self::start_with(RedisOpts::default())
    }

    /// Start a Redis that writes every command to its append-only file before answering.
    pub fn start_with_aof() -> Redis {
        Self::start_with(RedisOpts {
            appendonly: true,
            ..RedisOpts::default()
        })
    }

    pub fn start_with(opts: RedisOpts) -> Redis {
        let dir = TempDir::new("redis");
        // A port found free may be taken before redis-server binds it: try a few.
        let mut last_error = String::new();
        for _ in 0..5 {
            let port = free_port();
            match spawn_redis(&opts, dir.path(), port) {
                Ok(child) => {
                    return Redis {
                        child: Some(child),
                        port,
                        addr: SocketAddr::from(([127, 0, 0, 1], port)),
                        opts,
                        dir,
                        conn: Mutex::new(None),
                    }
                }
                Err(e) => last_error = e,
            }
        }
        panic!("redis-server did not start: {last_error}");
    }

    /// `redis://127.0.0.1:PORT`.
    pub fn url(&self) -> String {
        format!("redis://{}", self.addr)
    }

    /// The server's temp dir (its `--dir`: append-only files and the log live here).
    pub fn dir(&self) -> &Path {
        self.dir.path()
    }

    /// The PID of the running server, if it runs.
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    /// Whether the server process is still running.
    pub fn is_running(&mut self) -> bool {
        self.child
            .as_mut()
            .is_some_and(|c| matches!(c.try_wait(), Ok(None)))
    }

    /// SIGKILL the server (a crash: no shutdown, no final save) and reap it. The port is free
    /// afterwards; connections to it are refused until [`Redis::restart`].
    pub fn kill(&mut self) {
        *self.conn.lock().unwrap() = None;
        if let Some(mut child) = self.child.take() {
            // SAFETY: kill(2) on the PID of a child we have not reaped yet, so it is ours.
            unsafe {
                libc::kill(child.id() as libc::pid_t, libc::SIGKILL);
            }
            let _ = child.wait();
        }
    }

    /// Start the server again on the same port with the same options and dir (killing it first
    /// if it still runs), and wait until it answers PING. With [`RedisOpts::appendonly`] the
    /// data written before comes back from the append-only file.
    pub fn restart(&mut self) {
        self.kill();
        let started = Instant::now();
        loop {
            match spawn_redis(&self.opts, self.dir.path(), self.port) {
                Ok(child) => {
                    self.child = Some(child);
                    return;
                }
                // The old socket may linger for a moment; the port must stay the same.
                Err(e) if started.elapsed() < STARTUP_TIMEOUT => {
                    eprintln!("redis restart on port {} failed, retrying: {e}", self.port);
                    std::thread::sleep(Duration::from_millis(100));
                }
                Err(e) => panic!("redis-server did not restart on port {}: {e}", self.port),
            }
        }
    }

    /// A new connection of its own (for tests that want several, or a pipeline).
    pub fn client(&self) -> RedisClient {
        RedisClient::connect(self.addr).expect("connect to redis")
    }

    /// Run one command on the kept connection; an error reply comes back as
    /// [`RespValue::Error`]. Panics when the server cannot be reached (see [`Redis::try_cmd`]).
    pub fn cmd(&self, args: &[&str]) -> RespValue {
        self.try_cmd(args)
            .unwrap_or_else(|e| panic!("redis {args:?}: {e}"))
    }

    /// Like [`Redis::cmd`], with I/O failures returned (the server is down, killed, …). A kept
    /// connection that fails is dropped, so the next call reconnects.
    pub fn try_cmd(&self, args: &[&str]) -> io::Result<RespValue> {
        let mut conn = self.conn.lock().unwrap();
        if conn.is_none() {
            *conn = Some(RedisClient::connect(self.addr)?);
        }
        let result = match conn.as_mut() {
            Some(c) => c.cmd(args),
            None => Err(io::Error::other("no connection")),
        };
        if result.is_err() {
            *conn = None;
        }
        result
    }

    /// `HGETALL key` as (field, value) pairs, in the server's order.
    pub fn hgetall(&self, key: &str) -> Vec<(String, String)> {
        pairs(self.cmd(&["HGETALL", key]))
    }

    /// `KEYS pattern`, sorted.
    pub fn keys(&self, pattern: &str) -> Vec<String> {
        let mut keys = strings(self.cmd(&["KEYS", pattern]));
        keys.sort();
        keys
    }

    /// One `field:value` line of `INFO section` (e.g. `("stats", "total_commands_processed")`);
    /// the INFO command itself is counted in the stats it reports.
    pub fn info_field(&self, section: &str, field: &str) -> Option<String> {
        info_value(&self.cmd(&["INFO", section]), field)
    }

    /// `INFO stats` `total_commands_processed` (this INFO included).
    pub fn commands_processed(&self) -> u64 {
        self.info_field("stats", "total_commands_processed")
            .and_then(|v| v.parse().ok())
            .expect("total_commands_processed")
    }

    /// The server's log so far (its `--logfile`), for failure messages.
    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("redis.log")).unwrap_or_default()
    }
}

impl Drop for Redis {
    fn drop(&mut self) {
        self.kill();
    }
}

/// Start `redis-server` on `port` in `dir` and wait (up to [`STARTUP_TIMEOUT`]) until it answers
/// PING; `Err` with the reason (and its log) when it exits or stays silent.
pub(crate) fn spawn_redis(opts: &RedisOpts, dir: &Path, port: u16) -> Result<Child, String> {
    let mut cmd = Command::new(redis_server_bin());
    cmd.args(["--port", &port.to_string(), "--bind", "127.0.0.1"])
        .arg("--dir")
        .arg(dir)
        .args(["--logfile", "redis.log", "--daemonize", "no"])
        // An empty argument is `save ""`: no RDB snapshots.
        .args(["--save", ""]);
    if opts.appendonly {
        cmd.args(["--appendonly", "yes", "--appendfsync", "always"]);
    } else {
        cmd.args(["--appendonly", "no"]);
    }
    cmd.args(&opts.extra_args)
        .current_dir(dir)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::inherit());
    die_with_parent(&mut cmd);
    let mut child = cmd
        .spawn()
        .map_err(|e| format!("spawn {}: {e}", redis_server_bin().display()))?;
    let addr = SocketAddr::from(([127, 0, 0, 1], port));
    let log = || std::fs::read_to_string(dir.join("redis.log")).unwrap_or_default();
    let deadline = Instant::now() + STARTUP_TIMEOUT;
    loop {
        if let Ok(Some(status)) = child.try_wait() {
            return Err(format!("redis-server exited ({status}); log:\n{}", log()));
        }
        let pong = RedisClient::connect(addr).and_then(|mut c| c.cmd(&["PING"]));
        if matches!(&pong, Ok(RespValue::Simple(s)) if s == "PONG") {
            return Ok(child);
        }
        if Instant::now() >= deadline {
            kill_child(&mut child);
            return Err(format!(
                "redis-server did not answer PING within {STARTUP_TIMEOUT:?} ({pong:?}); log:\n{}",
                log()
            ));
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// A RESP2 reply.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum RespValue {
    /// `+OK`
    Simple(String),
    /// `-ERR …`
    Error(String),
    /// `:42`
    Int(i64),
    /// `$n` bulk string.
    Bulk(Vec<u8>),
    /// `*n` array.
    Array(Vec<RespValue>),
    /// `$-1` or `*-1`.
    Nil,
}

impl RespValue {
    /// A simple or bulk string's text (bulk bytes as lossy UTF-8).
    pub fn as_str(&self) -> Option<String> {
        match self {
            RespValue::Simple(s) => Some(s.clone()),
            RespValue::Bulk(b) => Some(String::from_utf8_lossy(b).into_owned()),
            _ => None,
        }
    }

    /// An integer reply, or a string that holds one (`GET` of a counter).
    pub fn as_int(&self) -> Option<i64> {
        match self {
            RespValue::Int(n) => Some(*n),
            _ => self.as_str()?.trim().parse().ok(),
        }
    }

    pub fn is_nil(&self) -> bool {
        *self == RespValue::Nil
    }

    /// Panics unless the reply is `+OK`.
    pub fn assert_ok(&self) {
        assert_eq!(*self, RespValue::Simple("OK".into()), "expected +OK");
    }
}

/// An array reply of strings as `Vec<String>` (panics on another shape).
pub(crate) fn strings(v: RespValue) -> Vec<String> {
    match v {
        RespValue::Array(items) => items
            .iter()
            .map(|i| i.as_str().unwrap_or_else(|| panic!("not a string: {i:?}")))
            .collect(),
        RespValue::Nil => Vec::new(),
        other => panic!("expected an array reply, got {other:?}"),
    }
}

/// A flat array reply `[k1, v1, k2, v2, …]` as pairs.
pub(crate) fn pairs(v: RespValue) -> Vec<(String, String)> {
    let flat = strings(v);
    let pairs = flat.chunks_exact(2);
    assert!(
        pairs.remainder().is_empty(),
        "odd-length pair reply: {flat:?}"
    );
    pairs.map(|p| (p[0].clone(), p[1].clone())).collect()
}

/// The value of `field` in an INFO reply (`field:value` lines).
pub(crate) fn info_value(reply: &RespValue, field: &str) -> Option<String> {
    let text = reply.as_str()?;
    text.lines().find_map(|l| {
        let (k, v) = l.split_once(':')?;
        (k == field).then(|| v.trim().to_string())
    })
}

/// A synchronous RESP2 connection: commands out as arrays of bulk strings, replies parsed
/// whole. Every read and write has [`IO_TIMEOUT`].
pub struct RedisClient {
    writer: TcpStream,
    reader: BufReader<TcpStream>,
}

impl RedisClient {
    pub fn connect(addr: SocketAddr) -> io::Result<RedisClient> {
        let stream = TcpStream::connect_timeout(&addr, IO_TIMEOUT)?;
        stream.set_read_timeout(Some(IO_TIMEOUT))?;
        stream.set_write_timeout(Some(IO_TIMEOUT))?;
        stream.set_nodelay(true)?;
        Ok(RedisClient {
            reader: BufReader::new(stream.try_clone()?),
            writer: stream,
        })
    }

    /// Send one command and read its reply.
    pub fn cmd(&mut self, args: &[&str]) -> io::Result<RespValue> {
        self.send(args)?;
        self.read_reply()
    }

    /// Send several commands in one write and read their replies in order.
    pub fn pipeline(&mut self, cmds: &[&[&str]]) -> io::Result<Vec<RespValue>> {
        let mut out = Vec::new();
        for args in cmds {
            encode_command(&mut out, args);
        }
        self.writer.write_all(&out)?;
        cmds.iter().map(|_| self.read_reply()).collect()
    }

    /// `HGETALL key` as (field, value) pairs.
    pub fn hgetall(&mut self, key: &str) -> io::Result<Vec<(String, String)>> {
        self.cmd(&["HGETALL", key]).map(pairs)
    }

    /// `KEYS pattern`, sorted.
    pub fn keys(&mut self, pattern: &str) -> io::Result<Vec<String>> {
        let mut keys = strings(self.cmd(&["KEYS", pattern])?);
        keys.sort();
        Ok(keys)
    }

    /// One `field:value` of `INFO section`.
    pub fn info_field(&mut self, section: &str, field: &str) -> io::Result<Option<String>> {
        Ok(info_value(&self.cmd(&["INFO", section])?, field))
    }

    fn send(&mut self, args: &[&str]) -> io::Result<()> {
        let mut out = Vec::new();
        encode_command(&mut out, args);
        self.writer.write_all(&out)
    }

    /// Read one whole reply.
    pub fn read_reply(&mut self) -> io::Result<RespValue> {
        let line = self.read_line()?;
        let bad =
            |what: &str| io::Error::new(io::ErrorKind::InvalidData, format!("{what}: {line:?}"));
        let (kind, rest) = line
            .split_at_checked(1)
            .ok_or_else(|| bad("empty reply line"))?;
        let int = |s: &str| s.parse::<i64>().map_err(|_| bad("bad integer"));
        Ok(match kind {
            "+" => RespValue::Simple(rest.to_string()),
            "-" => RespValue::Error(rest.to_string()),
            ":" => RespValue::Int(int(rest)?),
            "$" => match int(rest)? {
                -1 => RespValue::Nil,
                n if n < 0 => return Err(bad("bad bulk length")),
                n => {
                    let mut data = vec![0u8; n as usize + 2];
                    self.reader.read_exact(&mut data)?;
                    if !data.ends_with(b"\r\n") {
                        return Err(bad("bulk string without CRLF"));
                    }
                    data.truncate(n as usize);
                    RespValue::Bulk(data)
                }
            },
            "*" => match int(rest)? {
                -1 => RespValue::Nil,
                n if n < 0 => return Err(bad("bad array length")),
                n => RespValue::Array(
                    (0..n)
                        .map(|_| self.read_reply())
                        .collect::<io::Result<_>>()?,
                ),
            },
            _ => return Err(bad("unknown reply type")),
        })
    }

    /// One CRLF-terminated line, without the CRLF.
    fn read_line(&mut self) -> io::Result<String> {
        let mut buf = Vec::new();
        self.reader.read_until(b'\n', &mut buf)?;
        if buf.is_empty() {
            return Err(io::Error::new(
                io::ErrorKind::UnexpectedEof,
                "redis closed the connection",
            ));
        }
        if !buf.ends_with(b"\r\n") {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                format!(
                    "reply line without CRLF: {:?}",
                    String::from_utf8_lossy(&buf)
                ),
            ));
        }
        buf.truncate(buf.len() - 2);
        String::from_utf8(buf).map_err(|e| io::Error::new(io::ErrorKind::InvalidData, e))
    }
}

/// A command as a RESP array of bulk strings.
pub(crate) fn encode_command(out: &mut Vec<u8>, args: &[&str]) {
    out.extend_from_slice(format!("*{}\r\n", args.len()).as_bytes());
    for a in args {
        out.extend_from_slice(format!("${}\r\n", a.len()).as_bytes());
        out.extend_from_slice(a.as_bytes());
        out.extend_from_slice(b"\r\n");
    }
}

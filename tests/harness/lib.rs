//! Black-box test harness for Sluice.
//!
//! Spawns the real `sluice` and `mock-llm` binaries (built beforehand by `cargo build
//! --workspace`) on port 0, and talks to them over plain `std::net::TcpStream` with a tiny,
//! strict HTTP/1.1 client. Every socket read has a timeout, every spawned process is killed when
//! its guard is dropped (and, as a safety net, when the test process dies), so no test can hang
//! or leak a process.
//!
//! A typical test is one setup line per process:
//!
//! ```ignore
//! let mock = Mock::start(&["--inter-token-ms", "50"]);
//! let gw = Sluice::start(&Config::one_cluster(&mock).timeout("header_read_ms", 300));
//! let resp = gw.post("/v1/chat/completions", r#"{"model":"gpt-4o","messages":[]}"#);
//! ```
#![allow(clippy::unwrap_used, clippy::expect_used)]
// The harness runs on the test's own threads, never on a worker: it may sleep between polls of
// a process it waits for, and lock what its threads share.
#![allow(clippy::disallowed_methods, clippy::disallowed_types)]

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::io::{self, BufRead, BufReader, Read, Write};
use std::net::{Shutdown, SocketAddr, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, Command, ExitStatus, Output, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

pub use serde_json::{json, Value};

/// Default timeout for any single socket read or write done by the client.
pub const IO_TIMEOUT: Duration = Duration::from_secs(10);
/// How long a binary may take to print its startup line.
pub const STARTUP_TIMEOUT: Duration = Duration::from_secs(20);

// ---------------------------------------------------------------------------------------------
// Binaries, drivers, temp dirs
// ---------------------------------------------------------------------------------------------

/// The cargo target profile directory holding the built binaries (`target/debug`).
pub fn bin_dir() -> PathBuf {
    if let Ok(dir) = std::env::var("CARGO_TARGET_DIR") {
        let p = PathBuf::from(dir).join("debug");
        if p.join("sluice").exists() {
            return p;
        }
    }
    // current_exe = target/debug/deps/<test>-<hash>
    let exe = std::env::current_exe().expect("current_exe");
    let mut dir = exe.parent().map(Path::to_path_buf);
    while let Some(d) = dir {
        if d.join("sluice").is_file() || d.join("mock-llm").is_file() {
            return d;
        }
        dir = d.parent().map(Path::to_path_buf);
    }
    // Fall back to the conventional location: two levels up from the test executable.
    exe.parent()
        .and_then(Path::parent)
        .expect("target dir")
        .to_path_buf()
}

/// Path of a workspace binary (`sluice`, `mock-llm`); panics with a hint when it is missing.
pub fn bin(name: &str) -> PathBuf {
    let p = bin_dir().join(name);
    assert!(
        p.is_file(),
        "{} not found; run `cargo build --workspace` before the tests",
        p.display()
    );
    p
}

/// Which engine a `sluice-load` run uses when its arguments don't say.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LoadEngine {
    /// `SLUICE_LOAD_ENGINE` from the test's environment, if set (so a suite can be run again
    /// on the other engine).
    FromEnv,
    /// The generator's own default: the variable is removed.
    Default,
}

/// Run `sluice-load` with `args` plus `--json FILE`; panics unless it succeeds. Returns
/// (stdout, stderr, the parsed JSON).
pub fn run_sluice_load(url: &str, args: &[&str], engine: LoadEngine) -> (String, String, Value) {
    let dir = TempDir::new("loadgen");
    let json = dir.path().join("out.json");
    let mut cmd = Command::new(bin("sluice-load"));
    if engine == LoadEngine::Default {
        cmd.env_remove("SLUICE_LOAD_ENGINE");
    }
    let out = cmd
        .arg("--url")
        .arg(url)
        .args(args)
        .arg("--json")
        .arg(&json)
        .output()
        .expect("run sluice-load");
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(
        out.status.success(),
        "sluice-load failed: {}\nstdout: {stdout}\nstderr: {stderr}",
        out.status
    );
    let v: Value = serde_json::from_str(&std::fs::read_to_string(&json).expect("json file"))
        .expect("valid json");
    (stdout, stderr, v)
}

/// The workspace root (the parent of `tests/`).
pub fn workspace_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("workspace root")
        .to_path_buf()
}

/// Whether this run forces monoio's legacy (epoll) driver (`SLUICE_TEST_DRIVER=legacy`).
pub fn legacy_driver() -> bool {
    std::env::var("SLUICE_TEST_DRIVER").is_ok_and(|v| v.eq_ignore_ascii_case("legacy"))
}

/// The driver name the startup line must report in this run.
pub fn expected_driver() -> &'static str {
    if legacy_driver() {
        "legacy"
    } else {
        "io_uring"
    }
}

static UNIQUE: AtomicU64 = AtomicU64::new(0);

/// A temporary directory under `std::env::temp_dir()`, removed on drop.
pub struct TempDir {
    path: PathBuf,
}

impl TempDir {
    pub fn new(tag: &str) -> TempDir {
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos())
            .unwrap_or(0);
        let path = std::env::temp_dir().join(format!(
            "sluice-test-{tag}-{}-{}-{nanos}",
            std::process::id(),
            UNIQUE.fetch_add(1, Ordering::Relaxed)
        ));
        std::fs::create_dir_all(&path).expect("create temp dir");
        TempDir { path }
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Write `contents` to `name` inside the directory and return the full path.
    pub fn write(&self, name: &str, contents: impl AsRef<[u8]>) -> PathBuf {
        let p = self.path.join(name);
        std::fs::write(&p, contents).expect("write temp file");
        p
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.path);
    }
}

/// Make the child die with the test process even if the test is killed before its guards drop.
fn die_with_parent(cmd: &mut Command) {
    use std::os::unix::process::CommandExt;
    // SAFETY: prctl is async-signal-safe and touches no memory of the parent.
    unsafe {
        cmd.pre_exec(|| {
            libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL);
            Ok(())
        });
    }
}

fn kill_child(child: &mut Child) {
    if let Ok(None) = child.try_wait() {
        let _ = child.kill();
    }
    let _ = child.wait();
}

/// Poll `cond` every 10 ms until it holds or `within` passes; returns whether it held.
pub fn wait_until(within: Duration, mut cond: impl FnMut() -> bool) -> bool {
    let deadline = Instant::now() + within;
    loop {
        if cond() {
            return true;
        }
        if Instant::now() >= deadline {
            return false;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// A port on 127.0.0.1 that was free a moment ago and has nothing listening on it now.
pub fn dead_port() -> u16 {
    let l = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let port = l.local_addr().expect("addr").port();
    drop(l);
    port
}

// ---------------------------------------------------------------------------------------------
// mock-llm
// ---------------------------------------------------------------------------------------------

/// A running `mock-llm`. Killed on drop; it also exits when its stdin (held here) closes.
pub struct Mock {
    child: Child,
    _stdin: ChildStdin,
    pub addr: SocketAddr,
    tls: bool,
}

impl Mock {
    /// Start a plain-HTTP mock with extra flags (e.g. `&["--inter-token-ms", "50"]`).
    pub fn start(args: &[&str]) -> Mock {
        Self::spawn(args, false)
    }

    /// Start an HTTPS mock with the given PEM certificate chain and key.
    pub fn start_tls(cert: &Path, key: &Path, args: &[&str]) -> Mock {
        let mut all: Vec<&str> = args.to_vec();
        let cert = cert.to_str().expect("utf-8 path");
        let key = key.to_str().expect("utf-8 path");
        all.extend_from_slice(&["--tls-cert", cert, "--tls-key", key]);
        Self::spawn(&all, true)
    }

    fn spawn(args: &[&str], tls: bool) -> Mock {
        let mut cmd = Command::new(bin("mock-llm"));
        cmd.args(["--listen", "127.0.0.1:0", "--exit-on-stdin-eof"])
            .args(args)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit());
        die_with_parent(&mut cmd);
        let mut child = cmd.spawn().expect("spawn mock-llm");
        let stdin = child.stdin.take().expect("mock stdin");
        let stdout = child.stdout.take().expect("mock stdout");
        let (tx, rx) = mpsc::channel::<String>();
        std::thread::spawn(move || {
            let mut reader = BufReader::new(stdout);
            let mut line = String::new();
            // Forward the first line, then keep draining so the mock never blocks on stdout.
            while let Ok(n) = reader.read_line(&mut line) {
                if n == 0 {
                    break;
                }
                let _ = tx.send(line.trim_end().to_string());
                line.clear();
            }
        });
        let line = match rx.recv_timeout(STARTUP_TIMEOUT) {
            Ok(l) => l,
            Err(e) => {
                kill_child(&mut child);
                panic!("mock-llm did not print its listening line: {e}");
            }
        };
        let addr = line
            .strip_prefix("mock-llm listening on ")
            .and_then(|a| a.trim().parse::<SocketAddr>().ok())
            .unwrap_or_else(|| panic!("unexpected mock-llm startup line: {line:?}"));
        Mock {
            child,
            _stdin: stdin,
            addr,
            tls,
        }
    }

    pub fn port(&self) -> u16 {
        self.addr.port()
    }

    /// This (plain) mock's chat completions URL, for a load generator aimed at it directly.
    pub fn chat_url(&self) -> String {
        format!("http://{}/v1/chat/completions", self.addr)
    }

    /// The base_url a cluster uses for this mock (`http://127.0.0.1:P/v1`, or
    /// `https://localhost:P/v1` for a TLS mock).
    pub fn base_url(&self) -> String {
        if self.tls {
            format!("https://localhost:{}/v1", self.port())
        } else {
            format!("http://{}/v1", self.addr)
        }
    }

    /// `GET /_mock/stats` on a fresh connection (plain-HTTP mocks only).
    pub fn stats(&self) -> Value {
        assert!(!self.tls, "stats() needs a plain-HTTP mock");
        let mut c = Conn::open(self.addr);
        c.send(
            &Req::get("/_mock/stats")
                .header("Connection", "close")
                .build(),
        );
        let r = c.read_response();
        assert_eq!(r.status, 200, "mock stats: {}", r.text());
        r.json()
    }

    /// `POST /_mock/reset_peak`: `max_active_requests` starts over from the requests in flight
    /// now. Returns the stats after the reset.
    pub fn reset_peak(&self) -> Value {
        assert!(!self.tls, "reset_peak() needs a plain-HTTP mock");
        let mut c = Conn::open(self.addr);
        c.send(
            &Req::post("/_mock/reset_peak", "")
                .header("Connection", "close")
                .build(),
        );
        let r = c.read_response();
        assert_eq!(r.status, 200, "mock reset_peak: {}", r.text());
        r.json()
    }

    /// A request to one of the mock's own endpoints, on a fresh connection (plain-HTTP mocks
    /// only). They answer whatever the fault and however full the queue.
    pub fn control(&self, req: Req) -> Response {
        assert!(!self.tls, "control requests need a plain-HTTP mock");
        let mut c = Conn::open(self.addr);
        c.send(&req.header("Connection", "close").build());
        c.read_response()
    }

    /// `GET /_mock/fault`: `{"fault": SPEC or null}`, the fault every request gets.
    pub fn fault(&self) -> Value {
        let r = self.control(Req::get("/_mock/fault"));
        assert_eq!(r.status, 200, "mock fault: {}", r.text());
        r.json()
    }

    /// `POST /_mock/fault`: make every request misbehave as `spec` says (None: behave again),
    /// without restarting the mock. Returns the new state.
    pub fn set_fault(&self, spec: Option<&str>) -> Value {
        let body = json!({ "fault": spec }).to_string();
        let r = self.control(Req::post("/_mock/fault", &body));
        assert_eq!(r.status, 200, "mock set fault {spec:?}: {}", r.text());
        r.json()
    }

    /// `GET /_mock/queue`: the real running / waiting counts and what `/metrics` reports.
    pub fn queue(&self) -> Value {
        let r = self.control(Req::get("/_mock/queue"));
        assert_eq!(r.status, 200, "mock queue: {}", r.text());
        r.json()
    }

    /// `POST /_mock/queue`: report `{"waiting": W, "running": R, "kv_cache_usage": F}` (each
    /// optional) at `/metrics` instead of the real counts; `Value::Null` goes back to them.
    pub fn set_queue(&self, reported: Value) -> Value {
        let r = self.control(Req::post("/_mock/queue", &reported.to_string()));
        assert_eq!(r.status, 200, "mock set queue {reported}: {}", r.text());
        r.json()
    }

    /// `GET /metrics` (the queue, in vLLM's and SGLang's names), parsed.
    pub fn metrics(&self) -> Metrics {
        assert!(!self.tls, "metrics() needs a plain-HTTP mock");
        scrape(self.addr)
    }

    /// One counter from `/_mock/stats`.
    pub fn stat(&self, key: &str) -> u64 {
        let s = self.stats();
        s.get(key)
            .and_then(Value::as_u64)
            .unwrap_or_else(|| panic!("mock stats lack {key}: {s}"))
    }

    /// A keep-alive connection to the mock for reading stats without opening new connections
    /// between readings (so `connections_accepted` deltas count only other clients).
    pub fn stats_probe(&self) -> StatsProbe {
        assert!(!self.tls, "stats_probe() needs a plain-HTTP mock");
        StatsProbe {
            conn: Conn::open(self.addr),
        }
    }

    /// A [`RequestCounter`] starting now.
    pub fn request_counter(&self) -> RequestCounter {
        let mut probe = self.stats_probe();
        let a = probe.stat("requests");
        let b = probe.stat("requests");
        RequestCounter {
            probe,
            last: b,
            self_cost: b - a,
        }
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }
}

impl Drop for Mock {
    fn drop(&mut self) {
        kill_child(&mut self.child);
    }
}

/// Counts the requests the mock received from others (not the probe's own stats requests).
pub struct RequestCounter {
    probe: StatsProbe,
    last: u64,
    self_cost: u64,
}

impl RequestCounter {
    /// Requests the mock received since the counter was made (or last asked).
    pub fn delta(&mut self) -> u64 {
        let now = self.probe.stat("requests");
        let d = now - self.last - self.self_cost;
        self.last = now;
        d
    }
}

/// See [`Mock::stats_probe`].
pub struct StatsProbe {
    conn: Conn,
}

impl StatsProbe {
    pub fn stats(&mut self) -> Value {
        self.conn.send(&Req::get("/_mock/stats").build());
        let r = self.conn.read_response();
        assert_eq!(r.status, 200, "mock stats: {}", r.text());
        assert!(
            !r.header_has_token("connection", "close"),
            "mock closes its stats connection; a probe needs keep-alive"
        );
        r.json()
    }

    pub fn stat(&mut self, key: &str) -> u64 {
        let s = self.stats();
        s.get(key)
            .and_then(Value::as_u64)
            .unwrap_or_else(|| panic!("mock stats lack {key}: {s}"))
    }
}

// ---------------------------------------------------------------------------------------------
// redis-server
// ---------------------------------------------------------------------------------------------

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
            let port = dead_port();
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
fn spawn_redis(opts: &RedisOpts, dir: &Path, port: u16) -> Result<Child, String> {
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
fn strings(v: RespValue) -> Vec<String> {
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
fn pairs(v: RespValue) -> Vec<(String, String)> {
    let flat = strings(v);
    let pairs = flat.chunks_exact(2);
    assert!(
        pairs.remainder().is_empty(),
        "odd-length pair reply: {flat:?}"
    );
    pairs.map(|p| (p[0].clone(), p[1].clone())).collect()
}

/// The value of `field` in an INFO reply (`field:value` lines).
fn info_value(reply: &RespValue, field: &str) -> Option<String> {
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
fn encode_command(out: &mut Vec<u8>, args: &[&str]) {
    out.extend_from_slice(format!("*{}\r\n", args.len()).as_bytes());
    for a in args {
        out.extend_from_slice(format!("${}\r\n", a.len()).as_bytes());
        out.extend_from_slice(a.as_bytes());
        out.extend_from_slice(b"\r\n");
    }
}

// ---------------------------------------------------------------------------------------------
// Config builder
// ---------------------------------------------------------------------------------------------

/// One `[clusters.NAME]` table.
#[derive(Clone, Debug)]
pub struct Cluster {
    pub name: String,
    pub backends: Vec<(String, u32)>,
    pub model_map: Vec<(String, String)>,
    pub credential: Option<(String, String)>,
    pub ca_file: Option<String>,
}

impl Cluster {
    pub fn new(name: &str, base_urls: &[&str]) -> Cluster {
        Cluster {
            name: name.to_string(),
            backends: base_urls.iter().map(|u| (u.to_string(), 1)).collect(),
            model_map: Vec::new(),
            credential: None,
            ca_file: None,
        }
    }
}

/// Threads that spin until dropped: a loaded machine, on which timing bugs in limits and leases
/// show (the sync task of a pinned worker runs late when its core is shared).
pub struct BusyLoops {
    stop: Arc<std::sync::atomic::AtomicBool>,
    threads: Vec<std::thread::JoinHandle<u64>>,
}

impl BusyLoops {
    pub fn start(n: usize) -> BusyLoops {
        let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let threads = (0..n)
            .map(|_| {
                let stop = Arc::clone(&stop);
                std::thread::spawn(move || {
                    let mut spins: u64 = 0;
                    while !stop.load(Ordering::Relaxed) {
                        spins = std::hint::black_box(spins.wrapping_add(1));
                    }
                    spins
                })
            })
            .collect();
        BusyLoops { stop, threads }
    }
}

impl Drop for BusyLoops {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}

/// Sleep past the next edge of a wall-clock-aligned window of `window_secs` when fewer than
/// `margin_secs` of the current one are left, so a test's requests all land in one window
/// (limits' windows are aligned to unix time).
pub fn wait_out_window_edge(window_secs: u64, margin_secs: u64) {
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .expect("clock after 1970");
    let window_ms = window_secs * 1000;
    let left_ms = window_ms - (now.as_millis() as u64 % window_ms);
    if left_ms < margin_secs * 1000 {
        std::thread::sleep(Duration::from_millis(left_ms + 50));
    }
}

/// Builds a Sluice TOML config (format: `conf/sluice.toml`) plus the environment the process
/// gets. Defaults: `listen = 127.0.0.1:0`, one worker, no pinning.
#[derive(Clone, Debug)]
pub struct Config {
    sections: BTreeMap<String, Vec<(String, String)>>,
    clusters: Vec<Cluster>,
    routes: Vec<(String, String)>,
    env: Vec<(String, String)>,
    raw: String,
}

impl Default for Config {
    fn default() -> Self {
        Self::new()
    }
}

/// Quote a string as a TOML basic string.
pub fn toml_str(s: &str) -> String {
    let mut out = String::from("\"");
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            c if (c as u32) < 0x20 || c as u32 == 0x7f => {
                let _ = write!(out, "\\u{:04X}", c as u32);
            }
            c => out.push(c),
        }
    }
    out.push('"');
    out
}

/// A finite float as a TOML float literal (always with a fraction or exponent).
pub fn toml_float(v: f64) -> String {
    assert!(v.is_finite(), "not a finite float: {v}");
    format!("{v:?}")
}

impl Config {
    /// No clusters, no routes.
    pub fn new() -> Config {
        let mut c = Config {
            sections: BTreeMap::new(),
            clusters: Vec::new(),
            routes: Vec::new(),
            env: Vec::new(),
            raw: String::new(),
        };
        c = c
            .set("server", "listen", &toml_str("127.0.0.1:0"))
            .set("server", "workers", "1")
            .set("server", "pin_workers", "false");
        c
    }

    /// Cluster `main` with the mock as its one backend, and the route `gpt-4o` -> `main`.
    pub fn one_cluster(mock: &Mock) -> Config {
        Self::backend_url(&mock.base_url())
    }

    /// Cluster `main` with `base_url` as its one backend, and the route `gpt-4o` -> `main`.
    pub fn backend_url(base_url: &str) -> Config {
        Config::new()
            .cluster(Cluster::new("main", &[base_url]))
            .route("gpt-4o", "main")
    }

    /// Set `key = raw_value` in `[section]` (the value is raw TOML: quote strings yourself, or
    /// use [`toml_str`]). Replaces an earlier value of the same key.
    pub fn set(mut self, section: &str, key: &str, raw_value: &str) -> Config {
        let entries = self.sections.entry(section.to_string()).or_default();
        entries.retain(|(k, _)| k != key);
        entries.push((key.to_string(), raw_value.to_string()));
        self
    }

    /// `[timeouts] key = ms`.
    pub fn timeout(self, key: &str, ms: u64) -> Config {
        self.set("timeouts", key, &ms.to_string())
    }

    /// `[http] key = value`.
    pub fn http(self, key: &str, value: u64) -> Config {
        self.set("http", key, &value.to_string())
    }

    /// `[upstream] key = value`.
    pub fn upstream(self, key: &str, value: u64) -> Config {
        self.set("upstream", key, &value.to_string())
    }

    /// `[admin] listen = "127.0.0.1:0"`: the admin listener (`/metrics`, `/healthz`, `/readyz`)
    /// on a free port; [`Sluice::admin_addr`] reads the port back from the startup output.
    pub fn admin(self) -> Config {
        self.set("admin", "listen", &toml_str("127.0.0.1:0"))
    }

    /// `[access_log] dir = DIR`.
    pub fn access_log(self, dir: &Path) -> Config {
        self.set(
            "access_log",
            "dir",
            &toml_str(dir.to_str().expect("utf-8 path")),
        )
    }

    /// `[access_log] key = value` (`max_file_bytes`, `max_file_age_secs`, `batch_bytes`,
    /// `queue_batches`, `flush_interval_ms`).
    pub fn access_log_opt(self, key: &str, value: u64) -> Config {
        self.set("access_log", key, &value.to_string())
    }

    /// `[pricing."MODEL"] input = .., output = ..` (currency units per million tokens).
    pub fn price(self, model: &str, input: f64, output: f64) -> Config {
        let section = format!("pricing.{}", toml_str(model));
        self.set(&section, "input", &toml_float(input))
            .set(&section, "output", &toml_float(output))
    }

    /// Like [`Config::price`], with a separate price for cached prompt tokens.
    pub fn price_cached(self, model: &str, input: f64, output: f64, cached_input: f64) -> Config {
        let section = format!("pricing.{}", toml_str(model));
        self.price(model, input, output)
            .set(&section, "cached_input", &toml_float(cached_input))
    }

    pub fn workers(self, n: u32) -> Config {
        self.set("server", "workers", &n.to_string())
    }

    pub fn listen(self, addr: &str) -> Config {
        self.set("server", "listen", &toml_str(addr))
    }

    pub fn cluster(mut self, cluster: Cluster) -> Config {
        self.clusters.push(cluster);
        self
    }

    /// `[[routes]] model = MODEL, cluster = CLUSTER`, appended in order.
    pub fn route(mut self, model: &str, cluster: &str) -> Config {
        self.routes.push((model.to_string(), cluster.to_string()));
        self
    }

    fn first_cluster(&mut self) -> &mut Cluster {
        self.clusters
            .first_mut()
            .expect("config has no cluster yet")
    }

    /// Map `from` to `to` in the first cluster, adding the route `from` -> that cluster unless
    /// a route for exactly `from` exists already.
    pub fn map(mut self, from: &str, to: &str) -> Config {
        let c = self.first_cluster();
        c.model_map.push((from.to_string(), to.to_string()));
        let name = c.name.clone();
        if !self.routes.iter().any(|(m, _)| m == from) {
            self.routes.push((from.to_string(), name));
        }
        self
    }

    /// `credential = { env = ENV, header = HEADER }` on the first cluster.
    pub fn credential(mut self, env: &str, header: &str) -> Config {
        self.first_cluster().credential = Some((env.to_string(), header.to_string()));
        self
    }

    /// `ca_file = PATH` on the first cluster.
    pub fn ca_file(mut self, path: &Path) -> Config {
        self.first_cluster().ca_file = Some(path.to_str().expect("utf-8 path").to_string());
        self
    }

    /// An environment variable for the spawned sluice.
    pub fn env(mut self, key: &str, value: &str) -> Config {
        self.env.push((key.to_string(), value.to_string()));
        self
    }

    /// Raw TOML appended to the end of the file.
    pub fn raw(mut self, toml: &str) -> Config {
        self.raw.push_str(toml);
        self.raw.push('\n');
        self
    }

    pub fn to_toml(&self) -> String {
        let mut out = String::new();
        for (section, entries) in &self.sections {
            let _ = writeln!(out, "[{section}]");
            for (k, v) in entries {
                let _ = writeln!(out, "{k} = {v}");
            }
            out.push('\n');
        }
        for c in &self.clusters {
            let _ = writeln!(out, "[clusters.{}]", c.name);
            let backends: Vec<String> = c
                .backends
                .iter()
                .map(|(u, w)| format!("{{ base_url = {}, weight = {w} }}", toml_str(u)))
                .collect();
            let _ = writeln!(out, "backends = [{}]", backends.join(", "));
            if !c.model_map.is_empty() {
                let m: Vec<String> = c
                    .model_map
                    .iter()
                    .map(|(a, b)| format!("{} = {}", toml_str(a), toml_str(b)))
                    .collect();
                let _ = writeln!(out, "model_map = {{ {} }}", m.join(", "));
            }
            if let Some((env, header)) = &c.credential {
                let _ = writeln!(
                    out,
                    "credential = {{ env = {}, header = {} }}",
                    toml_str(env),
                    toml_str(header)
                );
            }
            if let Some(ca) = &c.ca_file {
                let _ = writeln!(out, "ca_file = {}", toml_str(ca));
            }
            out.push('\n');
        }
        for (model, cluster) in &self.routes {
            let _ = writeln!(
                out,
                "[[routes]]\nmodel = {}\ncluster = {}\n",
                toml_str(model),
                toml_str(cluster)
            );
        }
        out.push_str(&self.raw);
        out
    }
}

// ---------------------------------------------------------------------------------------------
// sluice
// ---------------------------------------------------------------------------------------------

/// The parsed startup line `sluice: listening on ADDR (workers=N, driver=D)`.
#[derive(Clone, Debug)]
pub struct Startup {
    pub line: String,
    pub addr: SocketAddr,
    pub workers: u32,
    pub driver: String,
}

impl Startup {
    pub fn parse(line: &str) -> Option<Startup> {
        let rest = line.trim().strip_prefix("sluice: listening on ")?;
        let (addr, rest) = rest.split_once(' ')?;
        let addr = addr.parse().ok()?;
        let inner = rest.trim().strip_prefix('(')?.strip_suffix(')')?;
        let mut workers = None;
        let mut driver = None;
        for part in inner.split(',') {
            let (k, v) = part.trim().split_once('=')?;
            match k {
                "workers" => workers = v.parse().ok(),
                "driver" => driver = Some(v.to_string()),
                _ => {}
            }
        }
        Some(Startup {
            line: line.trim().to_string(),
            addr,
            workers: workers?,
            driver: driver?,
        })
    }
}

/// A sluice that exited (or never said it was listening) during startup.
#[derive(Debug)]
pub struct StartFailure {
    /// The exit status code, `None` if it was still running (and was killed) or died by signal.
    pub code: Option<i32>,
    pub exited: bool,
    pub stderr: String,
    pub elapsed: Duration,
}

/// A running sluice. Killed on drop.
pub struct Sluice {
    child: Child,
    pub addr: SocketAddr,
    pub startup: Startup,
    stderr: Arc<Mutex<Vec<String>>>,
    /// Set when stderr reached EOF (the process exited): every line is in `stderr`.
    stderr_done: Arc<std::sync::atomic::AtomicBool>,
    _dir: TempDir,
    pub config_path: PathBuf,
}

fn sluice_command(config: &Config, path: &Path) -> Command {
    let mut cmd = Command::new(bin("sluice"));
    cmd.arg("--config").arg(path);
    cmd.env_remove("MONOIO_FORCE_LEGACY_DRIVER");
    if legacy_driver() {
        cmd.env("MONOIO_FORCE_LEGACY_DRIVER", "1");
    }
    for (k, v) in &config.env {
        cmd.env(k, v);
    }
    cmd
}

impl Sluice {
    /// Start sluice with `config`; panics (with its stderr) if it does not come up.
    pub fn start(config: &Config) -> Sluice {
        match Self::try_start(config) {
            Ok(s) => s,
            Err(f) => panic!(
                "sluice did not start (exit code {:?}) with config:\n{}\n--- stderr ---\n{}",
                f.code,
                config.to_toml(),
                f.stderr
            ),
        }
    }

    /// Start sluice; `Err` if it exits (or stays silent for [`STARTUP_TIMEOUT`]) before printing
    /// its listening line.
    pub fn try_start(config: &Config) -> Result<Sluice, StartFailure> {
        Self::try_start_within(config, STARTUP_TIMEOUT)
    }

    pub fn try_start_within(config: &Config, within: Duration) -> Result<Sluice, StartFailure> {
        Self::try_start_args(config, &[], within)
    }

    /// Start sluice with `config` and `args` after `--config FILE` (e.g. `--takeover PATH`);
    /// panics (with its stderr) if it does not come up.
    pub fn start_args(config: &Config, args: &[&str]) -> Sluice {
        match Self::try_start_args(config, args, STARTUP_TIMEOUT) {
            Ok(s) => s,
            Err(f) => panic!(
                "sluice {args:?} did not start (exit code {:?}):\n--- stderr ---\n{}",
                f.code, f.stderr
            ),
        }
    }

    pub fn try_start_args(
        config: &Config,
        args: &[&str],
        within: Duration,
    ) -> Result<Sluice, StartFailure> {
        let dir = TempDir::new("sluice");
        let config_path = dir.write("sluice.toml", config.to_toml());
        let mut cmd = sluice_command(config, &config_path);
        cmd.args(args);
        cmd.stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped());
        die_with_parent(&mut cmd);
        let started = Instant::now();
        let mut child = cmd.spawn().expect("spawn sluice");
        let stderr_pipe = child.stderr.take().expect("sluice stderr");
        let lines = Arc::new(Mutex::new(Vec::<String>::new()));
        let stderr_done = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let (tx, rx) = mpsc::channel::<Startup>();
        {
            let lines = Arc::clone(&lines);
            let done = Arc::clone(&stderr_done);
            std::thread::spawn(move || {
                let mut reader = BufReader::new(stderr_pipe);
                let mut buf = Vec::new();
                loop {
                    buf.clear();
                    match reader.read_until(b'\n', &mut buf) {
                        Ok(0) | Err(_) => break,
                        Ok(_) => {
                            let line = String::from_utf8_lossy(&buf).trim_end().to_string();
                            if let Some(s) = Startup::parse(&line) {
                                let _ = tx.send(s);
                            }
                            lines.lock().unwrap().push(line);
                        }
                    }
                }
                done.store(true, Ordering::Release);
                // tx drops here: the receiver learns that stderr closed.
            });
        }
        let fail = |child: &mut Child, lines: &Arc<Mutex<Vec<String>>>| {
            let exited = matches!(child.try_wait(), Ok(Some(_)));
            let status = if exited {
                child.wait().ok()
            } else {
                kill_child(child);
                None
            };
            // Give the reader thread a moment to collect the last lines.
            std::thread::sleep(Duration::from_millis(50));
            StartFailure {
                code: status.and_then(|s| s.code()),
                exited,
                stderr: lines.lock().unwrap().join("\n"),
                elapsed: started.elapsed(),
            }
        };
        match rx.recv_timeout(within) {
            Ok(startup) => Ok(Sluice {
                child,
                addr: startup.addr,
                startup,
                stderr: lines,
                stderr_done,
                _dir: dir,
                config_path,
            }),
            Err(mpsc::RecvTimeoutError::Disconnected) => {
                // stderr closed: the process is exiting; wait briefly for its status.
                let _ = wait_until(Duration::from_secs(5), || {
                    matches!(child.try_wait(), Ok(Some(_)))
                });
                Err(fail(&mut child, &lines))
            }
            Err(mpsc::RecvTimeoutError::Timeout) => Err(fail(&mut child, &lines)),
        }
    }

    /// Run `sluice check --config FILE` on this config.
    pub fn check(config: &Config) -> Output {
        let dir = TempDir::new("check");
        let path = dir.write("sluice.toml", config.to_toml());
        Self::check_file(&path, &config.env)
    }

    /// Run `sluice check --config PATH` (with extra environment).
    pub fn check_file(path: &Path, env: &[(String, String)]) -> Output {
        let mut cmd = Command::new(bin("sluice"));
        cmd.arg("check").arg("--config").arg(path);
        for (k, v) in env {
            cmd.env(k, v);
        }
        cmd.stdin(Stdio::null());
        die_with_parent(&mut cmd);
        // `check` must be quick; guard against a hang anyway.
        let mut child = cmd
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("spawn sluice check");
        let mut out = child.stdout.take().expect("stdout");
        let mut err = child.stderr.take().expect("stderr");
        let t_out = std::thread::spawn(move || {
            let mut v = Vec::new();
            let _ = out.read_to_end(&mut v);
            v
        });
        let t_err = std::thread::spawn(move || {
            let mut v = Vec::new();
            let _ = err.read_to_end(&mut v);
            v
        });
        let done = wait_until(Duration::from_secs(20), || {
            matches!(child.try_wait(), Ok(Some(_)))
        });
        if !done {
            kill_child(&mut child);
            panic!("`sluice check` did not exit within 20 s");
        }
        let status = child.wait().expect("wait");
        Output {
            status,
            stdout: t_out.join().unwrap_or_default(),
            stderr: t_err.join().unwrap_or_default(),
        }
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Whether the process is still running.
    pub fn is_running(&mut self) -> bool {
        matches!(self.child.try_wait(), Ok(None))
    }

    /// Number of open file descriptors of the sluice process (entries of /proc/PID/fd).
    pub fn fd_count(&self) -> usize {
        std::fs::read_dir(format!("/proc/{}/fd", self.pid()))
            .map(|d| d.count())
            .expect("read /proc/PID/fd")
    }

    /// Everything sluice wrote to stderr so far.
    pub fn stderr_text(&self) -> String {
        self.stderr.lock().unwrap().join("\n")
    }

    /// Wait up to `within` for a stderr line containing `needle`; whether one came.
    pub fn wait_stderr(&self, within: Duration, needle: &str) -> bool {
        wait_until(within, || {
            self.stderr
                .lock()
                .unwrap()
                .iter()
                .any(|l| l.contains(needle))
        })
    }

    /// Wait up to `within` for the process to exit: its status, or `None` while it still runs.
    /// Its stderr lines are all collected once it has exited.
    pub fn wait_exit(&mut self, within: Duration) -> Option<ExitStatus> {
        let mut status = None;
        wait_until(within, || {
            status = self.child.try_wait().ok().flatten();
            status.is_some()
        });
        if status.is_some() {
            // The reader thread has the last lines once it reads EOF on the pipe.
            let done = Arc::clone(&self.stderr_done);
            wait_until(Duration::from_secs(5), || done.load(Ordering::Acquire));
        }
        status
    }

    /// The admin listener's address, from the startup line `sluice: admin listening on ADDR
    /// (...)` that follows the main listening line (the config needs [`Config::admin`]). Waits
    /// up to [`STARTUP_TIMEOUT`] for it.
    pub fn admin_addr(&self) -> SocketAddr {
        let find = || {
            self.stderr
                .lock()
                .unwrap()
                .iter()
                .find_map(|l| parse_admin_line(l))
        };
        let mut addr = None;
        let found = wait_until(STARTUP_TIMEOUT, || {
            addr = find();
            addr.is_some()
        });
        assert!(
            found,
            "no `sluice: admin listening on` line within {STARTUP_TIMEOUT:?}; stderr:\n{}",
            self.stderr_text()
        );
        addr.expect("admin address")
    }

    /// The TLS listener's address, from `sluice: tls listening on ADDR` (printed before the
    /// startup line, so it is there once the process is up; the config needs `[tls]`).
    pub fn tls_addr(&self) -> SocketAddr {
        let lines = self.stderr.lock().unwrap();
        lines
            .iter()
            .find_map(|l| {
                l.trim()
                    .strip_prefix("sluice: tls listening on ")?
                    .parse()
                    .ok()
            })
            .unwrap_or_else(|| panic!("no `sluice: tls listening on` line:\n{}", lines.join("\n")))
    }

    /// `GET path` on the admin listener (see [`admin_get`]).
    pub fn admin_get(&self, path: &str) -> Response {
        admin_get(self.admin_addr(), path)
    }

    /// Scrape `/metrics` once and parse it (asserting a 200 and a parseable exposition).
    pub fn metrics(&self) -> Metrics {
        scrape(self.admin_addr())
    }

    /// Scrape `/metrics` every 50 ms until `cond` holds or `within` passes (workers publish
    /// every 500 ms, so a scrape lags); returns the last scrape, so the caller asserts on it.
    pub fn wait_metrics(
        &self,
        within: Duration,
        mut cond: impl FnMut(&Metrics) -> bool,
    ) -> Metrics {
        let addr = self.admin_addr();
        let deadline = Instant::now() + within;
        loop {
            let m = scrape(addr);
            if cond(&m) || Instant::now() >= deadline {
                return m;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// A new client connection.
    pub fn conn(&self) -> Conn {
        Conn::open(self.addr)
    }

    /// Send `signal` (e.g. `libc::SIGHUP`) to the sluice process.
    pub fn signal(&self, signal: i32) {
        // SAFETY: kill(2) on our own child's pid; it touches no memory.
        let rc = unsafe { libc::kill(self.pid() as i32, signal) };
        assert_eq!(rc, 0, "kill({}, {signal})", self.pid());
    }

    /// Replace the config file sluice was started with (what a reload reads) by `config`.
    pub fn rewrite_config(&self, config: &Config) {
        std::fs::write(&self.config_path, config.to_toml()).expect("rewrite the config file");
    }

    /// Replace the config file by `text` as written.
    pub fn rewrite_config_text(&self, text: &str) {
        std::fs::write(&self.config_path, text).expect("rewrite the config file");
    }

    /// `POST /admin/reload` with `token` as the bearer token (none: no `Authorization`).
    pub fn admin_reload(&self, token: Option<&str>) -> Response {
        let mut req = Req::post("/admin/reload", "");
        if let Some(t) = token {
            req = req.header("Authorization", &format!("Bearer {t}"));
        }
        let mut c = Conn::open(self.admin_addr());
        c.set_timeout(Duration::from_secs(40));
        c.send(&req.build());
        c.read_response_to("POST")
    }

    /// Send one request on a fresh connection and read the response.
    pub fn request(&self, req: &Req) -> Response {
        let mut c = self.conn();
        c.send(&req.build());
        c.read_response_to(&req.method)
    }

    /// `POST path` with a JSON body on a fresh connection.
    pub fn post(&self, path: &str, body: &str) -> Response {
        self.request(&Req::post(path, body))
    }

    /// `GET path` on a fresh connection.
    pub fn get(&self, path: &str) -> Response {
        self.request(&Req::get(path))
    }

    /// `POST /v1/chat/completions` with `body` on a fresh connection.
    pub fn chat(&self, body: &str) -> Response {
        self.post("/v1/chat/completions", body)
    }
}

impl Drop for Sluice {
    fn drop(&mut self) {
        kill_child(&mut self.child);
    }
}

// ---------------------------------------------------------------------------------------------
// Observability: the admin listener, Prometheus text, the access log
// ---------------------------------------------------------------------------------------------

/// The address in `sluice: admin listening on ADDR (/metrics, /healthz, /readyz)`.
pub fn parse_admin_line(line: &str) -> Option<SocketAddr> {
    let rest = line.trim().strip_prefix("sluice: admin listening on ")?;
    rest.split(' ').next()?.parse().ok()
}

/// `GET path` on a fresh connection to an admin listener (one request per connection there).
pub fn admin_get(addr: SocketAddr, path: &str) -> Response {
    let mut c = Conn::open(addr);
    c.send(&Req::get(path).header("Connection", "close").build());
    c.read_response()
}

/// `GET /metrics`, asserted complete and 200, parsed by [`Metrics::parse`].
pub fn scrape(addr: SocketAddr) -> Metrics {
    let r = admin_get(addr, "/metrics");
    assert_eq!(r.status, 200, "GET /metrics:\n{}", r.dump());
    assert_eq!(r.end, BodyEnd::Complete, "GET /metrics:\n{}", r.dump());
    Metrics::parse(&r.text()).unwrap_or_else(|e| panic!("bad exposition ({e}):\n{}", r.text()))
}

/// One sample line of a Prometheus text exposition.
#[derive(Clone, Debug, PartialEq)]
pub struct Sample {
    pub name: String,
    pub labels: Vec<(String, String)>,
    pub value: f64,
}

impl Sample {
    /// The value of label `name`, if present.
    pub fn label(&self, name: &str) -> Option<&str> {
        self.labels
            .iter()
            .find(|(k, _)| k == name)
            .map(|(_, v)| v.as_str())
    }

    fn has(&self, labels: &[(&str, &str)]) -> bool {
        labels.iter().all(|(k, v)| self.label(k) == Some(*v))
    }
}

/// A parsed Prometheus text exposition (format 0.0.4). The parser is strict about the line
/// grammar (names, quoting, escapes, numbers) but does not check family semantics; tests that
/// need a reference parser use Python's `prometheus_client` as well.
#[derive(Clone, Debug, Default)]
pub struct Metrics {
    pub text: String,
    pub samples: Vec<Sample>,
    /// `# TYPE` declarations: (family name, type), in order.
    pub types: Vec<(String, String)>,
}

fn is_metric_name(s: &str) -> bool {
    let mut chars = s.chars();
    chars
        .next()
        .is_some_and(|c| c.is_ascii_alphabetic() || c == '_' || c == ':')
        && chars.all(|c| c.is_ascii_alphanumeric() || c == '_' || c == ':')
}

fn is_label_name(s: &str) -> bool {
    let mut chars = s.chars();
    chars
        .next()
        .is_some_and(|c| c.is_ascii_alphabetic() || c == '_')
        && chars.all(|c| c.is_ascii_alphanumeric() || c == '_')
}

fn parse_prom_value(s: &str) -> Result<f64, String> {
    match s {
        "+Inf" | "Inf" => Ok(f64::INFINITY),
        "-Inf" => Ok(f64::NEG_INFINITY),
        "NaN" => Ok(f64::NAN),
        _ if s.is_empty()
            || s.contains(|c: char| c.is_ascii_alphabetic() && c != 'e' && c != 'E') =>
        {
            Err(format!("bad value {s:?}"))
        }
        _ => s
            .parse::<f64>()
            .map_err(|e| format!("bad value {s:?}: {e}")),
    }
}

impl Metrics {
    pub fn parse(text: &str) -> Result<Metrics, String> {
        let mut m = Metrics {
            text: text.to_string(),
            ..Metrics::default()
        };
        if !text.is_empty() && !text.ends_with('\n') {
            return Err("exposition does not end with a newline".into());
        }
        for (no, line) in text.lines().enumerate() {
            let err = |what: String| format!("line {}: {what}: {line:?}", no + 1);
            if line.is_empty() {
                continue;
            }
            if let Some(rest) = line.strip_prefix('#') {
                let mut parts = rest.trim_start().splitn(3, ' ');
                match (parts.next(), parts.next(), parts.next()) {
                    (Some("TYPE"), Some(name), Some(kind)) => {
                        if !is_metric_name(name) {
                            return Err(err("bad metric name in TYPE".into()));
                        }
                        if !["counter", "gauge", "histogram", "summary", "untyped"].contains(&kind)
                        {
                            return Err(err(format!("unknown type {kind:?}")));
                        }
                        m.types.push((name.to_string(), kind.to_string()));
                    }
                    (Some("HELP"), Some(name), _) if !is_metric_name(name) => {
                        return Err(err("bad metric name in HELP".into()));
                    }
                    _ => {}
                }
                continue;
            }
            let name_end = line
                .find(['{', ' '])
                .ok_or_else(|| err("no value".into()))?;
            let name = &line[..name_end];
            if !is_metric_name(name) {
                return Err(err("bad metric name".into()));
            }
            let mut labels = Vec::new();
            let mut rest = &line[name_end..];
            if let Some(after) = rest.strip_prefix('{') {
                let mut chars = after.char_indices().peekable();
                let mut end = None;
                loop {
                    // Label name up to '=' (or the closing brace).
                    let start = match chars.peek() {
                        Some((_, '}')) => {
                            end = Some(chars.next().map(|(i, _)| i + 1).unwrap_or(0));
                            break;
                        }
                        Some((i, _)) => *i,
                        None => break,
                    };
                    let mut eq = None;
                    for (i, c) in chars.by_ref() {
                        if c == '=' {
                            eq = Some(i);
                            break;
                        }
                    }
                    let eq = eq.ok_or_else(|| err("label without '='".into()))?;
                    let lname = &after[start..eq];
                    if !is_label_name(lname) {
                        return Err(err(format!("bad label name {lname:?}")));
                    }
                    if chars.next().map(|(_, c)| c) != Some('"') {
                        return Err(err("label value not quoted".into()));
                    }
                    let mut value = String::new();
                    let mut closed = false;
                    while let Some((_, c)) = chars.next() {
                        match c {
                            '"' => {
                                closed = true;
                                break;
                            }
                            '\\' => match chars.next().map(|(_, c)| c) {
                                Some('\\') => value.push('\\'),
                                Some('"') => value.push('"'),
                                Some('n') => value.push('\n'),
                                other => return Err(err(format!("bad escape {other:?}"))),
                            },
                            '\n' => return Err(err("newline in label value".into())),
                            c => value.push(c),
                        }
                    }
                    if !closed {
                        return Err(err("unterminated label value".into()));
                    }
                    if labels.iter().any(|(k, _): &(String, String)| k == lname) {
                        return Err(err(format!("duplicate label {lname:?}")));
                    }
                    labels.push((lname.to_string(), value));
                    match chars.next() {
                        Some((_, ',')) => {}
                        Some((i, '}')) => {
                            end = Some(i + 1);
                            break;
                        }
                        _ => return Err(err("expected ',' or '}' after a label".into())),
                    }
                }
                let end = end.ok_or_else(|| err("unterminated label set".into()))?;
                rest = &after[end..];
            }
            let rest = rest
                .strip_prefix(' ')
                .ok_or_else(|| err("no space before the value".into()))?;
            let mut fields = rest.split(' ');
            let value = parse_prom_value(fields.next().unwrap_or("")).map_err(&err)?;
            if let Some(ts) = fields.next() {
                ts.parse::<i64>()
                    .map_err(|_| err(format!("bad timestamp {ts:?}")))?;
            }
            if fields.next().is_some() {
                return Err(err("trailing fields".into()));
            }
            m.samples.push(Sample {
                name: name.to_string(),
                labels,
                value,
            });
        }
        Ok(m)
    }

    /// The samples named `name` whose labels include all of `labels`.
    pub fn matching<'a>(
        &'a self,
        name: &'a str,
        labels: &'a [(&'a str, &'a str)],
    ) -> impl Iterator<Item = &'a Sample> + 'a {
        self.samples
            .iter()
            .filter(move |s| s.name == name && s.has(labels))
    }

    /// The one sample named `name` whose labels include `labels`; `None` if there is none,
    /// panics if there are several.
    pub fn get(&self, name: &str, labels: &[(&str, &str)]) -> Option<f64> {
        let found: Vec<&Sample> = self.matching(name, labels).collect();
        assert!(
            found.len() <= 1,
            "{name}{labels:?} matches {} samples: {found:?}",
            found.len()
        );
        found.first().map(|s| s.value)
    }

    /// The sum over the samples named `name` whose labels include `labels` (0 if none).
    pub fn sum(&self, name: &str, labels: &[(&str, &str)]) -> f64 {
        self.matching(name, labels).map(|s| s.value).sum()
    }

    /// The declared type of family `name`.
    pub fn type_of(&self, name: &str) -> Option<&str> {
        self.types
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, t)| t.as_str())
    }
}

/// Run `cmd` to completion with piped stdout/stderr; panics if it takes longer than `within`.
pub fn output_within(mut cmd: Command, within: Duration, what: &str) -> Output {
    cmd.stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    die_with_parent(&mut cmd);
    let mut child = cmd.spawn().unwrap_or_else(|e| panic!("spawn {what}: {e}"));
    let mut out = child.stdout.take().expect("stdout");
    let mut err = child.stderr.take().expect("stderr");
    let t_out = std::thread::spawn(move || {
        let mut v = Vec::new();
        let _ = out.read_to_end(&mut v);
        v
    });
    let t_err = std::thread::spawn(move || {
        let mut v = Vec::new();
        let _ = err.read_to_end(&mut v);
        v
    });
    let done = wait_until(within, || matches!(child.try_wait(), Ok(Some(_))));
    if !done {
        kill_child(&mut child);
        panic!("{what} did not exit within {within:?}");
    }
    let status = child.wait().expect("wait");
    Output {
        status,
        stdout: t_out.join().unwrap_or_default(),
        stderr: t_err.join().unwrap_or_default(),
    }
}

/// The access-log files (`*.pb`) in `dir`, in name order (per worker, that is time order).
pub fn access_log_files(dir: &Path) -> Vec<PathBuf> {
    let mut files: Vec<PathBuf> = std::fs::read_dir(dir)
        .unwrap_or_else(|e| panic!("read {}: {e}", dir.display()))
        .map(|e| e.expect("dir entry").path())
        .filter(|p| p.extension().is_some_and(|x| x == "pb"))
        .collect();
    files.sort();
    files
}

/// What `sluice logs FILE…` made of an access-log directory.
#[derive(Debug)]
pub struct LogDump {
    pub files: Vec<PathBuf>,
    /// Whether `sluice logs` exited 0 (every file decoded completely).
    pub ok: bool,
    /// One JSON object per record printed.
    pub records: Vec<Value>,
    pub stderr: String,
}

impl LogDump {
    /// A one-line summary for assertion messages.
    pub fn describe(&self) -> String {
        format!(
            "{} record(s) from {} file(s), sluice logs {}; stderr: {}",
            self.records.len(),
            self.files.len(),
            if self.ok { "ok" } else { "FAILED" },
            self.stderr.trim()
        )
    }
}

/// Decode every access-log file in `dir` with the real `sluice logs`.
pub fn read_access_log(dir: &Path) -> LogDump {
    let files = access_log_files(dir);
    if files.is_empty() {
        return LogDump {
            files,
            ok: true,
            records: Vec::new(),
            stderr: String::new(),
        };
    }
    let mut cmd = Command::new(bin("sluice"));
    cmd.arg("logs").args(&files);
    let out = output_within(cmd, Duration::from_secs(30), "sluice logs");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let records = stdout
        .lines()
        .map(|l| {
            serde_json::from_str(l)
                .unwrap_or_else(|e| panic!("sluice logs printed a non-JSON line ({e}): {l:?}"))
        })
        .collect();
    LogDump {
        files,
        ok: out.status.success(),
        records,
        stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
    }
}

/// Decode the access log every 50 ms until `cond` holds or `within` passes (records reach the
/// files every `flush_interval_ms`); returns the last reading, so the caller asserts on it.
pub fn wait_access_log(
    dir: &Path,
    within: Duration,
    mut cond: impl FnMut(&LogDump) -> bool,
) -> LogDump {
    let deadline = Instant::now() + within;
    loop {
        let d = read_access_log(dir);
        if cond(&d) || Instant::now() >= deadline {
            return d;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Wait (up to `within`) until the access log in `dir` decodes cleanly to at least `n` records;
/// panics otherwise. Returns them.
pub fn wait_records(dir: &Path, n: usize, within: Duration) -> Vec<Value> {
    let d = wait_access_log(dir, within, |d| d.ok && d.records.len() >= n);
    assert!(
        d.ok && d.records.len() >= n,
        "expected {n} access-log record(s) within {within:?}; got {}",
        d.describe()
    );
    d.records
}

// ---------------------------------------------------------------------------------------------
// HTTP/1.1 client
// ---------------------------------------------------------------------------------------------

/// A request builder producing raw bytes. Adds `Host` and `Content-Length` unless told not to.
#[derive(Clone, Debug)]
pub struct Req {
    pub method: String,
    pub target: String,
    pub headers: Vec<(String, String)>,
    pub body: Vec<u8>,
    auto_host: bool,
    auto_length: bool,
}

impl Req {
    pub fn new(method: &str, target: &str) -> Req {
        Req {
            method: method.to_string(),
            target: target.to_string(),
            headers: Vec::new(),
            body: Vec::new(),
            auto_host: true,
            auto_length: true,
        }
    }

    pub fn get(target: &str) -> Req {
        Req::new("GET", target)
    }

    /// A POST with a JSON body.
    pub fn post(target: &str, body: &str) -> Req {
        Req::new("POST", target)
            .header("Content-Type", "application/json")
            .body(body.as_bytes())
    }

    pub fn header(mut self, name: &str, value: &str) -> Req {
        self.headers.push((name.to_string(), value.to_string()));
        self
    }

    pub fn body(mut self, body: &[u8]) -> Req {
        self.body = body.to_vec();
        self
    }

    /// Do not add a `Host` header.
    pub fn no_host(mut self) -> Req {
        self.auto_host = false;
        self
    }

    /// Do not add a `Content-Length` header (set framing headers yourself).
    pub fn no_length(mut self) -> Req {
        self.auto_length = false;
        self
    }

    /// The request head only (ends with the blank line).
    pub fn build_head(&self) -> Vec<u8> {
        let mut out = Vec::new();
        out.extend_from_slice(format!("{} {} HTTP/1.1\r\n", self.method, self.target).as_bytes());
        if self.auto_host {
            out.extend_from_slice(b"Host: sluice.test\r\n");
        }
        for (k, v) in &self.headers {
            out.extend_from_slice(k.as_bytes());
            out.extend_from_slice(b": ");
            out.extend_from_slice(v.as_bytes());
            out.extend_from_slice(b"\r\n");
        }
        if self.auto_length && (!self.body.is_empty() || self.method == "POST") {
            out.extend_from_slice(format!("Content-Length: {}\r\n", self.body.len()).as_bytes());
        }
        out.extend_from_slice(b"\r\n");
        out
    }

    /// Head and body.
    pub fn build(&self) -> Vec<u8> {
        let mut out = self.build_head();
        out.extend_from_slice(&self.body);
        out
    }
}

/// Encode `parts` as a chunked body, including the last chunk and final CRLF.
pub fn chunked(parts: &[&[u8]]) -> Vec<u8> {
    let mut out = Vec::new();
    for p in parts {
        out.extend_from_slice(format!("{:x}\r\n", p.len()).as_bytes());
        out.extend_from_slice(p);
        out.extend_from_slice(b"\r\n");
    }
    out.extend_from_slice(b"0\r\n\r\n");
    out
}

/// A response head.
#[derive(Clone, Debug)]
pub struct Head {
    pub version: String,
    pub status: u16,
    pub reason: String,
    pub headers: Vec<(String, String)>,
    /// When the end of the head arrived.
    pub at: Instant,
}

impl Head {
    /// The first value of header `name` (case-insensitive).
    pub fn header(&self, name: &str) -> Option<&str> {
        header_in(&self.headers, name)
    }

    /// All values of header `name`.
    pub fn headers_named(&self, name: &str) -> Vec<&str> {
        self.headers
            .iter()
            .filter(|(k, _)| k.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
            .collect()
    }
}

fn header_in<'a>(headers: &'a [(String, String)], name: &str) -> Option<&'a str> {
    headers
        .iter()
        .find(|(k, _)| k.eq_ignore_ascii_case(name))
        .map(|(_, v)| v.as_str())
}

/// How a response body was delimited.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Framing {
    /// No body by definition (HEAD, 1xx, 204, 304).
    None,
    Length(u64),
    Chunked,
    /// Read until the connection closed.
    Close,
}

/// How reading the body ended.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum BodyEnd {
    /// The framing said the body was complete (or a close-delimited body reached EOF).
    Complete,
    /// The connection closed (EOF) before the framing said the body was complete.
    Truncated,
    /// The connection was reset before the body was complete.
    Reset,
    /// A read timed out before the body was complete.
    Timeout,
    /// The body's framing was invalid (the string says how).
    Malformed(String),
}

/// A piece of body data (a chunk's data, or one read's worth for non-chunked bodies) and when
/// its last byte arrived.
#[derive(Clone, Debug)]
pub struct Piece {
    pub at: Instant,
    pub data: Vec<u8>,
}

/// A full response.
#[derive(Clone, Debug)]
pub struct Response {
    pub version: String,
    pub status: u16,
    pub reason: String,
    pub headers: Vec<(String, String)>,
    pub head_at: Instant,
    pub framing: Framing,
    pub body: Vec<u8>,
    pub pieces: Vec<Piece>,
    pub trailers: Vec<(String, String)>,
    pub end: BodyEnd,
}

impl Response {
    pub fn header(&self, name: &str) -> Option<&str> {
        header_in(&self.headers, name)
    }

    /// Whether header `name` holds the comma-separated token `token` (case-insensitive).
    pub fn header_has_token(&self, name: &str, token: &str) -> bool {
        self.headers
            .iter()
            .filter(|(k, _)| k.eq_ignore_ascii_case(name))
            .any(|(_, v)| v.split(',').any(|t| t.trim().eq_ignore_ascii_case(token)))
    }

    pub fn text(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }

    /// The body as JSON; panics with the body when it is not.
    pub fn json(&self) -> Value {
        serde_json::from_slice(&self.body).unwrap_or_else(|e| {
            panic!(
                "response body is not JSON ({e}); status {}; body: {:?}",
                self.status,
                self.text()
            )
        })
    }

    /// The raw head + body as text, for assertion messages and secret scans.
    pub fn dump(&self) -> String {
        let mut s = format!("{} {} {}\n", self.version, self.status, self.reason);
        for (k, v) in &self.headers {
            let _ = writeln!(s, "{k}: {v}");
        }
        s.push('\n');
        s.push_str(&self.text());
        for (k, v) in &self.trailers {
            let _ = write!(s, "\n{k}: {v}");
        }
        s
    }

    /// Server-sent events in the body, each stamped with the arrival of its last byte.
    pub fn sse_events(&self) -> Vec<SseEvent> {
        parse_sse(&self.pieces)
    }
}

/// Outcome of waiting for the peer to close.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum CloseState {
    /// Orderly close (read returned 0).
    Eof,
    /// Connection reset.
    Reset,
    /// Nothing arrived and the connection stayed open until the deadline.
    Open,
    /// The peer sent more bytes (shown lossily).
    Data(String),
}

impl CloseState {
    pub fn is_closed(&self) -> bool {
        matches!(self, CloseState::Eof | CloseState::Reset)
    }
}

#[derive(Debug)]
pub enum ReadError {
    /// EOF before any byte of a head.
    Closed,
    /// EOF in the middle of a head.
    Truncated(Vec<u8>),
    Reset,
    Timeout,
    Malformed(String),
    Io(io::Error),
}

fn classify(e: io::Error) -> ReadError {
    match e.kind() {
        io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut => ReadError::Timeout,
        io::ErrorKind::ConnectionReset
        | io::ErrorKind::ConnectionAborted
        | io::ErrorKind::BrokenPipe => ReadError::Reset,
        _ => ReadError::Io(e),
    }
}

/// A blocking client connection with read/write timeouts always set. Unconsumed bytes are kept
/// between responses, so keep-alive reuse works. Each read is stamped, so callers can tell when
/// any byte arrived.
pub struct Conn {
    stream: TcpStream,
    buf: Vec<u8>,
    /// Absolute stream offset of `buf[0]`.
    base: u64,
    /// (absolute end offset, arrival instant) of each read, oldest first.
    reads: Vec<(u64, Instant)>,
    timeout: Duration,
}

impl Conn {
    pub fn open(addr: SocketAddr) -> Conn {
        let stream = TcpStream::connect_timeout(&addr, IO_TIMEOUT)
            .unwrap_or_else(|e| panic!("connect to {addr}: {e}"));
        Self::from_stream(stream)
    }

    /// A connection over a socket the caller connected (to handle a connect error itself).
    pub fn from_stream(stream: TcpStream) -> Conn {
        stream.set_nodelay(true).expect("nodelay");
        let mut c = Conn {
            stream,
            buf: Vec::new(),
            base: 0,
            reads: Vec::new(),
            timeout: IO_TIMEOUT,
        };
        c.set_timeout(IO_TIMEOUT);
        c
    }

    /// Set the read and write timeout for subsequent operations (must be non-zero).
    pub fn set_timeout(&mut self, d: Duration) {
        self.timeout = d;
        self.stream.set_read_timeout(Some(d)).expect("read timeout");
        self.stream
            .set_write_timeout(Some(d))
            .expect("write timeout");
    }

    pub fn stream(&self) -> &TcpStream {
        &self.stream
    }

    /// A second handle to the socket (e.g. for a writer thread).
    pub fn try_clone_stream(&self) -> TcpStream {
        self.stream.try_clone().expect("clone stream")
    }

    /// Write all bytes; panics on error.
    pub fn send(&mut self, bytes: &[u8]) {
        self.try_send(bytes)
            .unwrap_or_else(|e| panic!("send {} bytes: {e}", bytes.len()));
    }

    /// Write all bytes.
    pub fn try_send(&mut self, bytes: &[u8]) -> io::Result<()> {
        self.stream.write_all(bytes)?;
        self.stream.flush()
    }

    /// Half-close the write side.
    pub fn shutdown_write(&self) {
        let _ = self.stream.shutdown(Shutdown::Write);
    }

    /// Bytes received but not consumed by a response parser yet.
    pub fn buffered(&self) -> &[u8] {
        &self.buf
    }

    /// Read once more from the socket into the buffer; returns the count (0 = EOF).
    pub fn read_more(&mut self) -> io::Result<usize> {
        self.fill()
    }

    /// Read a streamed response's body (after its head) until `n` SSE events with content have
    /// arrived, within 5 s; panics if the stream ends or stalls first. The bytes are kept
    /// (still chunk-framed, which does not hide the SSE lines from the parser).
    pub fn read_until_content_events(&mut self, n: usize) {
        let deadline = Instant::now() + Duration::from_secs(5);
        loop {
            let piece = Piece {
                at: Instant::now(),
                data: self.buffered().to_vec(),
            };
            let seen = parse_sse(&[piece])
                .iter()
                .filter(|e| e.content().is_some())
                .count();
            if seen >= n {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "{n} content events did not arrive"
            );
            assert!(
                self.read_more().expect("read stream") > 0,
                "stream ended early"
            );
        }
    }

    /// Read more bytes into the buffer; returns the count (0 = EOF).
    fn fill(&mut self) -> io::Result<usize> {
        let mut tmp = [0u8; 16384];
        let n = loop {
            match self.stream.read(&mut tmp) {
                Ok(n) => break n,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) => return Err(e),
            }
        };
        if n > 0 {
            self.buf.extend_from_slice(&tmp[..n]);
            let end = self.base + self.buf.len() as u64;
            self.reads.push((end, Instant::now()));
        }
        Ok(n)
    }

    /// Arrival instant of the byte at absolute offset `off`.
    fn arrival(&self, off: u64) -> Instant {
        self.reads
            .iter()
            .find(|(end, _)| *end > off)
            .or(self.reads.last())
            .map(|(_, t)| *t)
            .unwrap_or_else(Instant::now)
    }

    fn consume(&mut self, n: usize) -> Vec<u8> {
        let out: Vec<u8> = self.buf.drain(..n).collect();
        self.base += n as u64;
        // Forget reads entirely before the new base, keeping the one spanning it.
        let base = self.base;
        let keep_from = self
            .reads
            .iter()
            .position(|(end, _)| *end > base)
            .unwrap_or(self.reads.len());
        self.reads.drain(..keep_from);
        out
    }

    /// Read one response head (which may be a 1xx interim response).
    pub fn read_head(&mut self) -> Result<Head, ReadError> {
        loop {
            if let Some(pos) = find(&self.buf, b"\r\n\r\n") {
                let at = self.arrival(self.base + pos as u64 + 3);
                let raw = self.consume(pos + 4);
                return parse_head(&raw[..pos], at);
            }
            if self.buf.len() > 1 << 20 {
                return Err(ReadError::Malformed("response head over 1 MiB".into()));
            }
            match self.fill() {
                Ok(0) if self.buf.is_empty() => return Err(ReadError::Closed),
                Ok(0) => return Err(ReadError::Truncated(self.buf.clone())),
                Ok(_) => {}
                Err(e) => return Err(classify(e)),
            }
        }
    }

    /// Read a response to a non-HEAD request, skipping interim 1xx responses; panics if no
    /// head arrives.
    pub fn read_response(&mut self) -> Response {
        self.read_response_to("GET")
    }

    /// Like [`Conn::read_response`], for a request with `method` (HEAD responses have no body).
    pub fn read_response_to(&mut self, method: &str) -> Response {
        self.try_read_response(method)
            .unwrap_or_else(|e| panic!("no response head: {e:?}"))
    }

    pub fn try_read_response(&mut self, method: &str) -> Result<Response, ReadError> {
        let head = loop {
            let h = self.read_head()?;
            if (100..200).contains(&h.status) && h.status != 101 {
                continue;
            }
            break h;
        };
        Ok(self.read_body(head, method))
    }

    /// Read the body that follows `head` (a response to `method`).
    pub fn read_body(&mut self, head: Head, method: &str) -> Response {
        let mut resp = Response {
            version: head.version.clone(),
            status: head.status,
            reason: head.reason.clone(),
            headers: head.headers.clone(),
            head_at: head.at,
            framing: Framing::None,
            body: Vec::new(),
            pieces: Vec::new(),
            trailers: Vec::new(),
            end: BodyEnd::Complete,
        };
        let no_body = method.eq_ignore_ascii_case("HEAD")
            || (100..200).contains(&head.status)
            || head.status == 204
            || head.status == 304;
        if no_body {
            return resp;
        }
        let te = head.headers_named("transfer-encoding");
        let cls = head.headers_named("content-length");
        if !te.is_empty() {
            if !cls.is_empty() {
                resp.end = BodyEnd::Malformed(
                    "response has both Transfer-Encoding and Content-Length".into(),
                );
                return resp;
            }
            let codings: Vec<String> = te
                .iter()
                .flat_map(|v| v.split(','))
                .map(|t| t.trim().to_ascii_lowercase())
                .collect();
            if codings.last().map(String::as_str) != Some("chunked") {
                resp.framing = Framing::Close;
                resp.end = BodyEnd::Malformed(format!("unexpected transfer-encoding {codings:?}"));
                return resp;
            }
            resp.framing = Framing::Chunked;
            self.read_chunked(&mut resp);
        } else if !cls.is_empty() {
            let vals: Vec<&str> = cls
                .iter()
                .flat_map(|v| v.split(','))
                .map(str::trim)
                .collect();
            let first = vals[0];
            if vals.iter().any(|v| *v != first)
                || first.is_empty()
                || !first.bytes().all(|b| b.is_ascii_digit())
            {
                resp.end = BodyEnd::Malformed(format!("bad response Content-Length {cls:?}"));
                return resp;
            }
            let n: u64 = first.parse().unwrap_or(u64::MAX);
            resp.framing = Framing::Length(n);
            self.read_exact_body(&mut resp, n);
        } else {
            resp.framing = Framing::Close;
            self.read_to_close(&mut resp);
        }
        resp
    }

    fn push_piece(&mut self, resp: &mut Response, n: usize) {
        let at = self.arrival(self.base + n as u64 - 1);
        let data = self.consume(n);
        resp.body.extend_from_slice(&data);
        resp.pieces.push(Piece { at, data });
    }

    fn read_exact_body(&mut self, resp: &mut Response, len: u64) {
        let mut left = len;
        while left > 0 {
            if self.buf.is_empty() {
                match self.fill() {
                    Ok(0) => {
                        resp.end = BodyEnd::Truncated;
                        return;
                    }
                    Ok(_) => {}
                    Err(e) => {
                        resp.end = end_from(classify(e));
                        return;
                    }
                }
            }
            let take = (self.buf.len() as u64).min(left) as usize;
            self.push_piece(resp, take);
            left -= take as u64;
        }
    }

    fn read_to_close(&mut self, resp: &mut Response) {
        loop {
            if !self.buf.is_empty() {
                let n = self.buf.len();
                self.push_piece(resp, n);
            }
            match self.fill() {
                Ok(0) => return,
                Ok(_) => {}
                Err(e) => {
                    resp.end = end_from(classify(e));
                    return;
                }
            }
        }
    }

    /// Read until `buf` holds a CRLF-terminated line; returns the line without CRLF.
    fn read_line(&mut self, limit: usize) -> Result<Vec<u8>, BodyEnd> {
        loop {
            if let Some(pos) = find(&self.buf, b"\r\n") {
                let line = self.consume(pos + 2);
                return Ok(line[..pos].to_vec());
            }
            if self.buf.len() > limit {
                return Err(BodyEnd::Malformed("line too long".into()));
            }
            match self.fill() {
                Ok(0) => return Err(BodyEnd::Truncated),
                Ok(_) => {}
                Err(e) => return Err(end_from(classify(e))),
            }
        }
    }

    fn read_chunked(&mut self, resp: &mut Response) {
        loop {
            let line = match self.read_line(4096) {
                Ok(l) => l,
                Err(e) => {
                    resp.end = e;
                    return;
                }
            };
            let size_part = line.split(|b| *b == b';').next().unwrap_or(&[]);
            let size_str = String::from_utf8_lossy(size_part)
                .trim_end_matches([' ', '\t'])
                .to_string();
            if size_str.is_empty()
                || size_str.len() > 16
                || !size_str.bytes().all(|b| b.is_ascii_hexdigit())
            {
                resp.end = BodyEnd::Malformed(format!(
                    "bad chunk size line {:?}",
                    String::from_utf8_lossy(&line)
                ));
                return;
            }
            let size = u64::from_str_radix(&size_str, 16).unwrap_or(u64::MAX);
            if size == 0 {
                // Trailer section.
                loop {
                    match self.read_line(65536) {
                        Ok(l) if l.is_empty() => return,
                        Ok(l) => {
                            let s = String::from_utf8_lossy(&l).into_owned();
                            match s.split_once(':') {
                                Some((k, v)) => {
                                    resp.trailers.push((k.to_string(), v.trim().to_string()))
                                }
                                None => {
                                    resp.end = BodyEnd::Malformed(format!("bad trailer {s:?}"));
                                    return;
                                }
                            }
                        }
                        Err(e) => {
                            resp.end = e;
                            return;
                        }
                    }
                }
            }
            // Chunk data + CRLF.
            let need = size as usize + 2;
            while self.buf.len() < need {
                match self.fill() {
                    Ok(0) => {
                        resp.end = BodyEnd::Truncated;
                        return;
                    }
                    Ok(_) => {}
                    Err(e) => {
                        resp.end = end_from(classify(e));
                        return;
                    }
                }
            }
            if &self.buf[size as usize..need] != b"\r\n" {
                resp.end = BodyEnd::Malformed("chunk data not followed by CRLF".into());
                return;
            }
            self.push_piece(resp, size as usize);
            self.consume(2);
        }
    }

    /// Wait up to `within` for the peer to close the connection (extra bytes count as
    /// [`CloseState::Data`]). Restores the normal timeout afterwards.
    pub fn wait_close(&mut self, within: Duration) -> CloseState {
        if !self.buf.is_empty() {
            return CloseState::Data(String::from_utf8_lossy(&self.buf).into_owned());
        }
        let saved = self.timeout;
        let _ = self
            .stream
            .set_read_timeout(Some(within.max(Duration::from_millis(1))));
        let result = match self.fill() {
            Ok(0) => CloseState::Eof,
            Ok(_) => CloseState::Data(String::from_utf8_lossy(&self.buf).into_owned()),
            Err(e) => match classify(e) {
                ReadError::Reset => CloseState::Reset,
                ReadError::Timeout => CloseState::Open,
                other => panic!("waiting for close: {other:?}"),
            },
        };
        self.set_timeout(saved);
        result
    }

    /// Assert that the server closes this connection within `within` without sending more.
    pub fn assert_closed(&mut self, within: Duration) {
        let st = self.wait_close(within);
        assert!(
            st.is_closed(),
            "expected the server to close the connection within {within:?}, got {st:?}"
        );
    }
}

fn end_from(e: ReadError) -> BodyEnd {
    match e {
        ReadError::Reset => BodyEnd::Reset,
        ReadError::Timeout => BodyEnd::Timeout,
        ReadError::Closed | ReadError::Truncated(_) => BodyEnd::Truncated,
        ReadError::Malformed(m) => BodyEnd::Malformed(m),
        ReadError::Io(e) => BodyEnd::Malformed(format!("io: {e}")),
    }
}

fn find(hay: &[u8], needle: &[u8]) -> Option<usize> {
    hay.windows(needle.len()).position(|w| w == needle)
}

fn parse_head(raw: &[u8], at: Instant) -> Result<Head, ReadError> {
    let text = std::str::from_utf8(raw)
        .map_err(|_| ReadError::Malformed(format!("non-UTF-8 response head: {raw:?}")))?;
    let mut lines = text.split("\r\n");
    let status_line = lines.next().unwrap_or("");
    if status_line.contains('\n') || status_line.contains('\r') {
        return Err(ReadError::Malformed(format!(
            "bare CR/LF in status line {status_line:?}"
        )));
    }
    let mut parts = status_line.splitn(3, ' ');
    let version = parts.next().unwrap_or("").to_string();
    let status = parts
        .next()
        .and_then(|s| s.parse::<u16>().ok())
        .filter(|s| (100..1000).contains(s))
        .ok_or_else(|| ReadError::Malformed(format!("bad status line {status_line:?}")))?;
    if !version.starts_with("HTTP/1.") {
        return Err(ReadError::Malformed(format!(
            "bad status line {status_line:?}"
        )));
    }
    let reason = parts.next().unwrap_or("").to_string();
    let mut headers = Vec::new();
    for line in lines {
        if line.contains('\n') || line.contains('\r') {
            return Err(ReadError::Malformed(format!(
                "bare CR/LF in header {line:?}"
            )));
        }
        let (k, v) = line
            .split_once(':')
            .ok_or_else(|| ReadError::Malformed(format!("bad header line {line:?}")))?;
        if k.is_empty() || k.contains([' ', '\t']) {
            return Err(ReadError::Malformed(format!("bad header name {k:?}")));
        }
        headers.push((k.to_string(), v.trim().to_string()));
    }
    Ok(Head {
        version,
        status,
        reason,
        headers,
        at,
    })
}

// ---------------------------------------------------------------------------------------------
// SSE
// ---------------------------------------------------------------------------------------------

/// One server-sent event.
#[derive(Clone, Debug)]
pub struct SseEvent {
    /// When the blank line ending the event arrived.
    pub at: Instant,
    pub event: Option<String>,
    /// `data:` lines joined with `\n`.
    pub data: String,
    /// Comment lines (`: ...`), without the colon.
    pub comments: Vec<String>,
}

impl SseEvent {
    pub fn is_done(&self) -> bool {
        self.data == "[DONE]"
    }

    /// The data as JSON, if it is JSON.
    pub fn json(&self) -> Option<Value> {
        serde_json::from_str(&self.data).ok()
    }

    /// Whether the data is an OpenAI-shaped error object.
    pub fn is_error(&self) -> bool {
        self.json().is_some_and(|v| v.get("error").is_some())
    }

    /// Non-empty `choices[0].delta.content` (chat), `choices[0].text` (completions) or `delta`
    /// of a `response.output_text.delta` event, if present.
    pub fn content(&self) -> Option<String> {
        let v = self.json()?;
        let text = match v.get("choices").and_then(|c| c.get(0)) {
            Some(c) => c
                .get("delta")
                .and_then(|d| d.get("content"))
                .or_else(|| c.get("text"))
                .and_then(Value::as_str),
            None if v.get("type").and_then(Value::as_str) == Some("response.output_text.delta") => {
                v.get("delta").and_then(Value::as_str)
            }
            None => None,
        }?;
        (!text.is_empty()).then(|| text.to_string())
    }
}

/// Parse SSE events from timestamped body pieces. Lines end in LF, CRLF or CR; an event ends
/// at a blank line, and is stamped with the arrival of the piece holding that blank line. An
/// unterminated trailing event is dropped.
pub fn parse_sse(pieces: &[Piece]) -> Vec<SseEvent> {
    let mut events = Vec::new();
    let mut line: Vec<u8> = Vec::new();
    let mut cur = SseEvent {
        at: Instant::now(),
        event: None,
        data: String::new(),
        comments: Vec::new(),
    };
    let mut has_fields = false;
    let mut data_lines: Vec<String> = Vec::new();
    let mut prev_cr = false;
    for piece in pieces {
        for &b in &piece.data {
            if prev_cr && b == b'\n' {
                prev_cr = false;
                continue;
            }
            prev_cr = b == b'\r';
            if b != b'\n' && b != b'\r' {
                line.push(b);
                continue;
            }
            // End of a line.
            if line.is_empty() {
                if has_fields {
                    cur.data = data_lines.join("\n");
                    cur.at = piece.at;
                    events.push(cur.clone());
                }
                cur = SseEvent {
                    at: piece.at,
                    event: None,
                    data: String::new(),
                    comments: Vec::new(),
                };
                data_lines.clear();
                has_fields = false;
                continue;
            }
            let l = String::from_utf8_lossy(&line).into_owned();
            line.clear();
            has_fields = true;
            if let Some(c) = l.strip_prefix(':') {
                cur.comments.push(c.trim_start().to_string());
                continue;
            }
            let (field, value) = match l.split_once(':') {
                Some((f, v)) => (f.to_string(), v.strip_prefix(' ').unwrap_or(v).to_string()),
                None => (l.clone(), String::new()),
            };
            match field.as_str() {
                "data" => data_lines.push(value),
                "event" => cur.event = Some(value),
                _ => {}
            }
        }
    }
    events
}

// ---------------------------------------------------------------------------------------------
// Assertions
// ---------------------------------------------------------------------------------------------

/// Assert `resp` has `status` and an OpenAI-shaped JSON error body
/// `{"error":{"message","type","param","code"}}`; returns the inner error object.
pub fn assert_openai_error(resp: &Response, status: u16) -> Value {
    assert_eq!(
        resp.status,
        status,
        "expected status {status}, got:\n{}",
        resp.dump()
    );
    assert_eq!(
        resp.end,
        BodyEnd::Complete,
        "error body not completely delivered:\n{}",
        resp.dump()
    );
    let ct = resp.header("content-type").unwrap_or("");
    assert!(
        ct.to_ascii_lowercase().starts_with("application/json"),
        "error content-type should be application/json, got {ct:?}:\n{}",
        resp.dump()
    );
    let v: Value = serde_json::from_slice(&resp.body)
        .unwrap_or_else(|e| panic!("error body is not JSON ({e}):\n{}", resp.dump()));
    assert_error_value(&v).unwrap_or_else(|m| panic!("{m}:\n{}", resp.dump()));
    v["error"].clone()
}

/// Check a JSON value is `{"error":{"message":str,"type":str,"param":..,"code":..}}`.
pub fn assert_error_value(v: &Value) -> Result<(), String> {
    let err = v
        .get("error")
        .and_then(Value::as_object)
        .ok_or("no top-level \"error\" object")?;
    let msg = err.get("message").and_then(Value::as_str).unwrap_or("");
    if msg.is_empty() {
        return Err("error.message missing or empty".into());
    }
    let ty = err.get("type").and_then(Value::as_str).unwrap_or("");
    if ty.is_empty() {
        return Err("error.type missing or empty".into());
    }
    for key in ["param", "code"] {
        match err.get(key) {
            Some(Value::Null) | Some(Value::String(_)) => {}
            Some(Value::Number(_)) if key == "code" => {}
            Some(other) => return Err(format!("error.{key} has unexpected type: {other}")),
            None => return Err(format!("error.{key} missing")),
        }
    }
    Ok(())
}

/// Assert that a 400/413/414/431/408-class answer is followed by the server closing the
/// connection.
pub fn assert_error_and_close(conn: &mut Conn, status: u16) -> Value {
    let resp = conn.read_response();
    let err = assert_openai_error(&resp, status);
    conn.assert_closed(Duration::from_secs(3));
    err
}

/// A minimal valid chat body for `model`.
/// The SHA-256 of an API key, as `sluice key hash` prints it for `[[keys]] sha256` (the tool
/// operators use, run here for real).
pub fn key_hash(key: &str) -> String {
    let out = Command::new(bin("sluice"))
        .args(["key", "hash", key])
        .output()
        .expect("run sluice key hash");
    assert!(out.status.success(), "sluice key hash failed");
    String::from_utf8(out.stdout)
        .expect("utf-8")
        .trim()
        .to_string()
}

pub fn chat_body(model: &str) -> String {
    json!({"model": model, "messages": [{"role": "user", "content": "hello"}]}).to_string()
}

/// A minimal valid streaming chat body for `model`.
pub fn chat_stream_body(model: &str) -> String {
    json!({"model": model, "stream": true, "messages": [{"role": "user", "content": "hello"}]})
        .to_string()
}

/// The mock's `echo` object from a non-streaming response (or from a stream's `: echo` comment).
pub fn echo_of(resp: &Response) -> Value {
    if resp
        .header("content-type")
        .is_some_and(|c| c.contains("text/event-stream"))
    {
        for ev in resp.sse_events() {
            for c in &ev.comments {
                if let Some(j) = c.strip_prefix("echo ") {
                    return serde_json::from_str(j).expect("echo JSON");
                }
            }
        }
        panic!("stream carries no `: echo` comment:\n{}", resp.dump());
    }
    let v = resp.json();
    v.get("echo")
        .cloned()
        .unwrap_or_else(|| panic!("response has no echo:\n{}", resp.dump()))
}

/// The headers in a mock echo, as (lowercased name, value) pairs.
pub fn echo_headers(echo: &Value) -> Vec<(String, String)> {
    echo["headers"]
        .as_array()
        .expect("echo.headers")
        .iter()
        .map(|p| {
            (
                p[0].as_str().unwrap_or("").to_ascii_lowercase(),
                p[1].as_str().unwrap_or("").to_string(),
            )
        })
        .collect()
}

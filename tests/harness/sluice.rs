//! sluice: the real binary started on a config, its listeners, reloads, signals and output.

use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Output, Stdio};
use std::sync::atomic::Ordering;
use std::sync::mpsc;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::client::{Conn, Req, Response};
use crate::config::Config;
use crate::observe::{admin_get, parse_admin_line, scrape, Metrics};
use crate::process::{
    bin, die_with_parent, kill_child, legacy_driver, output_within, wait_until, TempDir,
    STARTUP_TIMEOUT,
};

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

pub(crate) fn sluice_command(config: &Config, path: &Path) -> Command {
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
        // `check` must be quick; guard against a hang anyway.
        output_within(cmd, Duration::from_secs(20), "sluice check")
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

//! mock-llm: the stand-in provider, started on port 0, and its counters.

use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::path::Path;
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::mpsc;

use crate::client::{Conn, Req, Response};
use crate::observe::{scrape, Metrics};
use crate::process::{bin, die_with_parent, kill_child, STARTUP_TIMEOUT};
use serde_json::{json, Value};

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

//! The config builder: a Sluice config file written from a test, and the helpers that shape a
//! run (a cluster of mocks, busy loops, waiting out a window edge).

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::Path;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use crate::mock::Mock;

/// The `pass_response_headers` line a test's own `[clusters.NAME]` table needs when it reads
/// mock-llm's `x-mock-*` answer headers back through Sluice (which drops them by default).
pub const PASS_MOCK_HEADERS: &str = "pass_response_headers = [\"default\", \"x-mock-*\"]\n";

/// One `[clusters.NAME]` table.
#[derive(Clone, Debug)]
pub struct Cluster {
    pub name: String,
    pub backends: Vec<(String, u32)>,
    pub model_map: Vec<(String, String)>,
    pub credential: Option<(String, String)>,
    pub ca_file: Option<String>,
    /// `pass_response_headers`: by default Sluice's own list and mock-llm's `x-mock-*`
    /// (what tests read back); `None` leaves the key out.
    pub pass_response_headers: Option<Vec<String>>,
}

impl Cluster {
    pub fn new(name: &str, base_urls: &[&str]) -> Cluster {
        Cluster {
            name: name.to_string(),
            backends: base_urls.iter().map(|u| (u.to_string(), 1)).collect(),
            model_map: Vec::new(),
            credential: None,
            ca_file: None,
            pass_response_headers: Some(vec!["default".into(), "x-mock-*".into()]),
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
    pub(crate) env: Vec<(String, String)>,
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

    /// Exactly `text` (a shipped config, edited by the test), nothing of [`Config::new`]'s.
    pub fn from_text(text: &str) -> Config {
        Config {
            sections: BTreeMap::new(),
            clusters: Vec::new(),
            routes: Vec::new(),
            env: Vec::new(),
            raw: text.to_string(),
        }
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
            if let Some(pass) = &c.pass_response_headers {
                let pass: Vec<String> = pass.iter().map(|p| toml_str(p)).collect();
                let _ = writeln!(out, "pass_response_headers = [{}]", pass.join(", "));
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

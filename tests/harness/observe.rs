//! Observability: the admin listener, Prometheus text, the access log.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use crate::client::{BodyEnd, Conn, Req, Response};
use crate::process::{bin, output_within};
use serde_json::Value;

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

pub(crate) fn is_metric_name(s: &str) -> bool {
    let mut chars = s.chars();
    chars
        .next()
        .is_some_and(|c| c.is_ascii_alphabetic() || c == '_' || c == ':')
        && chars.all(|c| c.is_ascii_alphanumeric() || c == '_' || c == ':')
}

pub(crate) fn is_label_name(s: &str) -> bool {
    let mut chars = s.chars();
    chars
        .next()
        .is_some_and(|c| c.is_ascii_alphabetic() || c == '_')
        && chars.all(|c| c.is_ascii_alphanumeric() || c == '_')
}

pub(crate) fn parse_prom_value(s: &str) -> Result<f64, String> {
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

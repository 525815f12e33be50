//! The access log end to end: records written through the library (`sluice::telemetry::accesslog`, with
//! size rotation) are read back by the real `sluice logs` binary, and — as an independent
//! implementation of the wire format — by Python's `protobuf` package using classes generated
//! from `proto/accesslog.proto` by `grpc_tools.protoc`. Also `sluice logs --follow` on a file
//! that grows one partial record at a time and then rotates.
//!
//! Needs `python3` with `protobuf` and `grpcio-tools` (`scripts/test.sh` installs them).
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::Duration;

use sluice::accesslog::{AccessLog, AccessLogConfig, AccessRecord, UsageSource};
use sluice_proto::prost::Message;
use sluice_tests::*;

/// Varied records: all defaults, every enum value, 64-bit hashes above 2^63, IPv6, escaping.
fn records() -> Vec<AccessRecord> {
    let mut v = vec![AccessRecord::default()];
    for i in 0..60u64 {
        let source = match i % 3 {
            0 => UsageSource::Reported,
            1 => UsageSource::Estimated,
            _ => UsageSource::None,
        };
        v.push(AccessRecord {
            time_unix_us: 1_760_000_000_000_000 + i * 1_000,
            client_addr: if i.is_multiple_of(2) {
                format!("192.0.2.{}:{}", i, 40_000 + i)
            } else {
                format!("[2001:db8::{i:x}]:443")
            },
            method: "POST".into(),
            path: "/v1/chat/completions".into(),
            status: if i.is_multiple_of(7) { 429 } else { 200 },
            key_id: format!("key_{i:04}"),
            entity: "team-α".into(),
            tags: (0..i % 4)
                .map(|t| format!("tag{t} \"quoted\" \\ 中文"))
                .collect(),
            requested_model: "gpt-4o".into(),
            mapped_model: "gpt-4o-2024-08-06".into(),
            cluster: "openai".into(),
            backend: "10.1.2.3:8000".into(),
            stream: i % 2 == 1,
            prompt_tokens: 1000 + i,
            completion_tokens: 2 * i,
            cached_tokens: 512,
            total_tokens: 1000 + 3 * i,
            usage_source: source as i32,
            cost: (i as f64) * 0.000_125 + 1e-9,
            ttft_us: 150_000 + i,
            tpot_us: 20_000 + i,
            latency_us: 3_000_000 + i,
            upstream_connect_us: 800,
            upstream_header_us: 120_000,
            overhead_us: 40 + i,
            bytes_in: 1_500,
            bytes_out: 30_000 + i,
            rejected_policy: if i.is_multiple_of(7) {
                "free-tier".into()
            } else {
                String::new()
            },
            rejected_dimension: if i.is_multiple_of(7) {
                "tpm".into()
            } else {
                String::new()
            },
            auth_rejection_reason: String::new(),
            error_class: if i.is_multiple_of(5) {
                "client_abort".into()
            } else {
                String::new()
            },
            fallback_attempts: (i % 3) as u32,
            sticky_id_hash: u64::MAX - i * 0x1234_5678_9abc,
            worker_id: 9,
            fallback_reason: if i % 3 == 0 {
                String::new()
            } else {
                "status_429".into()
            },
            cache_write_tokens: 64 * (i % 2),
            queued_us: 250 * i,
            priority_class: if i % 2 == 0 {
                "batch".into()
            } else {
                String::new()
            },
            queue_outcome: if i % 2 == 0 {
                "expired".into()
            } else {
                String::new()
            },
        });
    }
    v
}

/// The JSON object `sluice logs` must print for `r`, spelled out independently of the library.
fn expected_json(r: &AccessRecord) -> Value {
    let source = match UsageSource::try_from(r.usage_source).unwrap() {
        UsageSource::None => "USAGE_SOURCE_NONE",
        UsageSource::Reported => "USAGE_SOURCE_REPORTED",
        UsageSource::Estimated => "USAGE_SOURCE_ESTIMATED",
    };
    json!({
        "time_unix_us": r.time_unix_us,
        "client_addr": r.client_addr,
        "method": r.method,
        "path": r.path,
        "status": r.status,
        "key_id": r.key_id,
        "entity": r.entity,
        "tags": r.tags,
        "requested_model": r.requested_model,
        "mapped_model": r.mapped_model,
        "cluster": r.cluster,
        "backend": r.backend,
        "stream": r.stream,
        "prompt_tokens": r.prompt_tokens,
        "completion_tokens": r.completion_tokens,
        "cached_tokens": r.cached_tokens,
        "total_tokens": r.total_tokens,
        "usage_source": source,
        "cost": r.cost,
        "ttft_us": r.ttft_us,
        "tpot_us": r.tpot_us,
        "latency_us": r.latency_us,
        "upstream_connect_us": r.upstream_connect_us,
        "upstream_header_us": r.upstream_header_us,
        "overhead_us": r.overhead_us,
        "bytes_in": r.bytes_in,
        "bytes_out": r.bytes_out,
        "rejected_policy": r.rejected_policy,
        "rejected_dimension": r.rejected_dimension,
        "auth_rejection_reason": r.auth_rejection_reason,
        "error_class": r.error_class,
        "fallback_attempts": r.fallback_attempts,
        "sticky_id_hash": r.sticky_id_hash,
        "worker_id": r.worker_id,
        "fallback_reason": r.fallback_reason,
        "cache_write_tokens": r.cache_write_tokens,
        "queued_us": r.queued_us,
        "priority_class": r.priority_class,
        "queue_outcome": r.queue_outcome,
    })
}

/// Writes `recs` through the library with small files, so the log rotates; returns the files
/// in name (= time) order.
fn write_log(dir: &Path, recs: &[AccessRecord]) -> Vec<PathBuf> {
    let cfg = AccessLogConfig {
        max_file_bytes: 2048,
        batch_bytes: 1024,
        queue_batches: 1024, // the test must not drop
        ..AccessLogConfig::new(dir)
    };
    let mut log = AccessLog::open(&cfg, 9).expect("open access log");
    for r in recs {
        log.record(r);
    }
    let stats = log.close();
    assert_eq!(
        stats.dropped_queue_full + stats.lost_write_error,
        0,
        "{stats:?}"
    );
    assert_eq!(stats.records_written, recs.len() as u64, "{stats:?}");
    let mut files: Vec<PathBuf> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    files.sort();
    for f in &files {
        let name = f.file_name().unwrap().to_str().unwrap();
        assert!(
            name.starts_with("access-w9-") && name.ends_with(".pb"),
            "unexpected file {name}"
        );
    }
    assert!(
        files.len() > 3,
        "expected rotation into several files: {files:?}"
    );
    files
}

fn sluice_logs(args: &[&Path]) -> std::process::Output {
    Command::new(bin("sluice"))
        .arg("logs")
        .args(args)
        .output()
        .expect("run sluice logs")
}

#[test]
fn sluice_logs_prints_every_record_as_json_in_order() {
    let dir = TempDir::new("accesslog-json");
    let recs = records();
    let files = write_log(dir.path(), &recs);
    let args: Vec<&Path> = files.iter().map(PathBuf::as_path).collect();
    let out = sluice_logs(&args);
    let stdout = String::from_utf8(out.stdout).unwrap();
    assert!(
        out.status.success(),
        "sluice logs failed: {}\n{stdout}",
        String::from_utf8_lossy(&out.stderr)
    );
    let lines: Vec<&str> = stdout.lines().collect();
    assert_eq!(lines.len(), recs.len());
    for (i, (line, r)) in lines.iter().zip(&recs).enumerate() {
        check_line(line, r, &format!("record {i}"));
    }
}

/// Asserts that `line` is the JSON `sluice logs` must print for `r`.
fn check_line(line: &str, r: &AccessRecord, what: &str) {
    let mut got: Value = serde_json::from_str(line).unwrap_or_else(|e| panic!("{what}: {e}"));
    let mut want = expected_json(r);
    // serde_json's default float parser may be off by an ulp; read `cost` exactly instead.
    assert_eq!(raw_cost(line).to_bits(), r.cost.to_bits(), "{what}: {line}");
    got.as_object_mut().unwrap().remove("cost");
    want.as_object_mut().unwrap().remove("cost");
    assert_eq!(got, want, "{what}");
    assert!(
        line.starts_with(r#"{"time_unix_us":"#),
        "{what}: field order: {line}"
    );
}

/// The `cost` number of a JSON line, parsed with Rust's exact float parser.
fn raw_cost(line: &str) -> f64 {
    let start = line.find(r#""cost":"#).expect("cost field") + r#""cost":"#.len();
    let rest = &line[start..];
    let end = rest.find([',', '}']).expect("end of cost");
    rest[..end].parse().expect("cost is a number")
}

#[test]
fn sluice_logs_reports_a_truncated_file_after_its_complete_records() {
    let dir = TempDir::new("accesslog-trunc");
    let mut bytes = Vec::new();
    for r in &records()[..3] {
        r.encode_length_delimited(&mut bytes).unwrap();
    }
    bytes.truncate(bytes.len() - 5);
    let file = dir.write("access-w0-0000000000000001.pb", &bytes);
    let out = sluice_logs(&[&file]);
    assert!(!out.status.success());
    assert_eq!(String::from_utf8(out.stdout).unwrap().lines().count(), 2);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("access-w0-0000000000000001.pb") && stderr.contains("ends inside"),
        "{stderr}"
    );
}

/// Decodes the files with Python's protobuf runtime (its own varint framing, classes generated
/// by grpc_tools.protoc from the .proto) and compares each record with the line `sluice logs`
/// printed: same keys in proto field order, same values.
const PY_CHECK: &str = r#"
import json, sys
sys.path.insert(0, sys.argv[1])
import accesslog_pb2
from google.protobuf.descriptor import FieldDescriptor

D = accesslog_pb2.AccessRecord.DESCRIPTOR
names = [f.name for f in D.fields]

def varint(b, i):
    v = shift = 0
    while True:
        if i >= len(b):
            sys.exit("truncated length prefix")
        c = b[i]; i += 1
        v |= (c & 0x7F) << shift; shift += 7
        if c < 0x80:
            return v, i

def plain(m):
    out = {}
    for f in D.fields:
        v = getattr(m, f.name)
        if f.type == FieldDescriptor.TYPE_ENUM:
            ev = f.enum_type.values_by_number.get(v)
            v = ev.name if ev is not None else v
        elif not isinstance(v, (str, bytes, bool, int, float)):
            v = list(v)
        out[f.name] = v
    return out

recs = []
for path in sys.argv[3:]:
    b = open(path, "rb").read()
    i = 0
    while i < len(b):
        n, i = varint(b, i)
        if i + n > len(b):
            sys.exit(f"{path}: truncated record at byte {i}")
        m = accesslog_pb2.AccessRecord()
        m.ParseFromString(b[i:i + n])
        i += n
        recs.append(plain(m))

lines = open(sys.argv[2], encoding="utf-8").read().splitlines()
if len(lines) != len(recs):
    sys.exit(f"python decoded {len(recs)} records, sluice logs printed {len(lines)}")
for k, (p, line) in enumerate(zip(recs, lines)):
    j = json.loads(line)
    if list(j.keys()) != names:
        sys.exit(f"record {k}: keys {list(j.keys())} != proto fields {names}")
    if j != p:
        diff = {key: (j[key], p[key]) for key in names if j[key] != p[key]}
        sys.exit(f"record {k} differs (sluice, python): {diff}")
print("ok", len(recs))
"#;

fn python_ok(args: &[&str]) -> Result<(), String> {
    match Command::new("python3").args(args).output() {
        Ok(o) if o.status.success() => Ok(()),
        Ok(o) => Err(String::from_utf8_lossy(&o.stderr).into_owned()),
        Err(e) => Err(format!("cannot run python3: {e}")),
    }
}

#[test]
fn python_protobuf_decodes_the_same_records() {
    for module in ["google.protobuf", "grpc_tools.protoc"] {
        if let Err(e) = python_ok(&["-c", &format!("import {module}")]) {
            panic!(
                "python3 cannot import {module}; this test decodes the log with Python's protobuf \
                 package as an independent implementation. Install it with \
                 `python3 -m pip install protobuf grpcio-tools` (scripts/test.sh does).\n{e}"
            );
        }
    }
    let dir = TempDir::new("accesslog-py");
    let logs = dir.path().join("logs");
    let py = dir.path().join("py");
    std::fs::create_dir_all(&py).unwrap();
    let recs = records();
    let files = write_log(&logs, &recs);

    // Generate accesslog_pb2.py from the schema the Rust side is built from.
    let gen = Command::new("python3")
        .current_dir(workspace_root())
        .args(["-m", "grpc_tools.protoc", "-I", "proto"])
        .arg(format!("--python_out={}", py.display()))
        .arg("proto/accesslog.proto")
        .output()
        .expect("run grpc_tools.protoc");
    assert!(
        gen.status.success(),
        "grpc_tools.protoc failed: {}",
        String::from_utf8_lossy(&gen.stderr)
    );

    let args: Vec<&Path> = files.iter().map(PathBuf::as_path).collect();
    let out = sluice_logs(&args);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let jsonl = dir.write("sluice.jsonl", &out.stdout);
    let script = dir.write("check.py", PY_CHECK);
    let check = Command::new("python3")
        .arg(&script)
        .arg(&py)
        .arg(&jsonl)
        .args(&files)
        .output()
        .expect("run python3");
    let stdout = String::from_utf8_lossy(&check.stdout);
    assert!(
        check.status.success(),
        "python check failed: {}{stdout}",
        String::from_utf8_lossy(&check.stderr)
    );
    assert_eq!(stdout.trim(), format!("ok {}", recs.len()));
}

/// A `sluice logs --follow` child whose stdout lines arrive on a channel; killed on drop.
struct Follower {
    child: Child,
    lines: mpsc::Receiver<String>,
}

impl Follower {
    fn start(file: &Path) -> Follower {
        let mut child = Command::new(bin("sluice"))
            .arg("logs")
            .arg("--follow")
            .arg(file)
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("spawn sluice logs --follow");
        let stdout = child.stdout.take().unwrap();
        let (tx, lines) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines() {
                let Ok(line) = line else { break };
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        Follower { child, lines }
    }

    /// Asserts that the next line arrives within 10 s and is `r`'s JSON.
    fn expect(&self, r: &AccessRecord) {
        let line = self
            .lines
            .recv_timeout(Duration::from_secs(10))
            .expect("no line from sluice logs --follow within 10 s");
        check_line(&line, r, "followed record");
    }

    fn assert_quiet(&self, for_: Duration) {
        if let Ok(line) = self.lines.recv_timeout(for_) {
            panic!("unexpected output: {line}");
        }
    }
}

impl Drop for Follower {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

#[test]
fn follow_waits_for_partial_records_and_moves_to_the_rotated_file() {
    let dir = TempDir::new("accesslog-follow");
    let recs = records();
    let encode = |r: &AccessRecord| {
        let mut b = Vec::new();
        r.encode_length_delimited(&mut b).unwrap();
        b
    };
    let first = dir.path().join("access-w9-0000000000000100.pb");
    let mut f = std::fs::File::create(&first).unwrap();
    f.write_all(&encode(&recs[1])).unwrap();
    let follower = Follower::start(&first);
    follower.expect(&recs[1]);

    // Half a record (its length prefix and part of the message): nothing may come out yet.
    let second = encode(&recs[2]);
    let (head, tail) = second.split_at(second.len() / 2);
    f.write_all(head).unwrap();
    f.flush().unwrap();
    follower.assert_quiet(Duration::from_millis(700));
    f.write_all(tail).unwrap();
    follower.expect(&recs[2]);

    // Just the first byte of the next length prefix, then the rest.
    let third = encode(&recs[3]);
    f.write_all(&third[..1]).unwrap();
    follower.assert_quiet(Duration::from_millis(500));
    f.write_all(&third[1..]).unwrap();
    follower.expect(&recs[3]);

    // The writer rotates: a newer file of the same worker appears; another worker's file and
    // an older file are ignored.
    std::fs::write(
        dir.path().join("access-w8-0000000000000200.pb"),
        encode(&recs[10]),
    )
    .unwrap();
    std::fs::write(
        dir.path().join("access-w9-0000000000000050.pb"),
        encode(&recs[11]),
    )
    .unwrap();
    let mut next = std::fs::File::create(dir.path().join("access-w9-0000000000000300.pb")).unwrap();
    next.write_all(&encode(&recs[4])).unwrap();
    follower.expect(&recs[4]);
    next.write_all(&encode(&recs[5])).unwrap();
    follower.expect(&recs[5]);
    follower.assert_quiet(Duration::from_millis(500));
}

//! Observe: count a finished request in the worker's metrics and write its access-log record.
//!
//! Runs once per request, when it ends however it ends (after settle), and for the attempts a
//! fallback left behind. Takes the request, its inspection, the per-request record
//! ([`Observation`] and its [`Outcome`], see [`record`](crate::gateway::record)), the caller
//! and the error Sluice answered with, if any. Returns nothing and raises nothing: the metrics
//! shard and the log sink take it without I/O or locks.

use std::fmt::Write as _;

use crate::config::Snapshot;
use crate::gateway::admit::Caller;
use crate::gateway::context::Request;
use crate::gateway::error::{ErrorKind, GatewayError, Origin, UpstreamFault};
use crate::gateway::record::{LogSink, Observation, Outcome, RelayEnd, UsageSource};
use crate::openai::endpoint::Endpoint;
use crate::openai::inspect::Inspection;
use crate::openai::json::truncate;
use crate::telemetry::accesslog::RecordView;
use crate::telemetry::accesslog::UsageSource as LogUsageSource;
use crate::telemetry::metrics::MetricsView;
use crate::telemetry::metrics::{Attempt, EntityIdx, StatusClass, UpstreamErrorKind};

/// The most of a client's `model` a record keeps (a model name is tens of bytes; the client may
/// send megabytes): the one field of a record the client writes freely, so this bounds a
/// record's size (docs/accesslog.md).
const MAX_LOGGED_MODEL: usize = 256;

/// The metric `route` label of a request path.
fn route_name(path: &[u8]) -> &'static str {
    Endpoint::from_path(path).map_or(crate::telemetry::metrics::OTHER, Endpoint::label)
}

/// The status of a request the relay ended: the upstream's, or 499 (nginx's "client closed
/// request") for a client that left before the answer's head, when nothing was sent it.
fn relayed_status(obs: &Observation) -> u16 {
    match (obs.status, obs.end) {
        (0, Some(RelayEnd::ClientLeft)) => 499,
        (status, _) => status,
    }
}

/// Every `error_class` the access log may carry, "" for none (docs/accesslog.md and
/// proto/accesslog.proto list exactly these: a test holds them, and [`error_class`], to it).
#[cfg(test)]
pub(crate) const ERROR_CLASSES: [&str; 10] = [
    "",
    "client_error",
    "gateway_overload",
    "upstream_error",
    "upstream_unavailable",
    "upstream_status",
    "upstream_abort",
    "upstream_error_event",
    "client_abort",
    "server_shutdown",
];

/// What kind of failure a request ended in, for the access log (`error_class`).
fn error_class(obs: &Observation, error: Option<&GatewayError>) -> &'static str {
    match error {
        Some(e) if e.kind == ErrorKind::ShuttingDown => "server_shutdown",
        Some(e) if e.kind == ErrorKind::UpstreamUnavailable => "upstream_unavailable",
        Some(e) if e.kind == ErrorKind::ClientLeft => "client_abort",
        Some(e) => match e.origin() {
            Origin::Client => "client_error",
            Origin::Upstream => "upstream_error",
            Origin::Gateway => "gateway_overload",
        },
        None => match obs.end {
            Some(RelayEnd::ClientLeft) => "client_abort",
            Some(RelayEnd::UpstreamCut(_)) => "upstream_abort",
            Some(RelayEnd::Shutdown) => "server_shutdown",
            _ if obs.status >= 400 => "upstream_status",
            _ if obs.upstream_error_event() => "upstream_error_event",
            _ => "",
        },
    }
}

/// Count the finished request in the worker's metrics and write its access-log record.
/// `error` is what Sluice answered itself, when the request failed before a response started.
#[allow(clippy::too_many_arguments)] // each is one value the record needs; a struct would only rename them
pub(crate) fn emit(
    snapshot: &Snapshot,
    metrics: MetricsView<'_>,
    log: &LogSink,
    request: &Request<'_>,
    inspection: &Inspection,
    obs: &Observation,
    outcome: &Outcome,
    error: Option<&GatewayError>,
    caller: &Caller,
) {
    let done = Finished {
        request,
        inspection,
        obs,
        outcome,
        error,
        caller,
        status: error.map_or_else(|| relayed_status(obs), |e| e.status()),
    };
    done.count(metrics);
    done.write_record(snapshot, log);
}

/// One finished request, as [`emit`] reads it.
struct Finished<'a, 'r> {
    request: &'a Request<'r>,
    inspection: &'a Inspection,
    obs: &'a Observation,
    outcome: &'a Outcome<'a>,
    error: Option<&'a GatewayError>,
    caller: &'a Caller<'a>,
    /// The status the client got.
    status: u16,
}

impl Finished<'_, '_> {
    /// The request's metrics: label values come from configured names only.
    fn count(&self, m: MetricsView<'_>) {
        let (obs, outcome) = (self.obs, self.outcome);
        let names = m.names();
        let route = names.route(route_name(self.request.head.path(self.request.buf)));
        let model = names.model(&self.inspection.model);
        let entity = self
            .caller
            .principal
            .and_then(|p| p.key.entity)
            .map_or(EntityIdx::OTHER, |e| m.labels.entity(e));
        m.request_done(route, model, entity, StatusClass::from_status(self.status));
        if outcome.usage_source != UsageSource::None {
            let u = &outcome.usage;
            m.tokens(
                model,
                entity,
                u.prompt_tokens,
                u.completion_tokens,
                u.cached_tokens,
                u.cache_write_tokens,
            );
        }
        if let Some(cost) = outcome.cost {
            m.cost(model, entity, (cost * 1_000_000.0).round() as u64);
        }
        if let Some(ttft) = outcome.ttft {
            m.observe_ttft(model, ttft);
        }
        if let Some(tpot) = outcome.tpot {
            m.observe_tpot(model, tpot);
        }
        m.observe_latency(route, model, outcome.latency);
        m.observe_overhead(route, outcome.overhead);
        if let Some((_, backend_id)) = obs.routed {
            self.count_upstream(m, backend_id);
        }
    }

    /// The upstream requests it made of its last backend, and how the last one failed.
    fn count_upstream(&self, m: MetricsView<'_>, backend_id: usize) {
        let obs = self.obs;
        let backend = m.labels.backend(backend_id);
        if obs.forward.started_at.is_some() {
            let attempt = if obs.fallbacks > 0 {
                Attempt::Fallback
            } else {
                Attempt::First
            };
            m.upstream_request(backend, attempt);
            for _ in 0..obs.forward.retries {
                m.upstream_request(backend, Attempt::Retry);
            }
        }
        let kind = match self.error {
            Some(e) if e.kind == ErrorKind::UpstreamPoolFull => {
                Some(UpstreamErrorKind::PoolExhausted)
            }
            Some(e) => e.upstream_fault().map(fault_kind),
            None => match obs.end {
                Some(RelayEnd::UpstreamCut(fault)) => Some(fault_kind(fault)),
                _ if obs.status == 429 => Some(UpstreamErrorKind::Status429),
                _ if obs.status >= 500 => Some(UpstreamErrorKind::Status5xx),
                _ if obs.upstream_error_event() => Some(UpstreamErrorKind::ErrorEvent),
                _ => None,
            },
        };
        if let Some(kind) = kind {
            m.upstream_error(backend, kind);
        }
    }

    /// The access-log record: its fields are borrowed where they lie, only the peer is written
    /// out.
    fn write_record(&self, snapshot: &Snapshot, sink: &LogSink) {
        let (request, obs, outcome, error) = (self.request, self.obs, self.outcome, self.error);
        let mut log = sink.writer.borrow_mut();
        let Some(log) = log.as_mut() else {
            return;
        };
        let mut client_addr = sink.client_addr.borrow_mut();
        client_addr.clear();
        if let Some(peer) = request.peer {
            write_peer(&mut client_addr, peer);
        }
        // When the request was received: now, less the time since (no wall-clock read on the
        // way in).
        let since_receipt =
            crate::sys::clock::recent().saturating_duration_since(request.received_at);
        let path = request.head.path(request.buf);
        // A path is nearly always UTF-8 (ASCII): checked as a str, not walked in lossy chunks.
        let path = match std::str::from_utf8(path) {
            Ok(path) => std::borrow::Cow::Borrowed(path),
            Err(_) => String::from_utf8_lossy(path),
        };
        let (cluster, mapped_model, backend) = routed_names(snapshot, obs, outcome);
        let (rejected_policy, rejected_dimension) = refusal_labels(snapshot, self.caller);
        let key = self.caller.principal.map(|p| p.key);
        let u = &outcome.usage;
        log.record_view(&RecordView {
            time_unix_us: crate::sys::time::unix_us()
                .saturating_sub(since_receipt.as_micros() as u64),
            client_addr: &client_addr,
            method: "POST",
            path: &path,
            status: u32::from(self.status),
            key_id: key.map_or("", |k| &k.id),
            entity: key
                .and_then(|k| k.entity)
                .and_then(|e| snapshot.limits.entities.get(e))
                .map_or("", String::as_str),
            tags: key.map_or(&[], |k| k.tags.as_slice()),
            requested_model: truncate(&self.inspection.model, MAX_LOGGED_MODEL),
            mapped_model,
            cluster,
            backend,
            stream: self.inspection.stream,
            prompt_tokens: u.prompt_tokens,
            completion_tokens: u.completion_tokens,
            cached_tokens: u.cached_tokens,
            total_tokens: u.total_tokens,
            usage_source: match outcome.usage_source {
                UsageSource::Reported => LogUsageSource::Reported,
                UsageSource::Estimated => LogUsageSource::Estimated,
                UsageSource::None => LogUsageSource::None,
            } as i32,
            cost: outcome.cost.unwrap_or(0.0),
            ttft_us: outcome.ttft.map_or(0, |d| d.as_micros() as u64),
            tpot_us: outcome.tpot.map_or(0, |d| d.as_micros() as u64),
            latency_us: outcome.latency.as_micros() as u64,
            upstream_connect_us: obs.forward.connect.map_or(0, |d| d.as_micros() as u64),
            upstream_header_us: outcome.upstream_header.map_or(0, |d| d.as_micros() as u64),
            overhead_us: outcome.overhead.as_micros() as u64,
            bytes_in: obs.bytes_in,
            bytes_out: match error {
                // Sluice's own answer is written after this record: count what it will be.
                Some(e) => e.response_len(request.head.keep_alive, false, request.dialect()) as u64,
                None => obs.bytes_out,
            },
            rejected_policy,
            rejected_dimension,
            auth_rejection_reason: self.caller.auth_failure.unwrap_or(""),
            error_class: error_class(obs, error),
            fallback_attempts: obs.fallbacks + obs.forward.retries,
            sticky_id_hash: obs.sticky_id_hash,
            worker_id: sink.worker_id as u32,
            fallback_reason: obs.fallback_reason,
            cache_write_tokens: u.cache_write_tokens,
            queued_us: obs.queued.map_or(0, |d| d.as_micros() as u64),
            priority_class: class_name(snapshot, obs.queue_class),
            queue_outcome: obs.queue_outcome,
        });
    }
}

/// The name of the priority class a request waited in ("" when it did not wait).
fn class_name(snapshot: &Snapshot, class: Option<u8>) -> &str {
    let classes = snapshot.saturation.as_ref().map(|s| s.classes.as_slice());
    class
        .and_then(|c| classes?.get(usize::from(c)))
        .map_or("", |c| c.name.as_str())
}

/// The cluster, mapped model and backend (host) names of where the request went, or empty.
fn routed_names<'a>(
    snapshot: &'a Snapshot,
    obs: &Observation,
    outcome: &'a Outcome<'a>,
) -> (&'a str, &'a str, &'a str) {
    let Some((cluster_id, backend_id)) = obs.routed else {
        return ("", "", "");
    };
    let Some(cluster) = snapshot.clusters.get(cluster_id) else {
        return ("", "", "");
    };
    let backend = cluster.backends.iter().find(|b| b.id == backend_id);
    (
        &cluster.name,
        outcome.mapped_model,
        backend.map_or("", |b| b.host_header.as_str()),
    )
}

/// The policy and dimension that refused the request, or empty.
fn refusal_labels<'s>(snapshot: &'s Snapshot, caller: &Caller) -> (&'s str, &'static str) {
    caller.refusal.as_ref().map_or(("", ""), |r| {
        let policy = r
            .policy
            .and_then(|p| snapshot.limits.policies.get(p))
            .map_or("quota", |p| p.id.as_str());
        (policy, r.dimension.label())
    })
}

/// Count an attempt that failed and was followed by another (the request's last attempt is
/// counted by [`emit`]): `sluice_upstream_requests_total` and `sluice_upstream_errors_total`.
pub(crate) fn failed_attempt(
    metrics: MetricsView<'_>,
    obs: &Observation,
    backend_id: usize,
    reason: crate::gateway::fallback::FallbackReason,
) {
    use crate::gateway::fallback::FallbackReason as R;
    let backend = metrics.labels.backend(backend_id);
    let attempt = if obs.fallbacks > 0 {
        Attempt::Fallback
    } else {
        Attempt::First
    };
    if obs.forward.started_at.is_some() {
        metrics.upstream_request(backend, attempt);
        for _ in 0..obs.forward.retries {
            metrics.upstream_request(backend, Attempt::Retry);
        }
    }
    let kind = match reason {
        R::Connect => UpstreamErrorKind::Connect,
        R::Timeout => UpstreamErrorKind::Timeout,
        R::Io | R::FirstEventError => UpstreamErrorKind::Io,
        R::Status429 => UpstreamErrorKind::Status429,
        R::Status5xx | R::Overloaded => UpstreamErrorKind::Status5xx,
        R::PoolFull => UpstreamErrorKind::PoolExhausted,
        R::Credential => UpstreamErrorKind::CredentialRefused,
    };
    metrics.upstream_error(backend, kind);
}

/// A candidate passed over, unsent, because its provider's limits had no room:
/// `sluice_upstream_errors_total{kind="provider_limit"}`.
pub(crate) fn provider_skipped(metrics: MetricsView<'_>, backend_id: usize) {
    let backend = metrics.labels.backend(backend_id);
    metrics.upstream_error(backend, UpstreamErrorKind::ProviderLimit);
}

fn fault_kind(fault: UpstreamFault) -> UpstreamErrorKind {
    match fault {
        UpstreamFault::Connect => UpstreamErrorKind::Connect,
        UpstreamFault::Tls => UpstreamErrorKind::Tls,
        UpstreamFault::Timeout => UpstreamErrorKind::Timeout,
        UpstreamFault::Io => UpstreamErrorKind::Io,
        UpstreamFault::Protocol => UpstreamErrorKind::Protocol,
    }
}

/// `peer` as `Display` writes it (`1.2.3.4:5`, `[::1]:5`), an IPv4 one without core::fmt:
/// `SocketAddr`'s `Display` cost ~150 ns a request in the access log.
fn write_peer(out: &mut String, peer: std::net::SocketAddr) {
    match peer {
        std::net::SocketAddr::V4(v4) => {
            let mut num = itoa::Buffer::new();
            for (i, octet) in v4.ip().octets().into_iter().enumerate() {
                if i > 0 {
                    out.push('.');
                }
                out.push_str(num.format(octet));
            }
            out.push(':');
            out.push_str(num.format(v4.port()));
        }
        v6 => {
            let _ = write!(out, "{v6}");
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn the_logged_peer_reads_as_display_writes_it() {
        for peer in [
            "1.2.3.4:5",
            "0.0.0.0:0",
            "255.255.255.255:65535",
            "10.0.120.7:40000",
            "[::1]:8080",
            "[2001:db8::7]:443",
        ] {
            let peer: std::net::SocketAddr = peer.parse().unwrap();
            let mut out = String::new();
            write_peer(&mut out, peer);
            assert_eq!(out, peer.to_string());
        }
    }
}

#[cfg(test)]
mod documented_values {
    #![allow(clippy::unwrap_used)]
    //! The access log's enum-like fields against their documentation: every value the code can
    //! write is documented, and nothing else is (The first day II, item 5).
    use super::ERROR_CLASSES;
    use crate::gateway::error::ErrorKind;
    use std::collections::BTreeSet;

    fn repo_file(path: &str) -> String {
        let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
        std::fs::read_to_string(root.join(path)).unwrap()
    }

    /// The `backticked` values of the table row for `field` in docs/accesslog.md (`""` is "").
    fn documented(field: &str) -> BTreeSet<String> {
        let docs = repo_file("docs/accesslog.md");
        let row = docs
            .lines()
            .find(|l| l.contains(&format!("| `{field}` |")))
            .unwrap_or_else(|| panic!("no row for {field}"));
        let meaning = row.rsplit('|').nth(1).unwrap();
        meaning
            .split('`')
            .skip(1)
            .step_by(2)
            .map(|v| {
                if v == "\"\"" {
                    String::new()
                } else {
                    v.to_owned()
                }
            })
            .collect()
    }

    /// The "quoted" values in the proto comment right above `field`'s line ("" included).
    fn in_proto(field: &str) -> BTreeSet<String> {
        let proto = repo_file("proto/accesslog.proto");
        let lines: Vec<&str> = proto.lines().collect();
        let at = lines
            .iter()
            .position(|l| l.trim_start().starts_with(&format!("string {field} =")))
            .unwrap();
        let comment: String = lines[..at]
            .iter()
            .rev()
            .take_while(|l| l.trim_start().starts_with("//"))
            .map(|l| format!("{l}\n"))
            .collect();
        comment
            .split('"')
            .skip(1)
            .step_by(2)
            .map(str::to_owned)
            .collect()
    }

    /// The string literals in the body of `fn name` in `source`.
    fn literals_of(source: &str, name: &str) -> BTreeSet<String> {
        let start = source.find(&format!("fn {name}(")).unwrap();
        let body = &source[start..];
        let end = body.find("\n}\n").unwrap();
        body[..end]
            .split('"')
            .skip(1)
            .step_by(2)
            .map(str::to_owned)
            .collect()
    }

    #[test]
    fn error_classes_are_documented_as_written() {
        let code: BTreeSet<String> = ERROR_CLASSES.iter().map(|s| s.to_string()).collect();
        assert_eq!(documented("error_class"), code, "docs/accesslog.md");
        assert_eq!(in_proto("error_class"), code, "proto/accesslog.proto");
        let written = literals_of(include_str!("observe.rs"), "error_class");
        assert_eq!(written, code, "what error_class writes");
    }

    #[test]
    fn auth_rejection_reasons_are_documented_as_written() {
        let code: BTreeSet<String> = ErrorKind::AUTH_REJECTION_REASONS
            .iter()
            .map(|s| s.to_string())
            .collect();
        let written: BTreeSet<String> = ErrorKind::ALL
            .iter()
            .filter_map(|k| k.auth_rejection_reason())
            .map(str::to_owned)
            .collect();
        assert_eq!(written, code);
        let mut with_none = code.clone();
        with_none.insert(String::new());
        assert_eq!(
            documented("auth_rejection_reason"),
            with_none,
            "docs/accesslog.md"
        );
        assert_eq!(
            in_proto("auth_rejection_reason"),
            with_none,
            "proto/accesslog.proto"
        );
    }
}

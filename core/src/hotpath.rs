//! A fixture running the request path's hot spots in process, without sockets, for the
//! criterion benchmarks (`core/benches/hot_paths.rs`) and the callgrind instruction counts
//! (`perf/callgrind.sh` via `sluice-hotpath`). Not used by the gateway itself.
//!
//! Every call returns something derived from its work so the optimizer can't drop it. Panics
//! on a broken fixture (it is test tooling, never on a request path).
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::cell::Cell;
use std::sync::Arc;
use std::time::Instant;

use crate::config::Snapshot;
use crate::gateway::context::Request;
use crate::http::request::{parse_request_head, HeadScan, HeadStatus, RequestHead};
use crate::limits::shard::{Ask, LimiterShard, Permit};
use crate::openai::inspect::{Inspection, Inspector};
use crate::openai::meter::SseSplitter;
use crate::sys::time::unix_ms;

const KEY: &str = "sk-hotpath-bench-key";

pub struct Fixture {
    pub snapshot: Arc<Snapshot>,
    pub body: Vec<u8>,
    pub request: Vec<u8>,
    pub stream: Vec<u8>,
    inspector: Inspector,
    inspection: Inspection,
    splitter: SseSplitter,
    shard: LimiterShard,
    rng: Cell<u64>,
    head: RequestHead,
    out: Vec<u8>,
}

impl Default for Fixture {
    fn default() -> Self {
        Self::new()
    }
}

impl Fixture {
    pub fn new() -> Fixture {
        let text = format!(
            r#"
[clusters.main]
backends = [{{ base_url = "http://127.0.0.1:9/v1", weight = 3 }}, {{ base_url = "http://127.0.0.2:9/v1", weight = 1 }}]
model_map = {{ "gpt-4o" = "gpt-4o-2024-08-06" }}
[[routes]]
model = "gpt-4o"
cluster = "main"
[[routes]]
model = "gpt-*"
cluster = "main"
[[keys]]
id = "bench"
sha256 = "{}"
entity = "team"
tags = ["pro"]
models_allow = ["gpt-*"]
plans = [{{ id = "q", tokens = 1000000000000 }}]
[[policies]]
id = "rpm"
tags = ["pro"]
per = "key"
max_requests = 1000000000000
[[policies]]
id = "tpm"
entities = ["team"]
per = "entity"
max_tokens = 1000000000000
[[policies]]
id = "conc"
models = ["gpt-*"]
per = "model"
max_concurrency = 1000000
"#,
            crate::gateway::auth::hex(&crate::gateway::auth::digest(KEY.as_bytes()))
        );
        let snapshot = Arc::new(crate::config::load(&text, &|_| None).expect("fixture config"));
        let base = r#"{"model":"gpt-4o","stream":true,"max_tokens":256,"messages":[{"role":"system","content":"You are terse."},{"role":"user","content":""}]}"#;
        let pad = 1024 - base.len();
        let body = base
            .replace(
                r#""content":""}"#,
                &format!(r#""content":"{}"}}"#, "a".repeat(pad)),
            )
            .into_bytes();
        let mut request = format!(
            "POST /v1/chat/completions HTTP/1.1\r\nHost: gw\r\nAuthorization: Bearer {KEY}\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n",
            body.len()
        )
        .into_bytes();
        request.extend_from_slice(&body);
        let mut stream = Vec::new();
        for i in 0..64 {
            stream.extend_from_slice(format!("data: {{\"id\":\"c\",\"object\":\"chat.completion.chunk\",\"choices\":[{{\"index\":0,\"delta\":{{\"content\":\"tok{i} \"}},\"finish_reason\":null}}]}}\n\n").as_bytes());
        }
        stream.extend_from_slice(b"data: [DONE]\n\n");
        let shard = LimiterShard::new(&snapshot.limits, "bench".into());
        let mut f = Fixture {
            snapshot,
            body,
            request,
            stream,
            inspector: Inspector::default(),
            inspection: Inspection::default(),
            splitter: SseSplitter::new(),
            shard,
            rng: Cell::new(0x9e37_79b9_7f4a_7c15),
            head: RequestHead::default(),
            out: Vec::with_capacity(4096),
        };
        f.prime();
        f
    }

    /// Give the limiter leases, as a running worker's sync task would.
    fn prime(&mut self) {
        let ledger = crate::limits::ledger::InProcessLedger::new();
        let mut batch = Vec::new();
        let mut states = Vec::new();
        for _ in 0..3 {
            for _ in 0..1000 {
                let mut p = Permit::default();
                if self.admit_with(&mut p) {
                    self.shard.settle(&mut p, 10);
                }
            }
            self.shard
                .prepare(unix_ms(), std::time::Duration::from_millis(50), &mut batch);
            ledger.exchange_at(Instant::now(), "bench", 60_000, &batch, &mut states);
            self.shard.apply(Ok(&states), &batch, Instant::now());
        }
    }

    fn admit_with(&mut self, permit: &mut Permit) -> bool {
        let ask = Ask {
            key: Some(0),
            model: "gpt-4o",
            prompt_estimate: 300,
            max_tokens: Some(256),
            n: None,
        };
        self.shard
            .try_admit(&self.snapshot.limits, &ask, permit, &mut |_, _| {})
            .is_ok()
    }

    pub fn inspect(&mut self) -> usize {
        self.inspector
            .inspect(&self.body, &mut self.inspection)
            .expect("inspect");
        self.inspection.model.len()
    }

    pub fn split_sse(&mut self) -> usize {
        let mut events = 0;
        self.splitter.reset();
        self.splitter.feed(&self.stream, |_| events += 1);
        events
    }

    pub fn estimate(&self) -> u64 {
        crate::openai::tokens::estimate_tokens(&self.body)
    }

    pub fn admit_settle(&mut self) -> bool {
        let mut p = Permit::default();
        let ok = self.admit_with(&mut p);
        self.shard.settle(&mut p, 300);
        ok
    }

    pub fn route(&self) -> usize {
        crate::gateway::route::route(&self.snapshot, "gpt-4o", &self.rng)
            .expect("route")
            .backend
            .id
    }

    /// One request, head to upstream bytes, and its settlement.
    pub fn pipeline(&mut self) -> usize {
        let mut scan = HeadScan::default();
        let status = parse_request_head(
            &self.request,
            &mut scan,
            &self.snapshot.http,
            &mut self.head,
        )
        .expect("head");
        assert_eq!(status, HeadStatus::Complete);
        let body_at = self.head.head_len;
        let request = Request {
            buf: &self.request,
            received_at: Instant::now(),
            peer: None,
            head: &self.head,
            body: &self.request[body_at..],
        };
        let limits = &self.snapshot.limits;
        let principal = crate::gateway::auth::authenticate(limits, &request).expect("auth");
        self.inspector
            .inspect(request.body, &mut self.inspection)
            .expect("inspect");
        crate::gateway::auth::authorize(principal, &self.inspection.model, None)
            .expect("authorize");
        let target =
            crate::gateway::route::route(&self.snapshot, &self.inspection.model, &self.rng)
                .expect("route");
        let prompt = crate::openai::tokens::estimate_tokens(request.body);
        let ask = Ask {
            key: principal.map(|p| p.index),
            model: &self.inspection.model,
            prompt_estimate: prompt,
            max_tokens: self.inspection.max_tokens,
            n: self.inspection.n,
        };
        let mut permit = Permit::default();
        let admitted = self
            .shard
            .try_admit(limits, &ask, &mut permit, &mut |_, _| {})
            .is_ok();
        self.out.clear();
        crate::gateway::forward::build_request(
            &mut self.out,
            &request,
            &self.inspection,
            &target,
            true,
        );
        self.shard.settle(&mut permit, 300);
        self.out.len() + usize::from(admitted)
    }
}

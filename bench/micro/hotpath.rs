//! Run one hot path N times (for instruction counts under callgrind; see bench/callgrind.sh).
//!
//!   hotpath <inspect|inspect_64k|inspect_64k_plain|meter_64k|meter_answer|encode_record|sse|estimate|admit|route|pipeline|request_head|response_head|anthropic_request|anthropic_response|anthropic_stream> <iterations>
//!
//! The fixture is the criterion benchmarks' (`bench/micro/fixture/mod.rs`).
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::hint::black_box;

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let (Some(which), Some(n)) = (
        args.first(),
        args.get(1).and_then(|n| n.parse::<u64>().ok()),
    ) else {
        eprintln!("usage: hotpath <inspect|inspect_64k|inspect_64k_plain|meter_64k|meter_answer|encode_record|sse|estimate|admit|route|pipeline|request_head|response_head|anthropic_request|anthropic_response|anthropic_stream> <iterations>");
        std::process::exit(2);
    };
    let mut f = sluice::hotpath::Fixture::new();
    let mut acc = 0u64;
    for _ in 0..n {
        acc = acc.wrapping_add(match which.as_str() {
            "inspect" => f.inspect() as u64,
            "inspect_64k" => f.inspect_64k() as u64,
            "inspect_64k_plain" => f.inspect_64k_plain() as u64,
            "meter_64k" => f.meter_64k(),
            "meter_answer" => f.meter_answer(),
            "encode_record" => f.encode_record() as u64,
            "sse" => f.split_sse() as u64,
            "estimate" => f.estimate(),
            "admit" => u64::from(f.admit_settle()),
            "route" => f.route() as u64,
            "pipeline" => f.pipeline() as u64,
            "request_head" => f.request_head() as u64,
            "response_head" => f.response_head() as u64,
            "anthropic_request" => f.anthropic_request() as u64,
            "anthropic_response" => f.anthropic_response() as u64,
            "anthropic_stream" => f.anthropic_stream() as u64,
            other => {
                eprintln!("unknown path {other}");
                std::process::exit(2);
            }
        });
    }
    black_box(acc);
}

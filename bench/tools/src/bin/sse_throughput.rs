//! SSE splitter and meter throughput on a synthetic chat stream: the figures of perf/RESULTS.md,
//! "SSE splitter throughput".
//!
//!   cargo run --release -p sluice-perf --bin sse_throughput   # 64 MiB, as reported
//!   cargo run --release -p sluice-perf --bin sse_throughput -- 4  # a 4 MiB stream
//!
//! Realistic chunks with varying content lengths and a usage chunk every 200 events, fed in
//! 16 KiB reads; best of 3 runs of the splitter alone and of splitter + meter.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::hint::black_box;
use std::time::Instant;

use sluice::meter::{MeterSummary, Mono, SseMeter, SseSplitter};

fn main() {
    let mib: usize = match std::env::args().nth(1) {
        None => 64,
        Some(arg) => match arg.parse() {
            Ok(n) if n > 0 => n,
            _ => {
                eprintln!("usage: sse_throughput [MiB of stream, default 64]");
                std::process::exit(2);
            }
        },
    };
    let total = mib << 20;
    const READ: usize = 16 * 1024;
    let mut stream = Vec::with_capacity(total + 4096);
    let words = [
        "Hello",
        " world",
        "，中文",
        " 😀",
        " the",
        " quick brown fox",
        "\\n",
    ];
    let mut i = 0usize;
    while stream.len() < total {
        let w = words[i % words.len()];
        if i % 200 == 199 {
            stream.extend_from_slice(b"data: {\"id\":\"chatcmpl-B9MBs8CjcvOU2jLn4n570S5qMJKcT\",\"object\":\"chat.completion.chunk\",\"created\":1741569952,\"model\":\"gpt-4o-2024-08-06\",\"service_tier\":\"default\",\"system_fingerprint\":\"fp_4f2a9c1b7e\",\"choices\":[],\"usage\":{\"prompt_tokens\":19,\"completion_tokens\":200,\"total_tokens\":219,\"prompt_tokens_details\":{\"cached_tokens\":0,\"audio_tokens\":0},\"completion_tokens_details\":{\"reasoning_tokens\":0,\"audio_tokens\":0,\"accepted_prediction_tokens\":0,\"rejected_prediction_tokens\":0}}}\n\n");
        } else {
            stream.extend_from_slice(format!("data: {{\"id\":\"chatcmpl-B9MBs8CjcvOU2jLn4n570S5qMJKcT\",\"object\":\"chat.completion.chunk\",\"created\":1741569952,\"model\":\"gpt-4o-2024-08-06\",\"service_tier\":\"default\",\"system_fingerprint\":\"fp_4f2a9c1b7e\",\"choices\":[{{\"index\":0,\"delta\":{{\"content\":\"{w}\"}},\"logprobs\":null,\"finish_reason\":null}}],\"usage\":null}}\n\n").as_bytes());
        }
        i += 1;
    }
    let events = i;
    let gb = stream.len() as f64 / 1e9;
    let now = Mono::now();

    let mut best_split = f64::MAX;
    for _ in 0..3 {
        let mut s = SseSplitter::new();
        let mut n = 0usize;
        let start = Instant::now();
        for c in stream.chunks(READ) {
            s.feed(black_box(c), |e| n += black_box(e).len());
        }
        best_split = best_split.min(start.elapsed().as_secs_f64());
        assert!(n > 0);
    }

    let mut best_meter = f64::MAX;
    let mut summary = MeterSummary::default();
    for _ in 0..3 {
        let mut m = SseMeter::new();
        let start = Instant::now();
        for c in stream.chunks(READ) {
            m.feed(black_box(c), now);
        }
        best_meter = best_meter.min(start.elapsed().as_secs_f64());
        summary = m.summary();
    }
    assert_eq!(summary.events as usize, events);
    assert!(summary.usage.is_some());

    println!(
        "sse_throughput: {:.1} MiB, {} events ({} B/event avg), {} B reads",
        stream.len() as f64 / (1 << 20) as f64,
        events,
        stream.len() / events,
        READ
    );
    println!(
        "  splitter alone:    {:.2} GB/s ({:.0} ns/event)",
        gb / best_split,
        best_split * 1e9 / events as f64
    );
    println!(
        "  splitter + meter:  {:.2} GB/s ({:.0} ns/event, {:.1} M events/s)",
        gb / best_meter,
        best_meter * 1e9 / events as f64,
        events as f64 / best_meter / 1e6
    );
}

//! Criterion microbenchmarks of the request path's hot spots, one at a time, without I/O:
//! model extraction (inspection of a 1 KB and a 64 KB body), SSE splitting, limiter admission and
//! settlement, route choice, the prompt-token estimate, and one whole request through the
//! in-process pipeline (head parse → authenticate → inspect → authorize → route → admit →
//! build the upstream request → settle).
//!
//!   cargo bench -p sluice --features bench --bench hot_paths            # all
//!   cargo bench -p sluice --features bench --bench hot_paths -- sse     # a filter
//!
//! Instruction counts for stable comparisons on a noisy machine: `bench/callgrind.sh`. The fixture
//! (`fixture/mod.rs`, compiled into the library as `sluice::hotpath` with the `bench` feature) is
//! shared with `bench/micro/hotpath.rs`.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::hint::black_box;

use criterion::{criterion_group, criterion_main, Criterion, Throughput};

use sluice::hotpath::Fixture;

fn benches(c: &mut Criterion) {
    let mut f = Fixture::new();

    let mut g = c.benchmark_group("inspect");
    g.throughput(Throughput::Bytes(f.body.len() as u64));
    g.bench_function("model_1kb", |b| b.iter(|| black_box(f.inspect())));
    g.throughput(Throughput::Bytes(f.body_64k.len() as u64));
    g.bench_function("model_64kb", |b| b.iter(|| black_box(f.inspect_64k())));
    g.throughput(Throughput::Bytes(f.body_64k_plain.len() as u64));
    g.bench_function("model_64kb_plain", |b| {
        b.iter(|| black_box(f.inspect_64k_plain()))
    });
    g.finish();

    let mut g = c.benchmark_group("sse");
    g.throughput(Throughput::Bytes(f.stream.len() as u64));
    g.bench_function("split_64_events", |b| b.iter(|| black_box(f.split_sse())));
    g.finish();

    let mut g = c.benchmark_group("tokens");
    g.throughput(Throughput::Bytes(f.body.len() as u64));
    g.bench_function("estimate_1kb", |b| b.iter(|| black_box(f.estimate())));
    g.finish();

    c.bench_function("meter/usage_of_a_small_answer", |b| {
        b.iter(|| black_box(f.meter_answer()))
    });
    c.bench_function("accesslog/encode_a_record", |b| {
        b.iter(|| black_box(f.encode_record()))
    });
    c.bench_function("limiter/admit_settle_3_policies_and_quota", |b| {
        b.iter(|| black_box(f.admit_settle()))
    });
    c.bench_function("route/choose_weighted", |b| b.iter(|| black_box(f.route())));
    c.bench_function("pipeline/one_request_in_process", |b| {
        b.iter(|| black_box(f.pipeline()))
    });
}

criterion_group!(hot, benches);
criterion_main!(hot);

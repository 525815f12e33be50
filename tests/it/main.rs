//! The black-box suite: the real `sluice` binary over real sockets against mock-llm and a real
//! `redis-server` (the harness is `tests/harness`). One test binary, so the suite links once;
//! one module per area. Run one area with `cargo nextest run -p sluice-tests -E
//! 'test(/^shedding::/)'` (after `cargo build --workspace`: the binary under test is built by
//! its own package).

// The suite runs on the test's own threads, never on a worker: it may sleep to pace a client
// and lock what its threads share (clippy.toml's bans are about workers).
#![allow(clippy::disallowed_methods, clippy::disallowed_types)]

mod accesslog_tool;
mod anthropic;
mod anthropic_endpoint;
mod auth;
mod bench_kit;
mod cli;
mod deploy;
mod dialects;
mod fallback;
mod harness;
mod http_features;
mod http_strict;
mod https_upstream;
mod inspection;
mod keepalive;
mod limits;
mod limits_redis;
mod loadgen;
mod loadgen_uring;
mod observability;
mod outcomes;
mod pools;
mod process;
mod readme;
mod reload;
mod routing;
mod saturation;
mod shedding;
mod shutdown;
mod snapshot_swap;
mod sticky;
mod strategies;
mod stream_usage;
mod streaming;
mod timeouts;
mod tls;
mod translation_bounds;
mod upgrade;
mod upstream_errors;

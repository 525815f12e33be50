//! Sluice: an LLM API gateway. See `docs/architecture.md` for the layers and the rules between
//! them, `docs/request-lifecycle.md` for the life of a request, and [`gateway::pipeline::proxy`]
//! for the function that runs it.
//!
//! Layers, lowest first; each may import only the layers below it (checked by
//! `core/tests/layers.rs`):
//! - [`sys`]: socket syscalls the runtime does not offer, and the owned-buffer I/O steps built
//!   on them that the client and upstream sides share. Imports nothing of the crate.
//! - [`http`]: RFC 9112 parsing and framing, its own errors and limits.
//! - [`openai`]: wire knowledge without I/O: inspection, SSE metering, token estimates.
//! - [`config`]: raw serde types → resolvers → the validated snapshot; leaf types.
//! - [`limits`], [`upstream`]: per-core limiter shard and ledgers; per-core pools, TLS.
//! - [`telemetry`]: metrics shards and hub, access log, admin listener.
//! - [`gateway`]: the phases, the error catalogue and the pipeline.
//! - [`runtime`]: threads, per-core state, the connection loop: the only caller of the pipeline.

mod sys {
    //! Socket syscalls monoio does not offer (non-blocking send / recv / peek on a raw fd), and
    //! the owned-buffer I/O steps over monoio streams that the client and upstream sides share;
    //! the clocks (the worker's one reading per wake-up, and wall-clock numbers), a small
    //! random-number generator, what the CPU can do (AVX2), the heap cells a worker reuses
    //! for the futures and timers it boxes per request, the worker's list of deadlines its
    //! timed waits park on, and the slab both that list and the client socket set keep their
    //! entries in.
    pub(crate) mod client;
    pub(crate) mod clock;
    pub(crate) mod cpu;
    pub(crate) mod deadlines;
    pub(crate) mod mono;
    pub(crate) mod rand;
    pub(crate) mod slab;
    pub(crate) mod sock;
    pub(crate) mod spare;
    pub(crate) mod stream;
    #[cfg(test)]
    pub(crate) mod testing;
    pub(crate) mod time;
}

mod http;

mod openai {
    //! What Sluice knows of the OpenAI wire format, with no I/O: which top-level fields a request
    //! carries ([`inspect`]), what a response reports as it streams ([`meter`]), and how many
    //! tokens a text is ([`tokens`]).
    pub(crate) mod anthropic;
    pub(crate) mod endpoint;
    pub(crate) mod inspect;
    pub(crate) mod json;
    pub(crate) mod meter;
    pub(crate) mod tokens;
}

mod cli;
mod config;
mod limits;
mod upstream;

mod telemetry {
    //! Metrics (per-core shards published to a hub), the protobuf access log and the admin
    //! listener. Fed by the gateway's observations; never on a request's critical path.
    pub(crate) mod accesslog;
    pub(crate) mod admin;
    pub(crate) mod metrics;
}

mod gateway {
    //! One request's phases, each its own module, run top to bottom by [`pipeline::proxy`];
    //! [`error`] is the catalogue every phase answers with.
    pub(crate) mod admit;
    pub(crate) mod attempt;
    pub(crate) mod auth;
    pub(crate) mod client_addr;
    pub(crate) mod context;
    pub(crate) mod error;
    pub(crate) mod fallback;
    pub(crate) mod forward;
    pub(crate) mod front_door;
    pub(crate) mod models;
    pub(crate) mod observe;
    pub(crate) mod pipeline;
    pub(crate) mod queue;
    pub(crate) mod record;
    pub(crate) mod relay;
    pub(crate) mod route;
    pub(crate) mod sticky;
    pub(crate) mod translation;
}

mod runtime {
    //! Worker threads, per-core state and the connection loop.
    pub(crate) mod conn;
    pub(crate) mod control;
    pub(crate) mod fleet;
    pub(crate) mod scrape;
    pub(crate) mod server;
    pub(crate) mod takeover;
    pub(crate) mod worker;
}

// The public surface: what the binary, the integration tests, the examples and the benchmarks
// use, and nothing else. Every other item is crate-private (`unreachable_pub` is denied), so the
// compiler reports what nothing uses.

/// API keys are stored as SHA-256 digests (`sluice hash-key`).
pub use cli::{describe_reload, post_reload, reload_target, ReloadTarget};
pub use config::limits::{digest, hex};
/// Configuration: parse and validate a config file into the snapshot a gateway runs on.
pub use config::{load, load_with_warnings, ConfigError, Loaded, Snapshot, ENV_PLACEHOLDER};
/// Run the gateway on a snapshot (threads, listeners, admin), or one worker's parts of it.
pub use runtime::{conn::serve, server::run, worker::Worker};
/// The metrics hub and the families it exposes.
pub use telemetry::metrics::{MetricsHub, FAMILIES};

/// The protobuf access log: writing records, reading them back (`sluice logs`).
pub mod accesslog {
    pub use crate::telemetry::accesslog::{
        dump, AccessLog, AccessLogConfig, AccessRecord, LogError, UsageSource,
    };
}

/// Prompt-token counting and the fast estimate the limiter reserves by.
pub mod tokens {
    pub use crate::openai::tokens::{
        class_of, class_weight, count_tokens, estimate_tokens, warm_up, Class, Encoding,
    };
}

/// The SSE splitter and the usage meter the relay runs on streamed responses.
pub mod meter {
    pub use crate::openai::meter::sse::SseSplitter;
    pub use crate::openai::meter::usage::MeterSummary;
    pub use crate::openai::meter::SseMeter;
    /// The monotonic clock reading [`SseMeter::feed`] takes with each read.
    pub use crate::sys::clock::Mono;
}

/// The fuzz targets' bodies (`fuzz/`): compiled in with the `fuzz` feature, and in tests, which
/// replay the committed corpora through them.
#[cfg(any(test, feature = "fuzz"))]
#[doc(hidden)]
pub mod fuzzing;

/// The benchmark fixture (`bench/micro/fixture/mod.rs`): the hot path's pieces one by one, and
/// the pipeline's decisions whole on a real worker's per-core state, without sockets. Compiled in
/// only with the `bench` feature, which the criterion benchmarks and the callgrind driver
/// require: it drives crate-private phases, which so stay crate-private for everyone else (and
/// the shipped binary carries none of it).
#[cfg(feature = "bench")]
#[path = "../../bench/micro/fixture/mod.rs"]
pub mod hotpath;

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

pub mod sys {
    //! Socket syscalls monoio does not offer (non-blocking send / recv / peek on a raw fd), and
    //! the owned-buffer I/O steps over monoio streams that the client and upstream sides share.
    pub mod sock;
    pub mod stream;
    pub mod time;
}

pub mod http;

pub mod openai {
    //! What Sluice knows of the OpenAI wire format, with no I/O: which top-level fields a request
    //! carries ([`inspect`]), what a response reports as it streams ([`meter`]), and how many
    //! tokens a text is ([`tokens`]).
    pub mod endpoint;
    pub mod inspect;
    pub mod json;
    pub mod meter;
    pub mod tokens;
}

pub mod config;
pub mod limits;
pub mod upstream;

pub mod telemetry {
    //! Metrics (per-core shards published to a hub), the protobuf access log and the admin
    //! listener. Fed by the gateway's observations; never on a request's critical path.
    pub mod accesslog;
    pub mod admin;
    pub mod metrics;
}

pub mod gateway {
    //! One request's phases, each its own module, run top to bottom by [`pipeline::proxy`];
    //! [`error`] is the catalogue every phase answers with.
    pub mod admit;
    pub mod auth;
    pub mod context;
    pub mod error;
    pub mod forward;
    pub mod models;
    pub mod observe;
    pub mod pipeline;
    pub mod relay;
    pub mod route;
}

pub mod runtime {
    //! Worker threads, per-core state and the connection loop.
    pub mod conn;
    pub mod server;
    pub mod worker;
}

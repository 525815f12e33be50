//! Sluice: an LLM API gateway. See `docs/request-lifecycle.md` for the life of a request and
//! [`pipeline::proxy`] for the function that runs it.

pub mod accesslog;
pub mod admin;
pub mod admit;
pub mod auth;
pub mod config;
pub mod conn;
pub mod error;
pub mod forward;
pub mod http;
pub mod inspect;
pub mod limits;
pub mod meter;
pub mod metrics;
pub mod models;
pub mod observe;
pub mod pipeline;
pub mod relay;
pub mod route;
pub mod server;
pub mod sock;
pub mod tokens;
pub mod upstream;
pub mod worker;

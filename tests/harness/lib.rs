//! Black-box test harness for Sluice.
//!
//! Spawns the real `sluice` and `mock-llm` binaries (built beforehand by `cargo build
//! --workspace`) on port 0, and talks to them over plain `std::net::TcpStream` with a tiny,
//! strict HTTP/1.1 client. Every socket read has a timeout, every spawned process is killed when
//! its guard is dropped (and, as a safety net, when the test process dies), so no test can hang
//! or leak a process.
//!
//! A typical test is one setup line per process:
//!
//! ```ignore
//! let mock = Mock::start(&["--inter-token-ms", "50"]);
//! let gw = Sluice::start(&Config::one_cluster(&mock).timeout("header_read_ms", 300));
//! let resp = gw.post("/v1/chat/completions", r#"{"model":"gpt-4o","messages":[]}"#);
//! ```
#![allow(clippy::unwrap_used, clippy::expect_used)]
// The harness runs on the test's own threads, never on a worker: it may sleep between polls of
// a process it waits for, and lock what its threads share.
#![allow(clippy::disallowed_methods, clippy::disallowed_types)]
//!
//! One module per job, all re-exported here (tests name `harness::Mock`, not the module).

pub use serde_json::{json, Value};

mod assertions;
mod client;
mod config;
mod mock;
mod observe;
mod process;
mod redis;
mod sluice;
mod sse;

pub use assertions::*;
pub use client::*;
pub use config::*;
pub use mock::*;
pub use observe::*;
pub use process::*;
pub use redis::*;
pub use sluice::*;
pub use sse::*;

//! Sluice's protobuf schemas and their prost-generated Rust types.
//!
//! The access-log record lives in `proto/accesslog.proto` (package `sluice.accesslog.v1`); it is
//! compiled at build time by protox + prost-build, so no `protoc` binary is needed. The types are
//! re-exported at the crate root: [`AccessRecord`] and [`UsageSource`].

/// Generated code for package `sluice.accesslog.v1`.
pub mod accesslog {
    /// Version 1 of the access-log schema.
    pub mod v1 {
        #![allow(missing_docs, clippy::all, clippy::pedantic)]
        include!(concat!(env!("OUT_DIR"), "/sluice.accesslog.v1.rs"));
    }
}

pub use accesslog::v1::{AccessRecord, UsageSource};

/// Re-exported so users of these types can call `encode` / `decode` with the same prost version.
pub use prost;

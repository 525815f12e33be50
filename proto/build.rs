//! Compiles `accesslog.proto` to Rust with prost. The schema is parsed by protox (pure Rust), so
//! no `protoc` binary is needed.

use std::path::PathBuf;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let dir = PathBuf::from(std::env::var("CARGO_MANIFEST_DIR")?);
    let proto = dir.join("accesslog.proto");
    println!("cargo:rerun-if-changed={}", proto.display());
    let fds = protox::compile([&proto], [&dir])?;
    prost_build::Config::new().compile_fds(fds)?;
    Ok(())
}

//! The `sluice` command: run the gateway, or check a config file.

use std::process::ExitCode;

#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

const USAGE: &str = "\
usage:
  sluice --config FILE          run the gateway
  sluice check --config FILE    validate a config file and exit (non-zero on errors)
  sluice --version";

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let (check, rest) = match args.first().map(String::as_str) {
        Some("check") => (true, &args[1..]),
        Some("--version" | "-V") => {
            println!("sluice {}", env!("CARGO_PKG_VERSION"));
            return ExitCode::SUCCESS;
        }
        Some("--help" | "-h") => {
            println!("{USAGE}");
            return ExitCode::SUCCESS;
        }
        _ => (false, &args[..]),
    };
    let path = match rest {
        [flag, path] if flag == "--config" || flag == "-c" => path,
        _ => {
            eprintln!("{USAGE}");
            return ExitCode::from(2);
        }
    };
    let text = match std::fs::read_to_string(path) {
        Ok(t) => t,
        Err(e) => {
            eprintln!("error: cannot read {path}: {e}");
            return ExitCode::FAILURE;
        }
    };
    let snapshot = match sluice::config::load(&text, &|k| std::env::var(k).ok()) {
        Ok(s) => s,
        Err(errors) => {
            for e in &errors {
                eprintln!("error: {e}");
            }
            eprintln!("{path}: {} error(s)", errors.len());
            return ExitCode::FAILURE;
        }
    };
    if check {
        println!("config ok");
        return ExitCode::SUCCESS;
    }
    match sluice::server::run(snapshot) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("sluice: {e}");
            ExitCode::FAILURE
        }
    }
}

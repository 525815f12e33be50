//! The `sluice` command: run the gateway, or check a config file.

use std::process::ExitCode;

#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

const USAGE: &str = "\
usage:
  sluice --config FILE          run the gateway (SIGHUP reloads FILE; SIGTERM drains, stops)
  sluice --config FILE --takeover PATH
                                upgrade in place: take the listening sockets over from the
                                process serving at PATH (its server.takeover_socket), which
                                then drains
  sluice check --config FILE    validate a config file and exit (non-zero on errors)
  sluice logs FILE... [--follow] print access-log files as JSON lines (--follow: keep
                                reading the last file as it grows, across rotation)
  sluice key hash [KEY]          print a key's SHA-256 for `[[keys]] sha256` (reads the key
                                from stdin when not given, keeping it out of shell history)
  sluice key new                print a new random key and its SHA-256
  sluice --version";

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let (check, rest) = match args.first().map(String::as_str) {
        Some("check") => (true, &args[1..]),
        Some("logs") => return logs(&args[1..]),
        Some("key") => return key(&args[1..]),
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
    let is_config = |f: &String| f == "--config" || f == "-c";
    let (path, takeover) = match rest {
        [flag, path] if is_config(flag) => (path, None),
        // Only for running: take the listening sockets over from the process serving there.
        [flag, path, t, socket] | [t, socket, flag, path]
            if !check && is_config(flag) && t == "--takeover" =>
        {
            (path, Some(std::path::PathBuf::from(socket)))
        }
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
    let loaded = sluice::load_with_warnings(&text, &|k| std::env::var(k).ok());
    // Warnings do not stop a check or a start, but are always said.
    for w in &loaded.warnings {
        eprintln!("warning: {w}");
    }
    let snapshot = match loaded.snapshot {
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
    // Reloads (SIGHUP, POST /admin/reload) read this same file again.
    match sluice::run(snapshot, std::path::PathBuf::from(path), takeover) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("sluice: {e}");
            ExitCode::FAILURE
        }
    }
}

/// `sluice key hash [KEY]` / `sluice key new`.
fn key(args: &[String]) -> ExitCode {
    use sluice::{digest, hex};
    match args {
        [cmd, key] if cmd == "hash" => {
            println!("{}", hex(&digest(key.as_bytes())));
            ExitCode::SUCCESS
        }
        [cmd] if cmd == "hash" => {
            let mut line = String::new();
            if let Err(e) = std::io::stdin().read_line(&mut line) {
                eprintln!("sluice key hash: reading stdin: {e}");
                return ExitCode::FAILURE;
            }
            let key = line.trim_end_matches(['\r', '\n']);
            if key.is_empty() {
                eprintln!("sluice key hash: no key on stdin");
                return ExitCode::from(2);
            }
            println!("{}", hex(&digest(key.as_bytes())));
            ExitCode::SUCCESS
        }
        [cmd] if cmd == "new" => {
            use ring::rand::SecureRandom as _;
            let mut bytes = [0u8; 20];
            if ring::rand::SystemRandom::new().fill(&mut bytes).is_err() {
                eprintln!("sluice key new: no system randomness");
                return ExitCode::FAILURE;
            }
            let mut key = String::from("sk-sluice-");
            for b in bytes {
                key.push_str(&format!("{b:02x}"));
            }
            println!("key:    {key}");
            println!("sha256: {}", hex(&digest(key.as_bytes())));
            ExitCode::SUCCESS
        }
        _ => {
            eprintln!("{USAGE}");
            ExitCode::from(2)
        }
    }
}

/// `sluice logs FILE... [--follow]`: decode access-log files to JSON lines on stdout.
fn logs(args: &[String]) -> ExitCode {
    use std::io::Write as _;
    let mut follow = false;
    let mut files = Vec::new();
    for arg in args {
        match arg.as_str() {
            "--follow" | "-f" => follow = true,
            "--help" | "-h" => {
                println!("{USAGE}");
                return ExitCode::SUCCESS;
            }
            flag if flag.starts_with('-') => {
                eprintln!("sluice logs: unknown option {flag}\n{USAGE}");
                return ExitCode::from(2);
            }
            file => files.push(std::path::PathBuf::from(file)),
        }
    }
    if files.is_empty() {
        eprintln!("sluice logs: no FILE given\n{USAGE}");
        return ExitCode::from(2);
    }
    let stdout = std::io::stdout();
    let mut out = std::io::BufWriter::with_capacity(64 << 10, stdout.lock());
    let mut warn = |e: &sluice::accesslog::LogError| eprintln!("sluice logs: warning: {e}");
    let result = sluice::accesslog::dump(&files, follow, &mut out, &mut warn);
    let flushed = out.flush();
    match (result, flushed) {
        (Err(sluice::accesslog::LogError::Write(e)), _) | (Ok(_), Err(e))
            if e.kind() == std::io::ErrorKind::BrokenPipe =>
        {
            ExitCode::SUCCESS
        }
        (Ok(_), Ok(())) => ExitCode::SUCCESS,
        (Ok(_), Err(e)) => {
            eprintln!("sluice logs: writing output: {e}");
            ExitCode::FAILURE
        }
        (Err(e), _) => {
            eprintln!("sluice logs: {e}");
            ExitCode::FAILURE
        }
    }
}

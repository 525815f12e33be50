//! The `sluice` command: run the gateway, check a config, reload a running gateway, read its
//! access log, make keys; `sluice --help` (or `sluice help COMMAND`) says how.

use std::path::{Path, PathBuf};
use std::process::ExitCode;

use clap::{Args, CommandFactory, Parser, Subcommand};

#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// The `sluice` command line, defined once: parsing, each command's `--help`, the shell
/// completions (`sluice completions SHELL`) and the man page (`sluice man`) all come from it.
#[derive(Parser)]
#[command(
    name = "sluice",
    version,
    about = "An LLM API gateway: OpenAI- and Anthropic-compatible, thread-per-core, io_uring",
    long_about = "An LLM API gateway: OpenAI- and Anthropic-compatible, thread-per-core, \
                  io_uring.\n\nWith no command, `sluice --config FILE` runs the gateway (as \
                  `sluice run --config FILE`).",
    after_help = EXIT_STATUS,
    args_conflicts_with_subcommands = true,
    subcommand_negates_reqs = true
)]
struct Cli {
    #[command(subcommand)]
    command: Option<Command>,
    #[command(flatten)]
    run: RunArgs,
}

const EXIT_STATUS: &str = "Exit status: 0 success; 1 failure (config errors, an unreadable file, \
a rejected reload, the gateway stopping on an error); 2 a usage error (what was wrong is said).";

#[derive(Subcommand)]
enum Command {
    /// Run the gateway (the default: `sluice --config FILE` is the same)
    #[command(after_help = EXIT_STATUS)]
    Run(RunArgs),
    /// Validate a config file: every error, with its key path and position; 0 when it is valid
    #[command(after_help = EXIT_STATUS)]
    Check(CheckArgs),
    /// Reload the running gateway's config through its admin listener, and wait for the outcome
    ///
    /// Reads `admin.listen` and `admin.token_env` from FILE (the file the gateway runs on), sends
    /// `POST /admin/reload` with the token, and prints the outcome: exit 0 when applied, 1 when
    /// rejected (with every error) or when the gateway cannot be reached. Those two settings
    /// take effect only at a restart: after changing either, restart instead of reloading.
    #[command(after_help = EXIT_STATUS)]
    Reload(ReloadArgs),
    /// Print access-log files as JSON lines
    #[command(after_help = EXIT_STATUS)]
    Logs(LogsArgs),
    /// Make or hash an API key
    #[command(subcommand)]
    Key(KeyCommand),
    /// Print a shell completion script (bash, zsh, fish, elvish, powershell)
    Completions {
        /// The shell
        shell: clap_complete::Shell,
    },
    /// Print the man page (roff): `sluice man > sluice.1; man ./sluice.1`
    Man,
}

#[derive(Args)]
struct RunArgs {
    /// The config file (TOML); SIGHUP and `sluice reload` read it again
    #[arg(short, long, value_name = "FILE", required = true)]
    config: Option<PathBuf>,
    /// Upgrade in place: take the listening sockets over from the process serving at PATH (its
    /// `server.takeover_socket`), which then drains
    #[arg(long, value_name = "PATH")]
    takeover: Option<PathBuf>,
}

#[derive(Args)]
struct CheckArgs {
    /// The config file (TOML)
    #[arg(short, long, value_name = "FILE")]
    config: PathBuf,
    /// Check everything but the environment: variables the config names need not be set (for CI,
    /// without the production secrets); the variables it would read are listed
    #[arg(long)]
    no_env: bool,
}

#[derive(Args)]
struct ReloadArgs {
    /// The config file the gateway runs on (its `[admin]` says where to send the reload)
    #[arg(short, long, value_name = "FILE")]
    config: PathBuf,
    /// How long to wait for the outcome, in seconds
    #[arg(long, value_name = "SECS", default_value_t = 60)]
    timeout: u64,
}

#[derive(Args)]
struct LogsArgs {
    /// Access-log files (`access-w*.pb`), in order
    #[arg(required = true, value_name = "FILE")]
    files: Vec<PathBuf>,
    /// Keep reading the last file as it grows, across rotation
    #[arg(short, long)]
    follow: bool,
}

#[derive(Subcommand)]
enum KeyCommand {
    /// Print a key's SHA-256 for `[[keys]] sha256` (the key from stdin when not given, keeping it
    /// out of shell history)
    Hash {
        /// The key
        key: Option<String>,
    },
    /// Print a new random key and a `[[keys]]` block for it, ready to paste into the config
    New {
        /// The key's `id` in the block
        #[arg(long, default_value = "my-key")]
        id: String,
    },
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    match cli.command {
        None => run(cli.run),
        Some(Command::Run(args)) => run(args),
        Some(Command::Check(args)) => check(&args),
        Some(Command::Reload(args)) => reload(&args),
        Some(Command::Logs(args)) => logs(&args),
        Some(Command::Key(command)) => key(command),
        Some(Command::Completions { shell }) => {
            let mut script = Vec::new();
            clap_complete::generate(shell, &mut Cli::command(), "sluice", &mut script);
            print(&script)
        }
        Some(Command::Man) => {
            let mut page = Vec::new();
            match clap_mangen::Man::new(Cli::command()).render(&mut page) {
                Ok(()) => print(&page),
                Err(e) => {
                    eprintln!("sluice man: {e}");
                    ExitCode::FAILURE
                }
            }
        }
    }
}

/// Write `text` to stdout: a reader that stopped early (`| head`) is no failure, a full disk is.
fn print(text: &[u8]) -> ExitCode {
    use std::io::Write as _;
    let mut out = std::io::stdout().lock();
    match out.write_all(text).and_then(|()| out.flush()) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("sluice: writing output: {e}");
            ExitCode::FAILURE
        }
    }
}

/// Read and validate `path`, saying every warning and error; `lookup` reads the environment.
fn load(path: &Path, lookup: &dyn Fn(&str) -> Option<String>) -> Option<sluice::Snapshot> {
    let text = match std::fs::read_to_string(path) {
        Ok(t) => t,
        Err(e) => {
            eprintln!("error: cannot read {}: {e}", path.display());
            return None;
        }
    };
    let loaded = sluice::load_with_warnings(&text, lookup);
    // Warnings do not stop a check or a start, but are always said.
    for w in &loaded.warnings {
        eprintln!("warning: {w}");
    }
    match loaded.snapshot {
        Ok(s) => Some(s),
        Err(errors) => {
            for e in &errors {
                eprintln!("error: {e}");
            }
            eprintln!("{}: {} error(s)", path.display(), errors.len());
            None
        }
    }
}

fn run(args: RunArgs) -> ExitCode {
    // `required = true` (with no command) makes clap refuse a missing --config.
    let Some(path) = args.config else {
        return ExitCode::from(2);
    };
    let Some(snapshot) = load(&path, &|k| std::env::var(k).ok()) else {
        return ExitCode::FAILURE;
    };
    // Reloads (SIGHUP, POST /admin/reload) read this same file again.
    match sluice::run(snapshot, path, args.takeover) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("sluice: {e}");
            ExitCode::FAILURE
        }
    }
}

/// `sluice check`: with `--no-env`, every variable the config names reads as a placeholder
/// (a value of the form each use needs is not checked), and the names are listed.
fn check(args: &CheckArgs) -> ExitCode {
    let read = std::cell::RefCell::new(std::collections::BTreeSet::new());
    let placeholder = |name: &str| {
        read.borrow_mut().insert(name.to_owned());
        Some(sluice::ENV_PLACEHOLDER.to_owned())
    };
    let real = |name: &str| std::env::var(name).ok();
    let lookup: &dyn Fn(&str) -> Option<String> = if args.no_env { &placeholder } else { &real };
    let valid = load(&args.config, lookup).is_some();
    if args.no_env {
        let names: Vec<String> = read.borrow().iter().cloned().collect();
        if names.is_empty() {
            println!("reads no environment variables");
        } else {
            println!(
                "would read these environment variables: {}",
                names.join(", ")
            );
        }
    }
    if valid {
        println!(
            "config ok{}",
            if args.no_env {
                " (environment not checked)"
            } else {
                ""
            }
        );
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    }
}

/// `sluice key hash [KEY]` / `sluice key new [--id ID]`.
fn key(command: KeyCommand) -> ExitCode {
    use sluice::{digest, hex};
    match command {
        KeyCommand::Hash { key: Some(key) } => {
            println!("{}", hex(&digest(key.as_bytes())));
            ExitCode::SUCCESS
        }
        KeyCommand::Hash { key: None } => {
            let mut line = String::new();
            if let Err(e) = std::io::stdin().read_line(&mut line) {
                eprintln!("sluice key hash: reading stdin: {e}");
                return ExitCode::FAILURE;
            }
            let key = line.trim_end_matches(['\r', '\n']);
            if key.is_empty() {
                eprintln!("sluice key hash: no key on stdin (give it, or pipe it in)");
                return ExitCode::from(2);
            }
            println!("{}", hex(&digest(key.as_bytes())));
            ExitCode::SUCCESS
        }
        KeyCommand::New { id } => {
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
            // The key goes to the client and is shown once; the block (its hash only) goes in
            // the config.
            let block = format!(
                "# key (give it to the client; it is not stored anywhere): {key}\n[[keys]]\n\
                 id = {}\nsha256 = \"{}\"\n",
                toml_string(&id),
                hex(&digest(key.as_bytes()))
            );
            print(block.as_bytes())
        }
    }
}

/// `s` as a TOML basic string.
fn toml_string(s: &str) -> String {
    let mut out = String::from("\"");
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            c if c.is_control() => out.push_str(&format!("\\u{:04X}", u32::from(c))),
            c => out.push(c),
        }
    }
    out.push('"');
    out
}

/// `sluice reload --config FILE`: `POST /admin/reload` to the admin listener FILE names, with the
/// token from the variable FILE's `admin.token_env` names; the outcome printed, 0 when applied.
fn reload(args: &ReloadArgs) -> ExitCode {
    let target = match std::fs::read_to_string(&args.config)
        .map_err(|e| format!("cannot read {}: {e}", args.config.display()))
        .and_then(|text| sluice::reload_target(&text))
    {
        Ok(t) => t,
        Err(e) => {
            eprintln!("sluice reload: {e}");
            return ExitCode::FAILURE;
        }
    };
    let Ok(token) = std::env::var(&target.token_env) else {
        eprintln!(
            "sluice reload: {} (admin.token_env) is not set: the admin listener needs its token",
            target.token_env
        );
        return ExitCode::FAILURE;
    };
    let timeout = std::time::Duration::from_secs(args.timeout.max(1));
    match sluice::post_reload(target.addr, &token, timeout) {
        Ok((status, body)) => {
            let outcome = sluice::describe_reload(status, &body);
            if status == 200 {
                println!("{outcome}");
                ExitCode::SUCCESS
            } else {
                eprintln!("{outcome}");
                ExitCode::FAILURE
            }
        }
        Err(e) => {
            eprintln!("sluice reload: {}: {e}", target.addr);
            ExitCode::FAILURE
        }
    }
}

/// `sluice logs FILE... [--follow]`: decode access-log files to JSON lines on stdout.
fn logs(args: &LogsArgs) -> ExitCode {
    use std::io::Write as _;
    let stdout = std::io::stdout();
    let mut out = std::io::BufWriter::with_capacity(64 << 10, stdout.lock());
    let mut warn = |e: &sluice::accesslog::LogError| eprintln!("sluice logs: warning: {e}");
    let result = sluice::accesslog::dump(&args.files, args.follow, &mut out, &mut warn);
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

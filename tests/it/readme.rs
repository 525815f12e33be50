//! The README works as written (issue #11): every fenced code block in README.md (and in
//! docs/routing.md, the reference moved out of it) carries a
//! `<!-- readme-test: … -->` marker on the line before it saying how it is checked, and the
//! checks run the blocks against the shipped `conf/sluice.toml`:
//!
//! - `shell`: run with bash in the workspace root; it must exit 0 (curl is told to fail on an
//!   HTTP error through a `.curlrc`, so a 401 or 404 fails the block).
//! - `serve NAME`: one command line starting a server, kept running for the later blocks.
//! - `python`: run with python3 (the `openai` package is needed: `scripts/test.sh` installs it).
//! - `file NAME`: written to the scratch directory, for a later block to use.
//! - `check-output NAME`: `$ [VAR=value …] sluice check --config NAME` and its exact output.
//! - `skip (reason)`: not run here, with the reason said.
//!
//! The only rewrites are of places, never of behaviour: `target/release/` becomes this build's
//! binary directory, and the fixed ports (8080 for Sluice, 9000 for the upstream, 9090 for the
//! admin listener) become free ones, in the blocks and in a copy of the shipped config.
//!
//! Also here: the README's layout table names what the repository holds, and `scripts/demo.sh`
//! runs (with this build's binaries) and fails when it can't do what it says.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use sluice_tests::*;

struct Block {
    /// 1-based line of the opening fence.
    line: usize,
    marker: String,
    text: String,
}

/// README.md, then the pages its blocks moved to (docs/routing.md): checked as one text, in that
/// order (a block's line numbers count from README.md's first line).
fn readme() -> String {
    let mut text = std::fs::read_to_string(workspace_root().join("README.md")).expect("README.md");
    let moved = workspace_root().join("docs/routing.md");
    text.push('\n');
    text.push_str(&std::fs::read_to_string(moved).expect("docs/routing.md"));
    text
}

/// Every fenced block with the marker on the line before its opening fence ("" when none).
fn blocks(readme: &str) -> Vec<Block> {
    let mut out = Vec::new();
    let mut prev = "";
    let mut open: Option<Block> = None;
    for (i, line) in readme.lines().enumerate() {
        if let Some(b) = open.as_mut() {
            if line.trim_start().starts_with("```") {
                out.push(open.take().unwrap());
            } else {
                b.text.push_str(line);
                b.text.push('\n');
            }
        } else if line.trim_start().starts_with("```") {
            let marker = prev
                .trim()
                .strip_prefix("<!-- readme-test:")
                .and_then(|m| m.strip_suffix("-->"))
                .map_or(String::new(), |m| m.trim().to_string());
            open = Some(Block {
                line: i + 1,
                marker,
                text: String::new(),
            });
        }
        prev = line;
    }
    assert!(open.is_none(), "README.md ends inside a code block");
    out
}

/// A server a `serve` block started, stopped at the end of the test.
struct Server {
    child: Child,
    addr: String,
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Start `command` (one line: program and plain arguments) and wait for its `listening on ADDR`
/// line on stdout or stderr.
fn serve(command: &str, cwd: &Path) -> Server {
    let words: Vec<&str> = command.split_whitespace().collect();
    let (program, args) = words.split_first().expect("a command");
    let mut child = Command::new(program)
        .args(args)
        .current_dir(cwd)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| panic!("start `{command}`: {e}"));
    let (tx, rx) = std::sync::mpsc::channel::<String>();
    for pipe in [
        child
            .stdout
            .take()
            .map(|p| Box::new(p) as Box<dyn std::io::Read + Send>),
        child
            .stderr
            .take()
            .map(|p| Box::new(p) as Box<dyn std::io::Read + Send>),
    ]
    .into_iter()
    .flatten()
    {
        let tx = tx.clone();
        std::thread::spawn(move || {
            for line in BufReader::new(pipe).lines().map_while(Result::ok) {
                let _ = tx.send(line);
            }
        });
    }
    let deadline = Instant::now() + Duration::from_secs(20);
    let mut seen = String::new();
    while let Some(left) = deadline.checked_duration_since(Instant::now()) {
        let Ok(line) = rx.recv_timeout(left) else {
            break;
        };
        seen.push_str(&line);
        seen.push('\n');
        if let Some((_, rest)) = line.split_once("listening on ") {
            let addr = rest.split_whitespace().next().unwrap_or("").to_string();
            return Server { child, addr };
        }
    }
    let _ = child.kill();
    let _ = child.wait();
    panic!("`{command}` printed no `listening on` line within 20 s:\n{seen}");
}

/// The shipped config with free ports: Sluice and admin on port 0, the upstream at `upstream`.
fn shipped_config(upstream: &str) -> String {
    let text = std::fs::read_to_string(workspace_root().join("conf/sluice.toml")).unwrap();
    for fixed in [
        "listen = \"127.0.0.1:8080\"",
        "listen = \"127.0.0.1:9090\"",
        "http://127.0.0.1:9000/v1",
    ] {
        assert!(
            text.contains(fixed),
            "conf/sluice.toml no longer has `{fixed}`: update this test and the README"
        );
    }
    text.replace("listen = \"127.0.0.1:8080\"", "listen = \"127.0.0.1:0\"")
        .replace("listen = \"127.0.0.1:9090\"", "listen = \"127.0.0.1:0\"")
        .replace("http://127.0.0.1:9000/v1", &format!("http://{upstream}/v1"))
}

fn output_text(out: &std::process::Output) -> String {
    format!(
        "exit: {:?}\n--- stdout\n{}--- stderr\n{}",
        out.status.code(),
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

#[test]
fn every_readme_code_block_works_against_the_shipped_config() {
    let readme = readme();
    let blocks = blocks(&readme);
    assert!(blocks.len() >= 8, "only {} blocks found", blocks.len());
    let unmarked: Vec<usize> = blocks
        .iter()
        .filter(|b| b.marker.is_empty())
        .map(|b| b.line)
        .collect();
    assert!(
        unmarked.is_empty(),
        "README.md code blocks without a `<!-- readme-test: … -->` marker at lines {unmarked:?}"
    );

    let dir = TempDir::new("readme");
    let curl_home = dir.path().join("curl");
    std::fs::create_dir_all(&curl_home).unwrap();
    std::fs::write(curl_home.join(".curlrc"), "fail-with-body\nmax-time = 20\n").unwrap();
    let config = dir.path().join("sluice.toml");
    std::fs::write(&config, shipped_config("127.0.0.1:9000")).unwrap();
    let bin_dir = bin_dir();
    let mut servers: BTreeMap<String, Server> = BTreeMap::new();
    let mut ran = 0;

    for b in &blocks {
        let at = format!("README.md:{} ({})", b.line, b.marker);
        let sluice_addr = servers.get("sluice").map(|s| s.addr.clone());
        let rewrite = |text: &str| -> String {
            let mut t = text
                .replace("target/release/", &format!("{}/", bin_dir.display()))
                .replace("conf/sluice.toml", &config.display().to_string());
            if let Some(addr) = &sluice_addr {
                t = t.replace("127.0.0.1:8080", addr);
            }
            t
        };
        let (kind, arg) = b.marker.split_once(' ').unwrap_or((&b.marker, ""));
        match kind {
            "skip" => {
                assert!(
                    arg.starts_with('(') && arg.ends_with(')') && arg.len() > 8,
                    "{at}: a skipped block says why, in parentheses"
                );
                continue;
            }
            "file" => {
                std::fs::write(dir.path().join(arg), &b.text).unwrap();
            }
            "serve" => {
                let line = b.text.lines().next().unwrap_or("");
                let command = line.split('#').next().unwrap_or("").trim();
                let command = command.trim_end_matches('&').trim();
                let command = rewrite(command).replace("127.0.0.1:9000", "127.0.0.1:0");
                let server = serve(&command, &workspace_root());
                if arg == "mock-llm" {
                    std::fs::write(&config, shipped_config(&server.addr)).unwrap();
                }
                servers.insert(arg.to_string(), server);
            }
            "shell" => {
                let out = Command::new("bash")
                    .args(["-euo", "pipefail", "-c", &rewrite(&b.text)])
                    .current_dir(workspace_root())
                    .env("CURL_HOME", &curl_home)
                    .stdin(Stdio::null())
                    .output()
                    .unwrap();
                assert!(out.status.success(), "{at}:\n{}", output_text(&out));
            }
            "python" => {
                let out = Command::new("python3")
                    .args(["-c", &rewrite(&b.text)])
                    .stdin(Stdio::null())
                    .output()
                    .unwrap();
                assert!(
                    out.status.success(),
                    "{at} (the `openai` package must be installed: scripts/test.sh does):\n{}",
                    output_text(&out)
                );
            }
            "check-output" => {
                let mut lines = b.text.lines();
                let first = lines.next().unwrap_or("");
                // `$ [NAME=value …] sluice check --config FILE`
                let command = first.strip_prefix("$ ").unwrap_or("");
                let (env, rest) = command
                    .split_once("sluice check --config ")
                    .unwrap_or_else(|| panic!("{at}: starts with `$ … sluice check --config`"));
                assert_eq!(rest, arg, "{at}: the block checks the file it names");
                let mut cmd = Command::new(bin("sluice"));
                for assignment in env.split_whitespace() {
                    let (k, v) = assignment
                        .split_once('=')
                        .unwrap_or_else(|| panic!("{at}: `{assignment}` is not NAME=value"));
                    cmd.env(k, v);
                }
                let out = cmd
                    .args(["check", "--config", arg])
                    .current_dir(dir.path())
                    .stdin(Stdio::null())
                    .output()
                    .unwrap();
                let got = format!(
                    "{}{}",
                    String::from_utf8_lossy(&out.stdout),
                    String::from_utf8_lossy(&out.stderr)
                );
                let want: Vec<&str> = lines.collect();
                let got: Vec<&str> = got.lines().collect();
                assert_eq!(got, want, "{at}: `sluice check` prints something else");
            }
            other => panic!("{at}: unknown marker `{other}`"),
        }
        ran += 1;
    }
    assert!(ran >= 6, "only {ran} blocks ran");
    assert!(
        servers.contains_key("sluice"),
        "no block started sluice, so the requests ran against nothing"
    );
}

/// The table under `## Layout`: every path it names exists, and every top-level entry of the
/// repository and every module of the core crate is in it.
#[test]
fn the_layout_table_names_what_the_repository_holds() {
    let readme = readme();
    let table: String = readme
        .split("## Layout")
        .nth(1)
        .and_then(|rest| rest.split("\n## ").next())
        .expect("a ## Layout section")
        .to_string();
    let root = workspace_root();
    let named: Vec<String> = table
        .lines()
        .filter(|l| l.starts_with("| `"))
        .filter_map(|l| l.split('`').nth(1).map(str::to_string))
        .collect();
    for path in &named {
        assert!(
            root.join(path).exists(),
            "README layout names `{path}`, which does not exist"
        );
    }
    let ignored = [
        "target",
        ".git",
        ".gitignore",
        "Cargo.toml",
        "Cargo.lock",
        "README.md",
    ];
    for entry in std::fs::read_dir(&root).unwrap() {
        let name = entry.unwrap().file_name().to_string_lossy().into_owned();
        if ignored.contains(&name.as_str()) {
            continue;
        }
        let listed = named
            .iter()
            .any(|n| n.trim_end_matches('/') == name || n.starts_with(&format!("{name}/")));
        assert!(listed, "`{name}` is not in the README's layout table");
    }
    let core_row = table
        .lines()
        .find(|l| l.starts_with("| `core/`"))
        .expect("a core/ row");
    let mut missing = Vec::new();
    for entry in std::fs::read_dir(root.join("core/src")).unwrap() {
        let name = entry.unwrap().file_name().to_string_lossy().into_owned();
        if name == "lib.rs" {
            continue;
        }
        let shown = if name.ends_with(".rs") {
            name.clone()
        } else {
            format!("{name}/")
        };
        if !core_row.contains(&format!("`{shown}`")) {
            missing.push(shown);
        }
    }
    assert!(
        missing.is_empty(),
        "core/src entries the README's layout row for core/ does not name: {missing:?}"
    );
}

/// `scripts/demo.sh` with this build's binaries: free ports, a throwaway key, both requests and
/// the 401, exit 0; and a non-zero exit when it can't start what it needs.
#[test]
fn demo_script_runs_on_free_ports() {
    let run = |bin_dir: &Path| {
        Command::new("bash")
            .arg(workspace_root().join("scripts/demo.sh"))
            .env("BIN_DIR", bin_dir)
            .stdin(Stdio::null())
            .output()
            .unwrap()
    };
    let out = run(&bin_dir());
    let text = output_text(&out);
    assert!(out.status.success(), "{text}");
    assert!(text.contains("\"object\":\"chat.completion\""), "{text}");
    assert!(text.contains("data: [DONE]"), "{text}");
    assert!(text.contains("missing_api_key"), "{text}");
    assert!(
        !text.contains("127.0.0.1:8080"),
        "the demo used a fixed port:\n{text}"
    );

    let nowhere: PathBuf = TempDir::new("demo-no-bins").path().to_path_buf();
    let out = run(&nowhere);
    assert!(
        !out.status.success(),
        "the demo exited 0 without binaries:\n{}",
        output_text(&out)
    );
}

//! Running it for real (issue #13, point 8): the production config example passes `sluice check`
//! with the environment its header lists, and the systemd unit passes `systemd-analyze verify`.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::process::Command;

use sluice_tests::*;

fn conf(name: &str) -> String {
    std::fs::read_to_string(workspace_root().join("conf").join(name)).unwrap()
}

/// The variables `conf/production.toml`'s header says to set (`#   NAME=…` lines).
fn documented_env(text: &str) -> Vec<String> {
    text.lines()
        .take_while(|l| l.starts_with('#'))
        .filter_map(|l| l.strip_prefix("#   "))
        .filter_map(|l| l.split_once('=').map(|(name, _)| name))
        .filter(|name| name.bytes().all(|b| b.is_ascii_uppercase() || b == b'_'))
        .map(str::to_string)
        .collect()
}

/// `sluice check` passes on `conf/production.toml`, with no warning, given exactly the
/// variables its header lists (and fails naming the one left out when one is); it uses the
/// pieces it is there to show.
#[test]
fn production_config_passes_check_with_the_environment_it_documents() {
    let text = conf("production.toml");
    let names = documented_env(&text);
    assert_eq!(
        names,
        ["VLLM_API_KEY", "REDIS_PASSWORD", "SLUICE_ADMIN_TOKEN"],
        "the header's variables"
    );
    let env: Vec<(String, String)> = names
        .iter()
        .map(|n| (n.clone(), format!("{}-0123456789abcdef", n.to_lowercase())))
        .collect();
    let path = workspace_root().join("conf/production.toml");
    let out = Sluice::check_file(&path, &env);
    let (stdout, stderr) = (
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr),
    );
    assert_eq!(out.status.code(), Some(0), "{stdout}{stderr}");
    assert_eq!(stdout.trim(), "config ok");
    // Its two example keys carry placeholder digests, which `check` says (once each), and
    // nothing else.
    let warnings: Vec<&str> = stderr.lines().collect();
    assert_eq!(warnings.len(), 2, "{stderr}");
    assert!(
        warnings
            .iter()
            .all(|w| w.starts_with("warning: keys[") && w.contains("placeholder digest")),
        "warnings or errors on the production config: {stderr}"
    );
    for (i, left_out) in names.iter().enumerate() {
        let mut fewer = env.clone();
        fewer.remove(i);
        // The test process's own environment must not fill the gap.
        let mut cmd = Command::new(bin("sluice"));
        cmd.args(["check", "--config"])
            .arg(&path)
            .env_remove(left_out);
        for (k, v) in &fewer {
            cmd.env(k, v);
        }
        let out = cmd.output().unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "passed without {left_out}");
        assert!(stderr.contains(&format!("`{left_out}`")), "{stderr}");
    }
    for piece in [
        "address = \"redis://",
        "token_env = \"SLUICE_ADMIN_TOKEN\"",
        "[access_log]",
        "listen = \"127.0.0.1:9090\"",
        "# [tls]",
    ] {
        assert!(text.contains(piece), "conf/production.toml lacks {piece}");
    }
}

/// `conf/sluice.service` passes `systemd-analyze verify` (with ExecStart pointed at this build's
/// binary, which verify requires to exist), and stops later than the shutdown grace period.
#[test]
fn systemd_unit_verifies() {
    let unit = conf("sluice.service");
    for line in [
        "ExecStartPre=/usr/local/bin/sluice check --config /etc/sluice/sluice.toml",
        "ExecStart=/usr/local/bin/sluice --config /etc/sluice/sluice.toml",
        "ExecReload=/usr/local/bin/sluice reload --config /etc/sluice/sluice.toml",
        "KillSignal=SIGTERM",
        "Restart=on-failure",
        "User=sluice",
    ] {
        assert!(
            unit.lines().any(|l| l == line),
            "conf/sluice.service lacks `{line}`"
        );
    }
    let stop_secs: u64 = unit
        .lines()
        .find_map(|l| l.strip_prefix("TimeoutStopSec="))
        .and_then(|v| v.parse().ok())
        .expect("TimeoutStopSec= in seconds");
    let grace_ms: u64 = std::fs::read_to_string(workspace_root().join("docs/config.md"))
        .unwrap()
        .lines()
        .find(|l| l.starts_with("| `shutdown_grace_ms` |"))
        .and_then(|l| l.split('`').nth(3)?.parse().ok())
        .expect("docs/config.md documents shutdown_grace_ms with its default");
    assert!(
        stop_secs * 1000 > grace_ms,
        "TimeoutStopSec={stop_secs} is not above the {grace_ms} ms grace period"
    );
    let analyze = ["/usr/bin/systemd-analyze", "/bin/systemd-analyze"]
        .into_iter()
        .find(|p| std::path::Path::new(p).is_file());
    let Some(analyze) = analyze else {
        eprintln!(
            "NOTE: systemd-analyze is not installed (Debian package `systemd`; scripts/test.sh \
             installs it): conf/sluice.service was not verified"
        );
        return;
    };
    let dir = TempDir::new("unit");
    let sluice = bin("sluice");
    let path = dir.write(
        "sluice.service",
        unit.replace("/usr/local/bin/sluice", sluice.to_str().unwrap()),
    );
    let out = Command::new(analyze)
        .arg("verify")
        .arg(&path)
        .output()
        .unwrap();
    let all = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(out.status.success(), "systemd-analyze verify:\n{all}");
    assert!(
        !all.contains("sluice.service"),
        "systemd-analyze verify has something to say:\n{all}"
    );
}

/// The Dockerfile (README "Installing"; no Docker daemon on the test machine, so the image is
/// not built here): a release build of the locked tree, run as an unprivileged user, the API
/// and admin ports exposed, a health check on `/healthz`, the shipped config as the default.
#[test]
fn the_dockerfile_runs_sluice_unprivileged_with_a_health_check() {
    let file = std::fs::read_to_string(workspace_root().join("Dockerfile")).unwrap();
    let lines: Vec<&str> = file.lines().map(str::trim).collect();
    let has = |line: &str| lines.iter().any(|l| l.starts_with(line));
    assert!(
        has("RUN cargo build --release --locked -p sluice"),
        "{file}"
    );
    assert!(has("USER sluice"), "not run as root: {file}");
    // The user is switched to after everything that needs root.
    let user_at = lines.iter().position(|l| l.starts_with("USER ")).unwrap();
    assert!(
        lines[user_at..].iter().all(|l| !l.starts_with("RUN ")),
        "{file}"
    );
    assert!(has("EXPOSE 8080 9090"), "{file}");
    assert!(
        file.contains("HEALTHCHECK") && file.contains("/healthz"),
        "{file}"
    );
    assert!(
        has("CMD [\"--config\", \"/etc/sluice/sluice.toml\"]"),
        "{file}"
    );
    // The shipped config it defaults to listens where EXPOSE says.
    let shipped = std::fs::read_to_string(workspace_root().join("conf/sluice.toml")).unwrap();
    assert!(shipped.contains("listen = \"127.0.0.1:8080\""));
    assert!(shipped.contains("listen = \"127.0.0.1:9090\""));
    let ignore = std::fs::read_to_string(workspace_root().join(".dockerignore")).unwrap();
    assert!(
        ignore.lines().any(|l| l == "target"),
        "the build context skips target/"
    );
}

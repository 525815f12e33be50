//! The `sluice` command line (The first day II, items 1, 3 and 4): every usage error says what
//! was wrong and exits 2; `help`, `COMMAND --help` and `help COMMAND` exit 0 with that command's
//! help; `--config=FILE` and `-c FILE` work; completions and a man page come from the same
//! definition; `check --no-env` lints a config without its secrets; `sluice reload` applies a
//! config through the admin listener and fails, with the errors, when it is rejected.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::process::{Command, Output};
use std::time::Duration;

use sluice_tests::*;

fn sluice(args: &[&str]) -> Output {
    let mut cmd = Command::new(bin("sluice"));
    cmd.args(args);
    output_within(cmd, Duration::from_secs(30), "sluice")
}

fn text(out: &Output) -> (String, String) {
    (
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// A valid config file (the mock need not run: `check` does not connect).
fn config_file(dir: &TempDir, extra: &str) -> String {
    let path = dir.path().join("c.toml");
    let text = format!(
        "[clusters.main]\nbackends = [{{ base_url = \"http://127.0.0.1:9/v1\" }}]\n\
         [[routes]]\nmodel = \"gpt-4o\"\ncluster = \"main\"\n{extra}"
    );
    std::fs::write(&path, text).unwrap();
    path.to_str().unwrap().to_owned()
}

#[test]
fn usage_errors_say_what_was_wrong_and_exit_2() {
    let dir = TempDir::new("cli-usage");
    let file = config_file(&dir, "");
    let cases: &[(&[&str], &str)] = &[
        (&["bogus"], "'bogus'"),
        (&["check"], "--config <FILE>"),
        (&[], "--config <FILE>"),
        (&["--config"], "a value is required for '--config <FILE>'"),
        (
            &["check", "--config", &file, "--frobnicate"],
            "'--frobnicate'",
        ),
        (&["key"], "Usage: sluice key <COMMAND>"),
        (&["logs"], "<FILE>"),
        (&["completions", "tcsh"], "'tcsh'"),
    ];
    for (args, says) in cases {
        let out = sluice(args);
        let (stdout, stderr) = text(&out);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {stdout}{stderr}");
        assert!(
            stderr.contains(says),
            "{args:?} should say {says:?}: {stderr}"
        );
        // The reason, not the whole manual.
        assert!(stderr.lines().count() < 12, "{args:?}: {stderr}");
    }
}

#[test]
fn help_for_every_command_exits_0() {
    for (args, shows) in [
        (&["--help"][..], "Commands:"),
        (&["-h"], "Usage: sluice"),
        (&["help"], "Commands:"),
        (&["help", "check"], "--no-env"),
        (&["check", "--help"], "--no-env"),
        (&["reload", "--help"], "admin.token_env"),
        (&["key", "--help"], "new"),
        (&["key", "new", "--help"], "--id"),
        (&["logs", "--help"], "--follow"),
    ] {
        let out = sluice(args);
        let (stdout, stderr) = text(&out);
        assert_eq!(out.status.code(), Some(0), "{args:?}: {stderr}");
        assert!(
            stdout.contains(shows),
            "{args:?} should show {shows:?}: {stdout}"
        );
    }
    // The exit statuses are documented in the help.
    let (stdout, _) = text(&sluice(&["--help"]));
    assert!(
        stdout.contains("Exit status: 0 success; 1 failure"),
        "{stdout}"
    );
    let version = sluice(&["--version"]);
    assert_eq!(version.status.code(), Some(0));
    assert!(text(&version).0.starts_with("sluice "));
}

#[test]
fn config_flag_forms_all_work() {
    let dir = TempDir::new("cli-config");
    let file = config_file(&dir, "");
    let with_equals = format!("--config={file}");
    for args in [
        vec!["check", "--config", &file],
        vec!["check", &with_equals],
        vec!["check", "-c", &file],
    ] {
        let out = sluice(&args);
        let (stdout, stderr) = text(&out);
        assert_eq!(out.status.code(), Some(0), "{args:?}: {stdout}{stderr}");
        assert_eq!(stdout.trim(), "config ok", "{args:?}");
    }
    // A config with errors: exit 1 (not a usage error), every error said.
    let bad = config_file(&dir, "[[routes]]\nmodel = \"x\"\ncluster = \"nowhere\"\n");
    let out = sluice(&["check", "--config", &bad]);
    assert_eq!(out.status.code(), Some(1));
    assert!(text(&out).1.contains("nowhere"), "{}", text(&out).1);
}

#[test]
fn completions_and_the_man_page_come_from_the_definition() {
    for shell in ["bash", "zsh", "fish"] {
        let out = sluice(&["completions", shell]);
        let (stdout, stderr) = text(&out);
        assert_eq!(out.status.code(), Some(0), "{shell}: {stderr}");
        for word in ["check", "reload", "no-env", "config"] {
            assert!(stdout.contains(word), "{shell} completions lack {word}");
        }
    }
    let out = sluice(&["man"]);
    let (stdout, _) = text(&out);
    assert_eq!(out.status.code(), Some(0));
    assert!(
        stdout.starts_with(".ie") || stdout.contains(".TH sluice"),
        "{stdout}"
    );
    assert!(stdout.contains("reload"), "{stdout}");
}

/// `check --no-env` passes a config whose variables are unset, listing them; without it, the
/// same config fails on them.
#[test]
fn check_without_the_environment_lists_what_it_would_read() {
    let dir = TempDir::new("cli-no-env");
    let file = config_file(
        &dir,
        "[clusters.paid]\nbackends = [{ base_url = \"https://192.0.2.10/v1\" }]\n\
         credential = { env = \"CLI_TEST_UNSET_PROVIDER_KEY\" }\n\
         [admin]\nlisten = \"127.0.0.1:0\"\ntoken_env = \"CLI_TEST_UNSET_ADMIN_TOKEN\"\n",
    );
    let mut cmd = Command::new(bin("sluice"));
    cmd.args(["check", "--config", &file])
        .env_remove("CLI_TEST_UNSET_PROVIDER_KEY")
        .env_remove("CLI_TEST_UNSET_ADMIN_TOKEN");
    let out = output_within(cmd, Duration::from_secs(30), "check");
    assert_eq!(out.status.code(), Some(1), "{}", text(&out).1);
    assert!(text(&out).1.contains("CLI_TEST_UNSET_PROVIDER_KEY"));

    let mut cmd = Command::new(bin("sluice"));
    cmd.args(["check", "--no-env", "--config", &file])
        .env_remove("CLI_TEST_UNSET_PROVIDER_KEY")
        .env_remove("CLI_TEST_UNSET_ADMIN_TOKEN");
    let out = output_within(cmd, Duration::from_secs(30), "check --no-env");
    let (stdout, stderr) = text(&out);
    assert_eq!(out.status.code(), Some(0), "{stdout}{stderr}");
    assert!(
        stdout.contains(
            "would read these environment variables: CLI_TEST_UNSET_ADMIN_TOKEN, \
             CLI_TEST_UNSET_PROVIDER_KEY"
        ),
        "{stdout}"
    );
    assert!(
        stdout.contains("config ok (environment not checked)"),
        "{stdout}"
    );
}

/// `sluice reload`: an applied reload exits 0 and says so; a rejected one exits 1 with every
/// error, and the gateway keeps serving on the config it had.
#[test]
fn reload_applies_through_the_admin_listener_and_fails_loudly_when_rejected() {
    let mock = Mock::start(&[]);
    let token = "cli-reload-token-0123456789";
    let config = Config::one_cluster(&mock)
        .admin()
        .set("admin", "token_env", "\"CLI_RELOAD_TOKEN\"")
        .env("CLI_RELOAD_TOKEN", token);
    let gw = Sluice::start(&config);
    // The file the gateway runs on, with the admin listener's real port (it bound port 0).
    let toml = config.to_toml();
    let admin = toml.find("[admin]").expect("an [admin] section");
    let (before, after) = toml.split_at(admin);
    let running = format!(
        "{before}{}",
        after.replacen(
            "listen = \"127.0.0.1:0\"",
            &format!("listen = \"{}\"", gw.admin_addr()),
            1
        )
    );
    assert!(running.contains(&gw.admin_addr().to_string()), "{running}");
    let dir = TempDir::new("cli-reload");
    let file = dir.path().join("running.toml");
    let reload = |toml: &str| {
        std::fs::write(&file, toml).unwrap();
        gw.rewrite_config_text(toml);
        let mut cmd = Command::new(bin("sluice"));
        cmd.args(["reload", "--config"])
            .arg(&file)
            .env("CLI_RELOAD_TOKEN", token);
        output_within(cmd, Duration::from_secs(60), "reload")
    };
    let out = reload(&running);
    let (stdout, stderr) = text(&out);
    assert_eq!(out.status.code(), Some(0), "{stdout}{stderr}");
    assert!(stdout.starts_with("reload applied"), "{stdout}");

    let broken = format!("{running}\n[[routes]]\nmodel = \"x\"\ncluster = \"nowhere\"\n");
    let out = reload(&broken);
    let (stdout, stderr) = text(&out);
    assert_eq!(out.status.code(), Some(1), "{stdout}{stderr}");
    assert!(stderr.starts_with("reload rejected"), "{stderr}");
    assert!(
        stderr.contains("error: ") && stderr.contains("nowhere"),
        "{stderr}"
    );
    assert_eq!(gw.chat(&chat_body("gpt-4o")).status, 200, "still serving");

    // Without the token in its environment, it says which variable is missing.
    let mut cmd = Command::new(bin("sluice"));
    cmd.args(["reload", "--config"])
        .arg(&file)
        .env_remove("CLI_RELOAD_TOKEN");
    let out = output_within(cmd, Duration::from_secs(30), "reload without token");
    assert_eq!(out.status.code(), Some(1));
    assert!(
        text(&out).1.contains("CLI_RELOAD_TOKEN"),
        "{}",
        text(&out).1
    );
}

/// The first day II, item 8: with the connection cap left out (as the shipped config leaves
/// it), a start fits the process's open-file limit and says nothing of it; a cap set above what
/// the limit holds is warned of once, with the line that fixes it.
#[test]
fn the_connection_cap_fits_the_open_file_limit_unless_set_past_it() {
    let mock = Mock::start(&[]);
    let gw = Sluice::start(&Config::one_cluster(&mock).workers(2));
    assert_eq!(gw.chat(&chat_body("gpt-4o")).status, 200);
    let stderr = gw.stderr_text();
    assert!(!stderr.contains("open-file limit"), "{stderr}");
    drop(gw);

    let past = Config::one_cluster(&mock).workers(2).set(
        "server",
        "max_connections_per_worker",
        "1000000",
    );
    let gw = Sluice::start(&past);
    let stderr = gw.stderr_text();
    let warnings: Vec<&str> = stderr
        .lines()
        .filter(|l| l.contains("open-file limit"))
        .collect();
    assert_eq!(warnings.len(), 1, "{stderr}");
    assert!(
        warnings[0].contains("Fix: LimitNOFILE=")
            && warnings[0].contains("server.max_connections_per_worker = "),
        "{stderr}"
    );
}

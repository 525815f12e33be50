//! Binaries, drivers, temp dirs: where the binaries are, the processes the tests start and how they end.

use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use serde_json::Value;

/// How long a binary may take to print its startup line.
pub const STARTUP_TIMEOUT: Duration = Duration::from_secs(20);

/// The cargo target profile directory holding the built binaries (`target/debug`).
pub fn bin_dir() -> PathBuf {
    if let Ok(dir) = std::env::var("CARGO_TARGET_DIR") {
        let p = PathBuf::from(dir).join("debug");
        if p.join("sluice").exists() {
            return p;
        }
    }
    // current_exe = target/debug/deps/<test>-<hash>
    let exe = std::env::current_exe().expect("current_exe");
    let mut dir = exe.parent().map(Path::to_path_buf);
    while let Some(d) = dir {
        if d.join("sluice").is_file() || d.join("mock-llm").is_file() {
            return d;
        }
        dir = d.parent().map(Path::to_path_buf);
    }
    // Fall back to the conventional location: two levels up from the test executable.
    exe.parent()
        .and_then(Path::parent)
        .expect("target dir")
        .to_path_buf()
}

/// Path of a workspace binary (`sluice`, `mock-llm`); panics with a hint when it is missing.
pub fn bin(name: &str) -> PathBuf {
    let p = bin_dir().join(name);
    assert!(
        p.is_file(),
        "{} not found; run `cargo build --workspace` before the tests",
        p.display()
    );
    p
}

/// Which engine a `sluice-load` run uses when its arguments don't say.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LoadEngine {
    /// `SLUICE_LOAD_ENGINE` from the test's environment, if set (so a suite can be run again
    /// on the other engine).
    FromEnv,
    /// The generator's own default: the variable is removed.
    Default,
}

/// Run `sluice-load` with `args` plus `--json FILE`; panics unless it succeeds. Returns
/// (stdout, stderr, the parsed JSON).
pub fn run_sluice_load(url: &str, args: &[&str], engine: LoadEngine) -> (String, String, Value) {
    let dir = TempDir::new("loadgen");
    let json = dir.path().join("out.json");
    let mut cmd = Command::new(bin("sluice-load"));
    if engine == LoadEngine::Default {
        cmd.env_remove("SLUICE_LOAD_ENGINE");
    }
    let out = cmd
        .arg("--url")
        .arg(url)
        .args(args)
        .arg("--json")
        .arg(&json)
        .output()
        .expect("run sluice-load");
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(
        out.status.success(),
        "sluice-load failed: {}\nstdout: {stdout}\nstderr: {stderr}",
        out.status
    );
    let v: Value = serde_json::from_str(&std::fs::read_to_string(&json).expect("json file"))
        .expect("valid json");
    (stdout, stderr, v)
}

/// The workspace root (the parent of `tests/`).
pub fn workspace_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("workspace root")
        .to_path_buf()
}

/// Whether this run forces monoio's legacy (epoll) driver (`SLUICE_TEST_DRIVER=legacy`).
pub fn legacy_driver() -> bool {
    std::env::var("SLUICE_TEST_DRIVER").is_ok_and(|v| v.eq_ignore_ascii_case("legacy"))
}

/// The driver name the startup line must report in this run.
pub fn expected_driver() -> &'static str {
    if legacy_driver() {
        "legacy"
    } else {
        "io_uring"
    }
}

static UNIQUE: AtomicU64 = AtomicU64::new(0);

/// A temporary directory under `std::env::temp_dir()`, removed on drop.
pub struct TempDir {
    path: PathBuf,
}

impl TempDir {
    pub fn new(tag: &str) -> TempDir {
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos())
            .unwrap_or(0);
        let path = std::env::temp_dir().join(format!(
            "sluice-test-{tag}-{}-{}-{nanos}",
            std::process::id(),
            UNIQUE.fetch_add(1, Ordering::Relaxed)
        ));
        std::fs::create_dir_all(&path).expect("create temp dir");
        TempDir { path }
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Write `contents` to `name` inside the directory and return the full path.
    pub fn write(&self, name: &str, contents: impl AsRef<[u8]>) -> PathBuf {
        let p = self.path.join(name);
        std::fs::write(&p, contents).expect("write temp file");
        p
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.path);
    }
}

/// Make the child die with the test process even if the test is killed before its guards drop.
pub(crate) fn die_with_parent(cmd: &mut Command) {
    use std::os::unix::process::CommandExt;
    // SAFETY: prctl is async-signal-safe and touches no memory of the parent.
    unsafe {
        cmd.pre_exec(|| {
            libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL);
            Ok(())
        });
    }
}

pub(crate) fn kill_child(child: &mut Child) {
    if let Ok(None) = child.try_wait() {
        let _ = child.kill();
    }
    let _ = child.wait();
}

/// Poll `cond` every 10 ms until it holds or `within` passes; returns whether it held.
pub fn wait_until(within: Duration, mut cond: impl FnMut() -> bool) -> bool {
    let deadline = Instant::now() + within;
    loop {
        if cond() {
            return true;
        }
        if Instant::now() >= deadline {
            return false;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// A port on 127.0.0.1 that was free a moment ago, for a server to bind next (it may be taken
/// first: retry). For an upstream that must stay dead, use [`dead_port`].
pub fn free_port() -> u16 {
    let l = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let port = l.local_addr().expect("addr").port();
    drop(l);
    port
}

/// A port on 127.0.0.1 with nothing listening on it, for the life of the test process: a
/// socket is bound to it and never listens, so a connection to it is refused, and no other
/// server — another test's, started in parallel on port 0 — can be given it. (Binding, reading
/// the port and closing it, as this did, let a parallel test's server take the port, and the
/// "dead" upstream answered, or hung.)
pub fn dead_port() -> u16 {
    // SAFETY: plain socket calls on a descriptor this function owns; `addr` and `len` are
    // valid for the calls that read or write them.
    unsafe {
        let fd = libc::socket(libc::AF_INET, libc::SOCK_STREAM | libc::SOCK_CLOEXEC, 0);
        assert!(fd >= 0, "socket: {}", std::io::Error::last_os_error());
        let mut addr: libc::sockaddr_in = std::mem::zeroed();
        addr.sin_family = libc::AF_INET as libc::sa_family_t;
        addr.sin_addr.s_addr = u32::from_ne_bytes([127, 0, 0, 1]);
        let len = std::mem::size_of::<libc::sockaddr_in>() as libc::socklen_t;
        let bound = libc::bind(fd, (&raw const addr).cast(), len);
        assert_eq!(bound, 0, "bind: {}", std::io::Error::last_os_error());
        let mut len = len;
        let named = libc::getsockname(fd, (&raw mut addr).cast(), &mut len);
        assert_eq!(named, 0, "getsockname: {}", std::io::Error::last_os_error());
        // The descriptor stays open (and bound) until the process exits.
        u16::from_be(addr.sin_port)
    }
}

/// Run `cmd` to completion with piped stdout/stderr; panics if it takes longer than `within`.
pub fn output_within(mut cmd: Command, within: Duration, what: &str) -> Output {
    cmd.stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    die_with_parent(&mut cmd);
    let mut child = cmd.spawn().unwrap_or_else(|e| panic!("spawn {what}: {e}"));
    let mut out = child.stdout.take().expect("stdout");
    let mut err = child.stderr.take().expect("stderr");
    let t_out = std::thread::spawn(move || {
        let mut v = Vec::new();
        let _ = out.read_to_end(&mut v);
        v
    });
    let t_err = std::thread::spawn(move || {
        let mut v = Vec::new();
        let _ = err.read_to_end(&mut v);
        v
    });
    let done = wait_until(within, || matches!(child.try_wait(), Ok(Some(_))));
    if !done {
        kill_child(&mut child);
        panic!("{what} did not exit within {within:?}");
    }
    let status = child.wait().expect("wait");
    Output {
        status,
        stdout: t_out.join().unwrap_or_default(),
        stderr: t_err.join().unwrap_or_default(),
    }
}

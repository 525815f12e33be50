//! Zero-downtime upgrade (issue #13, point 3): a new process started with `--takeover PATH`
//! takes the listening sockets over from the running one, which drains. Under a steady stream of
//! new connections and with streams in flight, no connection is refused, no request fails and
//! no stream is cut.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use sluice_tests::*;

/// Requests on fresh connections, one after another, until `stop`: (ok, failed, first failure).
fn churn(
    addr: std::net::SocketAddr,
    stop: Arc<AtomicBool>,
    ok: Arc<AtomicU64>,
) -> std::thread::JoinHandle<Vec<String>> {
    std::thread::spawn(move || {
        let mut failures = Vec::new();
        while !stop.load(Ordering::Relaxed) {
            let outcome = std::net::TcpStream::connect(addr)
                .map_err(|e| format!("connect: {e}"))
                .and_then(|s| {
                    let mut c = Conn::from_stream(s);
                    c.set_timeout(Duration::from_secs(10));
                    c.try_send(&Req::post("/v1/chat/completions", &chat_body("gpt-4o")).build())
                        .map_err(|e| format!("send: {e}"))?;
                    c.try_read_response("POST")
                        .map_err(|e| format!("read: {e:?}"))
                });
            match outcome {
                Ok(r) if r.status == 200 => {
                    ok.fetch_add(1, Ordering::Relaxed);
                }
                Ok(r) => failures.push(format!("status {}: {}", r.status, r.dump())),
                Err(e) => failures.push(e),
            }
        }
        failures
    })
}

#[test]
fn a_takeover_under_load_refuses_no_connection_and_cuts_no_stream() {
    let mock = Mock::start(&["--inter-token-ms", "100", "--tokens", "20"]);
    let dir = TempDir::new("upgrade");
    let socket = dir.path().join("takeover.sock");
    // An admin listener on a fixed port, as in production: the successor binds it while the
    // old process still holds it.
    let admin_port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let config = Config::one_cluster(&mock)
        .workers(2)
        .set(
            "server",
            "takeover_socket",
            &toml_str(socket.to_str().unwrap()),
        )
        .set(
            "admin",
            "listen",
            &toml_str(&format!("127.0.0.1:{admin_port}")),
        );
    let mut old = Sluice::start(&config);
    let addr = old.addr;

    // 20 streams of 2 s on the old process.
    let streams: Vec<_> = (0..20)
        .map(|_| {
            std::thread::spawn(move || {
                let mut c = Conn::open(addr);
                c.set_timeout(Duration::from_secs(30));
                c.send(&Req::post("/v1/chat/completions", &chat_stream_body("gpt-4o")).build());
                c.read_response_to("POST")
            })
        })
        .collect();
    assert!(wait_until(Duration::from_secs(10), || mock
        .stat("active_streams")
        >= 20));

    // Four clients opening a new connection per request, throughout.
    let stop = Arc::new(AtomicBool::new(false));
    let ok = Arc::new(AtomicU64::new(0));
    let clients: Vec<_> = (0..4)
        .map(|_| churn(addr, Arc::clone(&stop), Arc::clone(&ok)))
        .collect();
    assert!(wait_until(Duration::from_secs(10), || ok
        .load(Ordering::Relaxed)
        > 50));

    // The upgrade: the successor takes the sockets, the old process drains and exits.
    let new = Sluice::start_args(&config, &["--takeover", socket.to_str().unwrap()]);
    assert_eq!(new.addr, addr, "the successor serves on the same sockets");
    assert!(
        new.wait_stderr(Duration::from_secs(10), "took over the listening sockets"),
        "{}",
        new.stderr_text()
    );
    let before = ok.load(Ordering::Relaxed);
    let status = old.wait_exit(Duration::from_secs(30));
    assert_eq!(
        status.and_then(|s| s.code()),
        Some(0),
        "{}",
        old.stderr_text()
    );
    // Requests go on, served by the successor alone now.
    assert!(wait_until(Duration::from_secs(10), || ok
        .load(Ordering::Relaxed)
        > before + 50));
    stop.store(true, Ordering::Relaxed);
    let failures: Vec<String> = clients
        .into_iter()
        .flat_map(|c| c.join().unwrap())
        .collect();
    assert!(
        failures.is_empty(),
        "{} of {} requests failed across the upgrade, e.g. {:?}",
        failures.len(),
        failures.len() as u64 + ok.load(Ordering::Relaxed),
        &failures[..failures.len().min(3)]
    );
    // Every stream the old process carried finished whole.
    for (i, s) in streams.into_iter().enumerate() {
        let r = s.join().unwrap();
        assert_eq!(r.status, 200, "stream {i}: {}", r.dump());
        assert_eq!(r.end, BodyEnd::Complete, "stream {i}: {}", r.dump());
        assert!(
            r.sse_events().last().is_some_and(SseEvent::is_done),
            "stream {i}"
        );
    }
    // And the successor can be taken over in turn (its own socket is up, this user's only).
    use std::os::unix::fs::PermissionsExt;
    let mode = std::fs::metadata(&socket).unwrap().permissions().mode();
    assert_eq!(mode & 0o777, 0o600, "takeover socket mode {mode:o}");
    assert_eq!(new.admin_addr().port(), admin_port);
    assert_eq!(new.admin_get("/readyz").status, 200);
    assert_eq!(new.chat(&chat_body("gpt-4o")).status, 200);
}

#[test]
fn a_takeover_with_nobody_listening_fails_clearly() {
    let mock = Mock::start(&[]);
    let dir = TempDir::new("upgrade");
    let socket = dir.path().join("nobody.sock");
    let f = Sluice::try_start_args(
        &Config::one_cluster(&mock),
        &["--takeover", socket.to_str().unwrap()],
        Duration::from_secs(10),
    )
    .err()
    .expect("no process to take over from");
    assert!(f.exited);
    assert!(f.stderr.contains("takeover: cannot reach"), "{}", f.stderr);
}

//! A worker swaps its config snapshot between requests (architecture issue, item 4): a request
//! runs to its end on the snapshot it started with, the next request uses the new one, and the
//! upstream pool of a backend both snapshots have keeps its connections.
//!
//! The reload trigger (a signal, the admin endpoint) is not built yet, so this test drives one
//! real worker in-process through the library — the same `Worker` and connection loop the
//! binary runs, on a monoio runtime of its own, over real sockets — against real `mock-llm`
//! processes, and swaps the snapshot from inside that runtime.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::net::SocketAddr;
use std::rc::Rc;
use std::sync::mpsc;
use std::time::Duration;

use sluice::Snapshot;
use sluice::Worker;
use sluice_tests::*;

/// `model "m"` goes to `m_backend`; `model "keep"` always goes to `keep_backend`.
fn snapshot(m_backend: &Mock, keep_backend: &Mock) -> Snapshot {
    let text = format!(
        r#"
[server]
listen = "127.0.0.1:0"
workers = 1

[clusters.for_m]
backends = [{{ base_url = "{}" }}]

[clusters.kept]
backends = [{{ base_url = "{}" }}]

[[routes]]
model = "m"
cluster = "for_m"

[[routes]]
model = "keep"
cluster = "kept"
"#,
        m_backend.base_url(),
        keep_backend.base_url()
    );
    sluice::load(&text, &|_| None).expect("config")
}

enum Command {
    /// Swap in this snapshot, then say so.
    Swap(Box<Snapshot>, mpsc::Sender<()>),
    Stop,
}

/// Run one worker on its own thread: accept on a loopback port and serve each connection with
/// the connection loop; between requests, swap in what `commands` sends.
fn start_worker(
    first: Snapshot,
) -> (
    SocketAddr,
    mpsc::Sender<Command>,
    std::thread::JoinHandle<()>,
) {
    let (addr_tx, addr_rx) = mpsc::channel();
    let (cmd_tx, cmd_rx) = mpsc::channel::<Command>();
    let handle = std::thread::spawn(move || {
        let mut runtime = monoio::RuntimeBuilder::<monoio::FusionDriver>::new()
            .enable_timer()
            .build()
            .expect("runtime");
        runtime.block_on(async move {
            let listener = monoio::net::TcpListener::bind("127.0.0.1:0").expect("bind");
            addr_tx.send(listener.local_addr().unwrap()).unwrap();
            let hub = sluice::MetricsHub::for_snapshot(&first);
            let worker = Rc::new(Worker::new(0, Rc::new(first), hub, None));
            let w = Rc::clone(&worker);
            monoio::spawn(async move {
                loop {
                    let (stream, peer) = listener.accept().await.expect("accept");
                    monoio::spawn(sluice::serve(Rc::clone(&w), stream, peer));
                }
            });
            loop {
                match cmd_rx.try_recv() {
                    Ok(Command::Swap(next, done)) => {
                        worker.swap_snapshot(Rc::new(*next));
                        let _ = done.send(());
                    }
                    Ok(Command::Stop) | Err(mpsc::TryRecvError::Disconnected) => return,
                    Err(mpsc::TryRecvError::Empty) => {
                        monoio::time::sleep(Duration::from_millis(5)).await;
                    }
                }
            }
        });
    });
    (addr_rx.recv().unwrap(), cmd_tx, handle)
}

fn chat(model: &str, stream: bool) -> String {
    serde_json::json!({"model": model, "stream": stream,
        "messages": [{"role": "user", "content": "hi"}]})
    .to_string()
}

/// The upstream a response came from: mock-llm echoes the Host it was sent.
fn answered_by(r: &Response) -> String {
    let v: serde_json::Value = serde_json::from_slice(&r.body).expect("json body");
    v["echo"]["headers"]
        .as_array()
        .and_then(|h| {
            h.iter().find(|kv| {
                kv[0]
                    .as_str()
                    .is_some_and(|k| k.eq_ignore_ascii_case("host"))
            })
        })
        .and_then(|kv| kv[1].as_str())
        .unwrap_or_default()
        .to_string()
}

#[test]
fn a_swap_mid_stream_finishes_the_stream_on_the_old_routes_and_keeps_kept_pools() {
    let old = Mock::start(&["--tokens", "20", "--inter-token-ms", "40"]);
    let new = Mock::start(&[]);
    let kept = Mock::start(&[]);
    let (addr, commands, worker) = start_worker(snapshot(&old, &kept));
    let post = |model: &str, stream: bool| {
        let mut c = Conn::open(addr);
        c.set_timeout(Duration::from_secs(10));
        c.send(&Req::post("/v1/chat/completions", &chat(model, stream)).build());
        c
    };

    // A request to the kept backend leaves one pooled connection there. (The probe reads the
    // mock's stats over a connection of its own, so its readings count only Sluice's.)
    let mut kept_probe = kept.stats_probe();
    let r = post("keep", false).read_response();
    assert_eq!(r.status, 200, "{}", r.dump());
    let kept_connections = kept_probe.stat("connections_accepted");

    // A stream starts on the old route…
    let mut streaming = post("m", true);
    while !streaming.buffered().windows(4).any(|w| w == b"tok1") {
        assert!(
            streaming.read_more().expect("stream") > 0,
            "stream ended early"
        );
    }
    // …the worker swaps: "m" now goes to the new backend, "keep" still to the kept one.
    let (done_tx, done) = mpsc::channel();
    commands
        .send(Command::Swap(Box::new(snapshot(&new, &kept)), done_tx))
        .unwrap();
    done.recv_timeout(Duration::from_secs(5))
        .expect("the worker swapped");
    let r = post("m", false).read_response();
    assert_eq!(r.status, 200, "{}", r.dump());
    let new_port = format!(":{}", new.port());
    assert!(
        answered_by(&r).ends_with(&new_port),
        "after the swap \"m\" went to {}, not to {new_port}",
        answered_by(&r)
    );

    // The stream that started before the swap ends whole, from the old backend.
    let r = streaming.read_response();
    assert_eq!(r.status, 200);
    let text = String::from_utf8_lossy(&r.body).into_owned();
    assert!(text.contains("tok19"), "the old stream was cut:\n{text}");
    assert!(text.contains("data: [DONE]"), "{text}");
    assert_eq!(
        old.stat("requests"),
        1,
        "the old backend served only the stream"
    );

    // The kept backend's pool survived the swap: no new connection to it.
    let r = post("keep", false).read_response();
    assert_eq!(r.status, 200, "{}", r.dump());
    assert_eq!(
        kept_probe.stat("connections_accepted"),
        kept_connections,
        "the swap dropped the kept backend's pooled connection"
    );

    commands.send(Command::Stop).unwrap();
    worker.join().unwrap();
}

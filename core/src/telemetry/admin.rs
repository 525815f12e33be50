//! The admin listener: `GET /metrics`, `GET /healthz`, `GET /readyz` and `POST /admin/reload`
//! on their own port.
//!
//! Runs beside the workers, never on them: one plain std thread blocks in `accept`, and each
//! connection gets a short-lived thread of its own (at most [`MAX_CONNECTIONS`] at once; past that
//! a connection is answered 503 and closed), so one slow client cannot hold up a liveness probe.
//! Takes the [`MetricsHub`] to render and the readiness flag the server sets once every worker
//! listens. Speaks a minimal HTTP/1.1: one request per connection (`Connection: close`), heads up
//! to [`MAX_HEAD_BYTES`], the whole head within [`HEAD_DEADLINE`], writes bounded by
//! [`WRITE_TIMEOUT`].
//!
//! | request | answer |
//! | --- | --- |
//! | `GET /metrics` | 200, `text/plain; version=0.0.4`, every family summed over workers |
//! | `GET /healthz` | 200 `ok` while the process runs |
//! | `GET /readyz` | 200 `ready` once the flag is true, else 503 `not ready` |
//! | `POST /admin/reload` | reload the config file: 200 and a JSON report when the new config is serving, 422 and its errors when it is invalid (the old one keeps serving); 401 without the bearer token `admin.token_env` names, 403 when none is configured |
//! | `HEAD` of the `GET`s | the same head, no body |
//! | another path | 404; another method: 405 with `Allow`; a bad head: 400 |

// The admin listener runs on its own plain thread with blocking sockets, never on a worker.
#![allow(clippy::disallowed_methods)]

use std::io::{self, Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{mpsc, Arc};
use std::thread;
use std::time::{Duration, Instant};

use crate::telemetry::metrics::MetricsHub;

/// Most admin connections served at once.
pub(crate) const MAX_CONNECTIONS: usize = 16;
/// Largest request head accepted (431 past it).
pub(crate) const MAX_HEAD_BYTES: usize = 8192;
/// Time allowed from accept until the whole request head has arrived (408 past it).
pub(crate) const HEAD_DEADLINE: Duration = Duration::from_secs(5);
/// Longest a single write to the client may block.
pub(crate) const WRITE_TIMEOUT: Duration = Duration::from_secs(10);

const METRICS_CONTENT_TYPE: &str = "text/plain; version=0.0.4; charset=utf-8";
const TEXT: &str = "text/plain; charset=utf-8";

/// How long `POST /admin/reload` waits for the reload's outcome.
pub(crate) const RELOAD_DEADLINE: Duration = Duration::from_secs(30);

/// The outcome of a reload, as the control thread reports it: the status and JSON body to
/// answer with.
pub(crate) struct ReloadReply {
    pub(crate) status: u16,
    pub(crate) body: String,
}

/// Asks the control thread for a reload; the outcome comes back on the sender it is given.
pub(crate) type ReloadHook = Box<dyn Fn(mpsc::Sender<ReloadReply>) + Send + Sync>;

/// What `POST /admin/reload` needs: the hook, and the SHA-256 of the bearer token callers must
/// present (`None`: no token configured, so reloading over HTTP is refused).
pub(crate) struct AdminControl {
    pub(crate) reload: ReloadHook,
    pub(crate) token_digest: Option<[u8; 32]>,
}

/// Bind `addr` (port 0 picks a free port) and serve the admin endpoints on a background thread
/// for the life of the process. Returns the bound address; a bind failure is returned, never
/// logged and ignored. The socket is bound with SO_REUSEPORT so that a successor taking this
/// process over can bind the same port while this one drains; with `shared` false (no
/// takeover) a port another socket holds is refused first, as the main listener's is.
pub(crate) fn spawn_admin(
    addr: SocketAddr,
    hub: Arc<MetricsHub>,
    ready: Arc<AtomicBool>,
    control: Option<AdminControl>,
    shared: bool,
) -> io::Result<SocketAddr> {
    let cannot =
        |e: io::Error| io::Error::new(e.kind(), format!("cannot bind admin listener {addr}: {e}"));
    let addr = if shared {
        addr
    } else {
        // A plain bind fails on any port already bound, SO_REUSEPORT or not.
        TcpListener::bind(addr)
            .and_then(|probe| probe.local_addr())
            .map_err(cannot)?
    };
    let listener = crate::sys::sock::reuseport_listener(addr, 128).map_err(cannot)?;
    let local = listener.local_addr()?;
    let shared = Arc::new(Shared {
        hub,
        ready,
        control,
    });
    thread::Builder::new()
        .name("sluice-admin".into())
        .spawn(move || accept_loop(listener, shared))?;
    Ok(local)
}

/// What every admin connection reads.
struct Shared {
    hub: Arc<MetricsHub>,
    ready: Arc<AtomicBool>,
    control: Option<AdminControl>,
}

/// Releases a connection's place when its thread ends (or fails to start).
struct Place(Arc<AtomicUsize>);

impl Drop for Place {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
    }
}

fn accept_loop(listener: TcpListener, shared: Arc<Shared>) {
    let active = Arc::new(AtomicUsize::new(0));
    for conn in listener.incoming() {
        let stream = match conn {
            Ok(stream) => stream,
            Err(e) => {
                // Out of descriptors or memory: back off instead of spinning.
                eprintln!("sluice: admin accept failed: {e}");
                thread::sleep(Duration::from_millis(50));
                continue;
            }
        };
        if active.fetch_add(1, Ordering::AcqRel) >= MAX_CONNECTIONS {
            active.fetch_sub(1, Ordering::AcqRel);
            let _ = stream.set_write_timeout(Some(Duration::from_millis(100)));
            let mut stream = stream;
            let _ = respond(
                &mut stream,
                503,
                TEXT,
                b"too many admin connections\n",
                false,
            );
            continue;
        }
        let place = Place(Arc::clone(&active));
        let shared = Arc::clone(&shared);
        let spawned = thread::Builder::new()
            .name("sluice-admin-conn".into())
            .spawn(move || {
                let _place = place;
                serve(stream, &shared);
            });
        if let Err(e) = spawned {
            eprintln!("sluice: admin connection thread failed to start: {e}");
        }
    }
}

/// What the head asked for.
enum Parsed {
    Request {
        method: Method,
        path: String,
        /// The `Authorization` header's value, when there is one.
        authorization: Option<String>,
    },
    Bad,
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Method {
    Get,
    Head,
    Post,
    Other,
}

/// Read one request head and answer it. Errors just close the connection.
fn serve(mut stream: TcpStream, shared: &Shared) {
    let _ = stream.set_nodelay(true);
    if stream.set_write_timeout(Some(WRITE_TIMEOUT)).is_err() {
        return;
    }
    let parsed = match read_head(&mut stream) {
        Ok(Some(parsed)) => parsed,
        Ok(None) => return, // closed before a whole head
        Err(status) => {
            let body = format!("{}\n", crate::http::reason(status).to_ascii_lowercase());
            if respond(&mut stream, status, TEXT, body.as_bytes(), false).is_ok() {
                linger_close(stream);
            }
            return;
        }
    };
    let (method, path, authorization) = match parsed {
        Parsed::Request {
            method,
            path,
            authorization,
        } => (method, path, authorization),
        Parsed::Bad => {
            if respond(&mut stream, 400, TEXT, b"bad request\n", false).is_ok() {
                linger_close(stream);
            }
            return;
        }
    };
    let head_only = method == Method::Head;
    let known = matches!(path.as_str(), "/metrics" | "/healthz" | "/readyz");
    let result = if path == "/admin/reload" {
        if method == Method::Post {
            reload(
                &mut stream,
                shared.control.as_ref(),
                authorization.as_deref(),
            )
        } else {
            respond_405(&mut stream, "POST")
        }
    } else if !known {
        respond(&mut stream, 404, TEXT, b"not found\n", head_only)
    } else if !matches!(method, Method::Get | Method::Head) {
        respond_405(&mut stream, "GET, HEAD")
    } else {
        match path.as_str() {
            "/metrics" => {
                let mut body = String::with_capacity(64 * 1024);
                shared.hub.render(&mut body);
                respond(
                    &mut stream,
                    200,
                    METRICS_CONTENT_TYPE,
                    body.as_bytes(),
                    head_only,
                )
            }
            "/healthz" => respond(&mut stream, 200, TEXT, b"ok", head_only),
            _ => {
                if shared.ready.load(Ordering::Acquire) {
                    respond(&mut stream, 200, TEXT, b"ready", head_only)
                } else {
                    respond(&mut stream, 503, TEXT, b"not ready", head_only)
                }
            }
        }
    };
    if result.is_ok() {
        linger_close(stream);
    }
}

/// Read until a whole head parses. `Ok(None)`: the peer closed first. `Err(status)`: answer that
/// status (408 too slow, 431 too large).
fn read_head(stream: &mut TcpStream) -> Result<Option<Parsed>, u16> {
    let start = Instant::now();
    let mut buf = vec![0u8; MAX_HEAD_BYTES];
    let mut len = 0;
    loop {
        let left = HEAD_DEADLINE.saturating_sub(start.elapsed());
        if left.is_zero() {
            return Err(408);
        }
        if stream.set_read_timeout(Some(left)).is_err() {
            return Ok(None);
        }
        let Some(free) = buf.get_mut(len..) else {
            return Err(431);
        };
        if free.is_empty() {
            return Err(431);
        }
        match stream.read(free) {
            Ok(0) => return Ok(None),
            Ok(n) => len += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e)
                if matches!(
                    e.kind(),
                    io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
                ) =>
            {
                return Err(408)
            }
            Err(_) => return Ok(None),
        }
        let mut headers = [httparse::EMPTY_HEADER; 32];
        let mut req = httparse::Request::new(&mut headers);
        match req.parse(buf.get(..len).unwrap_or(&[])) {
            Ok(httparse::Status::Complete(_)) => {
                let method = match req.method {
                    Some("GET") => Method::Get,
                    Some("HEAD") => Method::Head,
                    Some("POST") => Method::Post,
                    _ => Method::Other,
                };
                let authorization = req
                    .headers
                    .iter()
                    .find(|h| h.name.eq_ignore_ascii_case("authorization"))
                    .and_then(|h| std::str::from_utf8(h.value).ok())
                    .map(str::to_string);
                let Some(target) = req.path else {
                    return Ok(Some(Parsed::Bad));
                };
                let path = target.split(['?', '#']).next().unwrap_or("");
                return Ok(Some(Parsed::Request {
                    method,
                    path: path.to_string(),
                    authorization,
                }));
            }
            Ok(httparse::Status::Partial) => continue,
            Err(httparse::Error::TooManyHeaders) => return Err(431),
            Err(_) => return Ok(Some(Parsed::Bad)),
        }
    }
}

fn respond(
    stream: &mut TcpStream,
    status: u16,
    content_type: &str,
    body: &[u8],
    head_only: bool,
) -> io::Result<()> {
    respond_with(stream, status, content_type, "", body, head_only)
}

fn respond_405(stream: &mut TcpStream, allow: &str) -> io::Result<()> {
    respond_with(
        stream,
        405,
        TEXT,
        &format!("Allow: {allow}\r\n"),
        b"method not allowed\n",
        false,
    )
}

const JSON: &str = "application/json";

/// `POST /admin/reload`: check the bearer token, ask the control thread, answer its report.
fn reload(
    stream: &mut TcpStream,
    control: Option<&AdminControl>,
    authorization: Option<&str>,
) -> io::Result<()> {
    let Some(control) = control else {
        return respond(stream, 404, TEXT, b"not found\n", false);
    };
    let Some(expected) = control.token_digest else {
        let body = br#"{"error":"reloading over HTTP is off: set admin.token_env to the environment variable holding its bearer token"}"#;
        return respond(stream, 403, JSON, body, false);
    };
    let presented = authorization
        .and_then(|v| v.strip_prefix("Bearer "))
        .map(|t| crate::config::limits::digest(t.trim().as_bytes()));
    // Digests of equal length, compared in constant time.
    let authorized =
        presented.is_some_and(|p| crate::config::limits::constant_time_eq(&p, &expected));
    if !authorized {
        return respond_with(
            stream,
            401,
            JSON,
            "www-authenticate: Bearer\r\n",
            br#"{"error":"a valid admin bearer token is required"}"#,
            false,
        );
    }
    let (tx, rx) = mpsc::channel();
    (control.reload)(tx);
    match rx.recv_timeout(RELOAD_DEADLINE) {
        Ok(reply) => respond(stream, reply.status, JSON, reply.body.as_bytes(), false),
        Err(_) => respond(
            stream,
            503,
            JSON,
            br#"{"error":"the reload did not finish in time; see the log"}"#,
            false,
        ),
    }
}

fn respond_with(
    stream: &mut TcpStream,
    status: u16,
    content_type: &str,
    extra_headers: &str,
    body: &[u8],
    head_only: bool,
) -> io::Result<()> {
    let mut out = Vec::with_capacity(160 + if head_only { 0 } else { body.len() });
    let _ = crate::http::write_head_start(
        &mut crate::http::VecText(&mut out),
        status,
        content_type,
        body.len(),
    );
    out.extend_from_slice(b"cache-control: no-store\r\n");
    out.extend_from_slice(extra_headers.as_bytes());
    out.extend_from_slice(b"connection: close\r\n\r\n");
    if !head_only {
        out.extend_from_slice(body);
    }
    stream.write_all(&out)?;
    stream.flush()
}

/// Close without resetting: send FIN, then drain briefly so unread bytes from the client (a
/// pipelined request, a body) do not turn the close into an RST that could discard the answer.
fn linger_close(mut stream: TcpStream) {
    let _ = stream.shutdown(Shutdown::Write);
    let _ = stream.set_read_timeout(Some(Duration::from_millis(200)));
    let mut sink = [0u8; 4096];
    let mut drained = 0;
    while drained < 64 * 1024 {
        match stream.read(&mut sink) {
            Ok(0) | Err(_) => break,
            Ok(n) => drained += n,
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

    use super::*;
    use crate::telemetry::metrics::tests::parse_strict;
    use crate::telemetry::metrics::{LabelLists, MetricsShard, StatusClass};

    struct Reply {
        status: u16,
        headers: Vec<(String, String)>,
        body: Vec<u8>,
    }

    impl Reply {
        fn header(&self, name: &str) -> Option<&str> {
            self.headers
                .iter()
                .find(|(k, _)| k.eq_ignore_ascii_case(name))
                .map(|(_, v)| v.as_str())
        }
    }

    fn exchange(addr: SocketAddr, raw: &[u8]) -> Reply {
        let mut s = TcpStream::connect(addr).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        s.write_all(raw).unwrap();
        let mut bytes = Vec::new();
        s.read_to_end(&mut bytes).unwrap();
        let mut headers = [httparse::EMPTY_HEADER; 32];
        let mut resp = httparse::Response::new(&mut headers);
        let httparse::Status::Complete(n) = resp.parse(&bytes).unwrap() else {
            panic!("partial response: {:?}", String::from_utf8_lossy(&bytes));
        };
        Reply {
            status: resp.code.unwrap(),
            headers: resp
                .headers
                .iter()
                .map(|h| {
                    (
                        h.name.to_string(),
                        String::from_utf8_lossy(h.value).into_owned(),
                    )
                })
                .collect(),
            body: bytes[n..].to_vec(),
        }
    }

    fn get(addr: SocketAddr, path: &str) -> Reply {
        exchange(
            addr,
            format!("GET {path} HTTP/1.1\r\nHost: admin\r\n\r\n").as_bytes(),
        )
    }

    fn start() -> (SocketAddr, Arc<MetricsHub>, Arc<AtomicBool>) {
        let models = vec!["gpt-4o".to_string()];
        let routes = vec!["chat_completions".to_string()];
        let hub = MetricsHub::new(LabelLists {
            routes: &routes,
            models: &models,
            ..LabelLists::default()
        });
        let ready = Arc::new(AtomicBool::new(false));
        let addr = spawn_admin(
            "127.0.0.1:0".parse().unwrap(),
            Arc::clone(&hub),
            Arc::clone(&ready),
            None,
            false,
        )
        .unwrap();
        (addr, hub, ready)
    }

    #[test]
    fn serves_metrics_healthz_and_readyz() {
        let (addr, hub, ready) = start();
        assert_ne!(addr.port(), 0, "the bound port is returned");

        let shard = MetricsShard::new(&hub);
        let n = hub.names();
        shard.request_done(
            n.route("chat_completions"),
            n.model("gpt-4o"),
            n.entity("anyone"),
            StatusClass::Success,
        );
        shard.publish(&hub);

        let m = get(addr, "/metrics");
        assert_eq!(m.status, 200);
        assert_eq!(
            m.header("content-type"),
            Some("text/plain; version=0.0.4; charset=utf-8")
        );
        assert_eq!(m.header("connection"), Some("close"));
        assert_eq!(
            m.header("content-length")
                .unwrap()
                .parse::<usize>()
                .unwrap(),
            m.body.len()
        );
        let text = String::from_utf8(m.body).unwrap();
        let e = parse_strict(&text).unwrap_or_else(|err| panic!("{err}\n{text}"));
        assert_eq!(
            e.get(
                "sluice_requests_total",
                &[
                    ("route", "chat_completions"),
                    ("model", "gpt-4o"),
                    ("entity", "other"),
                    ("status_class", "2xx")
                ]
            ),
            Some(1.0)
        );

        let h = get(addr, "/healthz");
        assert_eq!((h.status, h.body.as_slice()), (200, &b"ok"[..]));

        let r = get(addr, "/readyz");
        assert_eq!((r.status, r.body.as_slice()), (503, &b"not ready"[..]));
        ready.store(true, Ordering::Release);
        let r = get(addr, "/readyz");
        assert_eq!((r.status, r.body.as_slice()), (200, &b"ready"[..]));
        // Liveness does not depend on readiness.
        ready.store(false, Ordering::Release);
        assert_eq!(get(addr, "/healthz").status, 200);
        assert_eq!(get(addr, "/readyz").status, 503);
    }

    #[test]
    fn head_query_strings_and_errors() {
        let (addr, _hub, _ready) = start();
        let h = exchange(addr, b"HEAD /metrics HTTP/1.1\r\nHost: a\r\n\r\n");
        assert_eq!(h.status, 200);
        assert!(h.body.is_empty());
        assert!(
            h.header("content-length")
                .unwrap()
                .parse::<usize>()
                .unwrap()
                > 0
        );

        assert_eq!(get(addr, "/metrics?name[]=x").status, 200);
        assert_eq!(get(addr, "/healthz?probe=1").status, 200);

        let nf = get(addr, "/nope");
        assert_eq!(nf.status, 404);
        let post = exchange(
            addr,
            b"POST /metrics HTTP/1.1\r\nHost: a\r\nContent-Length: 3\r\n\r\nabc",
        );
        assert_eq!(post.status, 405);
        assert_eq!(post.header("allow"), Some("GET, HEAD"));
        assert_eq!(exchange(addr, b"\x01\x02garbage\r\n\r\n").status, 400);
        let huge = format!(
            "GET /metrics HTTP/1.1\r\nX-Big: {}\r\n\r\n",
            "a".repeat(MAX_HEAD_BYTES)
        );
        assert_eq!(exchange(addr, huge.as_bytes()).status, 431);
    }

    #[test]
    fn a_silent_client_does_not_block_probes() {
        let (addr, _hub, _ready) = start();
        let _idle: Vec<TcpStream> = (0..3)
            .map(|_| {
                let mut s = TcpStream::connect(addr).unwrap();
                s.write_all(b"GET /heal").unwrap();
                s
            })
            .collect();
        let t = Instant::now();
        assert_eq!(get(addr, "/healthz").status, 200);
        assert!(t.elapsed() < Duration::from_secs(2), "{:?}", t.elapsed());
    }

    #[test]
    fn bind_failure_is_returned() {
        let (addr, hub, ready) = start();
        let again = spawn_admin(addr, hub, ready, None, false);
        let Err(e) = again else {
            panic!("a second bind of {addr} should fail");
        };
        // The operator is told which listener and address.
        assert!(
            e.to_string()
                .starts_with(&format!("cannot bind admin listener {addr}: ")),
            "{e}"
        );
    }
}

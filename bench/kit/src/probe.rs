//! `sluice-probe`: small, precise measurements the load generator does not make.
//!
//! ```text
//! sluice-probe ttfb --addr 127.0.0.1:8080 [--n 2000] [--warmup 200] [--model gpt-4o] [--body-bytes 1024]
//!     Sequential streamed chat completions over one keep-alive connection; prints the
//!     distribution of time to the first response byte and to the first `data:` event.
//! sluice-probe idle --addr 127.0.0.1:8080 [--conns 10000] [--hold-secs 20]
//!     Opens N connections, sends one `GET /v1/models` on each and reads the answer, then holds
//!     them all idle (keep-alive) for the given time. Prints `ready` when all are idle.
//! sluice-probe uring [--size 1024] [--conns 32] [--msgs 200000] [--warm 20000] [--rounds 5]
//!                    [--variants single,multi,single-fixed,multi-fixed,defer,zc,poll,select]
//!                    [--server-cpu C] [--client-cpu C]
//!     No proxy: what io_uring's receive and send variants cost the kernel on this machine, per
//!     message answered by one pinned server thread (see `probe/uring.rs`). The threads default
//!     to the first two CPUs the process may use.
//! ```

// The probe counts what it receives but never reads it, so `BufRing::get` goes unused here.
#[allow(dead_code)]
#[path = "load/bufring.rs"]
mod bufring;
#[path = "load/nofile.rs"]
mod nofile;
#[path = "probe/uring.rs"]
mod uring;

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn arg(args: &[String], name: &str, default: &str) -> String {
    args.iter()
        .position(|a| a == name)
        .and_then(|i| args.get(i + 1))
        .cloned()
        .unwrap_or_else(|| default.to_string())
}

fn num(args: &[String], name: &str, default: u64) -> u64 {
    arg(args, name, &default.to_string())
        .parse()
        .unwrap_or(default)
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let result = match args.first().map(String::as_str) {
        Some("ttfb") => ttfb(&args),
        Some("idle") => idle(&args),
        Some("uring") => uring::run(&args),
        _ => Err(
            "usage: sluice-probe ttfb|idle --addr HOST:PORT [options] | uring [options]"
                .to_string(),
        ),
    };
    if let Err(e) = result {
        eprintln!("sluice-probe: {e}");
        std::process::exit(1);
    }
}

/// A JSON chat body of about `size` bytes.
fn chat_body(model: &str, size: usize, stream: bool) -> String {
    let head = format!(
        "{{\"model\":\"{model}\",\"stream\":{stream},\"messages\":[{{\"role\":\"user\",\"content\":\""
    );
    let tail = "\"}]}";
    let fill = size.saturating_sub(head.len() + tail.len()).max(1);
    format!("{head}{}{tail}", "x".repeat(fill))
}

fn ttfb(args: &[String]) -> Result<(), String> {
    let addr = arg(args, "--addr", "127.0.0.1:8080");
    let n = num(args, "--n", 2000) as usize;
    let warmup = num(args, "--warmup", 200) as usize;
    let model = arg(args, "--model", "gpt-4o");
    let body = chat_body(&model, num(args, "--body-bytes", 1024) as usize, true);
    let request = format!(
        "POST /v1/chat/completions HTTP/1.1\r\nHost: {addr}\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    );
    let mut conn = TcpStream::connect(&addr).map_err(|e| format!("connect {addr}: {e}"))?;
    conn.set_nodelay(true).map_err(|e| e.to_string())?;
    conn.set_read_timeout(Some(Duration::from_secs(10)))
        .map_err(|e| e.to_string())?;
    let mut first_byte = Vec::with_capacity(n);
    let mut first_event = Vec::with_capacity(n);
    let mut buf = vec![0u8; 64 * 1024];
    for i in 0..warmup + n {
        let t0 = Instant::now();
        conn.write_all(request.as_bytes())
            .map_err(|e| e.to_string())?;
        let mut seen = Vec::with_capacity(4096);
        let mut t_byte = None;
        let mut t_event = None;
        loop {
            let got = conn.read(&mut buf).map_err(|e| e.to_string())?;
            if got == 0 {
                return Err("connection closed mid-response".into());
            }
            let now = Instant::now();
            t_byte.get_or_insert(now);
            seen.extend_from_slice(&buf[..got]);
            if t_event.is_none() && memchr::memmem::find(&seen, b"data: ").is_some() {
                t_event = Some(now);
            }
            if seen.ends_with(b"\r\n0\r\n\r\n") || seen.ends_with(b"\n0\r\n\r\n") {
                break;
            }
        }
        if !seen.starts_with(b"HTTP/1.1 200") {
            return Err(format!(
                "unexpected response: {}",
                String::from_utf8_lossy(&seen[..seen.len().min(200)])
            ));
        }
        if i >= warmup {
            if let (Some(b), Some(e)) = (t_byte, t_event) {
                first_byte.push((b - t0).as_nanos() as u64);
                first_event.push((e - t0).as_nanos() as u64);
            }
        }
    }
    report("first_byte_us", &mut first_byte);
    report("first_event_us", &mut first_event);
    Ok(())
}

fn report(name: &str, v: &mut [u64]) {
    v.sort_unstable();
    let pct = |p: f64| v[((v.len() as f64 - 1.0) * p).round() as usize] as f64 / 1000.0;
    println!(
        "{name} n={} p50={:.1} p90={:.1} p99={:.1} max={:.1}",
        v.len(),
        pct(0.5),
        pct(0.9),
        pct(0.99),
        pct(1.0)
    );
}

fn idle(args: &[String]) -> Result<(), String> {
    let addr = arg(args, "--addr", "127.0.0.1:8080");
    let conns = num(args, "--conns", 10_000) as usize;
    let hold = Duration::from_secs(num(args, "--hold-secs", 20));
    let request = format!("GET /v1/models HTTP/1.1\r\nHost: {addr}\r\n\r\n");
    let mut open = Vec::with_capacity(conns);
    let mut buf = [0u8; 4096];
    for i in 0..conns {
        let mut c = TcpStream::connect(&addr).map_err(|e| format!("connection {i}: {e}"))?;
        c.set_read_timeout(Some(Duration::from_secs(10)))
            .map_err(|e| e.to_string())?;
        c.write_all(request.as_bytes()).map_err(|e| e.to_string())?;
        let got = c
            .read(&mut buf)
            .map_err(|e| format!("connection {i}: {e}"))?;
        if !buf[..got].starts_with(b"HTTP/1.1 200") {
            return Err(format!("connection {i}: unexpected answer"));
        }
        open.push(c);
    }
    println!("ready {}", open.len());
    let _ = std::io::stdout().flush();
    std::thread::sleep(hold);
    // Every connection must still be open (the server kept them alive).
    let mut alive = 0;
    for c in &open {
        c.set_nonblocking(true).map_err(|e| e.to_string())?;
        let mut b = [0u8; 1];
        match (&*c).read(&mut b) {
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => alive += 1,
            _ => {}
        }
    }
    println!("still_open {alive}");
    Ok(())
}

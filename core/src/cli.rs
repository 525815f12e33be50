//! What the `sluice` command needs of the library beyond running and loading: `sluice reload`'s
//! exchange with a running gateway's admin listener. Runs in the command's own process, never on a worker; blocking I/O
//! is fine here.

use std::io::{Read as _, Write as _};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, TcpStream};
use std::time::Duration;

/// Where `sluice reload` sends the reload, and the variable holding its token.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReloadTarget {
    pub addr: SocketAddr,
    pub token_env: String,
}

/// Read `[admin] listen` and `token_env` from a config's text — only those: the file may hold
/// the very errors the reload is to report. A wildcard listen address is reached on loopback.
pub fn reload_target(config_text: &str) -> Result<ReloadTarget, String> {
    let doc: toml::Table = config_text
        .parse()
        .map_err(|e| format!("the config is not TOML: {e}"))?;
    let Some(admin) = doc.get("admin").and_then(toml::Value::as_table) else {
        return Err(
            "the config has no [admin] listener to reload through; add one (with \
                    token_env), or send the process SIGHUP"
                .into(),
        );
    };
    let listen = admin
        .get("listen")
        .and_then(toml::Value::as_str)
        .ok_or("[admin] has no listen address")?;
    let mut addr = resolve_listen(listen)?;
    if addr.ip().is_unspecified() {
        addr.set_ip(match addr.ip() {
            IpAddr::V4(_) => IpAddr::V4(Ipv4Addr::LOCALHOST),
            IpAddr::V6(_) => IpAddr::V6(Ipv6Addr::LOCALHOST),
        });
    }
    let token_env = admin
        .get("token_env")
        .and_then(toml::Value::as_str)
        .ok_or("[admin] has no token_env: the admin listener refuses reloads without a token")?;
    Ok(ReloadTarget {
        addr,
        token_env: token_env.to_owned(),
    })
}

/// `admin.listen` as an address: an IP literal, or a name resolved as the config resolves it (a
/// loopback address preferred).
#[allow(
    clippy::disallowed_methods,
    reason = "the sluice command's own process, not a worker: a blocking lookup is fine here"
)]
fn resolve_listen(listen: &str) -> Result<SocketAddr, String> {
    use std::net::ToSocketAddrs as _;
    let not = || format!("admin.listen `{listen}` is not an address like 127.0.0.1:9090");
    let addrs: Vec<SocketAddr> = listen.to_socket_addrs().map_err(|_| not())?.collect();
    addrs
        .iter()
        .find(|a| a.ip().is_loopback())
        .or_else(|| addrs.first())
        .copied()
        .ok_or_else(not)
}

/// `POST /admin/reload` to `addr` with `token`, waiting up to `timeout` for the answer: its
/// status and body.
pub fn post_reload(
    addr: SocketAddr,
    token: &str,
    timeout: Duration,
) -> std::io::Result<(u16, String)> {
    let token = token.trim();
    if token.contains(['\r', '\n']) {
        return Err(std::io::Error::other("the admin token holds a line break"));
    }
    let mut conn = TcpStream::connect_timeout(&addr, timeout)?;
    conn.set_read_timeout(Some(timeout))?;
    conn.set_write_timeout(Some(timeout))?;
    write!(
        conn,
        "POST /admin/reload HTTP/1.1\r\nHost: sluice\r\nAuthorization: Bearer {token}\r\n\
         Content-Length: 0\r\nConnection: close\r\n\r\n"
    )?;
    let mut answer = Vec::new();
    conn.read_to_end(&mut answer).map_err(|e| match e.kind() {
        std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut => {
            std::io::Error::other(format!(
                "no answer within {} s; the reload may still apply (the journal says)",
                timeout.as_secs()
            ))
        }
        _ => e,
    })?;
    let text = String::from_utf8_lossy(&answer);
    let (head, body) = text.split_once("\r\n\r\n").unwrap_or((&text, ""));
    let status = head
        .split(' ')
        .nth(1)
        .and_then(|s| s.parse().ok())
        .ok_or_else(|| std::io::Error::other("the admin listener's answer is not HTTP"))?;
    Ok((status, body.to_owned()))
}

/// The admin listener's answer to a reload, for a person: applied (with what waits for a
/// restart, and the warnings), rejected (with every error), or what else it said.
pub fn describe_reload(status: u16, body: &str) -> String {
    let Ok(v) = serde_json::from_str::<serde_json::Value>(body) else {
        return format!("the admin listener answered {status}: {}", body.trim());
    };
    let sha = v["config_sha256"].as_str().unwrap_or("unreadable file");
    let list = |key: &str, label: &str, out: &mut String| {
        for item in v[key].as_array().into_iter().flatten() {
            out.push_str(&format!(
                "\n  {label}: {}",
                item.as_str().unwrap_or_default()
            ));
        }
    };
    let mut out = match v["status"].as_str() {
        Some("applied") => format!(
            "reload applied (config sha256 {sha}, {} workers)",
            v["workers"].as_u64().unwrap_or(0)
        ),
        Some("rejected") => {
            format!("reload rejected (config sha256 {sha}); the running config stays")
        }
        _ => format!("the admin listener answered {status}: {}", body.trim()),
    };
    list("errors", "error", &mut out);
    list("restart_required", "needs a restart", &mut out);
    list("warnings", "warning", &mut out);
    out
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn the_reload_target_is_read_from_admin_alone() {
        let t = reload_target(
            "[admin]\nlisten = \"0.0.0.0:9090\"\ntoken_env = \"T\"\n[routes]\nbroken = [",
        );
        assert!(t.is_err(), "not TOML: {t:?}");
        let t = reload_target("[admin]\nlisten = \"0.0.0.0:9090\"\ntoken_env = \"T\"\n").unwrap();
        assert_eq!(t.addr, "127.0.0.1:9090".parse().unwrap());
        assert_eq!(t.token_env, "T");
        let t = reload_target("[admin]\nlisten = \"[::]:9\"\ntoken_env = \"T\"").unwrap();
        assert_eq!(t.addr, "[::1]:9".parse().unwrap());
        assert!(reload_target("[server]\n")
            .unwrap_err()
            .contains("no [admin]"));
        assert!(reload_target("[admin]\nlisten = \"127.0.0.1:1\"\n")
            .unwrap_err()
            .contains("token_env"));
    }

    #[test]
    fn outcomes_are_said_with_their_errors() {
        let rejected = r#"{"status":"rejected","config_sha256":"ab","errors":["routes[1].cluster: no cluster named `b`"]}"#;
        let said = describe_reload(422, rejected);
        assert!(
            said.starts_with("reload rejected (config sha256 ab)"),
            "{said}"
        );
        assert!(
            said.contains("error: routes[1].cluster: no cluster named `b`"),
            "{said}"
        );
        let applied = r#"{"status":"applied","config_sha256":"cd","workers":2,"restart_required":["server.listen"],"warnings":[]}"#;
        let said = describe_reload(200, applied);
        assert!(
            said.starts_with("reload applied (config sha256 cd, 2 workers)"),
            "{said}"
        );
        assert!(said.contains("needs a restart: server.listen"), "{said}");
        assert_eq!(
            describe_reload(403, "forbidden"),
            "the admin listener answered 403: forbidden"
        );
    }
}

//! `[limits.redis] address` and `seeds`: a Redis URL or a plain `host:port`, parsed into where
//! Redis is and, from a URL, who to be there.
//!
//! Runs on the control thread while a config is loaded; no I/O (the host is resolved by the
//! caller). Takes the string from the file; returns a [`RedisAddress`] or an error message. No
//! message, and no `Debug` output, ever carries the password: a message names only the part at
//! fault, and [`redacted`] is how the caller may echo the whole address.
//!
//! Accepted: `redis://[user[:password]@]host[:port][/db]` (user and password percent-decoded,
//! port 6379 when not given, `db` a decimal database number), an IPv6 host in brackets, and the
//! plain `host:port` the config always took. Refused, each with its reason: `rediss://` (TLS to
//! Redis is not implemented, and a `rediss://` address must not quietly become plain text),
//! `redis+cluster://` (a cluster is `cluster = true` plus `seeds`, as before), Unix sockets, and
//! query parameters (`?db=…`, `?password=…`: one place for each setting).

use std::fmt;

/// Redis's port when a URL gives none.
pub(crate) const DEFAULT_PORT: u16 = 6379;

/// One Redis address, as the file gives it.
#[derive(Clone, PartialEq, Eq)]
pub(crate) struct RedisAddress {
    /// A name or an IP address (IPv6 without its brackets).
    pub(crate) host: String,
    pub(crate) port: u16,
    /// From a URL's user info, percent-decoded; `None` when absent or empty.
    pub(crate) username: Option<String>,
    /// From a URL's user info, percent-decoded. Never printed.
    pub(crate) password: Option<String>,
    /// From a URL's path (`/2`); `None` when the URL has no path or the address is plain.
    pub(crate) db: Option<u32>,
}

impl RedisAddress {
    /// `host:port`, with an IPv6 host in brackets: the form name lookups and messages use.
    pub(crate) fn host_port(&self) -> String {
        if self.host.contains(':') {
            format!("[{}]:{}", self.host, self.port)
        } else {
            format!("{}:{}", self.host, self.port)
        }
    }
}

impl fmt::Debug for RedisAddress {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RedisAddress")
            .field("host", &self.host)
            .field("port", &self.port)
            .field("username", &self.username)
            .field("password", &self.password.as_ref().map(|_| "<redacted>"))
            .field("db", &self.db)
            .finish()
    }
}

/// The accepted forms, for messages.
const FORMS: &str = "redis://[user[:password]@]host[:port][/db] or host:port";

/// Parse an address: a `redis://` URL or a plain `host:port`.
pub(crate) fn parse(address: &str) -> Result<RedisAddress, String> {
    let Some((scheme, rest)) = address.split_once("://") else {
        return parse_plain(address);
    };
    match scheme.to_ascii_lowercase().as_str() {
        "redis" => parse_url(rest),
        "rediss" => Err(
            "TLS to Redis is not supported yet (`rediss://`): use redis:// on a trusted network, \
             or a local TLS tunnel (stunnel, spiped) and point redis:// at it"
                .into(),
        ),
        "redis+cluster" | "rediss+cluster" => Err(format!(
            "`{scheme}://` is not read: for a Redis Cluster write a redis:// URL (or host:port) \
             of one node here, set cluster = true, and list more nodes in seeds"
        )),
        "unix" | "redis+unix" | "redis-socket" => {
            Err("Unix sockets are not supported: use redis://host:port".into())
        }
        _ => Err(format!(
            "`{scheme}://` is not a Redis URL scheme; use {FORMS}"
        )),
    }
}

/// The address with any user info replaced by `***`, safe to print.
pub(crate) fn redacted(address: &str) -> String {
    let (scheme, rest) = match address.split_once("://") {
        Some((scheme, rest)) => (Some(scheme), rest),
        None => (None, address),
    };
    let rest = match rest.rfind('@') {
        Some(at) => format!("***{}", &rest[at..]),
        None => rest.to_string(),
    };
    match scheme {
        Some(scheme) => format!("{scheme}://{rest}"),
        None => rest,
    }
}

/// `host:port`, as the config always took it: the port is required.
fn parse_plain(address: &str) -> Result<RedisAddress, String> {
    if address.contains('@') {
        return Err(format!(
            "`{}`: a user or password needs a URL, like redis://user:password@host:6379",
            redacted(address)
        ));
    }
    let (host, port) = host_and_port(address, None)?;
    Ok(RedisAddress {
        host,
        port,
        username: None,
        password: None,
        db: None,
    })
}

/// What follows `redis://`.
fn parse_url(rest: &str) -> Result<RedisAddress, String> {
    // The user info ends at the last `@`, so a password may hold `@`, `/`, `?` or `#` unencoded.
    let (userinfo, location) = match rest.rfind('@') {
        Some(at) => (Some(&rest[..at]), &rest[at + 1..]),
        None => (None, rest),
    };
    let end = location.find(['/', '?', '#']).unwrap_or(location.len());
    let (authority, tail) = location.split_at(end);
    let db = match tail {
        "" | "/" => None,
        _ if tail.contains(['?', '#']) => {
            return Err(format!(
                "query parameters and fragments (`{}`) are not read: give the database as the \
                 path (redis://host:6379/2) and the password in the URL or password_env",
                &tail[tail.find(['?', '#']).unwrap_or(0)..]
            ))
        }
        _ => {
            let path = &tail[1..];
            let number = path.bytes().all(|b| b.is_ascii_digit());
            Some(path.parse::<u32>().ok().filter(|_| number).ok_or_else(|| {
                format!("the path `/{path}` is not a database number, like redis://host:6379/2")
            })?)
        }
    };
    let (host, port) = host_and_port(authority, Some(DEFAULT_PORT))?;
    let (username, password) = match userinfo {
        None => (None, None),
        Some(info) => {
            let (user, password) = match info.split_once(':') {
                Some((user, password)) => (user, Some(password)),
                None => (info, None),
            };
            let user = decode(user, "user name")?;
            let password = password.map(|p| decode(p, "password")).transpose()?;
            if password.as_deref() == Some("") {
                return Err(
                    "the password in the URL is empty: leave out `:` and the password, \
                     or give one"
                        .into(),
                );
            }
            (Some(user).filter(|u| !u.is_empty()), password)
        }
    };
    Ok(RedisAddress {
        host,
        port,
        username,
        password,
        db,
    })
}

/// Split `host[:port]` (`[v6][:port]`); `default_port` `None`: the port is required.
fn host_and_port(authority: &str, default_port: Option<u16>) -> Result<(String, u16), String> {
    let (host, port) = if let Some(bracketed) = authority.strip_prefix('[') {
        let Some((v6, after)) = bracketed.split_once(']') else {
            return Err(format!("`{authority}` has `[` without `]`"));
        };
        if v6.parse::<std::net::Ipv6Addr>().is_err() {
            return Err(format!("`[{v6}]` is not an IPv6 address"));
        }
        let port = match after {
            "" => None,
            _ => Some(
                after
                    .strip_prefix(':')
                    .ok_or_else(|| format!("`{after}` after `[{v6}]` is not `:port`"))?,
            ),
        };
        (v6, port)
    } else {
        if authority.matches(':').count() > 1 {
            return Err(format!(
                "`{authority}`: an IPv6 address goes in brackets, like [::1]:6379"
            ));
        }
        match authority.split_once(':') {
            Some((host, port)) => (host, Some(port)),
            None => (authority, None),
        }
    };
    if host.is_empty() {
        return Err(format!("no host: use {FORMS}"));
    }
    let plain_name = host
        .bytes()
        .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'.' | b'_' | b':'));
    if !plain_name {
        return Err(format!("`{host}` is not a host name or IP address"));
    }
    let port = match (port, default_port) {
        (Some(p), _) => p
            .parse::<u16>()
            .ok()
            .filter(|n| *n != 0 && p.bytes().all(|b| b.is_ascii_digit()))
            .ok_or_else(|| format!("port `{p}` is not a number from 1 to 65535"))?,
        (None, Some(default)) => default,
        (None, None) => {
            return Err(format!(
                "`{host}` has no port: write {host}:{DEFAULT_PORT} or redis://{host}"
            ))
        }
    };
    Ok((host.to_string(), port))
}

/// Percent-decode a URL's user name or password (`what`). The message never quotes the text.
fn decode(text: &str, what: &str) -> Result<String, String> {
    let bytes = text.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'%' {
            let byte = text
                .get(i + 1..i + 3)
                .filter(|hex| hex.bytes().all(|b| b.is_ascii_hexdigit()))
                .and_then(|hex| u8::from_str_radix(hex, 16).ok())
                .ok_or_else(|| {
                    format!(
                        "the {what} in the URL has a `%` not followed by two hex digits (write \
                         `%` itself as %25)"
                    )
                })?;
            out.push(byte);
            i += 3;
        } else {
            out.push(bytes[i]);
            i += 1;
        }
    }
    String::from_utf8(out).map_err(|_| format!("the {what} in the URL is not UTF-8 once decoded"))
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    fn addr(host: &str, port: u16) -> RedisAddress {
        RedisAddress {
            host: host.into(),
            port,
            username: None,
            password: None,
            db: None,
        }
    }

    #[test]
    fn accepts_the_usual_forms() {
        let cases = [
            ("127.0.0.1:6379", addr("127.0.0.1", 6379)),
            ("redis.internal:7000", addr("redis.internal", 7000)),
            ("[::1]:6380", addr("::1", 6380)),
            ("redis://127.0.0.1", addr("127.0.0.1", 6379)),
            ("redis://127.0.0.1/", addr("127.0.0.1", 6379)),
            ("REDIS://localhost:6380", addr("localhost", 6380)),
            ("redis://[::1]", addr("::1", 6379)),
            ("redis://[2001:db8::7]:7001/4", {
                RedisAddress {
                    db: Some(4),
                    ..addr("2001:db8::7", 7001)
                }
            }),
            ("redis://10.0.0.5:6379/0", {
                RedisAddress {
                    db: Some(0),
                    ..addr("10.0.0.5", 6379)
                }
            }),
            ("redis://sluice@10.0.0.5/1", {
                RedisAddress {
                    username: Some("sluice".into()),
                    db: Some(1),
                    ..addr("10.0.0.5", 6379)
                }
            }),
            ("redis://:s3cret@host", {
                RedisAddress {
                    password: Some("s3cret".into()),
                    ..addr("host", 6379)
                }
            }),
            ("redis://@host", addr("host", 6379)),
            // Percent-decoded; `+` stays a plus; `@`, `/`, `?` and `#` may be left unencoded
            // in the password, the user info ending at the last `@`.
            ("redis://us%65r:p%40ss%3Aw%2Frd%25+x@host:1/15", {
                RedisAddress {
                    username: Some("user".into()),
                    password: Some("p@ss:w/rd%+x".into()),
                    db: Some(15),
                    ..addr("host", 1)
                }
            }),
            ("redis://u:a@b/c?d#e@host", {
                RedisAddress {
                    username: Some("u".into()),
                    password: Some("a@b/c?d#e".into()),
                    ..addr("host", 6379)
                }
            }),
            ("redis://u:p%C3%A9@host", {
                RedisAddress {
                    username: Some("u".into()),
                    password: Some("pé".into()),
                    ..addr("host", 6379)
                }
            }),
        ];
        for (input, want) in cases {
            assert_eq!(parse(input), Ok(want), "{input}");
        }
    }

    #[test]
    fn refuses_the_rest_each_with_its_reason() {
        let cases = [
            (
                "rediss://:pw@host:6380/1",
                "TLS to Redis is not supported yet (`rediss://`): use redis:// on a trusted \
                 network, or a local TLS tunnel (stunnel, spiped) and point redis:// at it",
            ),
            (
                "redis+cluster://host:7000",
                "`redis+cluster://` is not read: for a Redis Cluster write a redis:// URL (or \
                 host:port) of one node here, set cluster = true, and list more nodes in seeds",
            ),
            (
                "unix:///run/redis.sock",
                "Unix sockets are not supported: use redis://host:port",
            ),
            (
                "http://host:6379",
                "`http://` is not a Redis URL scheme; use \
                 redis://[user[:password]@]host[:port][/db] or host:port",
            ),
            (
                "redis://host:6379/db2",
                "the path `/db2` is not a database number, like redis://host:6379/2",
            ),
            (
                "redis://host:6379/1/2",
                "the path `/1/2` is not a database number, like redis://host:6379/2",
            ),
            (
                "redis://host:6379/-1",
                "the path `/-1` is not a database number, like redis://host:6379/2",
            ),
            (
                "redis://host:6379/+1",
                "the path `/+1` is not a database number, like redis://host:6379/2",
            ),
            (
                "redis://host:+1",
                "port `+1` is not a number from 1 to 65535",
            ),
            (
                "redis://u:%+1@host",
                "the password in the URL has a `%` not followed by two hex digits (write `%` \
                 itself as %25)",
            ),
            (
                "redis://host?db=2",
                "query parameters and fragments (`?db=2`) are not read: give the database as \
                 the path (redis://host:6379/2) and the password in the URL or password_env",
            ),
            (
                "redis://host/2#x",
                "query parameters and fragments (`#x`) are not read: give the database as the \
                 path (redis://host:6379/2) and the password in the URL or password_env",
            ),
            ("redis://host:0", "port `0` is not a number from 1 to 65535"),
            (
                "redis://host:65536",
                "port `65536` is not a number from 1 to 65535",
            ),
            ("redis://host:", "port `` is not a number from 1 to 65535"),
            (
                "redis://",
                "no host: use redis://[user[:password]@]host[:port][/db] or host:port",
            ),
            (
                "redis://u:p@:6379",
                "no host: use redis://[user[:password]@]host[:port][/db] or host:port",
            ),
            (
                "redis://::1",
                "`::1`: an IPv6 address goes in brackets, like [::1]:6379",
            ),
            ("redis://[::1", "`[::1` has `[` without `]`"),
            ("redis://[nope]:1", "`[nope]` is not an IPv6 address"),
            ("redis://[::1]6379", "`6379` after `[::1]` is not `:port`"),
            ("redis://ho st", "`ho st` is not a host name or IP address"),
            (
                "redis://u:p%zz@host",
                "the password in the URL has a `%` not followed by two hex digits (write `%` \
                 itself as %25)",
            ),
            (
                "redis://u%4:p@host",
                "the user name in the URL has a `%` not followed by two hex digits (write `%` \
                 itself as %25)",
            ),
            (
                "redis://u:%FF%FE@host",
                "the password in the URL is not UTF-8 once decoded",
            ),
            (
                "redis://user:@host",
                "the password in the URL is empty: leave out `:` and the password, or give one",
            ),
            (
                "localhost",
                "`localhost` has no port: write localhost:6379 or redis://localhost",
            ),
            (
                "user:pw@host:6379",
                "`***@host:6379`: a user or password needs a URL, like \
                 redis://user:password@host:6379",
            ),
            (
                "",
                "no host: use redis://[user[:password]@]host[:port][/db] or host:port",
            ),
        ];
        for (input, want) in cases {
            assert_eq!(parse(input), Err(want.to_string()), "{input}");
        }
    }

    /// No message and no `Debug` output carries a password, whatever is wrong with the rest.
    #[test]
    fn passwords_never_show() {
        let secret = "Zq9secretXy";
        for input in [
            format!("rediss://u:{secret}@host"),
            format!("redis+cluster://u:{secret}@host"),
            format!("redis://u:{secret}@host:99999"),
            format!("redis://u:{secret}@host/x"),
            format!("redis://u:{secret}@host?a=b"),
            format!("redis://u:{secret}%@host"),
            format!("redis://u:{secret}@"),
            format!("redis://u:{secret}@ho st"),
            format!("u:{secret}@host:6379"),
            format!("{secret}@host"),
        ] {
            let msg = parse(&input).unwrap_err();
            assert!(!msg.contains(secret), "{input}: {msg}");
            assert!(!redacted(&input).contains(secret), "{input}");
        }
        let ok = parse(&format!("redis://u:{secret}@host")).unwrap();
        assert!(!format!("{ok:?}").contains(secret), "{ok:?}");
        assert_eq!(
            redacted(&format!("redis://u:{secret}@host:1/2")),
            "redis://***@host:1/2"
        );
        assert_eq!(redacted("redis://host:1/2"), "redis://host:1/2");
    }

    #[test]
    fn host_port_brackets_ipv6() {
        assert_eq!(parse("redis://[::1]").unwrap().host_port(), "[::1]:6379");
        assert_eq!(parse("redis://h:7").unwrap().host_port(), "h:7");
    }
}

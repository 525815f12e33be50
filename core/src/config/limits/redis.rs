//! `backend` and `[limits.redis]`: where the limiter's shared state lives, resolved once.

// The config loader resolves the Redis address here, once, on the control thread.
#![allow(clippy::disallowed_methods)]

use std::net::{SocketAddr, ToSocketAddrs};
use std::time::Duration;

use super::checks::check_id;
use super::raw::{RawRedis, DEFAULT_REDIS_DB};
use super::snapshot::RedisSettings;
use crate::config::redis_url;

/// `backend` and `[limits.redis]`: the Redis settings, or `None` for the in-process ledger (and
/// where Redis's address is wrong).
pub(super) fn resolve_backend(
    backend: &str,
    redis: Option<&RawRedis>,
    env: &dyn Fn(&str) -> Option<String>,
    err: &mut dyn FnMut(String, String),
) -> Option<RedisSettings> {
    match (backend, redis) {
        ("local", _) => None,
        ("redis", None) => {
            err(
                "limits.redis".into(),
                "backend = \"redis\" needs a [limits.redis] section with an address".into(),
            );
            None
        }
        ("redis", Some(r)) => resolve_redis(r, env, err),
        (other, _) => {
            err(
                "limits.backend".into(),
                format!("`{other}` is not \"local\" or \"redis\""),
            );
            None
        }
    }
}

fn resolve_redis(
    r: &RawRedis,
    env: &dyn Fn(&str) -> Option<String>,
    err: &mut dyn FnMut(String, String),
) -> Option<RedisSettings> {
    let url = redis_url::parse(&r.address)
        .map_err(|m| err("limits.redis.address".into(), m))
        .ok();
    let address = url.as_ref().and_then(|u| {
        resolve_host(u)
            .map_err(|m| err("limits.redis.address".into(), m))
            .ok()
    });
    let credentials = url.as_ref().map(|u| redis_credentials(r, u, env, err));
    if let Err(e) = check_id(&r.key_prefix) {
        err("limits.redis.key_prefix".into(), e);
    }
    let db = redis_db(r, url.as_ref(), err);
    let seeds = redis_seeds(r, err);
    if !r.cluster && !r.seeds.is_empty() {
        err(
            "limits.redis.seeds".into(),
            "seeds are for a Redis Cluster: set cluster = true".into(),
        );
    }
    let address = address?;
    let (username, password) = credentials?;
    Some(RedisSettings {
        address,
        cluster_seeds: r.cluster.then(|| {
            let mut all = vec![address];
            all.extend(seeds.iter().copied().filter(|s| *s != address));
            all
        }),
        username,
        password,
        db,
        key_prefix: r.key_prefix.clone(),
        connect_timeout: Duration::from_millis(r.connect_timeout_ms.max(1)),
    })
}

/// An address's host, resolved once, here (workers never resolve names).
fn resolve_host(a: &redis_url::RedisAddress) -> Result<SocketAddr, String> {
    match (a.host.as_str(), a.port).to_socket_addrs() {
        Ok(mut addrs) => addrs
            .next()
            .ok_or_else(|| format!("`{}` resolves to no address", a.host_port())),
        Err(e) => Err(format!("`{}` does not resolve: {e}", a.host_port())),
    }
}

/// The user and password: from the URL in `address`, from `username` / `password_env`, or both
/// when they agree. A user without a password is refused: `AUTH` needs one, and without it the
/// connection would quietly be the default user's. No message carries a password.
fn redis_credentials(
    r: &RawRedis,
    url: &redis_url::RedisAddress,
    env: &dyn Fn(&str) -> Option<String>,
    err: &mut dyn FnMut(String, String),
) -> (Option<String>, Option<String>) {
    let username = match (&url.username, &r.username) {
        (Some(in_url), Some(key)) if in_url != key => {
            err(
                "limits.redis.username".into(),
                format!(
                    "`{key}` differs from the user in address (`{in_url}`); give it in one place"
                ),
            );
            Some(in_url.clone())
        }
        (in_url, key) => in_url.clone().or_else(|| key.clone()),
    };
    let from_env = r.password_env.as_ref().map(|var| (var, env(var)));
    let password = match (&url.password, from_env) {
        (_, Some((var, None))) => {
            err(
                "limits.redis.password_env".into(),
                format!("environment variable `{var}` is not set"),
            );
            return (username, url.password.clone());
        }
        (Some(in_url), Some((var, Some(value))))
            if *in_url != value && value != crate::config::ENV_PLACEHOLDER =>
        {
            err(
                "limits.redis.password_env".into(),
                format!(
                    "`{var}` holds a different password than the one in address; give it in \
                     one place"
                ),
            );
            Some(value)
        }
        (in_url, from_env) => in_url.clone().or(from_env.and_then(|(_, v)| v)),
    };
    if username.is_some() && password.is_none() {
        let path = if url.username.is_some() {
            "limits.redis.address"
        } else {
            "limits.redis.username"
        };
        err(
            path.into(),
            "a user name needs a password (redis://user:password@host, or password_env): \
             Redis's AUTH takes both, and without it the connection would be the default user's"
                .into(),
        );
    }
    (username, password)
}

/// The database: `db`, the URL's `/db`, or both when they agree; 0 when neither says. A Redis
/// Cluster has only database 0.
fn redis_db(
    r: &RawRedis,
    url: Option<&redis_url::RedisAddress>,
    err: &mut dyn FnMut(String, String),
) -> u32 {
    let in_url = url.and_then(|u| u.db);
    let (db, path) = match (in_url, r.db) {
        (Some(u), Some(key)) if u != key => {
            err(
                "limits.redis.db".into(),
                format!("{key} differs from the database in address (/{u}); give it in one place"),
            );
            (u, "limits.redis.address")
        }
        (Some(u), _) => (u, "limits.redis.address"),
        (None, key) => (key.unwrap_or(DEFAULT_REDIS_DB), "limits.redis.db"),
    };
    if r.cluster && db != 0 {
        err(path.into(), "a Redis Cluster has only database 0".into());
    }
    db
}

/// `seeds`: more nodes of a Redis Cluster, each a `redis://` URL or `host:port`, without a user,
/// password or database of its own (every node is reached as `address` says).
fn redis_seeds(r: &RawRedis, err: &mut dyn FnMut(String, String)) -> Vec<SocketAddr> {
    let mut seeds = Vec::new();
    for (i, seed) in r.seeds.iter().enumerate() {
        let path = format!("limits.redis.seeds[{i}]");
        let resolved = redis_url::parse(seed).and_then(|s| {
            if s.username.is_some() || s.password.is_some() {
                return Err(
                    "a seed takes no user or password: every node is reached with \
                     address's (or username / password_env)"
                        .into(),
                );
            }
            if s.db.is_some_and(|db| db != 0) {
                return Err("a Redis Cluster has only database 0".into());
            }
            resolve_host(&s)
        });
        match resolved {
            Ok(a) => seeds.push(a),
            Err(m) => err(path, m),
        }
    }
    seeds
}

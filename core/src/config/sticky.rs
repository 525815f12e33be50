//! Sticky sessions: a route's `sticky` rule (where a session id comes from, the affinity
//! cookie, how long a pin lasts) and the top-level `[sticky]` keys that seal affinity cookies.
//! Read and validated here, once; used by the route phase.

use std::sync::Arc;

use serde::Deserialize;

use super::limits::decode_hex;

/// `[[routes]] sticky = { … }`.
#[derive(Debug, Deserialize)]
#[cfg_attr(test, derive(serde::Serialize))]
#[serde(deny_unknown_fields)]
pub(super) struct RawStickyRule {
    /// Where the session id is taken from, first found wins: `header:NAME`, `cookie:NAME`,
    /// `query:NAME`.
    #[serde(default)]
    from: Vec<String>,
    /// The affinity cookie Sluice sets (sealed; see `[sticky]`).
    cookie: Option<String>,
    #[serde(default = "default_ttl")]
    ttl_secs: u64,
}

/// The longest a pin or cookie may hold.
const MAX_TTL_SECS: u64 = 30 * 24 * 3600;

fn default_ttl() -> u64 {
    3_600
}

/// `[sticky]`.
#[derive(Debug, Default, Deserialize)]
#[cfg_attr(test, derive(serde::Serialize))]
#[serde(deny_unknown_fields, default)]
pub(super) struct RawSticky {
    keys: Vec<RawStickyKey>,
}

#[derive(Debug, Deserialize)]
#[cfg_attr(test, derive(serde::Serialize))]
#[serde(deny_unknown_fields)]
pub(super) struct RawStickyKey {
    id: u32,
    /// Environment variable holding the key: 64 hex digits (32 bytes).
    env: String,
}

/// Where one session id may come from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum StickySource {
    /// A request header (lower-case name).
    Header(String),
    Cookie(String),
    /// A query-string parameter.
    Query(String),
}

/// A route's sticky rule.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct StickyRule {
    pub(crate) sources: Vec<StickySource>,
    pub(crate) cookie: Option<String>,
    pub(crate) ttl_secs: u64,
}

/// The keys affinity cookies are sealed with (ChaCha20-Poly1305): the first seals, every one
/// opens, so a key can be rotated in without breaking the cookies already out.
#[derive(Clone, Default)]
pub(crate) struct StickyKeys {
    pub(crate) keys: Vec<(u32, Arc<ring::aead::LessSafeKey>)>,
}

impl std::fmt::Debug for StickyKeys {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let ids: Vec<u32> = self.keys.iter().map(|k| k.0).collect();
        write!(f, "StickyKeys({ids:?}: <redacted>)")
    }
}

pub(super) fn resolve_rule(
    raw: &RawStickyRule,
    path: &str,
    err: &mut dyn FnMut(String, String),
) -> StickyRule {
    let mut sources = Vec::new();
    for (i, s) in raw.from.iter().enumerate() {
        let parsed = match s.split_once(':') {
            Some(("header", n)) if valid_token(n) => {
                Some(StickySource::Header(n.to_ascii_lowercase()))
            }
            Some(("cookie", n)) if valid_token(n) => Some(StickySource::Cookie(n.to_string())),
            Some(("query", n)) if !n.is_empty() => Some(StickySource::Query(n.to_string())),
            _ => None,
        };
        match parsed {
            Some(p) => sources.push(p),
            None => err(
                format!("{path}.sticky.from[{i}]"),
                format!("`{s}` is not `header:NAME`, `cookie:NAME` or `query:NAME`"),
            ),
        }
    }
    if let Some(c) = &raw.cookie {
        if !valid_token(c) {
            err(
                format!("{path}.sticky.cookie"),
                format!("`{c}` is not a valid cookie name"),
            );
        }
    }
    if sources.is_empty() && raw.cookie.is_none() {
        err(
            format!("{path}.sticky"),
            "needs `from` (where the session id is), `cookie` (an affinity cookie), or both".into(),
        );
    }
    if raw.ttl_secs == 0 || raw.ttl_secs > MAX_TTL_SECS {
        err(
            format!("{path}.sticky.ttl_secs"),
            format!("must be from 1 to {MAX_TTL_SECS} (30 days)"),
        );
    }
    StickyRule {
        sources,
        cookie: raw.cookie.clone(),
        ttl_secs: raw.ttl_secs.clamp(1, MAX_TTL_SECS),
    }
}

/// An HTTP token (header and cookie names).
fn valid_token(s: &str) -> bool {
    !s.is_empty()
        && s.bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(&b))
}

pub(super) fn resolve_keys(
    raw: &RawSticky,
    env: &dyn Fn(&str) -> Option<String>,
    err: &mut dyn FnMut(String, String),
) -> StickyKeys {
    let mut keys = StickyKeys::default();
    for (i, k) in raw.keys.iter().enumerate() {
        let path = format!("sticky.keys[{i}]");
        if keys.keys.iter().any(|(id, _)| *id == k.id) {
            err(
                format!("{path}.id"),
                format!("key id {} is listed twice", k.id),
            );
            continue;
        }
        let Some(value) = env(&k.env) else {
            err(
                format!("{path}.env"),
                format!("environment variable `{}` is not set", k.env),
            );
            continue;
        };
        let bytes = decode_hex(value.trim());
        let key = bytes
            .filter(|b| b.len() == 32)
            .and_then(|b| ring::aead::UnboundKey::new(&ring::aead::CHACHA20_POLY1305, &b).ok());
        match key {
            Some(key) => keys
                .keys
                .push((k.id, Arc::new(ring::aead::LessSafeKey::new(key)))),
            None => err(
                format!("{path}.env"),
                format!(
                    "environment variable `{}` must hold 64 hex digits (a 32-byte key)",
                    k.env
                ),
            ),
        }
    }
    keys
}

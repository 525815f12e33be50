//! Sticky sessions: a route's `sticky` rule (where a session id comes from, the affinity
//! cookie, how long a pin lasts, prefix affinity) and the top-level `[sticky]` keys that seal
//! affinity cookies. Read and validated here, once; used by inspection (what to read of the
//! body: [`body_wants`]) and the route phase.

use std::sync::Arc;

use serde::Deserialize;

use super::limits::decode_hex;
use crate::openai::inspect::Wants;

/// `[[routes]] sticky = { … }`.
#[derive(Debug, Deserialize)]
#[cfg_attr(test, derive(serde::Serialize))]
#[serde(deny_unknown_fields)]
pub(super) struct RawStickyRule {
    /// Where the session id is taken from, first found wins: `header:NAME`, `cookie:NAME`,
    /// `query:NAME`, `body:PATH`.
    #[serde(default)]
    from: Vec<String>,
    /// The affinity cookie Sluice sets (sealed; see `[sticky]`).
    cookie: Option<String>,
    #[serde(default = "default_ttl")]
    ttl_secs: u64,
    /// Prefix affinity for requests no pin places.
    prefix: Option<RawPrefix>,
}

/// `sticky.prefix = { … }`.
#[derive(Debug, Deserialize)]
#[cfg_attr(test, derive(serde::Serialize))]
#[serde(deny_unknown_fields)]
pub(super) struct RawPrefix {
    /// How many bytes of the prompt's JSON text are hashed.
    #[serde(default = "default_prefix_bytes")]
    bytes: usize,
    /// No backend takes a prefix's request above this many times the average in flight.
    #[serde(default = "default_load_factor")]
    load_factor: f64,
}

fn default_prefix_bytes() -> usize {
    1_024
}

fn default_load_factor() -> f64 {
    1.25
}

/// The most prefix bytes that may be hashed (the largest body is 32 MiB; a prefix that long
/// would hash a whole conversation, which is what a session id is for).
const MAX_PREFIX_BYTES: usize = 1 << 20;
/// Keys in a `body:` path.
const MAX_PATH_KEYS: usize = 8;

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
    /// A value in the JSON body, at a dotted path of object keys; `slot` is its place in the
    /// snapshot's [`Wants::paths`] (set by [`body_wants`]).
    Body {
        path: Vec<String>,
        slot: usize,
    },
}

/// A route's sticky rule.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct StickyRule {
    pub(crate) sources: Vec<StickySource>,
    pub(crate) cookie: Option<String>,
    pub(crate) ttl_secs: u64,
    pub(crate) prefix: Option<PrefixAffinity>,
}

/// Prefix affinity: requests whose prompts share their first `bytes` go to one backend
/// (rendezvous hashing), unless it has more than `load_factor` × the average in flight.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct PrefixAffinity {
    pub(crate) bytes: usize,
    pub(crate) load_factor: f64,
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
            Some(("body", p)) => {
                let keys: Vec<String> = p.split('.').map(str::to_string).collect();
                if p.is_empty() || keys.iter().any(String::is_empty) || keys.len() > MAX_PATH_KEYS {
                    err(
                        format!("{path}.sticky.from[{i}]"),
                        format!(
                            "`{s}`: `body:` takes a dotted path of 1 to {MAX_PATH_KEYS} object \
                             keys, like `body:metadata.conversation_id`"
                        ),
                    );
                    continue;
                }
                Some(StickySource::Body {
                    path: keys,
                    slot: 0,
                })
            }
            _ => None,
        };
        match parsed {
            Some(p) => sources.push(p),
            None => err(
                format!("{path}.sticky.from[{i}]"),
                format!("`{s}` is not `header:NAME`, `cookie:NAME`, `query:NAME` or `body:PATH`"),
            ),
        }
    }
    let prefix = raw.prefix.as_ref().map(|p| {
        if p.bytes == 0 || p.bytes > MAX_PREFIX_BYTES {
            err(
                format!("{path}.sticky.prefix.bytes"),
                format!("must be from 1 to {MAX_PREFIX_BYTES}"),
            );
        }
        if !(1.0..=100.0).contains(&p.load_factor) {
            err(
                format!("{path}.sticky.prefix.load_factor"),
                "must be from 1 (no backend above the average) to 100".into(),
            );
        }
        PrefixAffinity {
            bytes: p.bytes.clamp(1, MAX_PREFIX_BYTES),
            load_factor: if p.load_factor.is_finite() {
                p.load_factor.clamp(1.0, 100.0)
            } else {
                1.0
            },
        }
    });
    if let Some(c) = &raw.cookie {
        if !valid_token(c) {
            err(
                format!("{path}.sticky.cookie"),
                format!("`{c}` is not a valid cookie name"),
            );
        }
    }
    if sources.is_empty() && raw.cookie.is_none() && prefix.is_none() {
        err(
            format!("{path}.sticky"),
            "needs `from` (where the session id is), `cookie` (an affinity cookie), `prefix` \
             (prefix affinity), or more than one"
                .into(),
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
        prefix,
    }
}

/// What inspection must read of bodies for these rules: each distinct `body:` path once (the
/// rules' sources get their slot), and the longest prefix any rule hashes.
pub(super) fn body_wants<'r>(rules: impl Iterator<Item = &'r mut StickyRule>) -> Wants {
    let mut wants = Wants::default();
    for rule in rules {
        if let Some(p) = rule.prefix {
            wants.prefix_bytes = wants.prefix_bytes.max(p.bytes);
        }
        for source in &mut rule.sources {
            if let StickySource::Body { path, slot } = source {
                *slot = match wants.paths.iter().position(|p| p == path) {
                    Some(i) => i,
                    None => {
                        wants.paths.push(path.clone());
                        wants.paths.len() - 1
                    }
                };
            }
        }
    }
    wants
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

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    fn route_with(sticky: &str) -> String {
        format!(
            "[clusters.c]\nbackends = [{{ base_url = \"http://127.0.0.1:9/v1\" }}]\n\
             [[routes]]\nmodel = \"m\"\ncluster = \"c\"\nsticky = {sticky}\n\
             [[routes]]\nmodel = \"n\"\ncluster = \"c\"\n\
             sticky = {{ from = [\"body:user\", \"body:metadata.conversation_id\"] }}\n"
        )
    }

    fn errors(sticky: &str) -> Vec<String> {
        match crate::config::load(&route_with(sticky), &|_| None) {
            Ok(_) => Vec::new(),
            Err(e) => e
                .iter()
                .map(|e| format!("{}: {}", e.path, e.message))
                .collect(),
        }
    }

    #[test]
    fn body_paths_and_prefixes_are_checked_with_their_key_path() {
        for bad in [
            "body:",
            "body:a..b",
            "body:.a",
            "body:a.",
            "body:1.2.3.4.5.6.7.8.9",
        ] {
            let e = errors(&format!("{{ from = [\"header:x\", \"{bad}\"] }}"));
            assert_eq!(e.len(), 1, "{bad}: {e:?}");
            assert!(
                e[0].starts_with("routes[0].sticky.from[1]: ") && e[0].contains("dotted path"),
                "{e:?}"
            );
        }
        let e = errors("{ from = [\"header:x\", \"form:x\"] }");
        assert_eq!(e.len(), 1, "{e:?}");
        assert!(e[0].contains("`body:PATH`"), "{e:?}");
        let e = errors("{ prefix = { bytes = 0, load_factor = 0.5 } }");
        assert_eq!(
            e,
            [
                "routes[0].sticky.prefix.bytes: must be from 1 to 1048576",
                "routes[0].sticky.prefix.load_factor: must be from 1 (no backend above the \
                 average) to 100"
            ]
        );
        assert_eq!(
            errors("{ prefix = { bytes = 16, lod_factor = 2.0 } }").len(),
            1
        );
        // Prefix affinity alone is a sticky rule; its defaults.
        assert_eq!(errors("{ prefix = {} }"), Vec::<String>::new());
    }

    #[test]
    fn each_body_path_is_read_once_whatever_routes_ask_it() {
        let s = crate::config::load(
            &route_with(
                "{ from = [\"header:x\", \"body:metadata.conversation_id\"], \
                 prefix = { bytes = 300 } }",
            ),
            &|_| None,
        )
        .unwrap();
        let paths: Vec<String> = s.body_wants.paths.iter().map(|p| p.join(".")).collect();
        assert_eq!(paths.len(), 2, "{paths:?}");
        assert_eq!(s.body_wants.prefix_bytes, 300);
        // Each rule's body source names the slot of its own path.
        for route in &s.routes {
            for source in &route.sticky.as_ref().unwrap().sources {
                if let StickySource::Body { path, slot } = source {
                    assert_eq!(&s.body_wants.paths[*slot], path);
                }
            }
        }
        let rule = s.routes.iter().find(|r| r.pattern.source() == "m").unwrap();
        assert_eq!(
            rule.sticky.as_ref().unwrap().prefix,
            Some(PrefixAffinity {
                bytes: 300,
                load_factor: 1.25
            })
        );
        // No route asks: nothing is read.
        let plain = "[clusters.c]\nbackends = [{ base_url = \"http://127.0.0.1:9/v1\" }]\n\
                     [[routes]]\nmodel = \"m\"\ncluster = \"c\"\n";
        let s = crate::config::load(plain, &|_| None).unwrap();
        assert_eq!(s.body_wants, Wants::default());
    }
}

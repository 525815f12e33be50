//! Sticky sessions: which session a request belongs to, and the sealed affinity cookie.
//!
//! Runs in the route phase, for a route with a `sticky` rule. [`session`] takes the rule, the
//! `[sticky]` keys, the request and its inspection; returns a [`Session`]: the session id's hash
//! (from the first of the rule's sources the request carries: a header, a cookie, a query
//! parameter or a value in the body, which inspection read), the backend the request's affinity
//! cookie names, if it has a valid one, and the hash of the prompt's first bytes for prefix
//! affinity. [`seal`] makes
//! the `Set-Cookie` line naming a backend. A cookie is `KID.HEX`: the key id, then the nonce,
//! the ChaCha20-Poly1305 ciphertext of (backend identity, expiry) and its tag, with the cookie's
//! name as associated data — it can be neither read nor forged, nor moved to another cookie
//! name. A cookie that does not open (tampered, another key, expired, malformed) is ignored,
//! never an error. Raises nothing.

use ring::aead::{Aad, Nonce, NONCE_LEN};

use crate::config::limits::decode_hex;
use crate::config::sticky::{StickyKeys, StickyRule, StickySource};
use crate::gateway::context::Request;
use crate::openai::inspect::Inspection;
use crate::upstream::health::{fnv1a_extend, identity_hash};

/// What a request says of its session.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct Session {
    /// The session id's hash, bound to the route (the same id sent to two sticky routes is two
    /// sessions, each pinned in its own route).
    pub(crate) id: Option<u64>,
    /// The backend identity a valid affinity cookie names, and until when (unix seconds).
    pub(crate) cookie_backend: Option<(u64, u64)>,
    /// The hash of the prompt's first `prefix.bytes` bytes, when the rule has prefix affinity
    /// and the body a prompt.
    pub(crate) prefix: Option<u64>,
}

/// Read the request's session under `rule`, the sticky rule of the route `route` (its model
/// pattern); `now` in unix seconds.
pub(crate) fn session(
    rule: &StickyRule,
    route: &str,
    keys: &StickyKeys,
    request: &Request<'_>,
    inspection: &Inspection,
    now: u64,
) -> Session {
    let id = rule
        .sources
        .iter()
        .find_map(|source| source_value(source, request, inspection))
        .map(|value| session_hash(route, value));
    let cookie_backend = rule.cookie.as_deref().and_then(|name| {
        let value = cookie(request, name)?;
        open(keys, &aad(name, route), value, now)
    });
    let prefix = rule.prefix.and_then(|p| {
        let (start, end) = inspection.prompt_prefix?;
        let prompt = request
            .body
            .get(start..end.min(start.saturating_add(p.bytes)))?;
        Some(prefix_hash(prompt))
    });
    Session {
        id,
        cookie_backend,
        prefix,
    }
}

/// A fast hash of a prompt's first bytes, eight at a time (FNV's byte loop would cost a
/// microsecond per kilobyte); only the same bytes need to give the same hash.
pub(crate) fn prefix_hash(bytes: &[u8]) -> u64 {
    const K: u64 = 0x9e37_79b9_7f4a_7c15;
    let mut chunks = bytes.chunks_exact(8);
    let mut h = (bytes.len() as u64).wrapping_mul(K);
    for chunk in chunks.by_ref() {
        let mut word = [0u8; 8];
        word.copy_from_slice(chunk);
        h = (h ^ u64::from_le_bytes(word))
            .wrapping_mul(K)
            .rotate_left(29);
    }
    fnv1a_extend(h, chunks.remainder())
}

/// A session id's hash within a route.
fn session_hash(route: &str, id: &str) -> u64 {
    // 0xff never occurs in UTF-8: it separates the route from the id.
    fnv1a_extend(fnv1a_extend(identity_hash(route), &[0xff]), id.as_bytes())
}

/// What a cookie is bound to: its name and its route (a cookie is not good for another).
pub(crate) fn aad(name: &str, route: &str) -> String {
    format!("{name}\n{route}")
}

fn source_value<'a>(
    source: &StickySource,
    request: &Request<'a>,
    inspection: &'a Inspection,
) -> Option<&'a str> {
    let value = match source {
        StickySource::Header(name) => header(request, name),
        StickySource::Cookie(name) => cookie(request, name),
        StickySource::Query(name) => query(request, name),
        StickySource::Body { slot, .. } => inspection.body_ids.get(*slot),
    }?;
    (!value.is_empty()).then_some(value)
}

/// A request header's value (the first of its name), trimmed; `None` when absent or not UTF-8.
pub(crate) fn header<'r>(request: &Request<'r>, name: &str) -> Option<&'r str> {
    let buf = request.buf;
    request
        .head
        .headers
        .iter()
        .find(|h| h.name(buf).eq_ignore_ascii_case(name.as_bytes()))
        .and_then(|h| std::str::from_utf8(h.value(buf)).ok())
        .map(str::trim)
}

/// A cookie's value, from every `Cookie` header (`a=b; c=d`).
fn cookie<'r>(request: &Request<'r>, name: &str) -> Option<&'r str> {
    let buf = request.buf;
    request
        .head
        .headers
        .iter()
        .filter(|h| h.name(buf).eq_ignore_ascii_case(b"cookie"))
        .filter_map(|h| std::str::from_utf8(h.value(buf)).ok())
        .flat_map(|v| v.split(';'))
        .filter_map(|pair| pair.trim().split_once('='))
        .find(|(k, _)| *k == name)
        .map(|(_, v)| v.trim().trim_matches('"'))
}

fn query<'r>(request: &Request<'r>, name: &str) -> Option<&'r str> {
    let target = std::str::from_utf8(request.head.target(request.buf)).ok()?;
    let (_, query) = target.split_once('?')?;
    query
        .split('&')
        .filter_map(|pair| pair.split_once('='))
        .find(|(k, _)| *k == name)
        .map(|(_, v)| v)
}

/// The plaintext: the backend identity and the expiry, little-endian.
const PLAIN_LEN: usize = 16;

/// The `Set-Cookie` header line naming `backend` for `ttl_secs`, sealed with the first key and
/// bound to `aad` (see [`aad`]), `Secure` when `secure` (the client came over TLS); `None`
/// without a key or a random nonce.
pub(crate) fn seal(
    keys: &StickyKeys,
    name: &str,
    aad: &str,
    backend: u64,
    ttl_secs: u64,
    now: u64,
    secure: bool,
) -> Option<String> {
    use ring::rand::SecureRandom as _;
    let (kid, key) = keys.keys.first()?;
    let mut nonce = [0u8; NONCE_LEN];
    ring::rand::SystemRandom::new().fill(&mut nonce).ok()?;
    let mut data = Vec::with_capacity(PLAIN_LEN + 16);
    data.extend_from_slice(&backend.to_le_bytes());
    data.extend_from_slice(&(now + ttl_secs).to_le_bytes());
    key.seal_in_place_append_tag(
        Nonce::assume_unique_for_key(nonce),
        Aad::from(aad.as_bytes()),
        &mut data,
    )
    .ok()?;
    use std::fmt::Write as _;
    let mut line = String::with_capacity(160);
    let _ = write!(line, "set-cookie: {name}={kid}.");
    for b in nonce.iter().chain(&data) {
        let _ = write!(line, "{b:02x}");
    }
    let _ = write!(line, "; Path=/; Max-Age={ttl_secs}; HttpOnly; SameSite=Lax");
    if secure {
        line.push_str("; Secure");
    }
    line.push_str("\r\n");
    Some(line)
}

/// The backend identity a cookie value names and its expiry, if it opens with one of `keys`
/// under `aad` and has not expired at `now`.
fn open(keys: &StickyKeys, aad: &str, value: &str, now: u64) -> Option<(u64, u64)> {
    let (kid, sealed) = value.split_once('.')?;
    let kid: u32 = kid.parse().ok()?;
    let (_, key) = keys.keys.iter().find(|(id, _)| *id == kid)?;
    if sealed.len() != 2 * (NONCE_LEN + PLAIN_LEN + key.algorithm().tag_len()) {
        return None;
    }
    let mut bytes = decode_hex(sealed)?;
    let nonce = Nonce::try_assume_unique_for_key(&bytes[..NONCE_LEN]).ok()?;
    let plain = key
        .open_in_place(nonce, Aad::from(aad.as_bytes()), &mut bytes[NONCE_LEN..])
        .ok()?;
    let backend = u64::from_le_bytes(plain[..8].try_into().ok()?);
    let until = u64::from_le_bytes(plain[8..16].try_into().ok()?);
    (until > now).then_some((backend, until))
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use std::sync::Arc;

    fn keys(pairs: &[(u32, u8)]) -> StickyKeys {
        StickyKeys {
            keys: pairs
                .iter()
                .map(|&(id, fill)| {
                    let key =
                        ring::aead::UnboundKey::new(&ring::aead::CHACHA20_POLY1305, &[fill; 32])
                            .unwrap();
                    (id, Arc::new(ring::aead::LessSafeKey::new(key)))
                })
                .collect(),
        }
    }

    fn value(line: &str) -> &str {
        let v = line.strip_prefix("set-cookie: aff=").unwrap();
        v.split(';').next().unwrap()
    }

    #[test]
    fn a_sealed_cookie_opens_until_it_expires_and_only_unaltered() {
        let k = keys(&[(2, 7), (1, 9)]);
        let line = seal(&k, "aff", "aff", 0xdead_beef, 60, 1_000, false).unwrap();
        assert!(
            line.ends_with("; Path=/; Max-Age=60; HttpOnly; SameSite=Lax\r\n"),
            "{line}"
        );
        let secure = seal(&k, "aff", "aff", 0xdead_beef, 60, 1_000, true).unwrap();
        assert!(
            secure.ends_with("; HttpOnly; SameSite=Lax; Secure\r\n"),
            "{secure}"
        );
        let v = value(&line);
        assert!(v.starts_with("2."), "sealed with the first key: {v}");
        assert_eq!(open(&k, "aff", v, 1_000), Some((0xdead_beef, 1_060)));
        assert_eq!(open(&k, "aff", v, 1_060), None, "expired");
        // Any altered byte, another name, an unknown key id, garbage: ignored.
        let mut altered = v.as_bytes().to_vec();
        let last = altered.len() - 1;
        altered[last] = if altered[last] == b'0' { b'1' } else { b'0' };
        assert_eq!(
            open(&k, "aff", std::str::from_utf8(&altered).unwrap(), 1_000),
            None
        );
        assert_eq!(open(&k, "other", v, 1_000), None);
        assert_eq!(open(&k, "aff", &v.replacen("2.", "3.", 1), 1_000), None);
        assert_eq!(open(&k, "aff", "2.zz", 1_000), None);
        assert_eq!(open(&k, "aff", "", 1_000), None);
        // Rotation: a cookie sealed with the old key (now second) still opens.
        let old = keys(&[(1, 9)]);
        let old_line = seal(&old, "aff", "aff", 5, 60, 1_000, false).unwrap();
        assert_eq!(open(&k, "aff", value(&old_line), 1_000), Some((5, 1_060)));
        // Bound to what it was sealed for: not good for another route's cookie.
        assert_eq!(open(&k, "aff\nother-route", value(&old_line), 1_000), None);
        // Two seals of the same backend differ (a fresh nonce each).
        assert_ne!(
            seal(&k, "aff", "aff", 5, 60, 1_000, false),
            seal(&k, "aff", "aff", 5, 60, 1_000, false)
        );
    }
}

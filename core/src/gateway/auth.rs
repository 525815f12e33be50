//! Authenticate and authorize: which API key is calling, and may it use this model from here.
//!
//! [`authenticate`] runs first for every OpenAI endpoint (before the body is parsed, so a
//! caller without a valid key costs no JSON work). It takes the request head; returns the key's
//! index, or `None` when no `[[keys]]` are configured (an open gateway). It raises 400 when the
//! request carries two different keys (`Authorization: Bearer …` and `x-api-key`, or either one
//! twice), and 401 `invalid_api_key` for a key that is unknown, disabled or expired — the same
//! body for all three, and the same work: the key's SHA-256 is compared in constant time with a
//! stored digest (a decoy when nothing matched), and the enabled / expiry checks run either way.
//! A missing key gets 401 `missing_api_key`.
//!
//! [`authorize`] runs after inspection (it needs the model). It raises 403 `source_not_allowed`
//! when the peer address is outside the key's subnets and 403 `model_not_allowed` when the model
//! is outside the key's allow list or inside its block list (block wins).

use std::net::IpAddr;

use zeroize::Zeroize;

use crate::config::limits::{ApiKey, KeyIdx, LimitsConfig};
use crate::gateway::context::Request;
use crate::gateway::error::{ErrorKind, GatewayError};
use crate::http::Name;
use crate::openai::json::truncate;

pub(crate) use crate::config::limits::digest;

use crate::config::limits::constant_time_eq;

/// The headers a key is presented in (which the forward phase also withholds from upstreams).
pub(crate) const AUTHORIZATION: Name = Name::new(b"authorization");
pub(crate) const X_API_KEY: Name = Name::new(b"x-api-key");
const BEARER: Name = Name::new(b"bearer ");

/// The key the request presents, if any: the `Bearer` token of `Authorization`, or `x-api-key`.
fn presented_key<'a>(request: &Request<'a>) -> Result<Option<&'a [u8]>, GatewayError> {
    let mut found: Option<&'a [u8]> = None;
    for h in &request.head.headers {
        let name = h.name(request.buf);
        let value = h.value(request.buf);
        let key = if AUTHORIZATION.matches(name) {
            match value.get(..7) {
                Some(scheme) if BEARER.matches(scheme) => trim(&value[7..]),
                // Another scheme (Basic, …) carries no API key for us.
                _ => continue,
            }
        } else if X_API_KEY.matches(name) {
            trim(value)
        } else {
            continue;
        };
        match found {
            Some(prev) if prev != key => {
                return Err(GatewayError::invalid_request(
                    "The request carries two different API keys (Authorization and x-api-key, \
                     or one of them twice); send exactly one.",
                    None,
                ))
            }
            _ => found = Some(key),
        }
    }
    Ok(found.filter(|k| !k.is_empty()))
}

fn trim(v: &[u8]) -> &[u8] {
    let start = v
        .iter()
        .position(|b| !b.is_ascii_whitespace())
        .unwrap_or(v.len());
    let end = v
        .iter()
        .rposition(|b| !b.is_ascii_whitespace())
        .map_or(start, |e| e + 1);
    &v[start..end.max(start)]
}

fn invalid_key(kind: ErrorKind) -> GatewayError {
    GatewayError::new(
        kind,
        "Incorrect API key provided. Ask the operator of this gateway for a valid key.",
    )
}

/// Who is calling: the key presented, looked up once and handed to every later phase.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Principal<'s> {
    /// The key's index in the config (what the limiter's budgets are keyed by).
    pub(crate) index: KeyIdx,
    pub(crate) key: &'s ApiKey,
}

/// The SHA-256 of the key a connection presented last, kept with the key's bytes so that the
/// connection's next request with the same key (an SDK sends its key on every request of a
/// kept-alive connection) is not hashed again: ~2,400 instructions a request under callgrind,
/// which runs SHA-256 in AVX code, ~0.1 µs where the processor has SHA instructions.
///
/// It holds a fact about bytes, not a decision: the digest is looked up, compared and the key's
/// state checked on every request, against the request's own config, so a reload or an expiry
/// needs nothing here. The key is compared in constant time, as a digest is: on a connection
/// shared by several clients (a proxy in front pooling its connections) a mismatch's timing
/// says nothing of how much of the last key it matched.
///
/// The key's bytes are wiped, not just let go, when another key takes their place and when the
/// connection ends: freed memory that still held a key could be read back by a later bug (a
/// buffer read past its end, a core dump).
#[derive(Default)]
pub(crate) struct KeyDigestMemo {
    /// The key last presented (empty: none yet, or longer than [`Self::MAX_KEY`]).
    key: Vec<u8>,
    digest: [u8; 32],
}

impl Drop for KeyDigestMemo {
    fn drop(&mut self) {
        self.key.zeroize();
    }
}

impl KeyDigestMemo {
    /// Longest key remembered: real keys are ~40–170 bytes; a longer one is hashed each time
    /// rather than held.
    const MAX_KEY: usize = 256;

    /// The SHA-256 of `key`, from the memo when it is the key last presented.
    pub(crate) fn digest(&mut self, key: &[u8]) -> [u8; 32] {
        if !self.key.is_empty() && constant_time_eq(&self.key, key) {
            return self.digest;
        }
        let presented = digest(key);
        // All of the buffer, its spare capacity too (a longer key may have been there), then
        // emptied.
        self.key.zeroize();
        if key.len() <= Self::MAX_KEY {
            self.key.extend_from_slice(key);
            self.digest = presented;
        }
        presented
    }
}

/// Who is calling. `Ok(None)`: no keys are configured, so nobody is asked. `memo`: the
/// connection's last key and its digest (`None` hashes afresh).
pub(crate) fn authenticate<'s>(
    limits: &'s LimitsConfig,
    request: &Request<'_>,
    memo: Option<&mut KeyDigestMemo>,
) -> Result<Option<Principal<'s>>, GatewayError> {
    if !limits.auth_required() {
        return Ok(None);
    }
    let Some(key) = presented_key(request)? else {
        return Err(GatewayError::new(
            ErrorKind::MissingApiKey,
            "You didn't provide an API key. Send it as `Authorization: Bearer YOUR_KEY` or \
             `x-api-key: YOUR_KEY`.",
        ));
    };
    let presented = match memo {
        Some(memo) => memo.digest(key),
        None => digest(key),
    };
    // The map finds a candidate; the decision is the constant-time comparison, which runs
    // whether or not a candidate was found.
    const DECOY: [u8; 32] = [0x5a; 32];
    let candidate = limits.by_digest.get(&presented).copied();
    let stored = candidate
        .and_then(|i| limits.keys.get(i))
        .map_or(&DECOY, |k| &k.digest);
    let matches = constant_time_eq(&presented, stored);
    let now = crate::sys::time::unix_secs();
    let (enabled, unexpired) = candidate
        .and_then(|i| limits.keys.get(i))
        .map_or((false, false), |k| {
            (k.enabled, k.expires.is_none_or(|e| now < e))
        });
    match candidate.and_then(|i| Some((i, limits.keys.get(i)?))) {
        Some((index, key)) if matches & enabled & unexpired => Ok(Some(Principal { index, key })),
        // One answer for all three; the kind tells the access log which it was.
        Some(_) if matches && !enabled => Err(invalid_key(ErrorKind::DisabledApiKey)),
        Some(_) if matches => Err(invalid_key(ErrorKind::ExpiredApiKey)),
        _ => Err(invalid_key(ErrorKind::InvalidApiKey)),
    }
}

/// May this key use `model` from `peer`?
pub(crate) fn authorize(
    principal: Option<Principal<'_>>,
    model: &str,
    peer: Option<IpAddr>,
) -> Result<(), GatewayError> {
    let Some(Principal { key, .. }) = principal else {
        return Ok(());
    };
    if !key.source_allowed(peer) {
        return Err(GatewayError::new(
            ErrorKind::SourceNotAllowed,
            "This API key may not be used from your network address.",
        ));
    }
    if !key.may_use(model) {
        return Err(GatewayError::new(
            ErrorKind::ModelNotAllowed,
            format!(
                "This API key is not allowed to use the model `{}`.",
                truncate(model, 128)
            ),
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use crate::config::limits::hex;

    #[test]
    fn sha256_matches_the_standard_vector() {
        assert_eq!(
            hex(&digest(b"abc")),
            "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
        );
    }

    #[test]
    fn comparison() {
        let a = digest(b"one");
        let mut b = a;
        assert!(constant_time_eq(&a, &b));
        b[31] ^= 1;
        assert!(!constant_time_eq(&a, &b));
    }

    #[test]
    fn comparison_of_unequal_lengths() {
        assert!(!constant_time_eq(b"sk-1", b"sk-12"));
        assert!(!constant_time_eq(b"", b"x"));
        assert!(constant_time_eq(b"", b""));
    }

    #[test]
    fn the_memo_gives_each_keys_own_digest() {
        let mut memo = KeyDigestMemo::default();
        // Hashed, remembered, recalled; then a key one byte apart, or a prefix, is not taken
        // for the last one.
        assert_eq!(memo.digest(b"sk-one"), digest(b"sk-one"));
        assert_eq!(memo.digest(b"sk-one"), digest(b"sk-one"));
        assert_eq!(memo.digest(b"sk-onf"), digest(b"sk-onf"));
        assert_eq!(memo.digest(b"sk-on"), digest(b"sk-on"));
        assert_eq!(memo.digest(b"sk-one"), digest(b"sk-one"));
        // A key too long to hold is hashed each time, and forgets the one before.
        let long = vec![b'k'; KeyDigestMemo::MAX_KEY + 1];
        assert_eq!(memo.digest(&long), digest(&long));
        assert!(memo.key.is_empty());
        assert_eq!(memo.digest(&long), digest(&long));
        assert_eq!(memo.digest(b"sk-one"), digest(b"sk-one"));
        assert_eq!(memo.key, b"sk-one");
    }

    /// The bytes of the key held in the memo's buffer, up to its capacity: what a later reader
    /// of the memory would find.
    fn held_bytes(memo: &KeyDigestMemo) -> Vec<u8> {
        let (ptr, cap) = (memo.key.as_ptr(), memo.key.capacity());
        // SAFETY: every byte up to the capacity was written, by a key or by the wipe that
        // preceded it (the test's first key fills the buffer it allocates).
        (0..cap).map(|i| unsafe { *ptr.add(i) }).collect()
    }

    #[test]
    fn a_replaced_key_leaves_nothing_of_itself_in_the_memo() {
        let mut memo = KeyDigestMemo::default();
        let first = b"sk-proj-the-first-key-of-forty-bytes-abc";
        memo.key.reserve_exact(first.len());
        memo.digest(first);
        assert_eq!(memo.key.capacity(), first.len());
        // A shorter key in its place: past its end, zeros, not the first key's tail.
        memo.digest(b"sk-short");
        let held = held_bytes(&memo);
        assert_eq!(&held[..8], b"sk-short");
        assert!(held[8..].iter().all(|&b| b == 0), "{held:?}");
        // A key too long to hold: the buffer is emptied and wiped.
        memo.digest(&[b'k'; KeyDigestMemo::MAX_KEY + 1]);
        assert!(memo.key.is_empty());
        assert!(held_bytes(&memo).iter().all(|&b| b == 0));
    }

    #[test]
    fn trims() {
        assert_eq!(trim(b"  sk-1 \t"), b"sk-1");
        assert_eq!(trim(b"   "), b"");
    }
}

//! Which of an upstream's response headers reach the client.
//!
//! A provider's answer carries headers about the provider's account and site, not about the
//! gateway's client: `openai-organization`, the account's `x-ratelimit-*` (next to the
//! gateway's own, for the client's key), `set-cookie` for the provider's domain,
//! `strict-transport-security` and `alt-svc` for the provider's host. A [`HeaderPass`] is the
//! list of names (and `prefix-*` patterns) that do reach the client; the relay drops the rest.
//! Framing and hop-by-hop headers are the relay's own business and never reach this list, and
//! `x-sluice-*` never passes: those names are Sluice's to write.

/// The names that pass when a cluster says nothing (`pass_response_headers`): what describes
/// the answer itself (type, encoding, caching), what a client's SDK reads to retry or to quote
/// to support (`retry-after`, `retry-after-ms`, `x-should-retry`, `x-request-id`,
/// `request-id`), and OpenAI's processing time and API version.
pub(crate) const DEFAULT_PASS: &[&str] = &[
    "content-type",
    "content-encoding",
    "content-language",
    "content-disposition",
    "cache-control",
    "expires",
    "etag",
    "last-modified",
    "vary",
    "date",
    "retry-after",
    "retry-after-ms",
    "x-should-retry",
    "x-request-id",
    "request-id",
    "openai-processing-ms",
    "openai-version",
];

/// The most entries a list may have.
pub(crate) const MAX_ENTRIES: usize = 128;

/// Names longer than this are matched by prefixes (or `*`) only.
const MAX_NAME: usize = 63;

/// The response headers a client may see from one cluster's backends.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct HeaderPass {
    /// `*`: every header passes (but `x-sluice-*`).
    all: bool,
    /// Lower-case names that pass whole, shortest first.
    names: Vec<Box<[u8]>>,
    /// Where the names of each length start in `names` (`names[by_len[n]..by_len[n + 1]]`
    /// are `n` bytes long), so a header is compared only with names of its own length.
    by_len: [u8; MAX_NAME + 2],
    /// Lower-case prefixes (`x-ratelimit-` of `x-ratelimit-*`) whose names pass.
    prefixes: Vec<Box<[u8]>>,
}

impl Default for HeaderPass {
    fn default() -> Self {
        HeaderPass::of(
            false,
            DEFAULT_PASS.iter().map(|n| n.as_bytes().into()).collect(),
            Vec::new(),
        )
    }
}

impl HeaderPass {
    /// A list from a config: header names, `prefix-*` patterns, `default` for the names of
    /// [`DEFAULT_PASS`], or `*` alone for every header. Names are compared without regard to
    /// case. The error says what is wrong with an entry.
    pub(crate) fn from_entries(entries: &[String]) -> Result<HeaderPass, String> {
        if entries.len() > MAX_ENTRIES {
            return Err(format!("at most {MAX_ENTRIES} entries"));
        }
        let (mut all, mut names, mut prefixes) = (false, Vec::new(), Vec::new());
        for entry in entries {
            let lower = entry.to_ascii_lowercase();
            if lower == "*" {
                all = true;
                continue;
            }
            if lower == "default" {
                names.extend(DEFAULT_PASS.iter().map(|n| n.as_bytes().into()));
                continue;
            }
            let (stem, prefix) = match lower.strip_suffix('*') {
                Some(stem) => (stem, true),
                None => (lower.as_str(), false),
            };
            if stem.is_empty() || stem.contains('*') || !stem.bytes().all(is_tchar) {
                return Err(format!(
                    "{entry:?} is not a header name, a `prefix-*` pattern or `*`"
                ));
            }
            if prefix {
                prefixes.push(stem.as_bytes().into());
            } else if stem.len() > MAX_NAME {
                return Err(format!("{entry:?}: a name is at most {MAX_NAME} bytes"));
            } else {
                names.push(stem.as_bytes().into());
            }
        }
        if all && (!names.is_empty() || !prefixes.is_empty()) {
            return Err("`*` passes every header: list nothing beside it".into());
        }
        Ok(HeaderPass::of(all, names, prefixes))
    }

    /// The list, its names indexed by length (each at most [`MAX_NAME`] bytes).
    fn of(all: bool, mut names: Vec<Box<[u8]>>, prefixes: Vec<Box<[u8]>>) -> HeaderPass {
        // By length, and within one length by bytes, so repeats sit together.
        names.sort();
        names.sort_by_key(|n| n.len());
        names.dedup();
        // MAX_ENTRIES, plus the default list, fits the index's bytes.
        names.truncate(usize::from(u8::MAX));
        let mut by_len = [0u8; MAX_NAME + 2];
        for (len, start) in by_len.iter_mut().enumerate() {
            *start = names.partition_point(|n| n.len() < len) as u8;
        }
        HeaderPass {
            all,
            names,
            by_len,
            prefixes,
        }
    }

    /// Whether a response header named `name` reaches the client.
    #[inline]
    pub(crate) fn passes(&self, name: &[u8]) -> bool {
        if name.first().is_some_and(|b| b | 0x20 == b'x')
            && starts_with_ignore_case(name, b"x-sluice-")
        {
            return false;
        }
        if self.all {
            return true;
        }
        let len = name.len();
        let same_length = match (self.by_len.get(len), self.by_len.get(len + 1)) {
            (Some(&from), Some(&to)) => self.names.get(usize::from(from)..usize::from(to)),
            _ => None,
        };
        same_length
            .unwrap_or_default()
            .iter()
            .any(|n| n.eq_ignore_ascii_case(name))
            || self
                .prefixes
                .iter()
                .any(|p| starts_with_ignore_case(name, p))
    }
}

/// A byte of a header name (RFC 9110 §5.6.2 `tchar`).
fn is_tchar(b: u8) -> bool {
    b.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(&b)
}

/// `name` starts with the lower-case `prefix`, in any case.
#[inline]
pub(crate) fn starts_with_ignore_case(name: &[u8], prefix: &[u8]) -> bool {
    name.get(..prefix.len())
        .is_some_and(|head| head.eq_ignore_ascii_case(prefix))
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn the_default_passes_the_answer_and_drops_the_account() {
        let pass = HeaderPass::default();
        for kept in [
            "Content-Type",
            "x-request-id",
            "Retry-After",
            "request-id",
            "vary",
        ] {
            assert!(pass.passes(kept.as_bytes()), "{kept}");
        }
        for dropped in [
            "set-cookie",
            "openai-organization",
            "x-ratelimit-remaining-requests",
            "anthropic-ratelimit-tokens-limit",
            "strict-transport-security",
            "alt-svc",
            "server",
            "cf-ray",
            "x-sluice-overhead-us",
            "content-typex",
        ] {
            assert!(!pass.passes(dropped.as_bytes()), "{dropped}");
        }
    }

    #[test]
    fn lists_prefixes_and_everything() {
        let pass = HeaderPass::from_entries(&["X-Ratelimit-*".into(), "server".into()]).unwrap();
        assert!(pass.passes(b"x-ratelimit-limit-tokens"));
        assert!(pass.passes(b"Server"));
        assert!(!pass.passes(b"x-ratelimi"));
        assert!(!pass.passes(b"content-type"));
        let all = HeaderPass::from_entries(&["*".into()]).unwrap();
        assert!(all.passes(b"set-cookie"));
        assert!(
            !all.passes(b"X-Sluice-Overhead-Us"),
            "Sluice's own names never pass"
        );
        assert!(!HeaderPass::from_entries(&[])
            .unwrap()
            .passes(b"content-type"));
        let more = HeaderPass::from_entries(&["default".into(), "x-mock-*".into()]).unwrap();
        assert!(more.passes(b"content-type") && more.passes(b"x-mock-model"));
        assert!(!more.passes(b"set-cookie"));
    }

    #[test]
    fn bad_entries_are_refused() {
        for bad in ["", "*x", "a b", "x:y", "é"] {
            assert!(HeaderPass::from_entries(&[bad.into()]).is_err(), "{bad:?}");
        }
        assert!(HeaderPass::from_entries(&["*".into(), "date".into()]).is_err());
        let many: Vec<String> = (0..=MAX_ENTRIES).map(|i| format!("x-{i}")).collect();
        assert!(HeaderPass::from_entries(&many).is_err());
        let repeated = vec!["default".to_string(); MAX_ENTRIES];
        assert_eq!(
            HeaderPass::from_entries(&repeated).unwrap(),
            HeaderPass::default()
        );
        assert!(HeaderPass::from_entries(&["a".repeat(MAX_NAME + 1)]).is_err());
        // Every length indexed, names of one length all found.
        let names: Vec<String> = (1..=MAX_NAME)
            .map(|n| "a".repeat(n))
            .chain(["b".into(), "ab".into()])
            .collect();
        let pass = HeaderPass::from_entries(&names).unwrap();
        for n in &names {
            assert!(pass.passes(n.to_uppercase().as_bytes()), "{n}");
        }
        assert!(!pass.passes(b"c") && !pass.passes(b"ba"));
        assert!(!pass.passes("a".repeat(MAX_NAME + 1).as_bytes()));
    }
}

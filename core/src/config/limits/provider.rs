//! `provider_limits`: a provider's own limits on a cluster or one of its credentials.

use serde::Deserialize;

use super::resolve::{rate, DEFAULT_WINDOW_SECS};
use super::snapshot::RateLimit;

/// `provider_limits` of a cluster or of one of its credentials: the provider's own limits.
#[derive(Debug, Deserialize)]
#[cfg_attr(test, derive(serde::Serialize))]
#[serde(deny_unknown_fields)]
pub(crate) struct RawProviderLimits {
    max_requests: Option<u64>,
    max_tokens: Option<u64>,
    max_concurrent: Option<u64>,
    window_secs: Option<u64>,
}

/// A provider's own limits on a cluster or one credential, shared across nodes through the
/// limits ledger like a policy's (same leases, same sliding windows).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct ProviderLimits {
    /// The budgets' name in the ledger: `<cluster>` or `<cluster>/<credential env>`.
    pub(crate) name: String,
    pub(crate) requests: Option<RateLimit>,
    pub(crate) tokens: Option<RateLimit>,
    pub(crate) concurrency: Option<u64>,
}

/// Resolve a `provider_limits` table at `path`, named `name` in the ledger.
pub(crate) fn resolve_provider_limits(
    raw: &RawProviderLimits,
    name: String,
    path: &str,
    err: &mut dyn FnMut(String, String),
) -> Option<ProviderLimits> {
    if raw.window_secs.is_some() && raw.max_requests.is_none() && raw.max_tokens.is_none() {
        err(
            format!("{path}.window_secs"),
            "needs max_requests or max_tokens".into(),
        );
    }
    let window = raw.window_secs.or(Some(DEFAULT_WINDOW_SECS));
    let mut any = |max: Option<u64>, what: &str| {
        max.and_then(|m| rate(Some(m), window, None, path, what, err))
    };
    let requests = any(raw.max_requests, "requests");
    let tokens = any(raw.max_tokens, "tokens");
    if raw.max_concurrent == Some(0) {
        err(
            format!("{path}.max_concurrent"),
            "must be at least 1".into(),
        );
    }
    if requests.is_none() && tokens.is_none() && raw.max_concurrent.is_none() {
        err(
            path.to_string(),
            "set at least one of max_requests, max_tokens, max_concurrent".into(),
        );
        return None;
    }
    Some(ProviderLimits {
        name,
        requests,
        tokens,
        concurrency: raw.max_concurrent.filter(|&c| c > 0),
    })
}

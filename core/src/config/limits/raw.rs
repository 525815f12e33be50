//! The raw `[[keys]]`, `[[plans]]`, `[[policies]]` and `[limits]` sections, as serde reads them.

use serde::Deserialize;

#[derive(Debug, Deserialize)]
#[cfg_attr(test, derive(serde::Serialize))]
#[serde(deny_unknown_fields)]
pub(crate) struct RawKey {
    pub(super) id: String,
    /// Hex SHA-256 of the key (`sluice key hash`); the plaintext is never in the config.
    pub(super) sha256: String,
    pub(super) entity: Option<String>,
    #[serde(default)]
    pub(super) tags: Vec<String>,
    #[serde(default = "yes")]
    pub(super) enabled: bool,
    pub(super) expires: Option<toml::value::Datetime>,
    #[serde(default)]
    pub(super) models_allow: Vec<String>,
    #[serde(default)]
    pub(super) models_block: Vec<String>,
    #[serde(default)]
    pub(super) source_subnets: Vec<String>,
    #[serde(default)]
    pub(super) plans: Vec<RawPlan>,
    /// The priority class of this key's requests (`[saturation]`).
    pub(super) class: Option<String>,
    /// This key's weight in its class's fair share (`[saturation]`).
    #[serde(default = "one")]
    pub(super) queue_weight: u32,
}

fn one() -> u32 {
    1
}

fn yes() -> bool {
    true
}

#[derive(Debug, Deserialize)]
#[cfg_attr(test, derive(serde::Serialize))]
#[serde(deny_unknown_fields)]
pub(crate) struct RawPlan {
    pub(super) id: String,
    /// Tokens per period (or in all, for a one-time plan); absent = unlimited.
    pub(super) tokens: Option<u64>,
    /// `"once"`, `"monthly"` or `"<N>d"` (every N days).
    #[serde(default = "once")]
    pub(super) period: String,
    /// Where periods start counting from (default 1970-01-01T00:00:00Z).
    pub(super) anchor: Option<toml::value::Datetime>,
    pub(super) expires: Option<toml::value::Datetime>,
    /// Lower is tried first.
    #[serde(default)]
    pub(super) priority: i64,
}

fn once() -> String {
    "once".into()
}

#[derive(Debug, Deserialize)]
#[cfg_attr(test, derive(serde::Serialize))]
#[serde(deny_unknown_fields)]
pub(crate) struct RawPolicy {
    pub(super) id: String,
    #[serde(default = "yes")]
    pub(super) enabled: bool,
    /// Which requests it applies to; every list given must match (empty lists match all).
    #[serde(default)]
    pub(super) keys: Vec<String>,
    #[serde(default)]
    pub(super) entities: Vec<String>,
    #[serde(default)]
    pub(super) tags: Vec<String>,
    #[serde(default)]
    pub(super) models: Vec<String>,
    /// Who gets their own counter: `"global"` (one for all matching requests), `"key"`,
    /// `"entity"` or `"model"`.
    #[serde(default = "global")]
    pub(super) per: String,
    pub(super) max_requests: Option<u64>,
    pub(super) requests_window_secs: Option<u64>,
    pub(super) requests_burst: Option<u64>,
    pub(super) max_tokens: Option<u64>,
    pub(super) tokens_window_secs: Option<u64>,
    pub(super) tokens_burst: Option<u64>,
    pub(super) max_concurrency: Option<u64>,
    pub(super) reserve: Option<RawReserve>,
    /// `"refuse"` (429 at once) or `"queue"` (wait for room, up to `max_queue_wait_ms`).
    #[serde(default = "refuse")]
    pub(super) on_limit: String,
    #[serde(default = "default_queue_wait")]
    pub(super) max_queue_wait_ms: u64,
}

fn refuse() -> String {
    "refuse".into()
}

fn default_queue_wait() -> u64 {
    10_000
}

fn global() -> String {
    "global".into()
}

#[derive(Debug, Deserialize, Clone, Copy)]
#[cfg_attr(test, derive(serde::Serialize))]
#[serde(deny_unknown_fields)]
pub(crate) struct RawReserve {
    pub(super) coefficient: Option<f64>,
    pub(super) offset: Option<u64>,
    pub(super) max_tokens_cap: Option<u64>,
}

#[derive(Debug, Deserialize)]
#[cfg_attr(test, derive(serde::Serialize))]
#[serde(deny_unknown_fields, default)]
pub(crate) struct RawLimits {
    /// `"local"` (in-process: the workers of one node share limits) or `"redis"`.
    pub(super) backend: String,
    pub(super) sync_interval_ms: u64,
    pub(super) sync_timeout_ms: u64,
    pub(super) lease_ttl_ms: u64,
    pub(super) lease_wait_ms: u64,
    /// `"allow"` or `"deny"`.
    pub(super) on_backend_down: String,
    /// How many Sluice nodes share the limits: a node's share while Redis is down is 1/nodes.
    pub(super) nodes: u32,
    /// Ask for `stream_options.include_usage` … (see `[upstream]`); here only the reservation.
    pub(super) reserve: Option<RawReserve>,
    /// `"estimate"` or `"tiktoken"`: how streamed output is counted when the upstream reports no
    /// usage.
    pub(super) settle_tokenizer: String,
    pub(super) redis: Option<RawRedis>,
}

impl Default for RawLimits {
    fn default() -> Self {
        RawLimits {
            backend: "local".into(),
            sync_interval_ms: 50,
            sync_timeout_ms: 100,
            lease_ttl_ms: 10_000,
            lease_wait_ms: 250,
            on_backend_down: "allow".into(),
            nodes: 1,
            reserve: None,
            settle_tokenizer: "estimate".into(),
            redis: None,
        }
    }
}

#[derive(Debug, Deserialize)]
#[cfg_attr(test, derive(serde::Serialize))]
#[serde(deny_unknown_fields)]
pub(crate) struct RawRedis {
    /// `redis://[user[:password]@]host[:port][/db]` or `host:port` (see [`redis_url`]).
    pub(super) address: String,
    /// Also settable in `address`; both given must agree.
    pub(super) username: Option<String>,
    /// Name of an environment variable holding the password (also settable in `address`; both
    /// given must agree).
    pub(super) password_env: Option<String>,
    /// Absent: `address`'s `/db`, else 0. Both given must agree.
    pub(super) db: Option<u32>,
    #[serde(default = "default_prefix")]
    pub(super) key_prefix: String,
    #[serde(default = "default_connect_ms")]
    pub(super) connect_timeout_ms: u64,
    /// A Redis Cluster: `address` and `seeds` are nodes to learn the slot map from; budgets go
    /// to the master owning their hash tag's slot.
    #[serde(default)]
    pub(super) cluster: bool,
    #[serde(default)]
    pub(super) seeds: Vec<String>,
}

/// The database when neither `db` nor the address names one.
pub(crate) const DEFAULT_REDIS_DB: u32 = 0;

fn default_prefix() -> String {
    "sluice".into()
}
fn default_connect_ms() -> u64 {
    500
}

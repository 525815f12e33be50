//! The `[[keys]]`, `[[policies]]` and `[limits]` sections: raw serde types and their validation
//! into the typed [`LimitsConfig`] that workers read.
//!
//! Runs once per config load, inside [`crate::config::load`]. Takes the raw sections and the
//! worker count; returns a [`LimitsConfig`], pushing every problem found (with its key path) to
//! the caller's error list rather than stopping at the first.

// The config loader resolves the Redis address here, once, on the control thread.
#![allow(clippy::disallowed_methods)]

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::net::{IpAddr, SocketAddr, ToSocketAddrs};
use std::time::Duration;

use serde::Deserialize;

use crate::config::{redis_url, ModelPattern};

/// Which limit a limiter policy checks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum LimitDimension {
    /// Requests per minute.
    Rpm,
    /// Tokens per minute.
    Tpm,
    /// Concurrent requests.
    Concurrency,
    /// Prepaid quota / budget.
    Quota,
}

impl LimitDimension {
    pub(crate) const ALL: [LimitDimension; 4] = [
        LimitDimension::Rpm,
        LimitDimension::Tpm,
        LimitDimension::Concurrency,
        LimitDimension::Quota,
    ];

    pub(crate) fn label(self) -> &'static str {
        match self {
            LimitDimension::Rpm => "rpm",
            LimitDimension::Tpm => "tpm",
            LimitDimension::Concurrency => "concurrency",
            LimitDimension::Quota => "quota",
        }
    }
}

/// The SHA-256 of a key, as stored in the config (`[[keys]] sha256`).
pub fn digest(key: &[u8]) -> [u8; 32] {
    let d = ring::digest::digest(&ring::digest::SHA256, key);
    let mut out = [0u8; 32];
    out.copy_from_slice(d.as_ref());
    out
}

/// Equal in time independent of where the inputs differ (only their lengths tell): for
/// comparing a presented secret, or its digest, with a stored one (API keys, the admin token).
pub(crate) fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    if a.len() != b.len() {
        return false;
    }
    let diff = a.iter().zip(b).fold(0u8, |diff, (x, y)| diff | (x ^ y));
    std::hint::black_box(diff) == 0
}

/// Lowercase hex of a digest (what `sluice key hash` prints).
pub fn hex(digest: &[u8; 32]) -> String {
    const HEX: &[u8; 16] = b"0123456789abcdef";
    let mut s = String::with_capacity(64);
    for b in digest {
        s.push(HEX[(b >> 4) as usize] as char);
        s.push(HEX[(b & 15) as usize] as char);
    }
    s
}

// ---------------------------------------------------------------------------------------------
// Raw types
// ---------------------------------------------------------------------------------------------

#[derive(Debug, Deserialize)]
#[cfg_attr(test, derive(serde::Serialize))]
#[serde(deny_unknown_fields)]
pub(crate) struct RawKey {
    id: String,
    /// Hex SHA-256 of the key (`sluice key hash`); the plaintext is never in the config.
    sha256: String,
    entity: Option<String>,
    #[serde(default)]
    tags: Vec<String>,
    #[serde(default = "yes")]
    enabled: bool,
    expires: Option<toml::value::Datetime>,
    #[serde(default)]
    models_allow: Vec<String>,
    #[serde(default)]
    models_block: Vec<String>,
    #[serde(default)]
    source_subnets: Vec<String>,
    #[serde(default)]
    plans: Vec<RawPlan>,
}

fn yes() -> bool {
    true
}

#[derive(Debug, Deserialize)]
#[cfg_attr(test, derive(serde::Serialize))]
#[serde(deny_unknown_fields)]
pub(crate) struct RawPlan {
    id: String,
    /// Tokens per period (or in all, for a one-time plan); absent = unlimited.
    tokens: Option<u64>,
    /// `"once"`, `"monthly"` or `"<N>d"` (every N days).
    #[serde(default = "once")]
    period: String,
    /// Where periods start counting from (default 1970-01-01T00:00:00Z).
    anchor: Option<toml::value::Datetime>,
    expires: Option<toml::value::Datetime>,
    /// Lower is tried first.
    #[serde(default)]
    priority: i64,
}

fn once() -> String {
    "once".into()
}

#[derive(Debug, Deserialize)]
#[cfg_attr(test, derive(serde::Serialize))]
#[serde(deny_unknown_fields)]
pub(crate) struct RawPolicy {
    id: String,
    #[serde(default = "yes")]
    enabled: bool,
    /// Which requests it applies to; every list given must match (empty lists match all).
    #[serde(default)]
    keys: Vec<String>,
    #[serde(default)]
    entities: Vec<String>,
    #[serde(default)]
    tags: Vec<String>,
    #[serde(default)]
    models: Vec<String>,
    /// Who gets their own counter: `"global"` (one for all matching requests), `"key"`,
    /// `"entity"` or `"model"`.
    #[serde(default = "global")]
    per: String,
    max_requests: Option<u64>,
    requests_window_secs: Option<u64>,
    requests_burst: Option<u64>,
    max_tokens: Option<u64>,
    tokens_window_secs: Option<u64>,
    tokens_burst: Option<u64>,
    max_concurrency: Option<u64>,
    reserve: Option<RawReserve>,
}

fn global() -> String {
    "global".into()
}

#[derive(Debug, Deserialize, Clone, Copy)]
#[cfg_attr(test, derive(serde::Serialize))]
#[serde(deny_unknown_fields)]
pub(crate) struct RawReserve {
    coefficient: Option<f64>,
    offset: Option<u64>,
    max_tokens_cap: Option<u64>,
}

#[derive(Debug, Deserialize)]
#[cfg_attr(test, derive(serde::Serialize))]
#[serde(deny_unknown_fields, default)]
pub(crate) struct RawLimits {
    /// `"local"` (in-process: the workers of one node share limits) or `"redis"`.
    backend: String,
    sync_interval_ms: u64,
    sync_timeout_ms: u64,
    lease_ttl_ms: u64,
    lease_wait_ms: u64,
    /// `"allow"` or `"deny"`.
    on_backend_down: String,
    /// How many Sluice nodes share the limits: a node's share while Redis is down is 1/nodes.
    nodes: u32,
    /// Ask for `stream_options.include_usage` … (see `[upstream]`); here only the reservation.
    reserve: Option<RawReserve>,
    /// `"estimate"` or `"tiktoken"`: how streamed output is counted when the upstream reports no
    /// usage.
    settle_tokenizer: String,
    redis: Option<RawRedis>,
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
    address: String,
    /// Also settable in `address`; both given must agree.
    username: Option<String>,
    /// Name of an environment variable holding the password (also settable in `address`; both
    /// given must agree).
    password_env: Option<String>,
    /// Absent: `address`'s `/db`, else 0. Both given must agree.
    db: Option<u32>,
    #[serde(default = "default_prefix")]
    key_prefix: String,
    #[serde(default = "default_connect_ms")]
    connect_timeout_ms: u64,
    /// A Redis Cluster: `address` and `seeds` are nodes to learn the slot map from; budgets go
    /// to the master owning their hash tag's slot.
    #[serde(default)]
    cluster: bool,
    #[serde(default)]
    seeds: Vec<String>,
}

/// The database when neither `db` nor the address names one.
pub(crate) const DEFAULT_REDIS_DB: u32 = 0;

fn default_prefix() -> String {
    "sluice".into()
}
fn default_connect_ms() -> u64 {
    500
}

// ---------------------------------------------------------------------------------------------
// Resolved types
// ---------------------------------------------------------------------------------------------

pub(crate) type KeyIdx = usize;
pub(crate) type PolicyIdx = usize;

/// The keys by their SHA-256, looked up on every request with a key. foldhash rather than
/// std's SipHash (~270 instructions a lookup of 32 bytes): the digests are the hash of what a
/// client sends, and the table is seeded per process.
pub(crate) type KeysByDigest = HashMap<[u8; 32], KeyIdx, foldhash::fast::RandomState>;

#[derive(Debug, Clone, Default)]
pub(crate) struct LimitsConfig {
    pub(crate) keys: Vec<ApiKey>,
    /// Digest → key, for authentication.
    pub(crate) by_digest: KeysByDigest,
    /// Entity names, sorted; keys refer to them by index (metrics label slots too).
    pub(crate) entities: Vec<String>,
    pub(crate) policies: Vec<Policy>,
    /// Policies that apply to requests without a key (no key/entity/tag filter).
    pub(crate) anonymous_policies: Vec<PolicyIdx>,
    pub(crate) sync: SyncSettings,
    /// The default reservation rule (quota plans, and policies without their own).
    pub(crate) reserve: Reserve,
    pub(crate) settle_tokenizer: SettleTokenizer,
    /// Stable ids of this config's names, for the limiter's budgets (see [`StableIds`]).
    pub(crate) ids: StableIds,
}

/// Stable ids for the names budgets are keyed by — policies, keys, entities, plans — with this
/// config's positions mapped to them. The ids come from one interner for the whole process, so
/// every config (a request keeps the one it started on, across reloads) maps a name to the same
/// id: a budget stays its name's, whatever a reload adds, removes or reorders.
#[derive(Debug, Clone, Default)]
pub(crate) struct StableIds {
    pub(crate) policies: Vec<u32>,
    pub(crate) keys: Vec<u32>,
    pub(crate) entities: Vec<u32>,
    /// Per key, per plan.
    pub(crate) plans: Vec<Vec<u32>>,
}

/// An id no name gets.
pub(crate) const NO_ID: u32 = u32::MAX;

impl StableIds {
    fn of(keys: &[ApiKey], entities: &[String], policies: &[Policy]) -> StableIds {
        // Config loading runs off the workers (startup, the control thread on reload), so this
        // lock is never on a request path; names only accumulate as reloads add them.
        #[allow(
            clippy::disallowed_types,
            reason = "config loading only, never a worker"
        )]
        static INTERNED: std::sync::OnceLock<std::sync::Mutex<HashMap<String, u32>>> =
            std::sync::OnceLock::new();
        let interned = INTERNED.get_or_init(Default::default);
        let mut interned = interned
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let mut id = |kind: char, name: &str| {
            let next = interned.len() as u32;
            *interned.entry(format!("{kind}\0{name}")).or_insert(next)
        };
        StableIds {
            policies: policies.iter().map(|p| id('p', &p.id)).collect(),
            keys: keys.iter().map(|k| id('k', &k.id)).collect(),
            entities: entities.iter().map(|e| id('e', e)).collect(),
            plans: keys
                .iter()
                .map(|k| {
                    k.plans
                        .iter()
                        .map(|p| id('q', &format!("{}\0{}", k.id, p.id)))
                        .collect()
                })
                .collect(),
        }
    }

    pub(crate) fn policy(&self, index: usize) -> u32 {
        self.policies.get(index).copied().unwrap_or(NO_ID)
    }
    pub(crate) fn key(&self, index: KeyIdx) -> u32 {
        self.keys.get(index).copied().unwrap_or(NO_ID)
    }
    pub(crate) fn entity(&self, index: usize) -> u32 {
        self.entities.get(index).copied().unwrap_or(NO_ID)
    }
    pub(crate) fn plan(&self, key: KeyIdx, index: usize) -> u32 {
        self.plans
            .get(key)
            .and_then(|p| p.get(index))
            .copied()
            .unwrap_or(NO_ID)
    }
}

impl LimitsConfig {
    /// Keys are configured: every request must carry one.
    pub(crate) fn auth_required(&self) -> bool {
        !self.keys.is_empty()
    }
}

#[derive(Debug, Clone)]
pub(crate) struct ApiKey {
    pub(crate) id: String,
    pub(crate) digest: [u8; 32],
    pub(crate) entity: Option<usize>,
    pub(crate) tags: Vec<String>,
    pub(crate) enabled: bool,
    /// Unix seconds.
    pub(crate) expires: Option<u64>,
    /// Empty: every model.
    pub(crate) models_allow: Vec<ModelPattern>,
    pub(crate) models_block: Vec<ModelPattern>,
    /// Empty: any source.
    pub(crate) subnets: Vec<Cidr>,
    /// By priority (lowest first), file order among equals.
    pub(crate) plans: Vec<Plan>,
    /// Policies whose key / entity / tag filters match this key (models are checked per
    /// request).
    pub(crate) policies: Vec<PolicyIdx>,
}

impl ApiKey {
    /// Block wins over allow; an empty allow list allows everything.
    pub(crate) fn may_use(&self, model: &str) -> bool {
        if self.models_block.iter().any(|p| p.matches(model)) {
            return false;
        }
        self.models_allow.is_empty() || self.models_allow.iter().any(|p| p.matches(model))
    }

    pub(crate) fn source_allowed(&self, ip: Option<IpAddr>) -> bool {
        if self.subnets.is_empty() {
            return true;
        }
        ip.is_some_and(|ip| self.subnets.iter().any(|c| c.contains(ip)))
    }
}

#[derive(Debug, Clone)]
pub(crate) struct Plan {
    pub(crate) id: String,
    /// None: unlimited.
    pub(crate) tokens: Option<u64>,
    pub(crate) period: Period,
    /// Unix seconds.
    pub(crate) anchor: u64,
    pub(crate) expires: Option<u64>,
    pub(crate) priority: i64,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Period {
    Once,
    Days(u32),
    Monthly,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Per {
    Global,
    Key,
    Entity,
    Model,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct RateLimit {
    pub(crate) max: u64,
    pub(crate) window: Duration,
    /// How much of a window's allowance may be used at once; the rest accrues evenly over the
    /// window. Equal to `max`: a plain fixed window.
    pub(crate) burst: u64,
}

impl RateLimit {
    /// The window's length in ms (at least 1).
    pub(crate) fn window_ms(&self) -> u64 {
        self.window.as_millis().max(1) as u64
    }

    /// The allowance of the window that started at `window_start_ms`, as of `now_ms`.
    pub(crate) fn allowance(&self, window_start_ms: u64, now_ms: u64) -> u64 {
        if self.burst >= self.max {
            return self.max;
        }
        let window_ms = self.window.as_millis().max(1) as u64;
        let elapsed = now_ms.saturating_sub(window_start_ms).min(window_ms);
        let accrued = (self.max as u128 * elapsed as u128 / window_ms as u128) as u64;
        (self.burst + accrued).min(self.max)
    }
}

#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct Reserve {
    pub(crate) coefficient: f64,
    pub(crate) offset: u64,
    pub(crate) max_tokens_cap: u64,
}

impl Default for Reserve {
    fn default() -> Self {
        Reserve {
            coefficient: 1.0,
            offset: 512,
            max_tokens_cap: 16_384,
        }
    }
}

impl Reserve {
    /// Tokens to reserve for a request: the prompt estimate plus its (capped) output cap when it
    /// sets one, else `coefficient × prompt + offset`. `n` choices multiply the output part.
    pub(crate) fn tokens(
        &self,
        prompt_estimate: u64,
        max_tokens: Option<u64>,
        n: Option<u64>,
    ) -> u64 {
        let choices = n.unwrap_or(1).clamp(1, 128);
        match max_tokens {
            Some(m) => prompt_estimate + m.min(self.max_tokens_cap).saturating_mul(choices),
            None => {
                (self.coefficient * prompt_estimate as f64).ceil() as u64
                    + self.offset.saturating_mul(choices)
            }
        }
    }
}

#[derive(Debug, Clone)]
pub(crate) struct Policy {
    pub(crate) id: String,
    pub(crate) enabled: bool,
    pub(crate) keys: Vec<String>,
    pub(crate) entities: Vec<String>,
    pub(crate) tags: Vec<String>,
    pub(crate) models: Vec<ModelPattern>,
    pub(crate) per: Per,
    pub(crate) requests: Option<RateLimit>,
    pub(crate) tokens: Option<RateLimit>,
    pub(crate) concurrency: Option<u64>,
    pub(crate) reserve: Reserve,
}

impl Policy {
    pub(crate) fn applies_to_model(&self, model: &str) -> bool {
        self.models.is_empty() || self.models.iter().any(|p| p.matches(model))
    }

    fn is_global(&self) -> bool {
        self.keys.is_empty() && self.entities.is_empty() && self.tags.is_empty()
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum DownPolicy {
    /// Serve on local caps (a limit / (nodes × workers) share per core).
    Allow,
    /// 503 with Retry-After when what a core holds does not cover the request.
    Deny,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub(crate) enum SettleTokenizer {
    #[default]
    Estimate,
    Tiktoken,
}

/// Where and how workers reach Redis. `Debug` leaves the password out.
#[derive(Clone, PartialEq, Eq)]
pub(crate) struct RedisSettings {
    pub(crate) address: SocketAddr,
    /// Some: a Redis Cluster, with these seed nodes (`address` first).
    pub(crate) cluster_seeds: Option<Vec<SocketAddr>>,
    pub(crate) username: Option<String>,
    pub(crate) password: Option<String>,
    pub(crate) db: u32,
    pub(crate) key_prefix: String,
    pub(crate) connect_timeout: Duration,
}

impl std::fmt::Debug for RedisSettings {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RedisSettings")
            .field("address", &self.address)
            .field("cluster_seeds", &self.cluster_seeds)
            .field("username", &self.username)
            .field("password", &self.password.as_ref().map(|_| "<redacted>"))
            .field("db", &self.db)
            .field("key_prefix", &self.key_prefix)
            .field("connect_timeout", &self.connect_timeout)
            .finish()
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct SyncSettings {
    /// None: the in-process ledger.
    pub(crate) redis: Option<RedisSettings>,
    pub(crate) interval: Duration,
    pub(crate) timeout: Duration,
    pub(crate) lease_ttl: Duration,
    pub(crate) lease_wait: Duration,
    pub(crate) on_down: DownPolicy,
    pub(crate) nodes: u32,
    /// Workers per node (from `[server]`), for the local share while the backend is down.
    pub(crate) workers: u32,
}

impl Default for SyncSettings {
    fn default() -> Self {
        SyncSettings {
            redis: None,
            interval: Duration::from_millis(50),
            timeout: Duration::from_millis(100),
            lease_ttl: Duration::from_secs(10),
            lease_wait: Duration::from_millis(250),
            on_down: DownPolicy::Allow,
            nodes: 1,
            workers: 1,
        }
    }
}

impl SyncSettings {
    /// The key prefix budgets live under (hash tags start after it).
    pub(crate) fn prefix(&self) -> &str {
        self.redis
            .as_ref()
            .map_or("sluice", |r| r.key_prefix.as_str())
    }
}

/// An IPv4 or IPv6 network.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Cidr {
    net: u128,
    mask: u128,
    v4: bool,
}

impl Cidr {
    pub(crate) fn parse(s: &str) -> Result<Cidr, String> {
        let (addr, len) = match s.split_once('/') {
            Some((a, l)) => (a, Some(l)),
            None => (s, None),
        };
        let ip: IpAddr = addr
            .parse()
            .map_err(|_| format!("`{s}` is not an address or network like 10.0.0.0/8"))?;
        let (bits, v4, value) = match ip {
            IpAddr::V4(v4) => (32u32, true, u32::from(v4) as u128),
            IpAddr::V6(v6) => (128u32, false, u128::from(v6)),
        };
        let len = match len {
            None => bits,
            Some(l) => l
                .parse::<u32>()
                .ok()
                .filter(|l| *l <= bits)
                .ok_or_else(|| format!("`{s}`: prefix length must be 0..={bits}"))?,
        };
        let mask = if len == 0 {
            0
        } else {
            (u128::MAX << (bits - len)) & (u128::MAX >> (128 - bits))
        };
        if value & !mask != 0 {
            return Err(format!("`{s}` has host bits set"));
        }
        Ok(Cidr {
            net: value,
            mask,
            v4,
        })
    }

    pub(crate) fn contains(&self, ip: IpAddr) -> bool {
        let (v4, value) = match ip {
            IpAddr::V4(a) => (true, u32::from(a) as u128),
            // An IPv4-mapped IPv6 peer (dual-stack listener) is the IPv4 address it carries.
            IpAddr::V6(a) => match a.to_ipv4_mapped() {
                Some(m) => (true, u32::from(m) as u128),
                None => (false, u128::from(a)),
            },
        };
        v4 == self.v4 && value & self.mask == self.net
    }
}

// ---------------------------------------------------------------------------------------------
// Validation
// ---------------------------------------------------------------------------------------------

/// Unix seconds of a TOML datetime with a date, a time and an offset.
fn unix_seconds(dt: &toml::value::Datetime) -> Result<u64, String> {
    let (Some(date), Some(time)) = (dt.date, dt.time) else {
        return Err(format!(
            "`{dt}` needs a date and a time, like 2027-01-01T00:00:00Z"
        ));
    };
    let offset_minutes: i64 = match dt.offset {
        Some(toml::value::Offset::Z) => 0,
        Some(toml::value::Offset::Custom { minutes }) => i64::from(minutes),
        None => {
            return Err(format!(
                "`{dt}` needs a UTC offset, like 2027-01-01T00:00:00Z"
            ))
        }
    };
    let days = days_from_civil(
        i64::from(date.year),
        u32::from(date.month),
        u32::from(date.day),
    );
    let secs = days * 86_400
        + i64::from(time.hour) * 3600
        + i64::from(time.minute) * 60
        + i64::from(time.second)
        - offset_minutes * 60;
    u64::try_from(secs).map_err(|_| format!("`{dt}` is before 1970"))
}

/// Days since 1970-01-01 of a proleptic Gregorian date (Howard Hinnant's algorithm).
pub(crate) fn days_from_civil(y: i64, m: u32, d: u32) -> i64 {
    let y = if m <= 2 { y - 1 } else { y };
    let era = if y >= 0 { y } else { y - 399 } / 400;
    let yoe = y - era * 400;
    let m = i64::from(m);
    let doy = (153 * (if m > 2 { m - 3 } else { m + 9 }) + 2) / 5 + i64::from(d) - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    era * 146_097 + doe - 719_468
}

/// (year, month) of a day count since 1970-01-01.
pub(crate) fn civil_year_month(days: i64) -> (i64, u32) {
    let z = days + 719_468;
    let era = if z >= 0 { z } else { z - 146_096 } / 146_097;
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let m = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    let y = yoe + era * 400 + i64::from(m <= 2);
    (y, m)
}

fn parse_period(s: &str) -> Result<Period, String> {
    match s {
        "once" => Ok(Period::Once),
        "monthly" => Ok(Period::Monthly),
        _ => s
            .strip_suffix('d')
            .and_then(|n| n.parse::<u32>().ok())
            .filter(|n| (1..=3660).contains(n))
            .map(Period::Days)
            .ok_or_else(|| format!("`{s}` is not \"once\", \"monthly\" or \"<N>d\" (N ≥ 1)")),
    }
}

fn parse_digest(s: &str) -> Option<[u8; 32]> {
    decode_hex(s)?.try_into().ok()
}

/// Lower- or upper-case hex to bytes; `None` when it is not hex (digits only: no sign).
pub(crate) fn decode_hex(s: &str) -> Option<Vec<u8>> {
    if !s.len().is_multiple_of(2) {
        return None;
    }
    let digit = |c: u8| (c as char).to_digit(16).map(|d| d as u8);
    s.as_bytes()
        .chunks(2)
        .map(|p| Some(digit(p[0])? << 4 | digit(p[1])?))
        .collect()
}

/// Ids end up in Redis keys, metric labels and log lines: keep them plain.
fn check_id(s: &str) -> Result<(), String> {
    if s.is_empty() || s.len() > 64 {
        return Err("must be 1 to 64 characters".into());
    }
    if !s
        .bytes()
        .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.'))
    {
        return Err(format!(
            "`{s}` may only hold letters, digits, `-`, `_` and `.`"
        ));
    }
    Ok(())
}

/// Check an id (see [`check_id`]) and that no earlier entry of its list, whose ids are in
/// `seen`, has it; `duplicate` words that error, given the earlier entry's index.
fn check_unique_id(
    id: &str,
    index: usize,
    seen: &mut BTreeMap<String, usize>,
    path: &str,
    err: &mut dyn FnMut(String, String),
    duplicate: impl FnOnce(usize) -> String,
) {
    if let Err(e) = check_id(id) {
        err(format!("{path}.id"), e);
    }
    if let Some(prev) = seen.insert(id.to_string(), index) {
        err(format!("{path}.id"), duplicate(prev));
    }
}

fn resolve_reserve(
    raw: Option<RawReserve>,
    base: Reserve,
    path: &str,
    err: &mut dyn FnMut(String, String),
) -> Reserve {
    let Some(r) = raw else {
        return base;
    };
    let reserve = Reserve {
        coefficient: r.coefficient.unwrap_or(base.coefficient),
        offset: r.offset.unwrap_or(base.offset),
        max_tokens_cap: r.max_tokens_cap.unwrap_or(base.max_tokens_cap),
    };
    if !reserve.coefficient.is_finite() || reserve.coefficient < 0.0 || reserve.coefficient > 100.0
    {
        err(
            format!("{path}.coefficient"),
            "must be between 0 and 100".into(),
        );
    }
    reserve
}

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

/// A policy's requests or tokens window when it gives none.
pub(crate) const DEFAULT_WINDOW_SECS: u64 = 60;

fn rate(
    max: Option<u64>,
    window_secs: Option<u64>,
    burst: Option<u64>,
    path: &str,
    what: &str,
    err: &mut dyn FnMut(String, String),
) -> Option<RateLimit> {
    let Some(max) = max else {
        if window_secs.is_some() || burst.is_some() {
            err(
                format!("{path}.max_{what}"),
                format!("{what}_window_secs / {what}_burst need max_{what}"),
            );
        }
        return None;
    };
    let window = window_secs.unwrap_or(DEFAULT_WINDOW_SECS);
    if window == 0 || window > 31 * 86_400 {
        err(
            format!("{path}.{what}_window_secs"),
            "must be 1 s to 31 days".into(),
        );
    }
    if max == 0 {
        err(format!("{path}.max_{what}"), "must be at least 1".into());
    }
    let burst = burst.unwrap_or(max);
    if burst == 0 {
        err(format!("{path}.{what}_burst"), "must be at least 1".into());
    }
    Some(RateLimit {
        max,
        window: Duration::from_secs(window),
        burst: burst.min(max),
    })
}

/// Validate the sections. `workers` is the resolved worker count.
pub(crate) fn resolve(
    raw_keys: &[RawKey],
    raw_policies: &[RawPolicy],
    raw: &RawLimits,
    workers: usize,
    env: &dyn Fn(&str) -> Option<String>,
    err: &mut dyn FnMut(String, String),
) -> LimitsConfig {
    let reserve = resolve_reserve(raw.reserve, Reserve::default(), "limits.reserve", err);
    let sync = resolve_sync(raw, workers, err);
    let settle_tokenizer = resolve_settle_tokenizer(&raw.settle_tokenizer, err);
    let redis = resolve_backend(&raw.backend, raw.redis.as_ref(), env, err);
    let policies = resolve_policies(raw_policies, reserve, err);
    let entities = entity_names(raw_keys);
    let (keys, by_digest) = resolve_keys(raw_keys, &policies, &entities, err);
    check_policy_references(&policies, &keys, &entities, err);
    let anonymous_policies = policies
        .iter()
        .enumerate()
        .filter(|(_, p)| p.is_global())
        .map(|(i, _)| i)
        .collect();
    let ids = StableIds::of(&keys, &entities, &policies);
    LimitsConfig {
        keys,
        by_digest,
        entities,
        policies,
        anonymous_policies,
        sync: SyncSettings { redis, ..sync },
        reserve,
        settle_tokenizer,
        ids,
    }
}

/// `[limits]`' timing, node count and outage policy; the Redis settings are
/// [`resolve_backend`]'s.
fn resolve_sync(
    raw: &RawLimits,
    workers: usize,
    err: &mut dyn FnMut(String, String),
) -> SyncSettings {
    if !(1..=10_000).contains(&raw.sync_interval_ms) {
        err(
            "limits.sync_interval_ms".into(),
            "must be 1 to 10000".into(),
        );
    }
    if raw.sync_timeout_ms == 0 {
        err("limits.sync_timeout_ms".into(), "must be at least 1".into());
    }
    if raw.lease_ttl_ms < raw.sync_interval_ms.saturating_mul(4) {
        err(
            "limits.lease_ttl_ms".into(),
            "must be at least 4 × sync_interval_ms (leases are renewed every interval)".into(),
        );
    }
    if raw.nodes == 0 {
        err("limits.nodes".into(), "must be at least 1".into());
    }
    let on_down = match raw.on_backend_down.as_str() {
        "allow" => DownPolicy::Allow,
        "deny" => DownPolicy::Deny,
        other => {
            err(
                "limits.on_backend_down".into(),
                format!("`{other}` is not \"allow\" or \"deny\""),
            );
            DownPolicy::Allow
        }
    };
    SyncSettings {
        redis: None,
        interval: Duration::from_millis(raw.sync_interval_ms),
        timeout: Duration::from_millis(raw.sync_timeout_ms),
        lease_ttl: Duration::from_millis(raw.lease_ttl_ms),
        lease_wait: Duration::from_millis(raw.lease_wait_ms),
        on_down,
        nodes: raw.nodes,
        workers: workers as u32,
    }
}

fn resolve_settle_tokenizer(raw: &str, err: &mut dyn FnMut(String, String)) -> SettleTokenizer {
    match raw {
        "estimate" => SettleTokenizer::Estimate,
        "tiktoken" => SettleTokenizer::Tiktoken,
        other => {
            err(
                "limits.settle_tokenizer".into(),
                format!("`{other}` is not \"estimate\" or \"tiktoken\""),
            );
            SettleTokenizer::Estimate
        }
    }
}

/// `backend` and `[limits.redis]`: the Redis settings, or `None` for the in-process ledger (and
/// where Redis's address is wrong).
fn resolve_backend(
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
        (Some(in_url), Some((var, Some(value)))) if *in_url != value => {
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

/// `[[policies]]`, in file order (a policy's index is its [`PolicyIdx`]). `reserve` is the
/// default reservation rule, for policies without their own.
fn resolve_policies(
    raw_policies: &[RawPolicy],
    reserve: Reserve,
    err: &mut dyn FnMut(String, String),
) -> Vec<Policy> {
    let mut ids = BTreeMap::new();
    let mut policies = Vec::with_capacity(raw_policies.len());
    for (i, rp) in raw_policies.iter().enumerate() {
        let path = format!("policies[{i}]");
        check_unique_id(&rp.id, i, &mut ids, &path, err, |prev| {
            format!("`{}` is already used by policies[{prev}]", rp.id)
        });
        policies.push(resolve_policy(rp, reserve, &path, err));
    }
    policies
}

fn resolve_policy(
    rp: &RawPolicy,
    reserve: Reserve,
    path: &str,
    err: &mut dyn FnMut(String, String),
) -> Policy {
    let per = match rp.per.as_str() {
        "global" => Per::Global,
        "key" => Per::Key,
        "entity" => Per::Entity,
        "model" => Per::Model,
        other => {
            err(
                format!("{path}.per"),
                format!("`{other}` is not \"global\", \"key\", \"entity\" or \"model\""),
            );
            Per::Global
        }
    };
    let requests = rate(
        rp.max_requests,
        rp.requests_window_secs,
        rp.requests_burst,
        path,
        "requests",
        err,
    );
    let tokens = rate(
        rp.max_tokens,
        rp.tokens_window_secs,
        rp.tokens_burst,
        path,
        "tokens",
        err,
    );
    if rp.max_concurrency == Some(0) {
        err(
            format!("{path}.max_concurrency"),
            "must be at least 1".into(),
        );
    }
    if requests.is_none() && tokens.is_none() && rp.max_concurrency.is_none() {
        err(
            path.to_string(),
            "a policy needs max_requests, max_tokens or max_concurrency".into(),
        );
    }
    Policy {
        id: rp.id.clone(),
        enabled: rp.enabled,
        keys: rp.keys.clone(),
        entities: rp.entities.clone(),
        tags: rp.tags.clone(),
        models: rp.models.iter().map(|m| ModelPattern::parse(m)).collect(),
        per,
        requests,
        tokens,
        concurrency: rp.max_concurrency,
        reserve: resolve_reserve(rp.reserve, reserve, &format!("{path}.reserve"), err),
    }
}

/// Every entity the keys name, sorted and without repeats: keys and metrics refer to an entity
/// by its index here.
fn entity_names(raw_keys: &[RawKey]) -> Vec<String> {
    let mut entities: Vec<String> = raw_keys.iter().filter_map(|k| k.entity.clone()).collect();
    entities.sort();
    entities.dedup();
    entities
}

/// `[[keys]]`, in file order (a key's index is its [`KeyIdx`]), and the digest → key map that
/// authentication looks keys up in.
fn resolve_keys(
    raw_keys: &[RawKey],
    policies: &[Policy],
    entities: &[String],
    err: &mut dyn FnMut(String, String),
) -> (Vec<ApiKey>, KeysByDigest) {
    let mut ids = BTreeMap::new();
    let mut by_digest = KeysByDigest::default();
    let mut keys = Vec::with_capacity(raw_keys.len());
    for (i, rk) in raw_keys.iter().enumerate() {
        let path = format!("keys[{i}]");
        check_unique_id(&rk.id, i, &mut ids, &path, err, |prev| {
            format!("`{}` is already used by keys[{prev}]", rk.id)
        });
        let digest = parse_digest(&rk.sha256.to_ascii_lowercase()).unwrap_or_else(|| {
            err(
                format!("{path}.sha256"),
                "must be 64 hex digits (`sluice key hash` prints it)".into(),
            );
            [0; 32]
        });
        if let Some(prev) = by_digest.insert(digest, i) {
            err(
                format!("{path}.sha256"),
                format!("the same key as keys[{prev}]"),
            );
        }
        keys.push(resolve_key(rk, digest, policies, entities, &path, err));
    }
    (keys, by_digest)
}

/// One key, its id and digest already checked (they must be unique among all keys).
fn resolve_key(
    rk: &RawKey,
    digest: [u8; 32],
    policies: &[Policy],
    entities: &[String],
    path: &str,
    err: &mut dyn FnMut(String, String),
) -> ApiKey {
    if let Some(e) = &rk.entity {
        if let Err(m) = check_id(e) {
            err(format!("{path}.entity"), m);
        }
    }
    let expires = rk.expires.as_ref().and_then(|dt| {
        unix_seconds(dt)
            .map_err(|m| err(format!("{path}.expires"), m))
            .ok()
    });
    let mut subnets = Vec::new();
    for (j, s) in rk.source_subnets.iter().enumerate() {
        match Cidr::parse(s) {
            Ok(c) => subnets.push(c),
            Err(m) => err(format!("{path}.source_subnets[{j}]"), m),
        }
    }
    let plans = resolve_plans(&rk.plans, path, err);
    let patterns = |models: &[String]| -> Vec<ModelPattern> {
        models.iter().map(|m| ModelPattern::parse(m)).collect()
    };
    ApiKey {
        id: rk.id.clone(),
        digest,
        entity: rk
            .entity
            .as_ref()
            .and_then(|e| entities.binary_search(e).ok()),
        tags: rk.tags.clone(),
        enabled: rk.enabled,
        expires,
        models_allow: patterns(&rk.models_allow),
        models_block: patterns(&rk.models_block),
        subnets,
        plans,
        policies: policies_of(rk, policies),
    }
}

/// A key's quota plans, by priority (lowest first), file order among equals.
fn resolve_plans(
    raw_plans: &[RawPlan],
    key_path: &str,
    err: &mut dyn FnMut(String, String),
) -> Vec<Plan> {
    let mut ids = BTreeMap::new();
    let mut plans = Vec::with_capacity(raw_plans.len());
    for (j, rp) in raw_plans.iter().enumerate() {
        let path = format!("{key_path}.plans[{j}]");
        check_unique_id(&rp.id, j, &mut ids, &path, err, |_| {
            format!("`{}` is used twice in this key", rp.id)
        });
        plans.push(resolve_plan(rp, &path, err));
    }
    plans.sort_by_key(|p| p.priority);
    plans
}

fn resolve_plan(rp: &RawPlan, path: &str, err: &mut dyn FnMut(String, String)) -> Plan {
    let period = parse_period(&rp.period).unwrap_or_else(|m| {
        err(format!("{path}.period"), m);
        Period::Once
    });
    let anchor = rp.anchor.as_ref().map_or(0, |dt| {
        unix_seconds(dt).unwrap_or_else(|m| {
            err(format!("{path}.anchor"), m);
            0
        })
    });
    let expires = rp.expires.as_ref().and_then(|dt| {
        unix_seconds(dt)
            .map_err(|m| err(format!("{path}.expires"), m))
            .ok()
    });
    Plan {
        id: rp.id.clone(),
        tokens: rp.tokens,
        period,
        anchor,
        expires,
        priority: rp.priority,
    }
}

/// The policies whose key / entity / tag filters match a key (models are checked per request).
fn policies_of(rk: &RawKey, policies: &[Policy]) -> Vec<PolicyIdx> {
    policies
        .iter()
        .enumerate()
        .filter(|(_, p)| {
            (p.keys.is_empty() || p.keys.contains(&rk.id))
                && (p.entities.is_empty()
                    || rk.entity.as_ref().is_some_and(|e| p.entities.contains(e)))
                && (p.tags.is_empty() || p.tags.iter().any(|t| rk.tags.contains(t)))
        })
        .map(|(j, _)| j)
        .collect()
}

/// A policy naming a key or entity that does not exist is a typo that would silently never
/// apply; so is a policy per key, for every request, when there are no keys.
fn check_policy_references(
    policies: &[Policy],
    keys: &[ApiKey],
    entities: &[String],
    err: &mut dyn FnMut(String, String),
) {
    let key_ids: BTreeSet<&str> = keys.iter().map(|k| k.id.as_str()).collect();
    for (i, p) in policies.iter().enumerate() {
        for k in &p.keys {
            if !key_ids.contains(k.as_str()) {
                err(
                    format!("policies[{i}].keys"),
                    format!("no key with id `{k}`"),
                );
            }
        }
        for e in &p.entities {
            if entities.binary_search(e).is_err() {
                err(
                    format!("policies[{i}].entities"),
                    format!("no key has entity `{e}`"),
                );
            }
        }
        if p.per == Per::Key && p.is_global() && keys.is_empty() {
            err(
                format!("policies[{i}].per"),
                "per = \"key\" needs [[keys]]".into(),
            );
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn cidrs() {
        let c = Cidr::parse("10.0.0.0/8").unwrap();
        assert!(c.contains("10.1.2.3".parse().unwrap()));
        assert!(!c.contains("11.0.0.1".parse().unwrap()));
        assert!(c.contains("::ffff:10.0.0.1".parse().unwrap()));
        let c6 = Cidr::parse("2001:db8::/32").unwrap();
        assert!(c6.contains("2001:db8::1".parse().unwrap()));
        assert!(!c6.contains("2001:db9::1".parse().unwrap()));
        assert!(!c6.contains("10.0.0.1".parse().unwrap()));
        assert!(Cidr::parse("0.0.0.0/0")
            .unwrap()
            .contains("1.2.3.4".parse().unwrap()));
        assert!(Cidr::parse("::1").unwrap().contains("::1".parse().unwrap()));
        assert!(Cidr::parse("10.0.0.1/8").is_err());
        assert!(Cidr::parse("10.0.0.0/33").is_err());
        assert!(Cidr::parse("nonsense").is_err());
    }

    #[test]
    fn civil_dates_round_trip() {
        assert_eq!(days_from_civil(1970, 1, 1), 0);
        assert_eq!(days_from_civil(2000, 3, 1), 11_017);
        for days in [0i64, 59, 60, 365, 11_016, 11_017, 20_000, 24_000] {
            let (y, m) = civil_year_month(days);
            assert!(days_from_civil(y, m, 1) <= days);
            let (ny, nm) = if m == 12 { (y + 1, 1) } else { (y, m + 1) };
            assert!(days_from_civil(ny, nm, 1) > days);
        }
    }

    #[test]
    fn paced_allowance() {
        let r = RateLimit {
            max: 600,
            window: Duration::from_secs(60),
            burst: 100,
        };
        assert_eq!(r.allowance(0, 0), 100);
        assert_eq!(r.allowance(0, 30_000), 400);
        assert_eq!(r.allowance(0, 60_000), 600);
        let plain = RateLimit { burst: 600, ..r };
        assert_eq!(plain.allowance(0, 0), 600);
    }

    /// `[limits.redis]` holding `section`, loaded with `env`: the settings, or every error as
    /// (path, message).
    fn redis(section: &str, env: &[(&str, &str)]) -> Result<RedisSettings, Vec<(String, String)>> {
        let text = format!(
            "[clusters.a]\nbackends = [{{ base_url = \"http://127.0.0.1:1/v1\" }}]\n\
             [[routes]]\nmodel = \"*\"\ncluster = \"a\"\n\
             [limits]\nbackend = \"redis\"\n[limits.redis]\n{section}"
        );
        let env = |k: &str| {
            env.iter()
                .find(|(name, _)| *name == k)
                .map(|(_, v)| v.to_string())
        };
        match crate::config::load(&text, &env) {
            Ok(s) => Ok(s.limits.sync.redis.clone().unwrap()),
            Err(errs) => Err(errs.into_iter().map(|e| (e.path, e.message)).collect()),
        }
    }

    fn errors(e: &[(String, String)]) -> Vec<(&str, &str)> {
        e.iter().map(|(p, m)| (p.as_str(), m.as_str())).collect()
    }

    #[test]
    fn a_redis_url_gives_user_password_and_db() {
        let r = redis("address = \"redis://sluice:p%40ss@127.0.0.1:6380/3\"", &[]).unwrap();
        assert_eq!(r.address, SocketAddr::from(([127, 0, 0, 1], 6380)));
        assert_eq!(r.username.as_deref(), Some("sluice"));
        assert_eq!(r.password.as_deref(), Some("p@ss"));
        assert_eq!(r.db, 3);
        assert_eq!(r.cluster_seeds, None);
        assert!(!format!("{r:?}").contains("p@ss"), "{r:?}");
        // Port 6379 and database 0 unless said; a plain host:port as always.
        let r = redis("address = \"redis://127.0.0.1\"", &[]).unwrap();
        assert_eq!(
            (r.address.port(), r.db, r.username, r.password),
            (6379, 0, None, None)
        );
        let r = redis("address = \"127.0.0.1:7000\"\ndb = 2", &[]).unwrap();
        assert_eq!((r.address.port(), r.db), (7000, 2));
    }

    #[test]
    fn url_and_keys_may_say_the_same_thing_or_share_the_work() {
        // The user in the URL, the password from the environment (kept out of the file).
        let r = redis(
            "address = \"redis://sluice@127.0.0.1/1\"\npassword_env = \"PW\"",
            &[("PW", "from-env")],
        )
        .unwrap();
        assert_eq!(r.username.as_deref(), Some("sluice"));
        assert_eq!(r.password.as_deref(), Some("from-env"));
        assert_eq!(r.db, 1);
        // Each given twice, the same both times.
        let r = redis(
            "address = \"redis://u:same@127.0.0.1/4\"\nusername = \"u\"\n\
             password_env = \"PW\"\ndb = 4",
            &[("PW", "same")],
        )
        .unwrap();
        assert_eq!(
            (r.username.as_deref(), r.password.as_deref(), r.db),
            (Some("u"), Some("same"), 4)
        );
    }

    /// A setting given in the URL and by its own key, differently, is an error for each, all at
    /// once, and no message shows either password.
    #[test]
    fn url_and_keys_that_differ_are_errors() {
        let errs = redis(
            "address = \"redis://a:urlsecret1@127.0.0.1/2\"\nusername = \"b\"\n\
             password_env = \"PW\"\ndb = 3",
            &[("PW", "envsecret2")],
        )
        .unwrap_err();
        assert_eq!(
            errors(&errs),
            [
                (
                    "limits.redis.username",
                    "`b` differs from the user in address (`a`); give it in one place"
                ),
                (
                    "limits.redis.password_env",
                    "`PW` holds a different password than the one in address; give it in one \
                     place"
                ),
                (
                    "limits.redis.db",
                    "3 differs from the database in address (/2); give it in one place"
                ),
            ]
        );
        for (_, m) in &errs {
            assert!(
                !m.contains("urlsecret1") && !m.contains("envsecret2"),
                "{m}"
            );
        }
    }

    #[test]
    fn a_user_needs_a_password() {
        let need = "a user name needs a password (redis://user:password@host, or password_env): \
                    Redis's AUTH takes both, and without it the connection would be the default \
                    user's";
        let errs = redis("address = \"redis://sluice@127.0.0.1\"", &[]).unwrap_err();
        assert_eq!(errors(&errs), [("limits.redis.address", need)]);
        let errs = redis("address = \"127.0.0.1:6379\"\nusername = \"u\"", &[]).unwrap_err();
        assert_eq!(errors(&errs), [("limits.redis.username", need)]);
        // An unset variable is its own error, not this one too.
        let errs = redis(
            "address = \"redis://sluice@127.0.0.1\"\npassword_env = \"NOPE\"",
            &[],
        )
        .unwrap_err();
        assert_eq!(
            errors(&errs),
            [(
                "limits.redis.password_env",
                "environment variable `NOPE` is not set"
            )]
        );
    }

    #[test]
    fn bad_addresses_are_reported_without_their_password() {
        let errs = redis("address = \"rediss://u:tlssecret@127.0.0.1/1\"", &[]).unwrap_err();
        assert_eq!(errs.len(), 1, "{errs:?}");
        assert_eq!(errs[0].0, "limits.redis.address");
        assert!(
            errs[0]
                .1
                .starts_with("TLS to Redis is not supported yet (`rediss://`)"),
            "{errs:?}"
        );
        let errs = redis(
            "address = \"redis://u:dnssecret@no-such-host.invalid:6379/1\"",
            &[],
        )
        .unwrap_err();
        assert_eq!(errs.len(), 1, "{errs:?}");
        assert_eq!(errs[0].0, "limits.redis.address");
        assert!(
            errs[0]
                .1
                .starts_with("`no-such-host.invalid:6379` does not resolve"),
            "{errs:?}"
        );
        assert!(!errs[0].1.contains("dnssecret"), "{errs:?}");
    }

    #[test]
    fn cluster_seeds_take_urls_without_credentials_and_only_db_0() {
        let r = redis(
            "address = \"redis://:pw@127.0.0.1:7000\"\ncluster = true\n\
             seeds = [\"redis://127.0.0.1:7001\", \"127.0.0.1:7002\", \"redis://127.0.0.1:7003/0\"]",
            &[],
        )
        .unwrap();
        let ports: Vec<u16> = r.cluster_seeds.unwrap().iter().map(|a| a.port()).collect();
        assert_eq!(ports, [7000, 7001, 7002, 7003]);
        assert_eq!(r.password.as_deref(), Some("pw"));
        let errs = redis(
            "address = \"redis://127.0.0.1:7000/1\"\ncluster = true\n\
             seeds = [\"redis://:pw@127.0.0.1:7001\", \"redis://127.0.0.1:7002/2\", \
             \"rediss://127.0.0.1:7003\"]",
            &[],
        )
        .unwrap_err();
        let errs = errors(&errs);
        assert_eq!(errs.len(), 4, "{errs:?}");
        assert_eq!(
            errs[0],
            (
                "limits.redis.address",
                "a Redis Cluster has only database 0"
            )
        );
        assert_eq!(
            errs[1],
            (
                "limits.redis.seeds[0]",
                "a seed takes no user or password: every node is reached with address's (or \
                 username / password_env)"
            )
        );
        assert_eq!(
            errs[2],
            (
                "limits.redis.seeds[1]",
                "a Redis Cluster has only database 0"
            )
        );
        assert_eq!(errs[3].0, "limits.redis.seeds[2]");
        assert!(errs[3].1.starts_with("TLS to Redis is not supported yet"));
    }

    #[test]
    fn reservations() {
        let r = Reserve::default();
        assert_eq!(r.tokens(100, Some(50), None), 150);
        assert_eq!(r.tokens(100, Some(50), Some(3)), 250);
        assert_eq!(r.tokens(100, Some(1 << 40), None), 100 + 16_384);
        assert_eq!(r.tokens(100, None, None), 612);
    }
}

//! The validated keys, plans, policies and limiter settings the workers read.

use std::collections::HashMap;
use std::net::{IpAddr, SocketAddr};
use std::time::Duration;

use crate::config::ModelPattern;

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
    pub(super) fn of(keys: &[ApiKey], entities: &[String], policies: &[Policy]) -> StableIds {
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
    /// The priority class named (resolved against `[saturation]`'s classes there).
    pub(crate) class: Option<String>,
    pub(crate) queue_weight: u32,
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
    /// `on_limit = "queue"`: how long a request over this policy waits for room (`None`:
    /// refused at once).
    pub(crate) queue_wait: Option<Duration>,
}

impl Policy {
    pub(crate) fn applies_to_model(&self, model: &str) -> bool {
        self.models.is_empty() || self.models.iter().any(|p| p.matches(model))
    }

    pub(super) fn is_global(&self) -> bool {
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

/// The longest a worker waits between reconnect attempts to an unreachable ledger: a recovered
/// ledger is found within this plus one interval and one timeout ([`SyncSettings::rejoin_within`]).
pub(crate) const RECONNECT_BACKOFF_MAX: Duration = Duration::from_millis(250);

impl SyncSettings {
    /// How soon after the ledger is reachable again every worker has found it: its next
    /// reconnect attempt, the interval to its next exchange, and that exchange's deadline.
    pub(crate) fn rejoin_within(&self) -> Duration {
        RECONNECT_BACKOFF_MAX + self.interval + self.timeout
    }
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

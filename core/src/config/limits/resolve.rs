//! The limits sections validated into the [`LimitsConfig`](super::LimitsConfig) workers read:
//! policies, keys and plans, each problem pushed with its key path.

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use super::checks::{check_id, check_unique_id, parse_digest, parse_period, unix_seconds};
use super::raw::{RawKey, RawLimits, RawPlan, RawPolicy, RawReserve};
use super::redis::resolve_backend;
use super::snapshot::{
    ApiKey, Cidr, DownPolicy, KeysByDigest, LimitsConfig, Per, Period, Plan, Policy, PolicyIdx,
    RateLimit, Reserve, SettleTokenizer, StableIds, SyncSettings,
};
use crate::config::ModelPattern;

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

/// A policy's requests or tokens window when it gives none.
pub(crate) const DEFAULT_WINDOW_SECS: u64 = 60;

pub(super) fn rate(
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
    let queue_wait = match rp.on_limit.as_str() {
        "refuse" => None,
        "queue" => Some(Duration::from_millis(rp.max_queue_wait_ms.min(3_600_000))),
        other => {
            err(
                format!("{path}.on_limit"),
                format!("`{other}` is neither \"refuse\" nor \"queue\""),
            );
            None
        }
    };
    if rp.max_queue_wait_ms > 3_600_000 {
        err(
            format!("{path}.max_queue_wait_ms"),
            "at most 3600000 (an hour)".into(),
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
        queue_wait,
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
        let parsed = parse_digest(&rk.sha256.to_ascii_lowercase());
        if parsed.is_none() {
            err(
                format!("{path}.sha256"),
                "must be 64 hex digits (`sluice key hash` prints it)".into(),
            );
        }
        // A digest that is not one stands for no key: the hash of its text (never a placeholder
        // pattern, so no warning echoes the error; a config with it does not load anyway).
        let digest = parsed.unwrap_or_else(|| super::digest(rk.sha256.as_bytes()));
        if let Some(prev) = by_digest.insert(digest, i).filter(|_| parsed.is_some()) {
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
        class: rk.class.clone(),
        queue_weight: rk.queue_weight,
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

//! `[saturation]`: what happens when every backend a request could go to is at its cap — the
//! priority classes, their deadlines and shedding, the wait queue's bounds, how keys share a
//! class, and which headers a client may lower its class or shorten its wait with. Read and
//! validated here, once; used by the route phase (a target's `max_in_flight` becomes a cap)
//! and the wait queue (`gateway::queue`).

use std::collections::BTreeMap;
use std::time::Duration;

use serde::Deserialize;

/// `[saturation]`.
#[derive(Debug, Deserialize)]
#[cfg_attr(test, derive(serde::Serialize))]
#[serde(deny_unknown_fields)]
pub(super) struct RawSaturation {
    /// The classes, highest first (at least one: the resolver says so).
    #[serde(default)]
    classes: Vec<RawClass>,
    /// The class of a request neither its key nor its route names (default: the last).
    default_class: Option<String>,
    #[serde(default = "default_max_queued")]
    max_queued_per_worker: usize,
    /// `"requests"` or `"tokens"`: what a key's share of a class is counted in.
    #[serde(default = "default_fair_by")]
    fair_by: String,
    #[serde(default = "default_priority_header")]
    priority_header: String,
    #[serde(default = "default_max_wait_header")]
    max_wait_header: String,
    /// How often the best waiter of a worker looks for a slot another worker freed.
    #[serde(default = "default_poll_ms")]
    poll_ms: u64,
    /// The class of each named entity's keys (those that name none themselves).
    #[serde(default)]
    entities: BTreeMap<String, String>,
}

/// `saturation.classes[]`.
#[derive(Debug, Deserialize)]
#[cfg_attr(test, derive(serde::Serialize))]
#[serde(deny_unknown_fields)]
pub(super) struct RawClass {
    name: String,
    #[serde(default = "default_max_wait_ms")]
    max_wait_ms: u64,
    #[serde(default)]
    sheddable: bool,
    #[serde(default)]
    refuse_while_higher_waits: bool,
}

fn default_max_queued() -> usize {
    1_024
}
fn default_fair_by() -> String {
    "requests".into()
}
fn default_priority_header() -> String {
    "x-sluice-priority".into()
}
fn default_max_wait_header() -> String {
    "x-sluice-max-wait-ms".into()
}
fn default_poll_ms() -> u64 {
    2
}
fn default_max_wait_ms() -> u64 {
    30_000
}

/// The most classes (a class is 3 bits of a waiter's rank).
pub(crate) const MAX_CLASSES: usize = 8;
/// The longest a class may let a request wait.
const MAX_WAIT_MS: u64 = 3_600_000;
/// The most a key's share of a class may weigh.
pub(crate) const MAX_QUEUE_WEIGHT: u32 = 1_000;

/// One priority class.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct PriorityClass {
    pub(crate) name: String,
    /// The longest a request of this class waits for room.
    pub(crate) max_wait: Duration,
    /// Dropped first when the queue is full.
    pub(crate) sheddable: bool,
    /// Refused at once, not queued, while a request of a higher class waits.
    pub(crate) refuse_while_higher_waits: bool,
}

/// The validated `[saturation]` section, with the class each key and route names (resolved
/// against the classes by [`resolve_saturation`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Saturation {
    /// Highest first: a class's index is its rank (0 goes first).
    pub(crate) classes: Vec<PriorityClass>,
    pub(crate) default_class: u8,
    pub(crate) max_queued_per_worker: usize,
    /// A key's share of its class counted in tokens (prompt estimate + `max_tokens`), not
    /// requests.
    pub(crate) fair_by_tokens: bool,
    /// Lower case.
    pub(crate) priority_header: String,
    pub(crate) max_wait_header: String,
    pub(crate) poll: Duration,
    /// Per key index: the class its `class` names, and its `queue_weight`.
    pub(crate) key_class: Vec<Option<u8>>,
    /// Per entity index (`LimitsConfig::entities`): the class `entities` gives it.
    pub(crate) entity_class: Vec<Option<u8>>,
    pub(crate) key_weight: Vec<u32>,
    /// Per route index (as stored: most specific first): the class its `class` names.
    pub(crate) route_class: Vec<Option<u8>>,
}

impl Saturation {
    /// The class a request gets from its key, else its key's entity, else its route, else the
    /// default.
    pub(crate) fn class_of(&self, key: Option<usize>, entity: Option<usize>, route: usize) -> u8 {
        key.and_then(|k| self.key_class.get(k).copied().flatten())
            .or_else(|| entity.and_then(|e| self.entity_class.get(e).copied().flatten()))
            .or_else(|| self.route_class.get(route).copied().flatten())
            .unwrap_or(self.default_class)
    }

    /// The class named `name`.
    pub(crate) fn class_named(&self, name: &str) -> Option<u8> {
        self.classes
            .iter()
            .position(|c| c.name.eq_ignore_ascii_case(name))
            .map(|i| i as u8)
    }
}

/// Check `[saturation]`; `keys` are each key's `(id, class, queue_weight)`, `entities` the
/// keys' entities (sorted, as `LimitsConfig::entities`) and `routes` each stored route's
/// `(pattern, class)`.
pub(super) fn resolve_saturation(
    raw: &RawSaturation,
    keys: &[(&str, Option<&str>, u32)],
    entities: &[String],
    routes: &[(&str, Option<&str>)],
    err: &mut dyn FnMut(String, String),
) -> Saturation {
    let classes = resolve_classes(&raw.classes, err);
    let named = |name: &str| classes.iter().position(|c| c.name == name).map(|i| i as u8);
    let last = classes.len().saturating_sub(1) as u8;
    let default_class = match &raw.default_class {
        None => last,
        Some(name) => named(name).unwrap_or_else(|| {
            err(
                "saturation.default_class".into(),
                format!("no class named `{name}` in saturation.classes"),
            );
            last
        }),
    };
    if raw.max_queued_per_worker == 0 {
        err(
            "saturation.max_queued_per_worker".into(),
            "must be at least 1".into(),
        );
    }
    let fair_by_tokens = match raw.fair_by.as_str() {
        "requests" => false,
        "tokens" => true,
        other => {
            err(
                "saturation.fair_by".into(),
                format!("`{other}` is neither \"requests\" nor \"tokens\""),
            );
            false
        }
    };
    for (key, value) in [
        ("priority_header", &raw.priority_header),
        ("max_wait_header", &raw.max_wait_header),
    ] {
        if !is_token(value) {
            err(
                format!("saturation.{key}"),
                format!("`{value}` is not a header name"),
            );
        }
    }
    if !(1..=1_000).contains(&raw.poll_ms) {
        err("saturation.poll_ms".into(), "must be 1 to 1000".into());
    }
    let mut key_class = Vec::with_capacity(keys.len());
    let mut key_weight = Vec::with_capacity(keys.len());
    for (i, (_, class, weight)) in keys.iter().enumerate() {
        key_class.push(class.and_then(|name| {
            let found = named(name);
            if found.is_none() {
                err(
                    format!("keys[{i}].class"),
                    format!("no class named `{name}` in saturation.classes"),
                );
            }
            found
        }));
        if !(1..=MAX_QUEUE_WEIGHT).contains(weight) {
            err(
                format!("keys[{i}].queue_weight"),
                format!("must be 1 to {MAX_QUEUE_WEIGHT}"),
            );
        }
        key_weight.push((*weight).clamp(1, MAX_QUEUE_WEIGHT));
    }
    let mut entity_class = vec![None; entities.len()];
    for (entity, class) in &raw.entities {
        let path = format!("saturation.entities.{entity}");
        let Ok(at) = entities.binary_search(entity) else {
            err(path, format!("no key has the entity `{entity}`"));
            continue;
        };
        match named(class) {
            Some(c) => entity_class[at] = Some(c),
            None => err(
                path,
                format!("no class named `{class}` in saturation.classes"),
            ),
        }
    }
    let route_class = routes
        .iter()
        .map(|(pattern, class)| {
            class.and_then(|name| {
                let found = named(name);
                if found.is_none() {
                    err(
                        "routes".into(),
                        format!(
                            "the route for `{pattern}` names class `{name}`, which \
                             saturation.classes lacks"
                        ),
                    );
                }
                found
            })
        })
        .collect();
    Saturation {
        classes,
        default_class,
        max_queued_per_worker: raw.max_queued_per_worker.max(1),
        fair_by_tokens,
        priority_header: raw.priority_header.to_ascii_lowercase(),
        max_wait_header: raw.max_wait_header.to_ascii_lowercase(),
        poll: Duration::from_millis(raw.poll_ms.clamp(1, 1_000)),
        key_class,
        key_weight,
        entity_class,
        route_class,
    }
}

fn resolve_classes(raw: &[RawClass], err: &mut dyn FnMut(String, String)) -> Vec<PriorityClass> {
    if raw.is_empty() || raw.len() > MAX_CLASSES {
        err(
            "saturation.classes".into(),
            format!("1 to {MAX_CLASSES} classes, highest first"),
        );
    }
    let mut classes: Vec<PriorityClass> = Vec::with_capacity(raw.len());
    for (i, c) in raw.iter().take(MAX_CLASSES).enumerate() {
        let path = format!("saturation.classes[{i}]");
        if c.name.is_empty() || !is_token(&c.name) {
            err(
                format!("{path}.name"),
                "a class name is letters, digits, `-` or `_`".into(),
            );
        }
        if classes.iter().any(|k| k.name == c.name) {
            err(
                format!("{path}.name"),
                format!("`{}` is named twice", c.name),
            );
        }
        if c.max_wait_ms > MAX_WAIT_MS {
            err(
                format!("{path}.max_wait_ms"),
                format!("at most {MAX_WAIT_MS} (an hour)"),
            );
        }
        classes.push(PriorityClass {
            name: c.name.clone(),
            max_wait: Duration::from_millis(c.max_wait_ms.min(MAX_WAIT_MS)),
            sheddable: c.sheddable,
            refuse_while_higher_waits: c.refuse_while_higher_waits,
        });
    }
    classes
}

/// Letters, digits, `-` and `_`: a header name (or a class name, sent in one).
fn is_token(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= 64
        && s.bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    const KEYS: &str = r#"
        [clusters.c]
        backends = [{ base_url = "http://127.0.0.1:9/v1" }]
        [[routes]]
        model = "batch-*"
        cluster = "c"
        class = "batch"
        [[routes]]
        model = "*"
        cluster = "c"
        [[keys]]
        id = "own"
        sha256 = "0000000000000000000000000000000000000000000000000000000000000001"
        entity = "evals"
        class = "interactive"
        [[keys]]
        id = "by-entity"
        sha256 = "0000000000000000000000000000000000000000000000000000000000000002"
        entity = "evals"
        [[keys]]
        id = "plain"
        sha256 = "0000000000000000000000000000000000000000000000000000000000000003"
    "#;

    /// A key's own class, else its entity's, else its route's, else the default.
    #[test]
    fn a_class_comes_from_the_key_then_the_entity_then_the_route() {
        let text = format!(
            r#"{KEYS}
            [saturation]
            classes = [{{ name = "interactive" }}, {{ name = "standard" }}, {{ name = "batch" }}]
            default_class = "standard"
            entities = {{ "evals" = "batch" }}
            "#
        );
        let s = crate::config::load(&text, &|_| None).unwrap();
        let sat = s.saturation.as_ref().unwrap();
        let evals = s.limits.entities.binary_search(&"evals".to_string()).ok();
        let (batch_route, any_route) = (0, 1);
        assert_eq!(sat.class_of(Some(0), evals, any_route), 0, "the key's own");
        assert_eq!(sat.class_of(Some(1), evals, any_route), 2, "its entity's");
        assert_eq!(sat.class_of(Some(2), None, batch_route), 2, "the route's");
        assert_eq!(sat.class_of(Some(2), None, any_route), 1, "the default");
        assert_eq!(sat.class_of(None, None, any_route), 1);
    }

    #[test]
    fn an_entity_no_key_has_or_a_class_not_defined_is_an_error() {
        let text = format!(
            r#"{KEYS}
            [saturation]
            classes = [{{ name = "interactive" }}]
            entities = {{ "nobody" = "interactive", "evals" = "urgent" }}
            "#
        );
        let errors = crate::config::load(&text, &|_| None).unwrap_err();
        let e: Vec<String> = errors.iter().map(ToString::to_string).collect();
        let e = e.join("\n");
        assert!(e.contains("saturation.entities.nobody"), "{e}");
        assert!(e.contains("no key has the entity `nobody`"), "{e}");
        assert!(e.contains("saturation.entities.evals"), "{e}");
        assert!(e.contains("no class named `urgent`"), "{e}");
    }
}

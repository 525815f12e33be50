//! Routes resolved: model patterns, scopes, target groups, each target checked against the
//! cluster table.

use std::collections::BTreeMap;
use std::time::Duration;

use super::raw::{RawGroup, RawRoute, RawTarget};
use super::snapshot::{ClusterId, ModelPattern, Route, RouteScope, RouteTarget, TargetGroup};
use super::{limits, routing, sticky};

/// The routes, most specific first: exact names, then globs by literal length (file order among
/// equals).
pub(super) fn resolve_routes(
    raw: &[Option<RawRoute>],
    clusters: &BTreeMap<String, Option<ClusterId>>,
    first_byte_default: Duration,
    limits: Option<&limits::LimitsConfig>,
    err: &mut dyn FnMut(String, String),
) -> Vec<Route> {
    if raw.is_empty() {
        err("routes".into(), "at least one route is required".into());
    }
    let mut routes = Vec::new();
    // (model, whose) → the route that has it: a key (or entity) with two routes for one model
    // name would have its choice made by file order.
    let mut seen = BTreeMap::new();
    for (i, rr) in raw.iter().enumerate() {
        let Some(rr) = rr else {
            continue; // Not readable: its error is reported.
        };
        let path = format!("routes[{i}]");
        if rr.model.is_empty() {
            err(format!("{path}.model"), "must not be empty".into());
        }
        let whose: Vec<String> = match (rr.keys.is_empty(), rr.entities.is_empty()) {
            (true, true) => vec![String::new()],
            (false, true) => rr.keys.iter().map(|k| format!("key `{k}`")).collect(),
            (true, false) => rr
                .entities
                .iter()
                .map(|e| format!("entity `{e}`"))
                .collect(),
            (false, false) => {
                err(
                    format!("{path}.entities"),
                    "a route is for `keys` or for `entities`, not both (give each its own route)"
                        .into(),
                );
                Vec::new()
            }
        };
        for who in whose {
            if let Some(prev) = seen.insert((rr.model.clone(), who.clone()), i) {
                let whom = if who.is_empty() {
                    String::new()
                } else {
                    format!(" for {who}")
                };
                err(
                    format!("{path}.model"),
                    format!("`{}` is already routed{whom} by routes[{prev}]", rr.model),
                );
            }
        }
        let scope = resolve_scope(rr, limits, &path, err);
        routes.extend(
            resolve_route(rr, clusters, first_byte_default, &path, err).map(|mut route| {
                route.scope = scope;
                route
            }),
        );
    }
    routes.sort_by_key(|r| match &r.pattern {
        ModelPattern::Exact(_) => (r.scope.rank(), 0, 0),
        ModelPattern::Glob { .. } => (r.scope.rank(), 1, usize::MAX - r.pattern.literal_len()),
    });
    routes
}

/// A route's `keys` / `entities`, by index; each must name one that exists (`limits` is `None`
/// when the keys could not be read: their errors are reported, and these are not checked).
pub(super) fn resolve_scope(
    rr: &RawRoute,
    limits: Option<&limits::LimitsConfig>,
    path: &str,
    err: &mut dyn FnMut(String, String),
) -> RouteScope {
    let Some(limits) = limits else {
        return RouteScope::Global;
    };
    if !rr.keys.is_empty() {
        let mut keys = Vec::new();
        for (j, id) in rr.keys.iter().enumerate() {
            match limits.keys.iter().position(|k| &k.id == id) {
                Some(index) => keys.push(index),
                None => err(format!("{path}.keys[{j}]"), format!("no key has id `{id}`")),
            }
        }
        return RouteScope::Keys(keys);
    }
    if !rr.entities.is_empty() {
        let mut entities = Vec::new();
        for (j, name) in rr.entities.iter().enumerate() {
            match limits.entities.iter().position(|e| e == name) {
                Some(index) => entities.push(index),
                None => err(
                    format!("{path}.entities[{j}]"),
                    format!("no key has entity `{name}`"),
                ),
            }
        }
        return RouteScope::Entities(entities);
    }
    RouteScope::Global
}

/// One route, its model name already checked; `None` when its cluster is not one that could be
/// read.
pub(super) fn resolve_route(
    rr: &RawRoute,
    clusters: &BTreeMap<String, Option<ClusterId>>,
    first_byte_default: Duration,
    path: &str,
    err: &mut dyn FnMut(String, String),
) -> Option<Route> {
    let pattern = ModelPattern::parse(&rr.model);
    if !rr.models.is_empty() && matches!(pattern, ModelPattern::Exact(_)) {
        err(
            format!("{path}.models"),
            "only a glob route (a `model` with `*`) declares models; an exact route is listed \
             by its name"
                .into(),
        );
    }
    for (j, m) in rr.models.iter().enumerate() {
        if !pattern.matches(m) {
            err(
                format!("{path}.models[{j}]"),
                format!("`{m}` does not match the route's pattern `{}`", rr.model),
            );
        }
    }
    let shorthand;
    let raw_groups: &[RawGroup] = match (&rr.cluster, rr.groups.is_empty()) {
        (Some(cluster), true) => {
            shorthand = [RawGroup {
                targets: vec![RawTarget {
                    cluster: cluster.clone(),
                    model: None,
                    weight: 1,
                    context_window: None,
                    max_in_flight: None,
                    max_waiting: None,
                }],
                strategy: routing::Strategy::default(),
                when: None,
                first_byte_timeout_ms: None,
            }];
            &shorthand
        }
        (None, false) => &rr.groups,
        (Some(_), false) => {
            err(
                format!("{path}.groups"),
                "a route has either `cluster` or `groups`, not both".into(),
            );
            return None;
        }
        (None, true) => {
            err(
                path.to_string(),
                "a route needs `cluster` (one cluster) or `groups` (target groups in fallback \
                 order)"
                    .into(),
            );
            return None;
        }
    };
    let mut groups = Vec::new();
    let mut complete = true;
    for (g, raw_group) in raw_groups.iter().enumerate() {
        let group_path = format!("{path}.groups[{g}]");
        if raw_group.targets.is_empty() {
            err(
                format!("{group_path}.targets"),
                "at least one target is required".into(),
            );
        }
        let when = raw_group.when.as_ref().map(|labels| {
            if g == 0 {
                err(
                    format!("{group_path}.when"),
                    "the first group is where every request starts: only a later group has a \
                     condition"
                        .into(),
                );
            }
            routing::FallbackOn::parse(labels, &format!("{group_path}.when"), err)
        });
        if raw_group.first_byte_timeout_ms == Some(0) {
            err(
                format!("{group_path}.first_byte_timeout_ms"),
                "must be at least 1 ms".into(),
            );
        }
        let first_byte_timeout = raw_group
            .first_byte_timeout_ms
            .map_or(first_byte_default, |ms| Duration::from_millis(ms.max(1)));
        let mut targets = Vec::new();
        for (t, rt) in raw_group.targets.iter().enumerate() {
            // The shorthand's errors are the route's own key.
            let target_path = if rr.cluster.is_some() {
                path.to_string()
            } else {
                format!("{group_path}.targets[{t}]")
            };
            if rt.weight == 0 {
                err(format!("{target_path}.weight"), "must be at least 1".into());
            }
            if rt.model.as_deref() == Some("") {
                err(format!("{target_path}.model"), "must not be empty".into());
            }
            if rt.context_window == Some(0) {
                err(
                    format!("{target_path}.context_window"),
                    "must be at least 1".into(),
                );
            }
            if rt.max_waiting == Some(0) {
                err(
                    format!("{target_path}.max_waiting"),
                    "must be at least 1".into(),
                );
            }
            if rt.max_in_flight == Some(0) {
                err(
                    format!("{target_path}.max_in_flight"),
                    "must be at least 1".into(),
                );
            }
            match clusters.get(&rt.cluster) {
                Some(Some(id)) => targets.push(RouteTarget {
                    cluster: *id,
                    model: rt.model.clone(),
                    weight: rt.weight.max(1),
                    context_window: rt.context_window,
                    max_in_flight: rt.max_in_flight,
                    max_waiting: rt.max_waiting,
                }),
                // Not readable: its error is reported.
                Some(None) => complete = false,
                None => {
                    err(
                        format!("{target_path}.cluster"),
                        format!("no cluster named `{}`", rt.cluster),
                    );
                    complete = false;
                }
            }
        }
        groups.push(TargetGroup {
            targets,
            strategy: raw_group.strategy,
            when,
            first_byte_timeout,
        });
    }
    if !complete {
        return None;
    }
    let sticky = rr
        .sticky
        .as_ref()
        .map(|raw| sticky::resolve_rule(raw, path, err));
    Some(Route {
        pattern,
        groups,
        sticky,
        models: rr.models.clone(),
        scope: RouteScope::Global,
        class: rr.class.clone(),
    })
}

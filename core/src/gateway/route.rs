//! Route: the ordered candidate targets for a request's model.
//!
//! Runs after inspection. Takes the config snapshot, the requested model and the worker's random
//! state; returns [`Candidates`]: the targets to try, in order. The first is one backend of the
//! route's cluster chosen by weight; the rest are the cluster's other backends, in config order —
//! what a fallback walks (the pipeline sends to the first only, today). Each [`Target`] carries
//! the model name the upstream will see (the cluster's `model_map` entry, when there is one).
//! Routes are stored most specific first (exact names, then globs by literal length), so the
//! first match is the most specific. Raises 404 `model_not_found` when no route matches.
//!
//! [`choose_backend`] is the seam where health and load-aware choice plug in; today it is
//! weighted random.

use std::cell::Cell;

use crate::config::{Backend, Cluster, ClusterId, Snapshot};
use crate::gateway::error::GatewayError;

/// Where one attempt of a request goes.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Target<'s> {
    pub(crate) cluster_id: ClusterId,
    pub(crate) cluster: &'s Cluster,
    pub(crate) backend: &'s Backend,
    /// The model name to put in the forwarded body, when it differs from the requested one.
    pub(crate) mapped_model: Option<&'s str>,
}

/// A request's targets in the order to try them: [`Candidates::primary`] first, then what the
/// iterator yields. Borrowed from the snapshot; allocates nothing.
#[derive(Debug, Clone)]
pub(crate) struct Candidates<'s> {
    primary: Target<'s>,
    /// Index of the primary's backend in its cluster (skipped by the iteration).
    primary_index: usize,
    /// The next backend index the iteration looks at.
    next: usize,
}

impl<'s> Candidates<'s> {
    /// The first target to try.
    pub(crate) fn primary(&self) -> Target<'s> {
        self.primary
    }
}

/// The fallbacks after the primary, in order.
impl<'s> Iterator for Candidates<'s> {
    type Item = Target<'s>;

    fn next(&mut self) -> Option<Target<'s>> {
        let backends = &self.primary.cluster.backends;
        if self.next == self.primary_index {
            self.next += 1;
        }
        let backend = backends.get(self.next)?;
        self.next += 1;
        Some(Target {
            backend,
            ..self.primary
        })
    }
}

pub(crate) fn route<'s>(
    snapshot: &'s Snapshot,
    model: &str,
    rng: &Cell<u64>,
) -> Result<Candidates<'s>, GatewayError> {
    let route = snapshot
        .routes
        .iter()
        .find(|r| r.pattern.matches(model))
        .ok_or_else(|| GatewayError::model_not_found(model))?;
    let cluster = &snapshot.clusters[route.cluster];
    let primary_index = choose_backend(cluster, rng);
    let mapped_model = cluster
        .model_map
        .get(model)
        .map(String::as_str)
        .filter(|m| *m != model);
    Ok(Candidates {
        primary: Target {
            cluster_id: route.cluster,
            cluster,
            backend: &cluster.backends[primary_index],
            mapped_model,
        },
        primary_index,
        next: 0,
    })
}

/// Weighted random choice among the cluster's backends: its index (config guarantees at least
/// one backend, and a positive total weight).
pub(crate) fn choose_backend(cluster: &Cluster, rng: &Cell<u64>) -> usize {
    let backends = &cluster.backends;
    if backends.len() == 1 || cluster.total_weight == 0 {
        return 0;
    }
    let mut pick = next_random(rng) % cluster.total_weight;
    for (i, b) in backends.iter().enumerate() {
        let w = u64::from(b.weight);
        if pick < w {
            return i;
        }
        pick -= w;
    }
    backends.len() - 1
}

/// xorshift64*: fast, per-worker, good enough for load spreading (not for secrets).
pub(crate) fn next_random(state: &Cell<u64>) -> u64 {
    let mut x = state.get();
    x ^= x >> 12;
    x ^= x << 25;
    x ^= x >> 27;
    state.set(x);
    x.wrapping_mul(0x2545_f491_4f6c_dd1d)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    fn snapshot() -> Snapshot {
        let text = r#"
            [clusters.a]
            backends = [{ base_url = "http://127.0.0.1:1/v1", weight = 3 }, { base_url = "http://127.0.0.1:2/v1", weight = 1 }]
            model_map = { "gpt-4o" = "real-4o" }
            [clusters.b]
            backends = [{ base_url = "http://127.0.0.1:3" }]
            [[routes]]
            model = "gpt-*"
            cluster = "b"
            [[routes]]
            model = "gpt-4o"
            cluster = "a"
            [[routes]]
            model = "gpt-4o-*"
            cluster = "a"
        "#;
        crate::config::load(text, &|_| None).unwrap()
    }

    #[test]
    fn most_specific_wins_and_maps() {
        let s = snapshot();
        let rng = Cell::new(1);
        let primary = |model| route(&s, model, &rng).unwrap().primary();
        let t = primary("gpt-4o");
        assert_eq!(t.cluster.name, "a");
        assert_eq!(t.mapped_model, Some("real-4o"));
        assert_eq!(primary("gpt-4o-mini").cluster.name, "a");
        assert_eq!(primary("gpt-3.5").cluster.name, "b");
        assert_eq!(primary("gpt-3.5").mapped_model, None);
        let e = route(&s, "claude", &rng).unwrap_err();
        assert_eq!((e.status(), e.code()), (404, Some("model_not_found")));
    }

    #[test]
    fn weights_are_respected() {
        let s = snapshot();
        let rng = Cell::new(0x9e37_79b9_7f4a_7c15);
        let mut first = 0;
        for _ in 0..10_000 {
            if choose_backend(&s.clusters[0], &rng) == 0 {
                first += 1;
            }
        }
        assert!((7_000..8_000).contains(&first), "{first}");
    }

    #[test]
    fn candidates_are_the_pick_then_the_clusters_other_backends_in_order() {
        let s = snapshot();
        let ids = |c: &Cluster| c.backends.iter().map(|b| b.id).collect::<Vec<_>>();
        let a = ids(&s.clusters[0]);
        let mut seen_primaries = std::collections::BTreeSet::new();
        for seed in 1..64u64 {
            let rng = Cell::new(seed.wrapping_mul(0x9e37_79b9_7f4a_7c15));
            let mut candidates = route(&s, "gpt-4o", &rng).unwrap();
            let primary = candidates.primary();
            seen_primaries.insert(primary.backend.id);
            let rest: Vec<_> = candidates.clone().map(|t| t.backend.id).collect();
            // Every backend exactly once, the primary first, the others in config order.
            let expected: Vec<_> = a
                .iter()
                .copied()
                .filter(|&id| id != primary.backend.id)
                .collect();
            assert_eq!(rest, expected, "seed {seed}");
            // Fallbacks keep the route's cluster and mapped model.
            assert!(candidates
                .all(|t| t.cluster_id == primary.cluster_id && t.mapped_model == Some("real-4o")));
        }
        // Both backends get to be primary (the weighted pick, not always the first).
        assert_eq!(seen_primaries.len(), 2);
        // A one-backend cluster has no fallback.
        let rng = Cell::new(7);
        assert_eq!(route(&s, "gpt-3.5", &rng).unwrap().count(), 0);
    }
}

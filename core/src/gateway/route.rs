//! Route: pick the cluster and backend for a request's model.
//!
//! Runs after inspection. Takes the config snapshot, the requested model and the worker's random
//! state; returns a [`Target`]: the cluster, one backend chosen by weight, and the model name the
//! upstream will see (the cluster's `model_map` entry, when there is one). Routes are stored most
//! specific first (exact names, then globs by literal length), so the first match is the most
//! specific. Raises 404 `model_not_found` when no route matches.
//!
//! [`choose_backend`] is the seam where health and load-aware choice plug in; today it is
//! weighted random.

use std::cell::Cell;

use crate::config::{Backend, Cluster, Snapshot};
use crate::gateway::error::GatewayError;

/// Where one request goes.
#[derive(Debug, Clone, Copy)]
pub struct Target<'s> {
    pub cluster_id: usize,
    pub cluster: &'s Cluster,
    pub backend: &'s Backend,
    /// The model name to put in the forwarded body, when it differs from the requested one.
    pub mapped_model: Option<&'s str>,
}

pub fn route<'s>(
    snapshot: &'s Snapshot,
    model: &str,
    rng: &Cell<u64>,
) -> Result<Target<'s>, GatewayError> {
    let route = snapshot
        .routes
        .iter()
        .find(|r| r.pattern.matches(model))
        .ok_or_else(|| GatewayError::model_not_found(model))?;
    let cluster = &snapshot.clusters[route.cluster];
    let backend = choose_backend(cluster, rng);
    let mapped_model = cluster
        .model_map
        .get(model)
        .map(String::as_str)
        .filter(|m| *m != model);
    Ok(Target {
        cluster_id: route.cluster,
        cluster,
        backend,
        mapped_model,
    })
}

/// Weighted random choice among the cluster's backends (config guarantees at least one, and a
/// positive total weight).
pub fn choose_backend<'s>(cluster: &'s Cluster, rng: &Cell<u64>) -> &'s Backend {
    let backends = &cluster.backends;
    if backends.len() == 1 || cluster.total_weight == 0 {
        return &backends[0];
    }
    let mut pick = next_random(rng) % cluster.total_weight;
    for b in backends {
        let w = u64::from(b.weight);
        if pick < w {
            return b;
        }
        pick -= w;
    }
    &backends[backends.len() - 1]
}

/// xorshift64*: fast, per-worker, good enough for load spreading (not for secrets).
pub fn next_random(state: &Cell<u64>) -> u64 {
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
        let t = route(&s, "gpt-4o", &rng).unwrap();
        assert_eq!(t.cluster.name, "a");
        assert_eq!(t.mapped_model, Some("real-4o"));
        assert_eq!(route(&s, "gpt-4o-mini", &rng).unwrap().cluster.name, "a");
        assert_eq!(route(&s, "gpt-3.5", &rng).unwrap().cluster.name, "b");
        assert_eq!(route(&s, "gpt-3.5", &rng).unwrap().mapped_model, None);
        let e = route(&s, "claude", &rng).unwrap_err();
        assert_eq!((e.status(), e.code()), (404, Some("model_not_found")));
    }

    #[test]
    fn weights_are_respected() {
        let s = snapshot();
        let rng = Cell::new(0x9e37_79b9_7f4a_7c15);
        let mut first = 0;
        for _ in 0..10_000 {
            if choose_backend(&s.clusters[0], &rng).id == s.clusters[0].backends[0].id {
                first += 1;
            }
        }
        assert!((7_000..8_000).contains(&first), "{first}");
    }
}

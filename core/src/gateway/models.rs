//! `GET /v1/models`: the models a client can ask for, in OpenAI's list format.
//!
//! Built once per config snapshot (and per request only for keys with model lists). Listed are
//! the concrete names that route: exact route names, the models a glob route declares
//! (`[[routes]] models = [...]`: a glob itself can't be enumerated), and each cluster's
//! `model_map` names, both sides — a name is listed only when a request for it would be routed,
//! so the list never offers a model that answers 404. Sorted by name, each once.

use crate::config::limits::ApiKey;
use crate::config::{ModelPattern, Snapshot};
use crate::openai::json::push_json_string;

pub(crate) fn list_body(snapshot: &Snapshot) -> Vec<u8> {
    body(snapshot, |_| true)
}

/// The list as one key sees it: only models its allow / block lists let it use (built per
/// request, for keys that have such lists).
pub(crate) fn list_body_for(snapshot: &Snapshot, key: &ApiKey) -> Vec<u8> {
    body(snapshot, |m| key.may_use(m))
}

fn body(snapshot: &Snapshot, keep: impl Fn(&str) -> bool) -> Vec<u8> {
    let mut names: Vec<&str> = snapshot
        .routes
        .iter()
        .flat_map(|r| {
            let exact = match &r.pattern {
                ModelPattern::Exact(m) => Some(m.as_str()),
                ModelPattern::Glob { .. } => None,
            };
            exact.into_iter().chain(r.models.iter().map(String::as_str))
        })
        .chain(snapshot.clusters.iter().flat_map(|c| {
            c.model_map
                .iter()
                .flat_map(|(from, to)| [from.as_str(), to.as_str()])
        }))
        .filter(|m| snapshot.routes.iter().any(|r| r.pattern.matches(m)))
        .filter(|m| keep(m))
        .collect();
    names.sort_unstable();
    names.dedup();
    let mut s = String::from("{\"object\":\"list\",\"data\":[");
    for (i, name) in names.iter().enumerate() {
        if i > 0 {
            s.push(',');
        }
        s.push_str("{\"id\":");
        push_json_string(&mut s, name);
        s.push_str(",\"object\":\"model\",\"created\":0,\"owned_by\":\"sluice\"}");
    }
    s.push_str("]}");
    s.into_bytes()
}

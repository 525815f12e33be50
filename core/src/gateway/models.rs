//! `GET /v1/models`: the models a client can ask for, in OpenAI's list format.
//!
//! Built once per config snapshot (and per request only for keys with model lists). Listed are
//! the concrete names that route: exact route names, the models a glob route declares
//! (`[[routes]] models = [...]`: a glob itself can't be enumerated), and each cluster's
//! `model_map` names, both sides — a name is listed only when a request for it would be routed,
//! so the list never offers a model that answers 404. A key sees the global routes' names and
//! those of its own routes and its entity's; a request without a key, only the global ones.
//! Sorted by name, each once.

use crate::config::limits::{ApiKey, KeyIdx};
use crate::config::{ModelPattern, RouteScope, Snapshot};
use crate::openai::json::push_json_string;

pub(crate) fn list_body(snapshot: &Snapshot) -> Vec<u8> {
    body(snapshot, None, |_| true)
}

/// Whether a key may see another list than [`list_body`]'s: it has model lists, or some
/// routes are a key's or an entity's own.
pub(crate) fn own_list(snapshot: &Snapshot, key: &ApiKey) -> bool {
    !key.models_allow.is_empty()
        || !key.models_block.is_empty()
        || snapshot
            .routes
            .iter()
            .any(|r| r.scope != RouteScope::Global)
}

/// The list as one key sees it: the global routes and its own (and its entity's), only models
/// its allow / block lists let it use (built per request, for keys [`own_list`] says so of).
pub(crate) fn list_body_for(snapshot: &Snapshot, index: KeyIdx, key: &ApiKey) -> Vec<u8> {
    body(snapshot, Some((index, key.entity)), |m| key.may_use(m))
}

fn body(
    snapshot: &Snapshot,
    caller: Option<(KeyIdx, Option<usize>)>,
    keep: impl Fn(&str) -> bool,
) -> Vec<u8> {
    let routes = || snapshot.routes.iter().filter(|r| r.scope.serves(caller));
    let mut names: Vec<&str> = routes()
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
        .filter(|m| routes().any(|r| r.pattern.matches(m)))
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

//! `GET /v1/models`: the configured models in OpenAI's list format.
//!
//! Built once per config snapshot (not per request) from the routes' exact model names, in file
//! order; glob routes cannot be enumerated and are not listed.

use crate::config::{ModelPattern, Snapshot};
use crate::error::push_json_string;
use crate::limits::config::ApiKey;

pub fn list_body(snapshot: &Snapshot) -> Vec<u8> {
    body(snapshot, |_| true)
}

/// The list as one key sees it: only models its allow / block lists let it use (built per
/// request, for keys that have such lists).
pub fn list_body_for(snapshot: &Snapshot, key: &ApiKey) -> Vec<u8> {
    body(snapshot, |m| key.may_use(m))
}

fn body(snapshot: &Snapshot, keep: impl Fn(&str) -> bool) -> Vec<u8> {
    let mut names: Vec<&str> = snapshot
        .routes
        .iter()
        .filter_map(|r| match &r.pattern {
            ModelPattern::Exact(m) => Some(m.as_str()),
            ModelPattern::Glob { .. } => None,
        })
        .filter(|m| keep(m))
        .collect();
    names.sort_unstable();
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

//! The mock's own endpoints: `/_mock/*` (stats, the process fault, the reported queue) and
//! `/metrics`. They ignore faults and request controls, are not counted in `requests`, and
//! never wait for a `--max-running` slot, so a test can always reach them — to read a backend
//! it made fail, or to make it recover.
//!
//! Bodies here are small and rare, so they go through serde_json rather than the
//! preformatted writers of the answer path.

use serde_json::{json, Map, Value};

use super::queue::{self, Override};
use super::{body, Fault, State};

/// Model name in `/metrics` labels (the model `/v1/models` lists).
const MODEL: &str = "mock-model";

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum Endpoint {
    Stats,
    ResetPeak,
    FaultGet,
    FaultSet,
    QueueGet,
    QueueSet,
    Metrics,
    /// A `/_mock/` path (or method) the mock does not have.
    Unknown,
}

impl Endpoint {
    /// The endpoint for a request, when its path is one of the mock's own (`/_mock/…`,
    /// `/metrics`); None for the provider API.
    pub fn route(method: &[u8], path: &[u8]) -> Option<Endpoint> {
        Some(match (method, path) {
            (b"GET", b"/_mock/stats") => Endpoint::Stats,
            (b"POST", b"/_mock/reset_peak") => Endpoint::ResetPeak,
            (b"GET", b"/_mock/fault") => Endpoint::FaultGet,
            (b"POST", b"/_mock/fault") => Endpoint::FaultSet,
            (b"GET", b"/_mock/queue") => Endpoint::QueueGet,
            (b"POST", b"/_mock/queue") => Endpoint::QueueSet,
            (b"GET", b"/metrics") => Endpoint::Metrics,
            (_, b"/metrics") => Endpoint::Unknown,
            _ if path.starts_with(b"/_mock/") => Endpoint::Unknown,
            _ => return None,
        })
    }
}

/// Status and content type of a control answer (its body is written to `out`).
pub struct Answer {
    pub status: u16,
    pub ctype: &'static str,
}

const JSON: &str = "application/json";

/// Carries out `ep` (with the request `body`) and writes the answer into `out`.
pub fn answer(ep: Endpoint, body: &[u8], st: &State, out: &mut Vec<u8>) -> Answer {
    let ok = Answer {
        status: 200,
        ctype: JSON,
    };
    let result = match ep {
        Endpoint::Stats => {
            st.stats.write_json(out, st.slots.counts());
            return ok;
        }
        Endpoint::ResetPeak => {
            st.stats.reset_peak();
            st.stats.write_json(out, st.slots.counts());
            return ok;
        }
        Endpoint::Metrics => {
            queue::write_metrics(out, &st.slots.report(), MODEL);
            return Answer {
                status: 200,
                ctype: "text/plain; version=0.0.4; charset=utf-8",
            };
        }
        Endpoint::FaultGet => Ok(fault_state(st)),
        Endpoint::FaultSet => parse_fault(body).map(|f| {
            st.fault.set(f);
            fault_state(st)
        }),
        Endpoint::QueueGet => Ok(queue_state(st)),
        Endpoint::QueueSet => parse_queue(body).map(|o| {
            st.slots.set_override(o);
            queue_state(st)
        }),
        Endpoint::Unknown => {
            body::error(
                out,
                404,
                "no such mock endpoint (see bench/MOCK_LLM.md)",
                None,
            );
            return Answer {
                status: 404,
                ctype: JSON,
            };
        }
    };
    match result {
        Ok(v) => {
            // Writing a Value to a Vec cannot fail.
            let _ = serde_json::to_writer(&mut *out, &v);
            ok
        }
        Err(why) => {
            body::error(out, 400, &why, None);
            Answer {
                status: 400,
                ctype: JSON,
            }
        }
    }
}

fn fault_state(st: &State) -> Value {
    json!({ "fault": st.fault.get().map(|f| f.to_string()) })
}

fn queue_state(st: &State) -> Value {
    let real = st.slots.counts();
    let rep = st.slots.report();
    let o = st.slots.override_();
    json!({
        "max_running": st.slots.max(),
        "running": real.running,
        "waiting": real.waiting,
        "queued": real.queued,
        "reported": {
            "running": rep.running,
            "waiting": rep.waiting,
            "kv_cache_usage": rep.kv_cache_usage,
        },
        "override": {
            "running": o.running,
            "waiting": o.waiting,
            "kv_cache_usage": o.kv_cache_usage,
        },
    })
}

fn object(body: &[u8], keys: &[&str]) -> Result<Option<Map<String, Value>>, String> {
    let v: Value =
        serde_json::from_slice(body).map_err(|e| format!("the body is not JSON: {e}"))?;
    let obj = match v {
        Value::Null => return Ok(None),
        Value::Object(o) => o,
        _ => return Err("the body must be a JSON object (or null)".to_owned()),
    };
    // A misspelt key would otherwise be ignored and the test would not notice.
    if let Some(k) = obj.keys().find(|k| !keys.contains(&k.as_str())) {
        return Err(format!("unknown key {k:?} (expected {keys:?})"));
    }
    Ok(Some(obj))
}

/// `{"fault": "SPEC"}`; `{"fault": null}` (or `"none"`) clears it.
fn parse_fault(body: &[u8]) -> Result<Option<Fault>, String> {
    let Some(obj) = object(body, &["fault"])? else {
        return Err("expected {\"fault\": SPEC or null}".to_owned());
    };
    match obj.get("fault") {
        None => Err("expected {\"fault\": SPEC or null}".to_owned()),
        Some(Value::Null) => Ok(None),
        Some(Value::String(s)) => Fault::parse_spec(s),
        Some(other) => Err(format!("fault must be a string or null, not {other}")),
    }
}

/// `{"waiting": W, "running": R, "kv_cache_usage": F}`, each optional (absent or null: the
/// real value); `null` (or `{}`) goes back to the real counts.
fn parse_queue(body: &[u8]) -> Result<Override, String> {
    let Some(obj) = object(body, &["waiting", "running", "kv_cache_usage"])? else {
        return Ok(Override::default());
    };
    let count = |k: &str| -> Result<Option<u64>, String> {
        match obj.get(k) {
            None | Some(Value::Null) => Ok(None),
            Some(v) => v
                .as_u64()
                .map(Some)
                .ok_or_else(|| format!("{k} must be a whole number (0 or more) or null, not {v}")),
        }
    };
    let kv = match obj.get("kv_cache_usage") {
        None | Some(Value::Null) => None,
        Some(v) => Some(
            v.as_f64()
                .filter(|f| (0.0..=1.0).contains(f))
                .ok_or_else(|| format!("kv_cache_usage must be a number in 0..1, not {v}"))?,
        ),
    };
    Ok(Override {
        waiting: count("waiting")?,
        running: count("running")?,
        kv_cache_usage: kv,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn routes() {
        assert_eq!(
            Endpoint::route(b"POST", b"/_mock/fault"),
            Some(Endpoint::FaultSet)
        );
        assert_eq!(
            Endpoint::route(b"GET", b"/metrics"),
            Some(Endpoint::Metrics)
        );
        assert_eq!(
            Endpoint::route(b"DELETE", b"/_mock/fault"),
            Some(Endpoint::Unknown)
        );
        assert_eq!(
            Endpoint::route(b"GET", b"/_mock/nope"),
            Some(Endpoint::Unknown)
        );
        assert_eq!(Endpoint::route(b"GET", b"/v1/models"), None);
    }

    #[test]
    fn fault_bodies() {
        assert_eq!(
            parse_fault(br#"{"fault":"die-after=3"}"#),
            Ok(Some(Fault::DieAfter(3)))
        );
        assert_eq!(parse_fault(br#"{"fault":null}"#), Ok(None));
        assert_eq!(parse_fault(br#"{"fault":"none"}"#), Ok(None));
        for bad in [
            &br#"{"fault":"nope"}"#[..],
            br#"{"falt":null}"#,
            br#"{}"#,
            b"null",
            b"[1]",
            b"",
            br#"{"fault":3}"#,
        ] {
            assert!(
                parse_fault(bad).is_err(),
                "{}",
                String::from_utf8_lossy(bad)
            );
        }
    }

    #[test]
    fn queue_bodies() {
        assert_eq!(
            parse_queue(br#"{"waiting":5,"running":2}"#),
            Ok(Override {
                waiting: Some(5),
                running: Some(2),
                kv_cache_usage: None
            })
        );
        assert_eq!(parse_queue(b"null"), Ok(Override::default()));
        assert_eq!(
            parse_queue(br#"{"kv_cache_usage":0.5,"waiting":null}"#),
            Ok(Override {
                kv_cache_usage: Some(0.5),
                ..Override::default()
            })
        );
        for bad in [
            &br#"{"waiting":-1}"#[..],
            br#"{"waiting":1.5}"#,
            br#"{"kv_cache_usage":2}"#,
            br#"{"queue":1}"#,
            b"7",
        ] {
            assert!(
                parse_queue(bad).is_err(),
                "{}",
                String::from_utf8_lossy(bad)
            );
        }
    }
}

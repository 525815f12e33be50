//! Tool calls on mock-llm's OpenAI chat completions (`x-mock-tool-calls: N` on
//! `POST /v1/chat/completions`): which tools a request offers, how many calls the answer makes,
//! and each call's id, name and arguments (whole, and in the fragments a stream sends them in).
//! The bytes of the answer are written by [`super::body`].
//!
//! Like [`super::anthropic`] for `/v1/messages`, the request is read as a `serde_json::Value`
//! (the one `conn::plan` already parsed for `model` and `stream`).

use std::io::Write as _;

use serde_json::Value;

/// Argument fragments of a streamed call: its arguments split in this many non-empty pieces,
/// cut mid-key and mid-value, each one chunk and one content event (what the timing and the
/// faults count).
pub const ARG_PIECES: u64 = 4;
/// Most calls one answer makes, whatever `x-mock-tool-calls` asks (a bound on the body).
pub const MAX_CALLS: u64 = 1024;

/// What a chat request's body says about tools.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Offer {
    /// The names calls go to, in turn: `tools[i].function.name` in order (entries without one
    /// are skipped), or only the function a `tool_choice` object names, when it is among them.
    pub names: Vec<String>,
    /// At most this many calls: 0 with `tool_choice: "none"`, 1 with
    /// `parallel_tool_calls: false`, else [`MAX_CALLS`].
    pub max: u64,
}

impl Offer {
    /// Reads `tools`, `tool_choice` and `parallel_tool_calls` of a chat request.
    pub fn read(req: &Value) -> Offer {
        let mut names: Vec<String> = req
            .get("tools")
            .and_then(Value::as_array)
            .map(|tools| {
                tools
                    .iter()
                    .filter_map(|t| t.pointer("/function/name").and_then(Value::as_str))
                    .map(str::to_owned)
                    .collect()
            })
            .unwrap_or_default();
        let mut max = MAX_CALLS;
        match req.get("tool_choice") {
            Some(Value::String(s)) if s == "none" => max = 0,
            Some(tc @ Value::Object(_)) => {
                let named = tc.pointer("/function/name").and_then(Value::as_str);
                if let Some(name) = named.filter(|n| names.iter().any(|t| t == n)) {
                    names = vec![name.to_owned()];
                }
            }
            _ => {}
        }
        if req.get("parallel_tool_calls").and_then(Value::as_bool) == Some(false) {
            max = max.min(1);
        }
        Offer { names, max }
    }

    /// How many calls answer a request that asked for `requested` (`x-mock-tool-calls`): none
    /// when it offers no tools.
    pub fn calls(&self, requested: u64) -> u64 {
        if self.names.is_empty() {
            0
        } else {
            requested.min(self.max)
        }
    }
}

/// The name call `i` goes to: the offered names in turn.
pub fn name(names: &[String], i: u64) -> &str {
    let n = names.len() as u64;
    i.checked_rem(n)
        .and_then(|k| names.get(k as usize))
        .map_or("", String::as_str)
}

/// Call `i`'s id as a JSON string: `"call_mock_{seq}_{i}"`.
pub fn id_json(out: &mut Vec<u8>, seq: u64, i: u64) {
    let _ = write!(out, "\"call_mock_{seq}_{i}\"");
}

/// Call `i`'s arguments, as JSON text (unquoted): the scripted ones (`scripted[i]`, see
/// [`read_script`]) when there are, else `{"city":"Paris","n":i}`.
pub fn arguments(scripted: &[String], i: u64) -> String {
    match scripted.get(i as usize) {
        Some(args) => args.clone(),
        None => format!("{{\"city\":\"Paris\",\"n\":{i}}}"),
    }
}

/// One call that `x-mock-tool-calls-json` scripts: its tool's name and its arguments (or, on
/// `/v1/messages`, its `input`) as JSON text.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Scripted {
    pub name: String,
    pub arguments: String,
}

/// Reads `x-mock-tool-calls-json`: a JSON array of `{"name": STRING, "arguments": VALUE}`, one
/// entry a call, in order. `arguments` given as a string is that JSON text itself (as OpenAI
/// carries it); any other value is written out as JSON text; absent, `{}`. `None` when the
/// value is not such an array, is empty, or has more than [`MAX_CALLS`] entries.
pub fn read_script(value: &[u8]) -> Option<Vec<Scripted>> {
    let Value::Array(calls) = serde_json::from_slice::<Value>(value).ok()? else {
        return None;
    };
    if calls.is_empty() || calls.len() as u64 > MAX_CALLS {
        return None;
    }
    calls
        .iter()
        .map(|call| {
            let name = call.get("name")?.as_str()?.to_owned();
            let arguments = match call.get("arguments") {
                None => "{}".to_owned(),
                Some(Value::String(text)) => text.clone(),
                Some(other) => other.to_string(),
            };
            Some(Scripted { name, arguments })
        })
        .collect()
}

/// Fragment `j` (0..[`ARG_PIECES`]) of call `i`'s arguments; the fragments join to
/// [`arguments`], and none of the made-up ones parses alone (a scripted one as short as `{}`
/// leaves some fragments empty).
pub fn argument_piece(scripted: &[String], i: u64, j: u64) -> String {
    let args = arguments(scripted, i);
    let len = args.len();
    let pieces = ARG_PIECES as usize;
    let j = (j as usize).min(pieces - 1);
    // Cut at char boundaries (a scripted text may not be ASCII).
    let start = char_cut(&args, len * j / pieces);
    let end = char_cut(&args, len * (j + 1) / pieces);
    args.get(start..end).unwrap_or_default().to_owned()
}

/// The first character boundary of `text` at or after byte `at` (its length past the end): where
/// a streamed piece of a call's JSON text may be cut.
pub fn char_cut(text: &str, at: usize) -> usize {
    (at..=text.len())
        .find(|&k| text.is_char_boundary(k))
        .unwrap_or(text.len())
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn offers() {
        let tools = json!([
            {"type": "function", "function": {"name": "get_weather", "parameters": {}}},
            {"type": "function", "function": {"description": "no name"}},
            {"type": "function", "function": {"name": "get_time"}}
        ]);
        let o = Offer::read(&json!({"tools": tools}));
        assert_eq!(o.names, ["get_weather", "get_time"]);
        assert_eq!((o.calls(3), o.calls(0)), (3, 0));
        assert_eq!(o.calls(u64::MAX), MAX_CALLS);
        assert_eq!(
            (name(&o.names, 0), name(&o.names, 1), name(&o.names, 2)),
            ("get_weather", "get_time", "get_weather")
        );
        assert_eq!(name(&[], 3), "");
        for no_tools in [json!({}), json!({"tools": []}), json!({"tools": "x"})] {
            assert_eq!(Offer::read(&no_tools).calls(2), 0, "{no_tools}");
        }
        let none = Offer::read(&json!({"tools": tools, "tool_choice": "none"}));
        assert_eq!(none.calls(2), 0);
        let one = Offer::read(&json!({"tools": tools, "parallel_tool_calls": false}));
        assert_eq!(one.calls(2), 1);
        let named = Offer::read(&json!({"tools": tools,
            "tool_choice": {"type": "function", "function": {"name": "get_time"}}}));
        assert_eq!(
            (named.names.as_slice(), named.calls(2)),
            (&["get_time".to_owned()][..], 2)
        );
        // A name that is not offered is ignored, as are `auto` and `required`.
        let other = Offer::read(&json!({"tools": tools,
            "tool_choice": {"type": "function", "function": {"name": "nope"}}}));
        assert_eq!(other.names.len(), 2);
        for choice in ["auto", "required"] {
            let o = Offer::read(&json!({"tools": tools, "tool_choice": choice}));
            assert_eq!(o.calls(2), 2, "{choice}");
        }
    }

    #[test]
    fn argument_pieces_join_to_the_arguments() {
        for i in [0, 7, 12, 1023] {
            let joined: String = (0..ARG_PIECES).map(|j| argument_piece(&[], i, j)).collect();
            assert_eq!(joined, arguments(&[], i));
            let v: Value = serde_json::from_str(&joined).unwrap();
            assert_eq!(v, json!({"city": "Paris", "n": i}));
            for j in 0..ARG_PIECES {
                let piece = argument_piece(&[], i, j);
                assert!(!piece.is_empty(), "{i} {j}");
                assert!(
                    serde_json::from_str::<Value>(&piece).is_err(),
                    "{piece} parses alone"
                );
            }
        }
        let mut id = Vec::new();
        id_json(&mut id, 4, 2);
        assert_eq!(id, b"\"call_mock_4_2\"");
    }

    #[test]
    fn a_script_names_each_call_and_its_arguments() {
        let script = read_script(
            br#"[{"name":"get_weather","arguments":{"city":"Oslo"}},
                 {"name":"lookup","arguments":"{\"q\":\"\u00e9t\u00e9\"}"},
                 {"name":"now"}]"#,
        )
        .unwrap();
        let names: Vec<&str> = script.iter().map(|c| c.name.as_str()).collect();
        assert_eq!(names, ["get_weather", "lookup", "now"]);
        assert_eq!(script[0].arguments, r#"{"city":"Oslo"}"#);
        assert_eq!(script[1].arguments, "{\"q\":\"été\"}");
        assert_eq!(script[2].arguments, "{}");
        // The fragments of a scripted call join to its arguments, cut at char boundaries.
        let args: Vec<String> = vec!["{\"q\":\"été\"}".to_owned()];
        let joined: String = (0..ARG_PIECES)
            .map(|j| argument_piece(&args, 0, j))
            .collect();
        assert_eq!(joined, args[0]);
        for bad in [
            &b"{}"[..],
            b"[]",
            b"[{\"arguments\":{}}]",
            b"[{\"name\":3}]",
            b"not json",
        ] {
            assert_eq!(read_script(bad), None, "{}", String::from_utf8_lossy(bad));
        }
    }
}

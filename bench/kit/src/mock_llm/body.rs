//! JSON bodies and SSE events of the mock upstream, appended to reusable byte buffers with plain
//! formatting (no serializer on the response path).

use std::io::Write as _;

use super::chat_tools;

/// What a response body is about: the request's identity and sizes.
pub struct Gen<'a> {
    /// Request sequence number, used in ids.
    pub seq: u64,
    /// Unix seconds.
    pub created: u64,
    /// The model as a JSON string literal (already quoted and escaped).
    pub model_json: &'a [u8],
    /// The prompt tokens reported (on chat completions, cache reads and writes included).
    pub prompt_tokens: u64,
    pub tokens: u64,
    /// Chat completions: `x-mock-cache-read` / `x-mock-cache-write` as (read, write), reported in
    /// `usage.prompt_tokens_details`; None: no details.
    pub cache: Option<(u64, u64)>,
    /// Chat completions: the names tool calls go to, in turn (see [`chat_tools::Offer`]).
    pub tool_names: &'a [String],
    /// Chat completions: each call's arguments as `x-mock-tool-calls-json` scripts them (empty:
    /// made up, see [`chat_tools::arguments`]).
    pub tool_args: &'a [String],
    /// Chat completions: tool calls answered instead of text (0: a text answer).
    pub tool_calls: u64,
}

/// Appends the output text `tok0 tok1 …` (no quotes; it never needs escaping).
fn text(out: &mut Vec<u8>, tokens: u64) {
    for i in 0..tokens {
        if i > 0 {
            out.push(b' ');
        }
        let _ = write!(out, "tok{i}");
    }
}

/// Appends the text of content token `i` as a JSON string (`"tok0"`, `" tok1"`, …).
pub fn token_json(out: &mut Vec<u8>, i: u64) {
    if i == 0 {
        out.extend_from_slice(b"\"tok0\"");
    } else {
        let _ = write!(out, "\" tok{i}\"");
    }
}

/// `{"prompt_tokens", "completion_tokens", "total_tokens"}`, and `prompt_tokens_details`
/// (`cached_tokens`: cache reads, `cache_write_tokens`: cache writes) when [`Gen::cache`] is set.
fn usage(out: &mut Vec<u8>, g: &Gen) {
    let _ = write!(
        out,
        "{{\"prompt_tokens\":{},\"completion_tokens\":{},\"total_tokens\":{}",
        g.prompt_tokens,
        g.tokens,
        g.prompt_tokens.saturating_add(g.tokens)
    );
    if let Some((read, write)) = g.cache {
        let _ = write!(
            out,
            ",\"prompt_tokens_details\":{{\"cached_tokens\":{read},\"cache_write_tokens\":{write}}}"
        );
    }
    out.push(b'}');
}

/// Responses-API usage; carries the Chat-style names too, with the same values.
fn responses_usage(out: &mut Vec<u8>, g: &Gen) {
    let _ = write!(
        out,
        "{{\"input_tokens\":{p},\"output_tokens\":{t},\"total_tokens\":{s},\
         \"prompt_tokens\":{p},\"completion_tokens\":{t}}}",
        p = g.prompt_tokens,
        t = g.tokens,
        s = g.prompt_tokens + g.tokens
    );
}

/// `,"echo":{…}}`, or only the `}` when the echo is empty (`x-mock-echo: none`).
fn echo_tail(out: &mut Vec<u8>, echo: &[u8]) {
    if !echo.is_empty() {
        out.extend_from_slice(b",\"echo\":");
        out.extend_from_slice(echo);
    }
    out.push(b'}');
}

pub fn chat_completion(out: &mut Vec<u8>, g: &Gen, echo: &[u8]) {
    let _ = write!(
        out,
        "{{\"id\":\"chatcmpl-mock-{}\",\"object\":\"chat.completion\",\"created\":{},\"model\":",
        g.seq, g.created
    );
    out.extend_from_slice(g.model_json);
    out.extend_from_slice(b",\"choices\":[{\"index\":0,\"message\":{\"role\":\"assistant\",");
    if g.tool_calls > 0 {
        out.extend_from_slice(b"\"content\":null,\"tool_calls\":[");
        for i in 0..g.tool_calls {
            if i > 0 {
                out.push(b',');
            }
            out.extend_from_slice(b"{\"id\":");
            chat_tools::id_json(out, g.seq, i);
            out.extend_from_slice(b",\"type\":\"function\",\"function\":{\"name\":");
            super::http::json_str(out, chat_tools::name(g.tool_names, i));
            out.extend_from_slice(b",\"arguments\":");
            super::http::json_str(out, &chat_tools::arguments(g.tool_args, i));
            out.extend_from_slice(b"}}");
        }
        out.extend_from_slice(b"]},\"finish_reason\":\"tool_calls\"}],\"usage\":");
    } else {
        out.extend_from_slice(b"\"content\":\"");
        text(out, g.tokens);
        out.extend_from_slice(b"\"},\"finish_reason\":\"stop\"}],\"usage\":");
    }
    usage(out, g);
    echo_tail(out, echo);
}

pub fn text_completion(out: &mut Vec<u8>, g: &Gen, echo: &[u8]) {
    let _ = write!(
        out,
        "{{\"id\":\"cmpl-mock-{}\",\"object\":\"text_completion\",\"created\":{},\"model\":",
        g.seq, g.created
    );
    out.extend_from_slice(g.model_json);
    out.extend_from_slice(b",\"choices\":[{\"text\":\"");
    text(out, g.tokens);
    out.extend_from_slice(
        b"\",\"index\":0,\"logprobs\":null,\"finish_reason\":\"stop\"}],\"usage\":",
    );
    usage(out, g);
    echo_tail(out, echo);
}

/// A Responses-API `response` object (without a closing brace when `open`, so an echo can follow).
fn response_object(out: &mut Vec<u8>, g: &Gen, done: bool) {
    let _ = write!(
        out,
        "{{\"id\":\"resp_mock_{}\",\"object\":\"response\",\"created_at\":{},\"status\":\"{}\",\"model\":",
        g.seq,
        g.created,
        if done { "completed" } else { "in_progress" }
    );
    out.extend_from_slice(g.model_json);
    if done {
        let _ = write!(
            out,
            ",\"output\":[{{\"type\":\"message\",\"id\":\"msg_mock_{}\",\"status\":\"completed\",\
             \"role\":\"assistant\",\"content\":[{{\"type\":\"output_text\",\"text\":\"",
            g.seq
        );
        text(out, g.tokens);
        out.extend_from_slice(b"\",\"annotations\":[]}]}],\"usage\":");
        responses_usage(out, g);
    } else {
        out.extend_from_slice(b",\"output\":[],\"usage\":null");
    }
}

pub fn response(out: &mut Vec<u8>, g: &Gen, echo: &[u8]) {
    response_object(out, g, true);
    echo_tail(out, echo);
}

pub fn embeddings(out: &mut Vec<u8>, g: &Gen, echo: &[u8]) {
    out.extend_from_slice(
        b"{\"object\":\"list\",\"data\":[{\"object\":\"embedding\",\"index\":0,\"embedding\":\
          [0.125,-0.25,0.375,-0.5,0.625,-0.75,0.875,-1.0]}],\"model\":",
    );
    out.extend_from_slice(g.model_json);
    let _ = write!(
        out,
        ",\"usage\":{{\"prompt_tokens\":{p},\"total_tokens\":{p}}}",
        p = g.prompt_tokens
    );
    echo_tail(out, echo);
}

pub fn models(out: &mut Vec<u8>, echo: &[u8]) {
    out.extend_from_slice(
        b"{\"object\":\"list\",\"data\":[{\"id\":\"mock-model\",\"object\":\"model\",\
          \"created\":1700000000,\"owned_by\":\"sluice-mock\"}]",
    );
    echo_tail(out, echo);
}

/// OpenAI error `type` and `code` for a status.
fn error_kind(status: u16) -> (&'static str, &'static str) {
    match status {
        400 | 413 | 422 => ("invalid_request_error", "invalid_request"),
        401 => ("authentication_error", "invalid_api_key"),
        403 => ("permission_error", "permission_denied"),
        404 => ("invalid_request_error", "not_found"),
        408 | 504 => ("timeout_error", "timeout"),
        // What OpenAI sends for a rate limit: `type` names the limit hit (`requests` or
        // `tokens`), `code` says it is a rate limit.
        429 => ("requests", "rate_limit_exceeded"),
        431 => ("invalid_request_error", "headers_too_large"),
        503 => ("server_error", "overloaded"),
        529 => ("overloaded_error", "overloaded"),
        _ if status >= 500 => ("server_error", "server_error"),
        _ => ("invalid_request_error", "mock_error"),
    }
}

/// The `code` (and `type`) of OpenAI's spend-limit 429, which retrying will not cure.
pub const QUOTA_CODE: &str = "insufficient_quota";
/// OpenAI's message for it, word for word (clients and gateways match on it).
const QUOTA_MESSAGE: &str = "You exceeded your current quota, please check your plan and \
     billing details. For more information on this error, read the docs: \
     https://platform.openai.com/docs/guides/error-codes/api-errors.";

fn error_object(out: &mut Vec<u8>, message: &str, kind: &str, code: &str) {
    out.extend_from_slice(b"{\"message\":");
    super::http::json_str(out, message);
    out.extend_from_slice(b",\"type\":");
    super::http::json_str(out, kind);
    out.extend_from_slice(b",\"param\":null,\"code\":");
    super::http::json_str(out, code);
    out.push(b'}');
}

/// An OpenAI-shaped error body; `message` is JSON-escaped here. The echo is added when given.
pub fn error(out: &mut Vec<u8>, status: u16, message: &str, echo: Option<&[u8]>) {
    let (kind, code) = error_kind(status);
    out.extend_from_slice(b"{\"error\":");
    error_object(out, message, kind, code);
    match echo {
        Some(e) => echo_tail(out, e),
        None => out.push(b'}'),
    }
}

/// The body of an injected error status (`x-mock-status`, `status=N`, `quota`), shaped as the
/// providers send theirs, so a gateway can tell the kinds apart by the body alone:
/// - `code` = `insufficient_quota`: OpenAI's spend-limit error (`type` too, and its message);
/// - 429: OpenAI's rate limit, `type` `requests`, `code` `rate_limit_exceeded`;
/// - 529: Anthropic's overload error (`{"type":"error","error":{"type":"overloaded_error",…}}`),
///   which also has the OpenAI fields (`param`, `code`), so either kind of client parses it;
/// - others: `type` and `code` by status.
///
/// `code` replaces the status's usual `error.code` (`x-mock-error-code`, `--error-code`).
pub fn injected_error(out: &mut Vec<u8>, status: u16, code: Option<&str>) {
    let (kind, usual) = error_kind(status);
    let code = code.unwrap_or(usual);
    if code == QUOTA_CODE {
        out.extend_from_slice(b"{\"error\":");
        error_object(out, QUOTA_MESSAGE, QUOTA_CODE, QUOTA_CODE);
        out.push(b'}');
        return;
    }
    let message = match status {
        429 => "Rate limit reached for mock-model in organization org-mock on requests per min \
                (RPM): Limit 60, Used 60, Requested 1. (mock error status 429)"
            .to_owned(),
        529 => "Overloaded (mock error status 529)".to_owned(),
        _ => format!("mock error status {status}"),
    };
    if status == 529 {
        out.extend_from_slice(b"{\"type\":\"error\",\"error\":");
    } else {
        out.extend_from_slice(b"{\"error\":");
    }
    error_object(out, &message, kind, code);
    out.push(b'}');
}

// ---- SSE events (each is one complete `…\n\n` event) ----

/// `: echo {json}` comment event (none for an empty echo).
pub fn ev_echo(out: &mut Vec<u8>, echo: &[u8]) {
    if echo.is_empty() {
        return;
    }
    out.extend_from_slice(b": echo ");
    out.extend_from_slice(echo);
    out.extend_from_slice(b"\n\n");
}

pub fn ev_done(out: &mut Vec<u8>) {
    out.extend_from_slice(b"data: [DONE]\n\n");
}

/// The error event of a chat / completions stream, as OpenAI sends one mid-stream:
/// `data: {"error":{…}}`.
pub fn ev_error(out: &mut Vec<u8>, code: Option<&str>) {
    out.extend_from_slice(b"data: {\"error\":");
    error_object(
        out,
        "mock error event",
        "server_error",
        code.unwrap_or("mock_error_event"),
    );
    out.extend_from_slice(b"}\n\n");
}

/// The Responses API's error event: `event: error`, with the error's fields at the top level.
pub fn ev_response_error(out: &mut Vec<u8>, code: Option<&str>, sequence_number: u64) {
    out.extend_from_slice(b"event: error\ndata: {\"type\":\"error\",\"code\":");
    super::http::json_str(out, code.unwrap_or("server_error"));
    let _ = write!(
        out,
        ",\"message\":\"mock error event\",\"param\":null,\"sequence_number\":{sequence_number}}}\n\n"
    );
}

fn chat_chunk_head(out: &mut Vec<u8>, g: &Gen) {
    let _ = write!(
        out,
        "data: {{\"id\":\"chatcmpl-mock-{}\",\"object\":\"chat.completion.chunk\",\"created\":{},\"model\":",
        g.seq, g.created
    );
    out.extend_from_slice(g.model_json);
}

pub fn ev_chat_role(out: &mut Vec<u8>, g: &Gen) {
    chat_chunk_head(out, g);
    out.extend_from_slice(
        b",\"choices\":[{\"index\":0,\"delta\":{\"role\":\"assistant\"},\"finish_reason\":null}]}\n\n",
    );
}

pub fn ev_chat_content(out: &mut Vec<u8>, g: &Gen, i: u64) {
    chat_chunk_head(out, g);
    out.extend_from_slice(b",\"choices\":[{\"index\":0,\"delta\":{\"content\":");
    token_json(out, i);
    out.extend_from_slice(b"},\"finish_reason\":null}]}\n\n");
}

/// The first chunk of tool call `i`: its index, id, type and name, and empty arguments.
pub fn ev_chat_tool_start(out: &mut Vec<u8>, g: &Gen, i: u64) {
    chat_chunk_head(out, g);
    let _ = write!(
        out,
        ",\"choices\":[{{\"index\":0,\"delta\":{{\"tool_calls\":[{{\"index\":{i},\"id\":"
    );
    chat_tools::id_json(out, g.seq, i);
    out.extend_from_slice(b",\"type\":\"function\",\"function\":{\"name\":");
    super::http::json_str(out, chat_tools::name(g.tool_names, i));
    out.extend_from_slice(b",\"arguments\":\"\"}}]},\"finish_reason\":null}]}\n\n");
}

/// Fragment `j` of tool call `i`'s arguments (only the index and the fragment, as OpenAI sends
/// them).
pub fn ev_chat_tool_args(out: &mut Vec<u8>, g: &Gen, i: u64, j: u64) {
    chat_chunk_head(out, g);
    let _ = write!(
        out,
        ",\"choices\":[{{\"index\":0,\"delta\":{{\"tool_calls\":[{{\"index\":{i},\
         \"function\":{{\"arguments\":"
    );
    super::http::json_str(out, &chat_tools::argument_piece(g.tool_args, i, j));
    out.extend_from_slice(b"}}]},\"finish_reason\":null}]}\n\n");
}

/// The finish chunk: `finish_reason` `tool_calls` when the answer calls tools, else `stop`.
pub fn ev_chat_finish(out: &mut Vec<u8>, g: &Gen) {
    chat_chunk_head(out, g);
    let reason = if g.tool_calls > 0 {
        "tool_calls"
    } else {
        "stop"
    };
    let _ = write!(
        out,
        ",\"choices\":[{{\"index\":0,\"delta\":{{}},\"finish_reason\":\"{reason}\"}}]}}\n\n"
    );
}

pub fn ev_chat_usage(out: &mut Vec<u8>, g: &Gen) {
    chat_chunk_head(out, g);
    out.extend_from_slice(b",\"choices\":[],\"usage\":");
    usage(out, g);
    out.extend_from_slice(b"}\n\n");
}

fn completion_chunk_head(out: &mut Vec<u8>, g: &Gen) {
    let _ = write!(
        out,
        "data: {{\"id\":\"cmpl-mock-{}\",\"object\":\"text_completion\",\"created\":{},\"model\":",
        g.seq, g.created
    );
    out.extend_from_slice(g.model_json);
}

pub fn ev_completion_content(out: &mut Vec<u8>, g: &Gen, i: u64) {
    completion_chunk_head(out, g);
    out.extend_from_slice(b",\"choices\":[{\"text\":");
    token_json(out, i);
    out.extend_from_slice(b",\"index\":0,\"logprobs\":null,\"finish_reason\":null}]}\n\n");
}

pub fn ev_completion_finish(out: &mut Vec<u8>, g: &Gen) {
    completion_chunk_head(out, g);
    out.extend_from_slice(
        b",\"choices\":[{\"text\":\"\",\"index\":0,\"logprobs\":null,\"finish_reason\":\"stop\"}]}\n\n",
    );
}

pub fn ev_completion_usage(out: &mut Vec<u8>, g: &Gen) {
    completion_chunk_head(out, g);
    out.extend_from_slice(b",\"choices\":[],\"usage\":");
    usage(out, g);
    out.extend_from_slice(b"}\n\n");
}

pub fn ev_response_created(out: &mut Vec<u8>, g: &Gen) {
    out.extend_from_slice(
        b"event: response.created\ndata: {\"type\":\"response.created\",\"sequence_number\":0,\"response\":",
    );
    response_object(out, g, false);
    out.extend_from_slice(b"}}\n\n");
}

pub fn ev_response_delta(out: &mut Vec<u8>, g: &Gen, i: u64) {
    let _ = write!(
        out,
        "event: response.output_text.delta\ndata: {{\"type\":\"response.output_text.delta\",\
         \"sequence_number\":{},\"item_id\":\"msg_mock_{}\",\"output_index\":0,\"content_index\":0,\"delta\":",
        i + 1,
        g.seq
    );
    token_json(out, i);
    out.extend_from_slice(b"}\n\n");
}

pub fn ev_response_completed(out: &mut Vec<u8>, g: &Gen) {
    let _ = write!(
        out,
        "event: response.completed\ndata: {{\"type\":\"response.completed\",\"sequence_number\":{},\"response\":",
        g.tokens + 1
    );
    response_object(out, g, true);
    out.extend_from_slice(b"}}\n\n");
}

#[cfg(test)]
mod tests {
    use super::*;

    fn g() -> Gen<'static> {
        Gen {
            seq: 7,
            created: 1,
            model_json: b"\"m\\\"x\"",
            prompt_tokens: 3,
            tokens: 3,
            cache: None,
            tool_names: &[],
            tool_args: &[],
            tool_calls: 0,
        }
    }

    fn parse(b: &[u8]) -> serde_json::Value {
        match serde_json::from_slice(b) {
            Ok(v) => v,
            Err(e) => panic!("{e}: {}", String::from_utf8_lossy(b)),
        }
    }

    fn data_of(ev: &[u8]) -> serde_json::Value {
        let s = String::from_utf8_lossy(ev);
        let Some(line) = s.lines().find_map(|l| l.strip_prefix("data: ")) else {
            panic!("no data line in {s}")
        };
        parse(line.as_bytes())
    }

    #[test]
    fn bodies_are_json() {
        let echo = br#"{"a":1}"#;
        let mut out = Vec::new();
        chat_completion(&mut out, &g(), echo);
        let v = parse(&out);
        assert_eq!(v["choices"][0]["message"]["content"], "tok0 tok1 tok2");
        assert_eq!(v["model"], "m\"x");
        assert_eq!(v["usage"]["total_tokens"], 6);
        assert_eq!(v["echo"]["a"], 1);
        for f in [text_completion, response, embeddings] {
            out.clear();
            f(&mut out, &g(), echo);
            parse(&out);
        }
        out.clear();
        models(&mut out, echo);
        parse(&out);
        out.clear();
        error(&mut out, 400, "x\"y", Some(echo));
        assert_eq!(parse(&out)["error"]["message"], "x\"y");
        out.clear();
        error(&mut out, 404, "nope", None);
        parse(&out);
    }

    #[test]
    fn injected_errors_tell_their_kind() {
        let mut out = Vec::new();
        let mut body = |status, code| {
            out.clear();
            injected_error(&mut out, status, code);
            parse(&out)
        };
        let rate = body(429, None);
        assert_eq!(rate["error"]["code"], "rate_limit_exceeded");
        assert_eq!(rate["error"]["type"], "requests");
        let quota = body(429, Some(QUOTA_CODE));
        assert_eq!(quota["error"]["type"], QUOTA_CODE);
        assert_eq!(quota["error"]["code"], QUOTA_CODE);
        assert!(quota["error"]["message"]
            .as_str()
            .is_some_and(|m| m.starts_with("You exceeded your current quota")));
        let overloaded = body(529, None);
        assert_eq!(overloaded["type"], "error");
        assert_eq!(overloaded["error"]["type"], "overloaded_error");
        assert_eq!(overloaded["error"]["param"], serde_json::Value::Null);
        let custom = body(503, Some("x\"y"));
        assert_eq!(custom["error"]["code"], "x\"y");
        assert_eq!(custom["error"]["type"], "server_error");
    }

    #[test]
    fn events_are_json() {
        type Ev = fn(&mut Vec<u8>, &Gen);
        let evs: [Ev; 7] = [
            ev_chat_role,
            ev_chat_finish,
            ev_chat_usage,
            ev_completion_finish,
            ev_completion_usage,
            ev_response_created,
            ev_response_completed,
        ];
        let mut out = Vec::new();
        for f in evs {
            out.clear();
            f(&mut out, &g());
            assert!(out.ends_with(b"\n\n"));
            data_of(&out);
        }
        out.clear();
        ev_chat_content(&mut out, &g(), 1);
        assert_eq!(data_of(&out)["choices"][0]["delta"]["content"], " tok1");
        out.clear();
        ev_completion_content(&mut out, &g(), 0);
        assert_eq!(data_of(&out)["choices"][0]["text"], "tok0");
        out.clear();
        ev_response_delta(&mut out, &g(), 2);
        assert_eq!(data_of(&out)["delta"], " tok2");
        out.clear();
        ev_error(&mut out, None);
        assert_eq!(data_of(&out)["error"]["code"], "mock_error_event");
        out.clear();
        ev_response_error(&mut out, Some("c"), 2);
        assert!(out.starts_with(b"event: error\n"));
        assert_eq!(data_of(&out)["code"], "c");
    }

    /// Three calls over two tools, with cache usage: 10 prompt tokens, 7 of them cache reads
    /// and 2 cache writes.
    fn tools_gen(names: &[String]) -> Gen<'_> {
        Gen {
            prompt_tokens: 10,
            cache: Some((7, 2)),
            tool_names: names,
            tool_args: &[],
            tool_calls: 3,
            ..g()
        }
    }

    fn tool_names() -> Vec<String> {
        vec!["get_weather".into(), "get_\"time".into()]
    }

    #[test]
    fn chat_tool_calls_body() {
        let names = tool_names();
        let mut out = Vec::new();
        chat_completion(&mut out, &tools_gen(&names), b"{}");
        let v = parse(&out);
        let choice = &v["choices"][0];
        assert_eq!(choice["finish_reason"], "tool_calls");
        let message = &choice["message"];
        assert_eq!(message["role"], "assistant");
        assert_eq!(message["content"], serde_json::Value::Null);
        let calls = message["tool_calls"].as_array().unwrap();
        assert_eq!(calls.len(), 3);
        for (i, call) in calls.iter().enumerate() {
            assert_eq!(call["id"], format!("call_mock_7_{i}"));
            assert_eq!(call["type"], "function");
            assert_eq!(call["function"]["name"], names[i % 2].as_str());
            let args = call["function"]["arguments"].as_str().unwrap();
            assert_eq!(
                parse(args.as_bytes()),
                serde_json::json!({"city": "Paris", "n": i})
            );
            assert!(call.get("index").is_none(), "{call}");
        }
        // Usage: as the text answer reports it, the cache parts in the details.
        let u = &v["usage"];
        assert_eq!(
            (
                &u["prompt_tokens"],
                &u["completion_tokens"],
                &u["total_tokens"]
            ),
            (&10.into(), &3.into(), &13.into())
        );
        assert_eq!(u["prompt_tokens_details"]["cached_tokens"], 7);
        assert_eq!(u["prompt_tokens_details"]["cache_write_tokens"], 2);
        // No cache headers: no details, as before.
        out.clear();
        chat_completion(&mut out, &g(), b"{}");
        assert!(parse(&out)["usage"].get("prompt_tokens_details").is_none());
    }

    #[test]
    fn chat_tool_call_events() {
        let names = tool_names();
        let g = tools_gen(&names);
        let mut out = Vec::new();
        for i in 0..g.tool_calls {
            out.clear();
            ev_chat_tool_start(&mut out, &g, i);
            assert!(out.ends_with(b"\n\n"));
            let v = data_of(&out);
            assert_eq!(v["object"], "chat.completion.chunk");
            assert_eq!(v["choices"][0]["finish_reason"], serde_json::Value::Null);
            let tc = &v["choices"][0]["delta"]["tool_calls"];
            assert_eq!(tc.as_array().map(Vec::len), Some(1));
            let tc = &tc[0];
            assert_eq!(tc["index"], i);
            assert_eq!(tc["id"], format!("call_mock_7_{i}"));
            assert_eq!(tc["type"], "function");
            assert_eq!(tc["function"]["name"], names[i as usize % 2].as_str());
            assert_eq!(tc["function"]["arguments"], "");
            let mut joined = String::new();
            for j in 0..chat_tools::ARG_PIECES {
                out.clear();
                ev_chat_tool_args(&mut out, &g, i, j);
                let v = data_of(&out);
                let tc = &v["choices"][0]["delta"]["tool_calls"][0];
                assert_eq!(tc["index"], i);
                assert!(tc.get("id").is_none() && tc.get("type").is_none(), "{tc}");
                assert!(tc["function"].get("name").is_none(), "{tc}");
                joined.push_str(tc["function"]["arguments"].as_str().unwrap());
            }
            assert_eq!(
                parse(joined.as_bytes()),
                serde_json::json!({"city": "Paris", "n": i})
            );
        }
        out.clear();
        ev_chat_finish(&mut out, &g);
        assert_eq!(data_of(&out)["choices"][0]["finish_reason"], "tool_calls");
        out.clear();
        ev_chat_usage(&mut out, &g);
        let v = data_of(&out);
        assert_eq!(v["choices"], serde_json::json!([]));
        assert_eq!(v["usage"]["prompt_tokens"], 10);
        assert_eq!(v["usage"]["total_tokens"], 13);
        assert_eq!(v["usage"]["prompt_tokens_details"]["cached_tokens"], 7);
        assert_eq!(v["usage"]["prompt_tokens_details"]["cache_write_tokens"], 2);
        out.clear();
        ev_chat_finish(&mut out, &super::tests::g());
        assert_eq!(data_of(&out)["choices"][0]["finish_reason"], "stop");
    }
}

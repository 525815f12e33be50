//! Anthropic's Messages API on mock-llm (`POST /v1/messages`): the checks a request must pass
//! (credentials and version headers, then the body, as strictly as the real API checks it) and
//! the plan of the answer (which blocks, how many deltas, the usage). The bytes of the answer are
//! written by [`super::anthropic_wire`].
//!
//! Error messages follow the real API's wording where it is known (`max_tokens: Field required`,
//! `stream_options: Extra inputs are not permitted`, the `tool_use` / `tool_result` pairing
//! messages); the path before the colon names the offending field as the API does
//! (`messages.1.content.0.source.base64.media_type`).
//!
//! Requests are rare and small in tests, so they are checked on a `serde_json::Value`.

use serde_json::{Map, Value};

use super::anthropic_wire::tool_input;

/// `thinking_delta` events of a thinking block (each one output token).
pub const THINKING_DELTAS: u64 = 3;
/// `input_json_delta` events of a `tool_use` block: an empty one first (as the API sends), then
/// the input JSON in four pieces (each one output token).
pub const TOOL_JSON_DELTAS: u64 = 5;
/// Most `cache_control` breakpoints a request may carry (tools, system and messages together).
const MAX_CACHE_BREAKPOINTS: usize = 4;
/// Largest tool name length.
const MAX_TOOL_NAME: usize = 128;

/// A request the Messages API refuses: status, Anthropic error `type`, message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Reject {
    pub status: u16,
    pub kind: &'static str,
    pub message: String,
}

fn invalid(message: impl Into<String>) -> Reject {
    Reject {
        status: 400,
        kind: "invalid_request_error",
        message: message.into(),
    }
}

fn unauthorized(message: &str) -> Reject {
    Reject {
        status: 401,
        kind: "authentication_error",
        message: message.to_owned(),
    }
}

type Check<T = ()> = Result<T, Reject>;

/// The request headers the Messages API looks at.
#[derive(Default, Debug)]
pub struct Headers<'a> {
    /// `x-api-key`.
    pub api_key: Option<&'a [u8]>,
    /// The token of an `Authorization: Bearer …`.
    pub bearer: Option<&'a [u8]>,
    /// `anthropic-version`.
    pub version: Option<&'a [u8]>,
    /// `anthropic-beta` (comma-separated; repeated headers are joined).
    pub beta: Vec<&'a [u8]>,
}

/// The version whose clients send their key in `x-api-key` (and for which a bearer token is
/// an OAuth token, refused without its beta header).
pub const KEY_HEADER_VERSION: &[u8] = b"2023-06-01";

/// A header value that is there and not blank.
fn present(v: Option<&[u8]>) -> Option<&[u8]> {
    v.map(<[u8]>::trim_ascii).filter(|v| !v.is_empty())
}

/// `YYYY-MM-DD`.
fn is_date(v: &[u8]) -> bool {
    v.len() == 10
        && v.iter().enumerate().all(|(i, &b)| match i {
            4 | 7 => b == b'-',
            _ => b.is_ascii_digit(),
        })
}

/// Credentials first (401), then the version (400). The credential is `x-api-key` (a bearer
/// beside it is ignored), or `Authorization: Bearer` where the API takes one: with an
/// `anthropic-version` later than 2023-06-01 (the official SDKs 2.x send their API key so, with
/// `anthropic-version: 2026-10-21`), or with an `oauth-…` beta. Otherwise a bearer token alone is
/// answered as the API answers an OAuth token sent without its beta header: 401 "OAuth
/// authentication is currently not supported.". A credential in `reject_keys` (`--reject-key`)
/// is answered as a revoked key. Any well-formed version date is taken (the API knows a closed
/// list the mock does not keep).
pub fn check_headers(h: &Headers, reject_keys: &[String]) -> Check {
    let version = present(h.version).unwrap_or_default();
    let oauth_beta = h.beta.iter().any(|b| {
        b.split(|&c| c == b',')
            .any(|t| t.trim_ascii().starts_with(b"oauth-"))
    });
    let bearer_ok = oauth_beta || (is_date(version) && version > KEY_HEADER_VERSION);
    let revoked = |c: &[u8]| reject_keys.iter().any(|k| k.as_bytes() == c);
    match (present(h.api_key), present(h.bearer)) {
        (Some(key), _) if revoked(key) => return Err(unauthorized("invalid x-api-key")),
        (Some(_), _) => {}
        (None, Some(token)) if bearer_ok => {
            if revoked(token) {
                return Err(unauthorized("Invalid bearer token"));
            }
        }
        (None, Some(_)) => {
            return Err(unauthorized(
                "OAuth authentication is currently not supported.",
            ))
        }
        (None, None) => return Err(unauthorized("x-api-key header is required")),
    }
    if version.is_empty() {
        return Err(invalid("anthropic-version: header is required"));
    }
    if !is_date(version) {
        return Err(invalid(format!(
            "anthropic-version: invalid version {:?} (a date, such as 2023-06-01)",
            String::from_utf8_lossy(version)
        )));
    }
    Ok(())
}

/// `tool_choice`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ToolChoice {
    Auto,
    Any,
    None,
    Tool(String),
}

/// What a valid request asks for, as far as the answer depends on it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Request {
    pub stream: bool,
    pub max_tokens: u64,
    /// `thinking: {"type": "enabled", …}`.
    pub thinking: bool,
    /// Names of the tools offered, in order.
    pub tools: Vec<String>,
    pub tool_choice: ToolChoice,
    pub disable_parallel: bool,
}

fn at(path: &str, key: &str) -> String {
    if path.is_empty() {
        key.to_owned()
    } else {
        format!("{path}.{key}")
    }
}

fn at_index(path: &str, i: usize) -> String {
    format!("{path}.{i}")
}

fn only_keys(obj: &Map<String, Value>, allowed: &[&str], path: &str) -> Check {
    match obj.keys().find(|k| !allowed.contains(&k.as_str())) {
        Some(k) => Err(invalid(format!(
            "{}: Extra inputs are not permitted",
            at(path, k)
        ))),
        None => Ok(()),
    }
}

fn required<'a>(obj: &'a Map<String, Value>, key: &str, path: &str) -> Check<&'a Value> {
    obj.get(key)
        .ok_or_else(|| invalid(format!("{}: Field required", at(path, key))))
}

fn want_str<'a>(v: &'a Value, path: &str) -> Check<&'a str> {
    v.as_str()
        .ok_or_else(|| invalid(format!("{path}: Input should be a valid string")))
}

fn want_obj<'a>(v: &'a Value, path: &str) -> Check<&'a Map<String, Value>> {
    v.as_object()
        .ok_or_else(|| invalid(format!("{path}: Input should be a valid dictionary")))
}

fn want_arr<'a>(v: &'a Value, path: &str) -> Check<&'a Vec<Value>> {
    v.as_array()
        .ok_or_else(|| invalid(format!("{path}: Input should be a valid list")))
}

fn want_bool(v: &Value, path: &str) -> Check<bool> {
    v.as_bool()
        .ok_or_else(|| invalid(format!("{path}: Input should be a valid boolean")))
}

fn want_uint(v: &Value, path: &str) -> Check<u64> {
    match (v.as_u64(), v.as_i64()) {
        (Some(n), _) => Ok(n),
        (None, Some(_)) => Err(invalid(format!(
            "{path}: Input should be greater than or equal to 0"
        ))),
        _ => Err(invalid(format!("{path}: Input should be a valid integer"))),
    }
}

fn want_unit_interval(v: &Value, path: &str) -> Check<f64> {
    let x = v
        .as_f64()
        .ok_or_else(|| invalid(format!("{path}: Input should be a valid number")))?;
    if x < 0.0 {
        return Err(invalid(format!(
            "{path}: Input should be greater than or equal to 0"
        )));
    }
    if x > 1.0 {
        return Err(invalid(format!(
            "{path}: Input should be less than or equal to 1"
        )));
    }
    Ok(x)
}

/// The `type` tag of a tagged object (a content block, a source, `tool_choice`, `thinking`).
fn tag<'a>(obj: &'a Map<String, Value>, path: &str) -> Check<&'a str> {
    want_str(required(obj, "type", path)?, &at(path, "type"))
}

fn bad_tag(path: &str, found: &str, expected: &[&str]) -> Reject {
    let expected: Vec<String> = expected.iter().map(|t| format!("'{t}'")).collect();
    invalid(format!(
        "{path}: Input tag '{found}' found using 'type' does not match any of the expected \
         tags: {}",
        expected.join(", ")
    ))
}

/// `^[a-zA-Z0-9_-]{1,max}$`.
fn is_name(s: &str, max: usize) -> bool {
    !s.is_empty()
        && s.len() <= max
        && s.bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-')
}

/// Counts the `cache_control` breakpoints and checks each one's shape.
struct Cache {
    breakpoints: usize,
}

impl Cache {
    /// Checks `obj.cache_control`, when present (`null` is no breakpoint).
    fn check(&mut self, obj: &Map<String, Value>, path: &str) -> Check {
        let Some(cc) = obj.get("cache_control") else {
            return Ok(());
        };
        if cc.is_null() {
            return Ok(());
        }
        let path = at(path, "cache_control");
        let cc = want_obj(cc, &path)?;
        let kind = tag(cc, &path)?;
        if kind != "ephemeral" {
            return Err(bad_tag(&path, kind, &["ephemeral"]));
        }
        let path = at(&path, "ephemeral");
        only_keys(cc, &["type", "ttl"], &path)?;
        if let Some(ttl) = cc.get("ttl") {
            let ttl_path = at(&path, "ttl");
            if !matches!(want_str(ttl, &ttl_path)?, "5m" | "1h") {
                return Err(invalid(format!("{ttl_path}: Input should be '5m' or '1h'")));
            }
        }
        self.breakpoints += 1;
        Ok(())
    }
}

/// Checks a Messages request body. The first problem found is the answer, as the API reports
/// one.
pub fn validate(body: &[u8]) -> Check<Request> {
    let v: Value = serde_json::from_slice(body).map_err(|e| {
        invalid(format!(
            "There was an issue with the request body: not valid JSON ({e})"
        ))
    })?;
    let top = want_obj(&v, "body")?;
    only_keys(
        top,
        &[
            "model",
            "messages",
            "max_tokens",
            "system",
            "metadata",
            "stop_sequences",
            "stream",
            "temperature",
            "top_k",
            "top_p",
            "tools",
            "tool_choice",
            "thinking",
            "service_tier",
            "container",
            "mcp_servers",
            "context_management",
            "output_config",
        ],
        "",
    )?;
    let model = want_str(required(top, "model", "")?, "model")?;
    if model.is_empty() {
        return Err(invalid("model: String should have at least 1 character"));
    }
    let max_tokens = want_uint(required(top, "max_tokens", "")?, "max_tokens")?;
    if max_tokens < 1 {
        return Err(invalid(
            "max_tokens: Input should be greater than or equal to 1",
        ));
    }
    let messages = want_arr(required(top, "messages", "")?, "messages")?;
    let stream = match top.get("stream") {
        Some(s) => want_bool(s, "stream")?,
        None => false,
    };
    let mut cache = Cache { breakpoints: 0 };

    // Sampling and the small fields.
    let temperature = match top.get("temperature") {
        Some(t) => Some(want_unit_interval(t, "temperature")?),
        None => None,
    };
    if let Some(p) = top.get("top_p") {
        want_unit_interval(p, "top_p")?;
    }
    if let Some(k) = top.get("top_k") {
        want_uint(k, "top_k")?;
    }
    if let Some(stops) = top.get("stop_sequences") {
        for (i, s) in want_arr(stops, "stop_sequences")?.iter().enumerate() {
            let path = at_index("stop_sequences", i);
            if want_str(s, &path)?.trim().is_empty() {
                return Err(invalid(
                    "stop_sequences: each stop sequence must contain non-whitespace",
                ));
            }
        }
    }
    if let Some(m) = top.get("metadata") {
        let m = want_obj(m, "metadata")?;
        only_keys(m, &["user_id"], "metadata")?;
        if let Some(id) = m.get("user_id").filter(|id| !id.is_null()) {
            want_str(id, "metadata.user_id")?;
        }
    }
    if let Some(tier) = top.get("service_tier") {
        if !matches!(want_str(tier, "service_tier")?, "auto" | "standard_only") {
            return Err(invalid(
                "service_tier: Input should be 'auto' or 'standard_only'",
            ));
        }
    }

    // Tools, then the choice among them.
    let tools = match top.get("tools") {
        Some(t) => check_tools(t, &mut cache)?,
        None => Vec::new(),
    };
    let (tool_choice, disable_parallel) = match top.get("tool_choice") {
        Some(tc) => check_tool_choice(tc, &tools)?,
        None => (ToolChoice::Auto, false),
    };

    // Extended thinking.
    let thinking = match top.get("thinking") {
        Some(t) => check_thinking(t, max_tokens)?,
        None => false,
    };
    if thinking {
        if temperature.is_some_and(|t| t != 1.0) {
            return Err(invalid(
                "`temperature` may only be set to 1 when thinking is enabled. Please consult \
                 our documentation at https://docs.claude.com/en/docs/build-with-claude/\
                 extended-thinking#important-considerations-when-using-extended-thinking",
            ));
        }
        if top.contains_key("top_k") {
            return Err(invalid("`top_k` must be unset when thinking is enabled."));
        }
        if matches!(tool_choice, ToolChoice::Any | ToolChoice::Tool(_)) {
            return Err(invalid(
                "Thinking may not be enabled when tool_choice forces tool use.",
            ));
        }
    }

    if let Some(system) = top.get("system") {
        check_system(system, &mut cache)?;
    }
    check_messages(messages, &mut cache)?;
    if cache.breakpoints > MAX_CACHE_BREAKPOINTS {
        return Err(invalid(format!(
            "A maximum of {MAX_CACHE_BREAKPOINTS} blocks with cache_control may be provided. \
             Found {}.",
            cache.breakpoints
        )));
    }
    Ok(Request {
        stream,
        max_tokens,
        thinking,
        tools,
        tool_choice,
        disable_parallel,
    })
}

/// `tools`: custom tools (`name`, `input_schema` of type object, …) or server tools (a dated
/// `type`, checked no further). Names must be unique. Returns the names.
fn check_tools(tools: &Value, cache: &mut Cache) -> Check<Vec<String>> {
    let mut names: Vec<String> = Vec::new();
    for (i, tool) in want_arr(tools, "tools")?.iter().enumerate() {
        let path = at_index("tools", i);
        let obj = want_obj(tool, &path)?;
        let server = obj
            .get("type")
            .and_then(Value::as_str)
            .is_some_and(|t| t != "custom");
        let name = if server {
            want_str(required(obj, "name", &path)?, &at(&path, "name"))?
        } else {
            let path = at(&path, "custom");
            only_keys(
                obj,
                &[
                    "type",
                    "name",
                    "description",
                    "input_schema",
                    "cache_control",
                    "strict",
                ],
                &path,
            )?;
            let name_path = at(&path, "name");
            let name = want_str(required(obj, "name", &path)?, &name_path)?;
            if !is_name(name, MAX_TOOL_NAME) {
                return Err(invalid(format!(
                    "{name_path}: String should match pattern '^[a-zA-Z0-9_-]{{1,{MAX_TOOL_NAME}}}$'"
                )));
            }
            if let Some(d) = obj.get("description") {
                want_str(d, &at(&path, "description"))?;
            }
            let schema_path = at(&path, "input_schema");
            let schema = want_obj(required(obj, "input_schema", &path)?, &schema_path)?;
            let schema_type = at(&schema_path, "type");
            if required(schema, "type", &schema_path)?.as_str() != Some("object") {
                return Err(invalid(format!("{schema_type}: Input should be 'object'")));
            }
            if let Some(strict) = obj.get("strict") {
                want_bool(strict, &at(&path, "strict"))?;
            }
            cache.check(obj, &path)?;
            name
        };
        if names.iter().any(|n| n == name) {
            return Err(invalid("tools: Tool names must be unique."));
        }
        names.push(name.to_owned());
    }
    Ok(names)
}

fn check_tool_choice(tc: &Value, tools: &[String]) -> Check<(ToolChoice, bool)> {
    let obj = want_obj(tc, "tool_choice")?;
    let kind = tag(obj, "tool_choice")?;
    let path = &at("tool_choice", kind);
    let choice = match kind {
        "auto" => ToolChoice::Auto,
        "any" => ToolChoice::Any,
        "none" => ToolChoice::None,
        "tool" => {
            ToolChoice::Tool(want_str(required(obj, "name", path)?, &at(path, "name"))?.to_owned())
        }
        _ => {
            return Err(bad_tag(
                "tool_choice",
                kind,
                &["auto", "any", "tool", "none"],
            ))
        }
    };
    match choice {
        ToolChoice::None => only_keys(obj, &["type"], path)?,
        ToolChoice::Tool(_) => {
            only_keys(obj, &["type", "name", "disable_parallel_tool_use"], path)?
        }
        _ => only_keys(obj, &["type", "disable_parallel_tool_use"], path)?,
    }
    let disable_parallel = match obj.get("disable_parallel_tool_use") {
        Some(d) => want_bool(d, &at(path, "disable_parallel_tool_use"))?,
        None => false,
    };
    match &choice {
        ToolChoice::Any | ToolChoice::Tool(_) if tools.is_empty() => {
            return Err(invalid(format!(
                "tool_choice: tool_choice.type '{kind}' may only be specified while providing \
                 tools"
            )))
        }
        ToolChoice::Tool(name) if !tools.contains(name) => {
            return Err(invalid(format!(
                "tool_choice.tool.name: Tool '{name}' not found in provided tools"
            )))
        }
        _ => {}
    }
    Ok((choice, disable_parallel))
}

/// `thinking`: `{"type": "enabled", "budget_tokens": N}` (1024 ≤ N < max_tokens) or
/// `{"type": "disabled"}`. Whether it is on.
fn check_thinking(t: &Value, max_tokens: u64) -> Check<bool> {
    let obj = want_obj(t, "thinking")?;
    let kind = tag(obj, "thinking")?;
    let path = at("thinking", kind);
    match kind {
        "enabled" => {
            only_keys(obj, &["type", "budget_tokens"], &path)?;
            let budget_path = at(&path, "budget_tokens");
            let budget = want_uint(required(obj, "budget_tokens", &path)?, &budget_path)?;
            if budget < 1024 {
                return Err(invalid(format!(
                    "{budget_path}: Input should be greater than or equal to 1024"
                )));
            }
            if max_tokens <= budget {
                return Err(invalid(
                    "`max_tokens` must be greater than `thinking.budget_tokens`. Please consult \
                     our documentation at https://docs.claude.com/en/docs/build-with-claude/\
                     extended-thinking#max-tokens-and-context-window-size",
                ));
            }
            Ok(true)
        }
        "disabled" => {
            only_keys(obj, &["type"], &path)?;
            Ok(false)
        }
        _ => Err(bad_tag("thinking", kind, &["enabled", "disabled"])),
    }
}

/// `system`: a string, or a list of text blocks.
fn check_system(system: &Value, cache: &mut Cache) -> Check {
    if system.is_string() {
        return Ok(());
    }
    let blocks = system.as_array().ok_or_else(|| {
        invalid("system: Input should be a valid string or a list of text blocks")
    })?;
    for (i, b) in blocks.iter().enumerate() {
        let path = at_index("system", i);
        let obj = want_obj(b, &path)?;
        let kind = tag(obj, &path)?;
        if kind != "text" {
            return Err(bad_tag(&path, kind, &["text"]));
        }
        check_text(obj, &path, "system", cache)?;
    }
    Ok(())
}

/// A text block (`where_` names the list in the emptiness message: `messages`, `system`).
fn check_text(obj: &Map<String, Value>, path: &str, where_: &str, cache: &mut Cache) -> Check {
    only_keys(obj, &["type", "text", "cache_control", "citations"], path)?;
    let text = want_str(required(obj, "text", path)?, &at(path, "text"))?;
    if text.is_empty() {
        return Err(invalid(format!(
            "{where_}: text content blocks must be non-empty"
        )));
    }
    cache.check(obj, path)
}

/// The block types each role may send.
const USER_BLOCKS: &[&str] = &["text", "image", "document", "tool_result"];
const ASSISTANT_BLOCKS: &[&str] = &["text", "tool_use", "thinking", "redacted_thinking"];

/// `messages`: at least one; roles user / assistant, alternating, the first a user; every
/// message's content non-empty except a final assistant message's; every `tool_use` answered
/// by a `tool_result` in the very next (user) message, and every `tool_result` answering a
/// `tool_use` of the message just before it.
fn check_messages(messages: &[Value], cache: &mut Cache) -> Check {
    if messages.is_empty() {
        return Err(invalid("messages: at least one message is required"));
    }
    // `tool_use` ids of the previous (assistant) message still waiting for their results, and
    // every id seen so far.
    let mut pending: Vec<String> = Vec::new();
    let mut seen: Vec<String> = Vec::new();
    let mut prev_role: Option<&str> = None;
    for (i, m) in messages.iter().enumerate() {
        let path = at_index("messages", i);
        let obj = want_obj(m, &path)?;
        only_keys(obj, &["role", "content"], &path)?;
        let role_path = at(&path, "role");
        let role = want_str(required(obj, "role", &path)?, &role_path)?;
        let is_user = match role {
            "user" => true,
            "assistant" => false,
            _ => {
                return Err(invalid(format!(
                    "{role_path}: Input should be 'user' or 'assistant'"
                )))
            }
        };
        match prev_role {
            None if !is_user => {
                return Err(invalid(
                    "messages: first message must use the \"user\" role",
                ))
            }
            Some(prev) if prev == role => {
                return Err(invalid(format!(
                    "messages: roles must alternate between \"user\" and \"assistant\", but \
                     found multiple \"{role}\" roles in a row"
                )))
            }
            _ => {}
        }
        prev_role = Some(role);
        let last_assistant = !is_user && i + 1 == messages.len();
        let content_path = at(&path, "content");
        let content = required(obj, "content", &path)?;
        let not_empty = || {
            invalid(format!(
                "{path}: all messages must have non-empty content except for the optional \
                 final assistant message"
            ))
        };
        // Results this (user) message gives.
        let mut results: Vec<&str> = Vec::new();
        match content {
            Value::String(s) => {
                if s.is_empty() && !last_assistant {
                    return Err(not_empty());
                }
            }
            Value::Array(blocks) => {
                if blocks.is_empty() && !last_assistant {
                    return Err(not_empty());
                }
                let allowed = if is_user {
                    USER_BLOCKS
                } else {
                    ASSISTANT_BLOCKS
                };
                for (j, b) in blocks.iter().enumerate() {
                    let bpath = at_index(&content_path, j);
                    let bobj = want_obj(b, &bpath)?;
                    let kind = tag(bobj, &bpath)?;
                    if !allowed.contains(&kind) {
                        return Err(bad_tag(&bpath, kind, allowed));
                    }
                    match kind {
                        "text" => check_text(bobj, &bpath, "messages", cache)?,
                        "image" => check_image(bobj, &bpath, cache)?,
                        "document" => check_document(bobj, &bpath, cache)?,
                        "tool_use" => {
                            let id = check_tool_use(bobj, &bpath, cache)?;
                            if seen.iter().any(|s| s == id) {
                                return Err(invalid(format!(
                                    "{bpath}: `tool_use` ids must be unique"
                                )));
                            }
                            seen.push(id.to_owned());
                        }
                        "tool_result" => {
                            let id = check_tool_result(bobj, &bpath, cache)?;
                            if !pending.iter().any(|p| p == id) {
                                return Err(invalid(format!(
                                    "{bpath}: unexpected `tool_use_id` found in `tool_result` \
                                     blocks: {id}. Each `tool_result` block must have a \
                                     corresponding `tool_use` block in the previous message."
                                )));
                            }
                            if results.contains(&id) {
                                return Err(invalid(format!(
                                    "{bpath}: each `tool_use` id may be answered by only one \
                                     `tool_result` block: {id}"
                                )));
                            }
                            results.push(id);
                        }
                        "thinking" => {
                            only_keys(bobj, &["type", "thinking", "signature"], &bpath)?;
                            want_str(required(bobj, "thinking", &bpath)?, &at(&bpath, "thinking"))?;
                            want_str(
                                required(bobj, "signature", &bpath)?,
                                &at(&bpath, "signature"),
                            )?;
                        }
                        _ => {
                            // redacted_thinking
                            only_keys(bobj, &["type", "data"], &bpath)?;
                            want_str(required(bobj, "data", &bpath)?, &at(&bpath, "data"))?;
                        }
                    }
                }
            }
            _ => {
                return Err(invalid(format!(
                    "{content_path}: Input should be a valid string or a list of content blocks"
                )))
            }
        }
        // The previous assistant message's `tool_use` blocks must all be answered here.
        let unanswered: Vec<&str> = pending
            .iter()
            .map(String::as_str)
            .filter(|p| !results.contains(p))
            .collect();
        if !unanswered.is_empty() {
            return Err(invalid(format!(
                "messages.{}: `tool_use` ids were found without `tool_result` blocks \
                 immediately after: {}. Each `tool_use` block must have a corresponding \
                 `tool_result` block in the next message.",
                i - 1,
                unanswered.join(", ")
            )));
        }
        pending.clear();
        if !is_user {
            if let Value::Array(blocks) = content {
                pending.extend(
                    blocks
                        .iter()
                        .filter(|b| b.get("type").and_then(Value::as_str) == Some("tool_use"))
                        .filter_map(|b| b.get("id").and_then(Value::as_str))
                        .map(str::to_owned),
                );
            }
        }
    }
    if !pending.is_empty() {
        return Err(invalid(format!(
            "messages.{}: `tool_use` ids were found without `tool_result` blocks immediately \
             after: {}. Each `tool_use` block must have a corresponding `tool_result` block in \
             the next message.",
            messages.len() - 1,
            pending.join(", ")
        )));
    }
    Ok(())
}

/// Image media types the API takes, with the bytes each format starts with.
const IMAGE_TYPES: &[(&str, &[u8])] = &[
    ("image/jpeg", b"\xff\xd8\xff"),
    ("image/png", b"\x89PNG\r\n\x1a\n"),
    ("image/gif", b"GIF8"),
    ("image/webp", b"RIFF"),
];

fn check_image(obj: &Map<String, Value>, path: &str, cache: &mut Cache) -> Check {
    only_keys(obj, &["type", "source", "cache_control"], path)?;
    let spath = at(path, "source");
    let source = want_obj(required(obj, "source", path)?, &spath)?;
    let kind = tag(source, &spath)?;
    let spath = at(&spath, kind);
    match kind {
        "base64" => {
            only_keys(source, &["type", "media_type", "data"], &spath)?;
            let mt_path = at(&spath, "media_type");
            let media_type = want_str(required(source, "media_type", &spath)?, &mt_path)?;
            let Some((_, magic)) = IMAGE_TYPES.iter().find(|(t, _)| *t == media_type) else {
                return Err(invalid(format!(
                    "{mt_path}: Input should be 'image/jpeg', 'image/png', 'image/gif' or \
                     'image/webp'"
                )));
            };
            let data_path = at(&spath, "data");
            let data = want_str(required(source, "data", &spath)?, &data_path)?;
            let bytes = base64_decode(data).ok_or_else(|| {
                invalid(format!("{data_path}: The image data is not valid base64"))
            })?;
            let webp_ok = media_type != "image/webp" || bytes.get(8..12) == Some(&b"WEBP"[..]);
            if bytes.is_empty() || !bytes.starts_with(magic) || !webp_ok {
                return Err(invalid(format!(
                    "{data_path}: Image does not match the provided media type {media_type}"
                )));
            }
        }
        "url" => {
            only_keys(source, &["type", "url"], &spath)?;
            let url_path = at(&spath, "url");
            let url = want_str(required(source, "url", &spath)?, &url_path)?;
            let rest = url
                .strip_prefix("https://")
                .or_else(|| url.strip_prefix("http://"));
            if rest.is_none_or(|r| r.is_empty()) {
                return Err(invalid(format!("{url_path}: Input should be a valid URL")));
            }
        }
        "file" => {
            only_keys(source, &["type", "file_id"], &spath)?;
            want_str(required(source, "file_id", &spath)?, &at(&spath, "file_id"))?;
        }
        _ => {
            return Err(bad_tag(
                &at(path, "source"),
                kind,
                &["base64", "url", "file"],
            ))
        }
    }
    cache.check(obj, path)
}

fn check_document(obj: &Map<String, Value>, path: &str, cache: &mut Cache) -> Check {
    only_keys(
        obj,
        &[
            "type",
            "source",
            "title",
            "context",
            "citations",
            "cache_control",
        ],
        path,
    )?;
    let spath = at(path, "source");
    let source = want_obj(required(obj, "source", path)?, &spath)?;
    let kind = tag(source, &spath)?;
    if !matches!(kind, "base64" | "text" | "content" | "url" | "file") {
        return Err(bad_tag(
            &spath,
            kind,
            &["base64", "text", "content", "url", "file"],
        ));
    }
    cache.check(obj, path)
}

/// A `tool_use` block of an assistant message; returns its id.
fn check_tool_use<'a>(
    obj: &'a Map<String, Value>,
    path: &str,
    cache: &mut Cache,
) -> Check<&'a str> {
    only_keys(obj, &["type", "id", "name", "input", "cache_control"], path)?;
    let id_path = at(path, "id");
    let id = want_str(required(obj, "id", path)?, &id_path)?;
    if !is_name(id, usize::MAX) {
        return Err(invalid(format!(
            "{id_path}: String should match pattern '^[a-zA-Z0-9_-]+$'"
        )));
    }
    let name_path = at(path, "name");
    let name = want_str(required(obj, "name", path)?, &name_path)?;
    if !is_name(name, MAX_TOOL_NAME) {
        return Err(invalid(format!(
            "{name_path}: String should match pattern '^[a-zA-Z0-9_-]{{1,{MAX_TOOL_NAME}}}$'"
        )));
    }
    want_obj(required(obj, "input", path)?, &at(path, "input"))?;
    cache.check(obj, path)?;
    Ok(id)
}

/// A `tool_result` block of a user message; returns the id it answers.
fn check_tool_result<'a>(
    obj: &'a Map<String, Value>,
    path: &str,
    cache: &mut Cache,
) -> Check<&'a str> {
    only_keys(
        obj,
        &[
            "type",
            "tool_use_id",
            "content",
            "is_error",
            "cache_control",
        ],
        path,
    )?;
    let id = want_str(
        required(obj, "tool_use_id", path)?,
        &at(path, "tool_use_id"),
    )?;
    if let Some(e) = obj.get("is_error") {
        want_bool(e, &at(path, "is_error"))?;
    }
    match obj.get("content") {
        None | Some(Value::String(_)) => {}
        Some(Value::Array(blocks)) => {
            let cpath = at(path, "content");
            for (k, b) in blocks.iter().enumerate() {
                let bpath = at_index(&cpath, k);
                let bobj = want_obj(b, &bpath)?;
                match tag(bobj, &bpath)? {
                    "text" => check_text(bobj, &bpath, "messages", cache)?,
                    "image" => check_image(bobj, &bpath, cache)?,
                    "document" => check_document(bobj, &bpath, cache)?,
                    other => return Err(bad_tag(&bpath, other, &["text", "image", "document"])),
                }
            }
        }
        Some(_) => {
            return Err(invalid(format!(
                "{}: Input should be a valid string or a list of content blocks",
                at(path, "content")
            )))
        }
    }
    cache.check(obj, path)?;
    Ok(id)
}

/// Standard base64 with padding (what `data` of a base64 source must be); None when it isn't.
pub fn base64_decode(s: &str) -> Option<Vec<u8>> {
    fn sextet(c: u8) -> Option<u32> {
        Some(u32::from(match c {
            b'A'..=b'Z' => c - b'A',
            b'a'..=b'z' => c - b'a' + 26,
            b'0'..=b'9' => c - b'0' + 52,
            b'+' => 62,
            b'/' => 63,
            _ => return None,
        }))
    }
    let b = s.as_bytes();
    let quads = b.chunks_exact(4);
    if !quads.remainder().is_empty() {
        return None;
    }
    let mut out = Vec::with_capacity(b.len() / 4 * 3);
    for (n, quad) in quads.enumerate() {
        let last = n + 1 == b.len() / 4;
        let pad = quad.iter().rev().take_while(|&&c| c == b'=').count();
        if pad > 2 || (pad > 0 && !last) {
            return None;
        }
        let mut acc = 0u32;
        for &c in &quad[..4 - pad] {
            acc = (acc << 6) | sextet(c)?;
        }
        acc <<= 6 * pad as u32;
        let bytes = acc.to_be_bytes();
        out.extend_from_slice(&bytes[1..4 - pad]);
    }
    Some(out)
}

/// One content block of the answer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Block {
    Thinking,
    Text,
    /// The `n`th `tool_use` block (0-based among the tool calls).
    Tool(usize),
}

/// What the mock answers a valid Messages request with.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Answer {
    /// `usage.input_tokens`: the request body's length / 4, at least 1 (as the OpenAI routes'
    /// `prompt_tokens`).
    pub input_tokens: u64,
    /// `usage.cache_read_input_tokens` (`x-mock-cache-read`).
    pub cache_read: u64,
    /// `usage.cache_creation_input_tokens` (`x-mock-cache-write`).
    pub cache_write: u64,
    /// A thinking block comes first.
    pub thinking: bool,
    /// Words of the text block (`tok0 tok1 …`).
    pub text_tokens: u64,
    /// Whether there is a text block (there is one unless tools are called and the text is
    /// empty).
    pub text_block: bool,
    /// The tool each `tool_use` block calls, in order.
    pub tool_calls: Vec<String>,
    /// Each `tool_use` block's `input`, as JSON text.
    pub tool_inputs: Vec<String>,
    pub stop_reason: &'static str,
}

/// How much the answer may hold, from the request and the controls.
pub struct Sizes {
    /// `--tokens` / `x-mock-tokens`.
    pub tokens: u64,
    /// `x-mock-tool-calls` (0 when absent).
    pub tool_calls: u64,
    /// `x-mock-tool-calls-json`: exactly these calls (names and inputs), whatever the request
    /// offers; empty: none scripted.
    pub script: Vec<super::chat_tools::Scripted>,
    pub input_tokens: u64,
    pub cache_read: u64,
    pub cache_write: u64,
}

impl Answer {
    /// Plans the answer. Tools are called only when the request offers some: as many calls as
    /// `x-mock-tool-calls` says (at least one when `tool_choice` is `any` or `tool`, none when
    /// it is `none`, at most one with `disable_parallel_tool_use`), each to the next tool in
    /// order (or to the named tool). The output is cut to `max_tokens`: thinking, then text,
    /// then whole tool calls; what is cut makes the stop reason `max_tokens`.
    /// A script (`x-mock-tool-calls-json`) replaces all of that but the cut: its calls, by its
    /// names and inputs.
    pub fn plan(req: &Request, s: &Sizes) -> Answer {
        let scripted = !s.script.is_empty();
        let mut calls = match req.tool_choice {
            _ if scripted => s.script.len() as u64,
            _ if req.tools.is_empty() => 0,
            ToolChoice::None => 0,
            ToolChoice::Any | ToolChoice::Tool(_) => s.tool_calls.max(1),
            ToolChoice::Auto => s.tool_calls,
        };
        if req.disable_parallel && !scripted {
            calls = calls.min(1);
        }
        let thinking_tokens = if req.thinking { THINKING_DELTAS } else { 0 };
        let mut budget = req.max_tokens.saturating_sub(thinking_tokens);
        let mut cut = false;
        let text_tokens = if s.tokens > budget {
            cut = true;
            budget
        } else {
            s.tokens
        };
        budget -= text_tokens;
        let mut tool_calls = Vec::new();
        let mut tool_inputs = Vec::new();
        for n in 0..calls {
            if cut || budget < TOOL_JSON_DELTAS {
                cut = true;
                break;
            }
            budget -= TOOL_JSON_DELTAS;
            let (name, input) = match (s.script.get(n as usize), &req.tool_choice) {
                (Some(call), _) => (call.name.clone(), call.arguments.clone()),
                (None, ToolChoice::Tool(name)) => (name.clone(), tool_input(n as usize)),
                (None, _) => (
                    req.tools[(n as usize) % req.tools.len()].clone(),
                    tool_input(n as usize),
                ),
            };
            tool_calls.push(name);
            tool_inputs.push(input);
        }
        Answer {
            input_tokens: s.input_tokens,
            cache_read: s.cache_read,
            cache_write: s.cache_write,
            thinking: req.thinking,
            text_tokens,
            text_block: text_tokens > 0 || tool_calls.is_empty(),
            stop_reason: if cut {
                "max_tokens"
            } else if tool_calls.is_empty() {
                "end_turn"
            } else {
                "tool_use"
            },
            tool_calls,
            tool_inputs,
        }
    }

    /// The content blocks, in order.
    pub fn blocks(&self) -> Vec<Block> {
        let mut b = Vec::with_capacity(2 + self.tool_calls.len());
        if self.thinking {
            b.push(Block::Thinking);
        }
        if self.text_block {
            b.push(Block::Text);
        }
        b.extend((0..self.tool_calls.len()).map(Block::Tool));
        b
    }

    /// Content deltas of a block (`thinking_delta`, `text_delta`, `input_json_delta`; not the
    /// `signature_delta`).
    pub fn deltas(&self, block: Block) -> u64 {
        match block {
            Block::Thinking => THINKING_DELTAS,
            Block::Text => self.text_tokens,
            Block::Tool(_) => TOOL_JSON_DELTAS,
        }
    }

    /// `usage.output_tokens`: one per content delta.
    pub fn output_tokens(&self) -> u64 {
        self.blocks().into_iter().map(|b| self.deltas(b)).sum()
    }

    /// The prompt in OpenAI's terms: input, cache reads and cache writes together.
    pub fn prompt_tokens(&self) -> u64 {
        self.input_tokens
            .saturating_add(self.cache_read)
            .saturating_add(self.cache_write)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn check(v: Value) -> Check<Request> {
        validate(v.to_string().as_bytes())
    }

    fn base() -> Value {
        json!({"model": "claude-x", "max_tokens": 64,
               "messages": [{"role": "user", "content": "hello"}]})
    }

    fn with(mut v: Value, key: &str, val: Value) -> Value {
        v[key] = val;
        v
    }

    fn rejects(v: Value, needle: &str) {
        match check(v.clone()) {
            Err(r) => {
                assert_eq!((r.status, r.kind), (400, "invalid_request_error"), "{v}");
                assert!(
                    r.message.contains(needle),
                    "{needle:?} not in {:?} for {v}",
                    r.message
                );
            }
            Ok(_) => panic!("accepted {v}"),
        }
    }

    const PNG_1PX: &str = "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mNk+M9QDwADhgGAWjR9awAAAABJRU5ErkJggg==";

    #[test]
    fn headers_key_then_version() {
        let h = |key: Option<&'static str>,
                 bearer: Option<&'static str>,
                 version: Option<&'static str>| Headers {
            api_key: key.map(str::as_bytes),
            bearer: bearer.map(str::as_bytes),
            version: version.map(str::as_bytes),
            beta: Vec::new(),
        };
        let old = Some("2023-06-01");
        let new = Some("2026-10-21");
        let revoked = ["k".to_owned()];
        assert_eq!(check_headers(&h(Some("k"), None, old), &[]), Ok(()));
        let r = check_headers(&h(Some("k"), None, old), &revoked).unwrap_err();
        assert_eq!((r.status, r.message.as_str()), (401, "invalid x-api-key"));
        // A bearer: refused as an OAuth token under 2023-06-01, taken by later versions.
        let r = check_headers(&h(None, Some("t"), old), &[]).unwrap_err();
        assert_eq!(r.kind, "authentication_error");
        assert!(r.message.starts_with("OAuth authentication"));
        assert_eq!(check_headers(&h(None, Some("t"), new), &[]), Ok(()));
        assert_eq!(
            check_headers(&h(None, Some("k"), new), &revoked)
                .unwrap_err()
                .status,
            401
        );
        let mut beta = h(None, Some("t"), old);
        beta.beta.push(b"foo, oauth-2025-04-20");
        assert_eq!(check_headers(&beta, &[]), Ok(()));
        // The key wins over a bearer beside it.
        assert_eq!(check_headers(&h(Some("k"), Some("t"), old), &[]), Ok(()));
        let none = check_headers(&h(None, Some(" "), None), &[]).unwrap_err();
        assert_eq!(none.message, "x-api-key header is required");
        let r = check_headers(&h(Some("k"), None, None), &[]).unwrap_err();
        assert_eq!(
            (r.status, r.message.as_str()),
            (400, "anthropic-version: header is required")
        );
        assert_eq!(
            check_headers(&h(Some("k"), None, Some("v1")), &[])
                .unwrap_err()
                .status,
            400
        );
    }

    #[test]
    fn required_fields_and_extra_inputs() {
        let req = check(base()).unwrap();
        assert!(!req.stream && !req.thinking);
        assert_eq!(req.max_tokens, 64);
        let mut v = base();
        v.as_object_mut().unwrap().remove("max_tokens");
        rejects(v, "max_tokens: Field required");
        let mut v = base();
        v.as_object_mut().unwrap().remove("model");
        rejects(v, "model: Field required");
        rejects(
            with(base(), "max_tokens", json!(0)),
            "max_tokens: Input should be greater",
        );
        rejects(
            with(base(), "max_tokens", json!("9")),
            "max_tokens: Input should be a valid integer",
        );
        rejects(with(base(), "messages", json!([])), "at least one message");
        rejects(
            with(base(), "stream_options", json!({"include_usage": true})),
            "stream_options: Extra inputs are not permitted",
        );
        rejects(
            with(base(), "stream", json!("yes")),
            "stream: Input should be a valid boolean",
        );
        rejects(
            with(base(), "temperature", json!(1.5)),
            "temperature: Input should be less",
        );
        rejects(
            with(base(), "metadata", json!({"user": "u"})),
            "metadata.user: Extra inputs",
        );
        rejects(
            with(base(), "stop_sequences", json!([" "])),
            "non-whitespace",
        );
        let r = validate(b"{not json").unwrap_err();
        assert!(r.message.contains("not valid JSON"), "{r:?}");
        rejects(json!([1]), "body: Input should be a valid dictionary");
        let ok = with(
            with(base(), "metadata", json!({"user_id": "u1"})),
            "stop_sequences",
            json!(["END"]),
        );
        check(ok).unwrap();
    }

    #[test]
    fn roles_alternate_starting_with_user() {
        let msgs = |m: Value| with(base(), "messages", m);
        rejects(
            msgs(json!([{"role": "assistant", "content": "hi"}])),
            "first message must use the \"user\" role",
        );
        rejects(
            msgs(json!([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}])),
            "found multiple \"user\" roles in a row",
        );
        rejects(
            msgs(json!([{"role": "system", "content": "a"}])),
            "messages.0.role: Input should be 'user' or 'assistant'",
        );
        rejects(
            msgs(json!([{"role": "user", "content": "a", "name": "bob"}])),
            "messages.0.name: Extra inputs are not permitted",
        );
        rejects(
            msgs(json!([{"role": "user", "content": ""}])),
            "non-empty content",
        );
        rejects(
            msgs(json!([{"role": "user", "content": [{"type": "text", "text": ""}]}])),
            "text content blocks must be non-empty",
        );
        // A final assistant message may be empty (a prefill).
        check(msgs(json!([
            {"role": "user", "content": "a"}, {"role": "assistant", "content": ""}
        ])))
        .unwrap();
        rejects(
            msgs(
                json!([{"role": "user", "content": [{"type": "tool_use", "id": "t", "name": "f", "input": {}}]}]),
            ),
            "Input tag 'tool_use' found using 'type'",
        );
    }

    #[test]
    fn system_is_top_level_text() {
        check(with(base(), "system", json!("be brief"))).unwrap();
        check(with(
            base(),
            "system",
            json!([{"type": "text", "text": "be brief", "cache_control": {"type": "ephemeral"}}]),
        ))
        .unwrap();
        rejects(
            with(base(), "system", json!([{"type": "image", "source": {}}])),
            "system.0: Input tag 'image'",
        );
        rejects(with(base(), "system", json!(3)), "system: Input should be");
        rejects(
            with(
                base(),
                "system",
                json!([{"type": "text", "text": "x", "cache_control": {"type": "forever"}}]),
            ),
            "system.0.cache_control: Input tag 'forever'",
        );
    }

    fn tool_turns(result_id: &str) -> Value {
        json!([
            {"role": "user", "content": "weather?"},
            {"role": "assistant", "content": [
                {"type": "text", "text": "checking"},
                {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "a"}},
                {"type": "tool_use", "id": "toolu_2", "name": "get_weather", "input": {"city": "b"}}
            ]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "toolu_1", "content": "sunny"},
                {"type": "tool_result", "tool_use_id": result_id,
                 "content": [{"type": "text", "text": "rain"}], "is_error": false}
            ]}
        ])
    }

    #[test]
    fn tool_results_answer_the_previous_tool_uses() {
        check(with(base(), "messages", tool_turns("toolu_2"))).unwrap();
        rejects(
            with(base(), "messages", tool_turns("toolu_9")),
            "messages.2.content.1: unexpected `tool_use_id` found in `tool_result` blocks: toolu_9",
        );
        rejects(
            with(base(), "messages", tool_turns("toolu_1")),
            "only one `tool_result`",
        );
        // toolu_2 left unanswered.
        let mut m = tool_turns("toolu_2");
        m[2]["content"].as_array_mut().unwrap().pop();
        m[2]["content"]
            .as_array_mut()
            .unwrap()
            .push(json!({"type": "text", "text": "hm"}));
        rejects(
            with(base(), "messages", m),
            "messages.1: `tool_use` ids were found without `tool_result` blocks immediately after: toolu_2",
        );
        // Ending on an assistant tool_use: nothing answers it.
        let mut m = tool_turns("toolu_2");
        m.as_array_mut().unwrap().pop();
        rejects(with(base(), "messages", m), "toolu_1, toolu_2");
        // A result two turns late does not count.
        let late = json!([
            {"role": "user", "content": "a"},
            {"role": "assistant", "content": [{"type": "tool_use", "id": "x", "name": "f", "input": {}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "x"}]},
            {"role": "assistant", "content": "ok"},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "x"}]}
        ]);
        rejects(
            with(base(), "messages", late),
            "messages.4.content.0: unexpected `tool_use_id`",
        );
        // Inputs are objects (a translator must parse OpenAI's argument strings).
        let mut m = tool_turns("toolu_2");
        m[1]["content"][1]["input"] = json!("{\"city\":\"a\"}");
        rejects(
            with(base(), "messages", m),
            "messages.1.content.1.input: Input should be a valid dictionary",
        );
        let mut m = tool_turns("toolu_2");
        m[1]["content"][2]["id"] = json!("toolu_1");
        rejects(with(base(), "messages", m), "ids must be unique");
    }

    #[test]
    fn tools_and_tool_choice() {
        let tools = json!([
            {"name": "get_weather", "description": "d", "input_schema": {"type": "object"}},
            {"name": "get_time", "input_schema": {"type": "object", "properties": {}}}
        ]);
        let v = with(base(), "tools", tools.clone());
        let req = check(v.clone()).unwrap();
        assert_eq!(req.tools, ["get_weather", "get_time"]);
        assert_eq!(req.tool_choice, ToolChoice::Auto);
        for (tc, want) in [
            (json!({"type": "auto"}), ToolChoice::Auto),
            (
                json!({"type": "any", "disable_parallel_tool_use": true}),
                ToolChoice::Any,
            ),
            (json!({"type": "none"}), ToolChoice::None),
            (
                json!({"type": "tool", "name": "get_time"}),
                ToolChoice::Tool("get_time".into()),
            ),
        ] {
            assert_eq!(
                check(with(v.clone(), "tool_choice", tc))
                    .unwrap()
                    .tool_choice,
                want
            );
        }
        rejects(
            with(v.clone(), "tool_choice", json!({"type": "required"})),
            "tool_choice: Input tag 'required' found using 'type' does not match any of the expected tags: 'auto', 'any', 'tool', 'none'",
        );
        rejects(
            with(v.clone(), "tool_choice", json!("auto")),
            "tool_choice: Input should be a valid dictionary",
        );
        rejects(
            with(
                v.clone(),
                "tool_choice",
                json!({"type": "tool", "name": "nope"}),
            ),
            "Tool 'nope' not found",
        );
        rejects(
            with(base(), "tool_choice", json!({"type": "any"})),
            "while providing tools",
        );
        rejects(
            with(
                base(),
                "tools",
                json!([{"type": "function", "function": {"name": "f"}}]),
            ),
            "tools.0.name: Field required",
        );
        rejects(
            with(base(), "tools", json!([{"name": "f", "parameters": {}}])),
            "tools.0.custom.parameters: Extra inputs are not permitted",
        );
        rejects(
            with(base(), "tools", json!([{"name": "f"}])),
            "tools.0.custom.input_schema: Field required",
        );
        rejects(
            with(
                base(),
                "tools",
                json!([{"name": "f g", "input_schema": {"type": "object"}}]),
            ),
            "tools.0.custom.name: String should match pattern",
        );
        rejects(
            with(
                base(),
                "tools",
                json!([{"name": "f", "input_schema": {"type": "array"}}]),
            ),
            "tools.0.custom.input_schema.type: Input should be 'object'",
        );
        let dup = json!([
            {"name": "f", "input_schema": {"type": "object"}},
            {"name": "f", "input_schema": {"type": "object"}}
        ]);
        rejects(with(base(), "tools", dup), "Tool names must be unique");
        // A server tool is taken as it is.
        check(with(
            base(),
            "tools",
            json!([{"type": "web_search_20250305", "name": "web_search"}]),
        ))
        .unwrap();
    }

    #[test]
    fn thinking_needs_a_budget_below_max_tokens() {
        let v = with(base(), "max_tokens", json!(4096));
        let on = with(
            v.clone(),
            "thinking",
            json!({"type": "enabled", "budget_tokens": 2048}),
        );
        assert!(check(on.clone()).unwrap().thinking);
        assert!(
            !check(with(v.clone(), "thinking", json!({"type": "disabled"})))
                .unwrap()
                .thinking
        );
        rejects(
            with(
                v.clone(),
                "thinking",
                json!({"type": "enabled", "budget_tokens": 100}),
            ),
            "thinking.enabled.budget_tokens: Input should be greater than or equal to 1024",
        );
        rejects(
            with(
                v.clone(),
                "thinking",
                json!({"type": "enabled", "budget_tokens": 4096}),
            ),
            "`max_tokens` must be greater than `thinking.budget_tokens`",
        );
        rejects(
            with(v.clone(), "thinking", json!({"type": "enabled"})),
            "budget_tokens: Field required",
        );
        rejects(
            with(v.clone(), "thinking", json!({"type": "on"})),
            "thinking: Input tag 'on'",
        );
        rejects(
            with(on.clone(), "temperature", json!(0.5)),
            "`temperature` may only be set to 1",
        );
        let forced = with(
            with(
                on,
                "tools",
                json!([{"name": "f", "input_schema": {"type": "object"}}]),
            ),
            "tool_choice",
            json!({"type": "any"}),
        );
        rejects(forced, "tool_choice forces tool use");
    }

    #[test]
    fn images_need_a_valid_source() {
        let img = |source: Value| {
            with(
                base(),
                "messages",
                json!([{"role": "user", "content": [
                    {"type": "text", "text": "what is this?"},
                    {"type": "image", "source": source}
                ]}]),
            )
        };
        check(img(
            json!({"type": "base64", "media_type": "image/png", "data": PNG_1PX}),
        ))
        .unwrap();
        check(img(
            json!({"type": "url", "url": "https://example.com/a.png"}),
        ))
        .unwrap();
        rejects(
            img(json!({"type": "base64", "media_type": "image/jpeg", "data": PNG_1PX})),
            "messages.0.content.1.source.base64.data: Image does not match the provided media type image/jpeg",
        );
        rejects(
            img(json!({"type": "base64", "media_type": "image/bmp", "data": PNG_1PX})),
            "messages.0.content.1.source.base64.media_type: Input should be",
        );
        rejects(
            img(json!({"type": "base64", "media_type": "image/png", "data": "not base64!"})),
            "not valid base64",
        );
        rejects(
            img(json!({"type": "url", "url": "data:image/png;base64,AAAA"})),
            "valid URL",
        );
        rejects(
            img(json!({"type": "image_url", "url": "x"})),
            "source: Input tag 'image_url'",
        );
        rejects(
            img(json!({"type": "base64", "media_type": "image/png"})),
            "source.base64.data: Field required",
        );
        // OpenAI's shape is not a block the API knows.
        let openai = with(
            base(),
            "messages",
            json!([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "https://x/a.png"}}]}]),
        );
        rejects(openai, "messages.0.content.0: Input tag 'image_url'");
    }

    #[test]
    fn at_most_four_cache_breakpoints() {
        let cc = json!({"type": "ephemeral"});
        let block = json!({"type": "text", "text": "x", "cache_control": cc});
        let four = with(base(), "system", json!([block, block, block, block]));
        check(four.clone()).unwrap();
        let mut five = four;
        five["messages"] = json!([{"role": "user", "content": [block]}]);
        rejects(
            five,
            "A maximum of 4 blocks with cache_control may be provided. Found 5.",
        );
        rejects(
            with(
                base(),
                "system",
                json!([{"type": "text", "text": "x", "cache_control": {"type": "ephemeral", "ttl": "2h"}}]),
            ),
            "ttl: Input should be '5m' or '1h'",
        );
    }

    #[test]
    fn base64() {
        assert_eq!(base64_decode("aGVsbG8=").as_deref(), Some(&b"hello"[..]));
        assert_eq!(base64_decode("aGVsbG8h").as_deref(), Some(&b"hello!"[..]));
        assert_eq!(base64_decode("aGk=").as_deref(), Some(&b"hi"[..]));
        assert_eq!(base64_decode("").as_deref(), Some(&b""[..]));
        for bad in ["aGVsbG8", "aG=k", "a===", "aGk=aGk=", "a b="] {
            assert_eq!(base64_decode(bad), None, "{bad}");
        }
    }

    fn sizes(tokens: u64, tool_calls: u64) -> Sizes {
        Sizes {
            tokens,
            tool_calls,
            script: Vec::new(),
            input_tokens: 10,
            cache_read: 3,
            cache_write: 2,
        }
    }

    #[test]
    fn a_script_decides_the_calls_names_and_inputs() {
        // No tools offered, `tool_choice: none`, no parallel calls: the script wins over all.
        let req = Request {
            stream: false,
            max_tokens: 1000,
            thinking: false,
            tools: Vec::new(),
            tool_choice: ToolChoice::None,
            disable_parallel: true,
        };
        let mut s = sizes(0, 0);
        s.script = crate::chat_tools::read_script(
            br#"[{"name":"get_weather","arguments":{"city":"Oslo"}},{"name":"now"}]"#,
        )
        .unwrap();
        let a = Answer::plan(&req, &s);
        assert_eq!(a.tool_calls, ["get_weather", "now"]);
        assert_eq!(a.tool_inputs, [r#"{"city":"Oslo"}"#, "{}"]);
        assert_eq!(a.blocks(), [Block::Tool(0), Block::Tool(1)]);
        assert_eq!(a.stop_reason, "tool_use");
    }

    #[test]
    fn answer_plans() {
        let req = |tools: &[&str], tc: ToolChoice| Request {
            stream: false,
            max_tokens: 1000,
            thinking: false,
            tools: tools.iter().map(|t| t.to_string()).collect(),
            tool_choice: tc,
            disable_parallel: false,
        };
        let plain = Answer::plan(&req(&[], ToolChoice::Auto), &sizes(4, 3));
        assert_eq!(plain.blocks(), [Block::Text]);
        assert_eq!((plain.output_tokens(), plain.stop_reason), (4, "end_turn"));
        assert_eq!(plain.prompt_tokens(), 15);
        let two = Answer::plan(&req(&["a", "b"], ToolChoice::Auto), &sizes(4, 3));
        assert_eq!(two.tool_calls, ["a", "b", "a"]);
        assert_eq!(
            two.blocks(),
            [Block::Text, Block::Tool(0), Block::Tool(1), Block::Tool(2)]
        );
        assert_eq!((two.output_tokens(), two.stop_reason), (4 + 15, "tool_use"));
        let named = Answer::plan(
            &req(&["a", "b"], ToolChoice::Tool("b".into())),
            &sizes(0, 0),
        );
        assert_eq!(named.tool_calls, ["b"]);
        assert_eq!(named.blocks(), [Block::Tool(0)]);
        let none = Answer::plan(&req(&["a"], ToolChoice::None), &sizes(2, 3));
        assert!(none.tool_calls.is_empty());
        let mut one = req(&["a"], ToolChoice::Any);
        one.disable_parallel = true;
        assert_eq!(Answer::plan(&one, &sizes(2, 3)).tool_calls.len(), 1);
        let mut think = req(&[], ToolChoice::Auto);
        think.thinking = true;
        let t = Answer::plan(&think, &sizes(2, 0));
        assert_eq!(t.blocks(), [Block::Thinking, Block::Text]);
        assert_eq!(t.output_tokens(), 2 + THINKING_DELTAS);
        // Cut to max_tokens.
        let mut short = req(&["a"], ToolChoice::Auto);
        short.max_tokens = 3;
        let cut = Answer::plan(&short, &sizes(8, 2));
        assert_eq!((cut.text_tokens, cut.stop_reason), (3, "max_tokens"));
        assert!(cut.tool_calls.is_empty());
    }
}

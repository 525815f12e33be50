//! An Anthropic Messages request: read for routing ([`inspect_messages`]) and turned into a chat
//! completions request ([`messages_to_chat`]).
//!
//! Both parse strictly: the body must be UTF-8, one JSON object, with no top-level key twice
//! (the upstream might read the other copy). Errors name the field the way Anthropic's own
//! do (`messages.1.content.0.source: …`).
//!
//! What maps to what:
//!
//! | Messages | chat completions |
//! | --- | --- |
//! | `system` (string, or text blocks joined with a blank line) | a first `system` message |
//! | user `text` blocks | `text` parts (one text block alone: a string `content`) |
//! | `image`, source `base64` / `url` | `image_url` with a `data:` URI / the URL |
//! | `document`, source `base64` (PDF) / `text` / `content` | a `file` part / `text` parts |
//! | `tool_result` blocks | one `tool` message each, before the rest of that user turn; images in them go to the user message after |
//! | assistant `text` blocks | `content`, concatenated |
//! | assistant `tool_use` | `tool_calls` (`input` serialized as `arguments`) |
//! | `thinking`, `redacted_thinking` | dropped: their signatures mean nothing to another provider |
//! | `tools` (custom) | `function` tools, `input_schema` → `parameters` |
//! | `tool_choice` auto / any / tool / none | `auto` / `required` / named function / `none` |
//! | `disable_parallel_tool_use: true` | `parallel_tool_calls: false` |
//! | `max_tokens` | `max_tokens` (the name every OpenAI-dialect server accepts) |
//! | `stop_sequences` | `stop` |
//! | `metadata.user_id` | `user` |
//! | `temperature`, `top_p` | the same |
//! | `stream: true` | `stream`, and `stream_options.include_usage` so usage is metered |
//!
//! Dropped, because an OpenAI-dialect server would refuse or misread them: `cache_control`
//! (OpenAI caches by itself), `top_k`, `thinking`, `service_tier`, `tool_result.is_error`,
//! and any field this list does not name. Refused with a 400 instead of dropped, because
//! dropping would change what the model is asked: server tools (`web_search_…`, `bash_…`,
//! …), content blocks of other types, image and document sources by URL or file id where
//! OpenAI takes none.

use std::collections::BTreeSet;
use std::fmt;

use serde::de::{self, Deserialize, Deserializer, IgnoredAny, MapAccess, Visitor};
use serde_json::{json, Map, Value};

use super::TranslateError;
use crate::openai::json::truncate;

/// What the gateway needs of a Messages request before routing.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct MessagesRequest {
    pub(crate) model: String,
    /// Byte range of the model's JSON string literal (quotes included) in the body: a
    /// passthrough to an Anthropic cluster rewrites only these bytes.
    pub(crate) model_span: (usize, usize),
    pub(crate) stream: bool,
    pub(crate) max_tokens: u64,
}

/// Read `model`, `stream` and `max_tokens` (required, at least 1) of a `/v1/messages` body.
pub(crate) fn inspect_messages(body: &[u8]) -> Result<MessagesRequest, TranslateError> {
    inspect(body, true)
}

/// As [`inspect_messages`], for `/v1/messages/count_tokens`, which takes no `max_tokens`
/// (0 when absent).
pub(crate) fn inspect_count_tokens(body: &[u8]) -> Result<MessagesRequest, TranslateError> {
    inspect(body, false)
}

fn inspect(body: &[u8], max_tokens_required: bool) -> Result<MessagesRequest, TranslateError> {
    let text = utf8(body)?;
    let fields: RoutingFields = serde_json::from_str(text).map_err(json_error)?;
    let model = match fields.model {
        Some(Value::String(m)) => m,
        Some(_) => return Err(invalid("model: Input should be a valid string")),
        None => return Err(invalid("model: Field required")),
    };
    let stream = stream_flag(fields.stream.as_ref())?;
    let max_tokens = match max_tokens(fields.max_tokens.as_ref())? {
        Some(n) => n,
        None if max_tokens_required => return Err(invalid("max_tokens: Field required")),
        None => 0,
    };
    // The parse above proved the body valid and `model` a top-level key present once.
    let model_span =
        member_span(text, "model").ok_or_else(|| invalid("The request body is malformed."))?;
    Ok(MessagesRequest {
        model,
        model_span,
        stream,
        max_tokens,
    })
}

/// Translate a Messages request body into a chat completions request for `model` (the mapped
/// name), appended to `out`. See the module docs for what maps to what.
pub(crate) fn messages_to_chat(
    body: &[u8],
    model: &str,
    out: &mut Vec<u8>,
) -> Result<(), TranslateError> {
    let StrictObject(mut req) =
        serde_json::from_str::<StrictObject>(utf8(body)?).map_err(json_error)?;
    let mut chat = Map::new();
    chat.insert("model".into(), Value::String(model.to_owned()));

    let mut messages = Vec::new();
    if let Some(system) = req.remove("system") {
        system_message(system, &mut messages)?;
    }
    match req.remove("messages") {
        Some(Value::Array(list)) => {
            for (i, m) in list.into_iter().enumerate() {
                message(i, m, &mut messages)?;
            }
        }
        Some(_) => return Err(invalid("messages: Input should be a valid list")),
        None => return Err(invalid("messages: Field required")),
    }
    chat.insert("messages".into(), Value::Array(messages));

    let Some(max) = max_tokens(req.get("max_tokens"))? else {
        return Err(invalid("max_tokens: Field required"));
    };
    chat.insert("max_tokens".into(), max.into());
    if stream_flag(req.get("stream"))? {
        chat.insert("stream".into(), Value::Bool(true));
        chat.insert("stream_options".into(), json!({ "include_usage": true }));
    }
    for key in ["temperature", "top_p"] {
        match req.remove(key) {
            Some(v @ Value::Number(_)) => {
                chat.insert(key.into(), v);
            }
            None | Some(Value::Null) => {}
            Some(_) => return Err(invalid(format!("{key}: Input should be a valid number"))),
        }
    }
    match req.remove("stop_sequences") {
        Some(Value::Array(stops)) => {
            if !stops.iter().all(Value::is_string) {
                return Err(invalid("stop_sequences: Input should be a list of strings"));
            }
            if !stops.is_empty() {
                chat.insert("stop".into(), Value::Array(stops));
            }
        }
        None | Some(Value::Null) => {}
        Some(_) => return Err(invalid("stop_sequences: Input should be a valid list")),
    }
    if let Some(Value::Object(mut metadata)) = req.remove("metadata") {
        if let Some(Value::String(user)) = metadata.remove("user_id") {
            chat.insert("user".into(), Value::String(user));
        }
    }
    tools(req.remove("tools"), req.remove("tool_choice"), &mut chat)?;

    serde_json::to_writer(&mut *out, &chat)
        .map_err(|e| TranslateError::new(format!("The request could not be written: {e}.")))
}

/// `system`: a string, or a list of text blocks (their `cache_control` dropped).
fn system_message(system: Value, messages: &mut Vec<Value>) -> Result<(), TranslateError> {
    let text = match system {
        Value::String(s) => s,
        Value::Array(blocks) => {
            let mut joined = String::new();
            for (j, block) in blocks.into_iter().enumerate() {
                let path = format!("system.{j}");
                let mut block = object(block, &path)?;
                match block_type(&block, &path)?.as_str() {
                    "text" => {
                        if !joined.is_empty() {
                            joined.push_str("\n\n");
                        }
                        joined.push_str(&take_string(&mut block, "text", &path)?);
                    }
                    other => {
                        return Err(invalid(format!(
                            "{path}.type: system blocks must be text, not `{}`",
                            truncate(other, 64)
                        )))
                    }
                }
            }
            joined
        }
        Value::Null => return Ok(()),
        _ => {
            return Err(invalid(
                "system: Input should be a valid string or a list of text blocks",
            ))
        }
    };
    if !text.is_empty() {
        messages.push(json!({ "role": "system", "content": text }));
    }
    Ok(())
}

fn message(i: usize, m: Value, messages: &mut Vec<Value>) -> Result<(), TranslateError> {
    let path = format!("messages.{i}");
    let mut m = object(m, &path)?;
    let user = match m.get("role") {
        Some(Value::String(r)) if r == "user" => true,
        Some(Value::String(r)) if r == "assistant" => false,
        Some(_) => {
            return Err(invalid(format!(
                "{path}.role: Input should be 'user' or 'assistant'"
            )))
        }
        None => return Err(invalid(format!("{path}.role: Field required"))),
    };
    let Some(content) = m.remove("content") else {
        return Err(invalid(format!("{path}.content: Field required")));
    };
    if user {
        user_message(&path, content, messages)
    } else {
        assistant_message(&path, content, messages)
    }
}

/// A turn's `content`: a string is the whole message, pushed as `role`'s (`None`: nothing more
/// to do); a list gives its blocks; anything else is refused as Anthropic refuses it.
fn content_blocks(
    path: &str,
    role: &str,
    content: Value,
    messages: &mut Vec<Value>,
) -> Result<Option<Vec<Value>>, TranslateError> {
    match content {
        Value::String(s) => {
            messages.push(json!({ "role": role, "content": s }));
            Ok(None)
        }
        Value::Array(blocks) => Ok(Some(blocks)),
        _ => Err(invalid(format!(
            "{path}.content: Input should be a valid string or list of content blocks"
        ))),
    }
}

/// A user turn: its `tool_result` blocks become `tool` messages (which must follow the
/// assistant's tool calls directly), then the rest is one user message.
fn user_message(
    path: &str,
    content: Value,
    messages: &mut Vec<Value>,
) -> Result<(), TranslateError> {
    let Some(blocks) = content_blocks(path, "user", content, messages)? else {
        return Ok(());
    };
    let mut parts = Vec::new();
    for (j, block) in blocks.into_iter().enumerate() {
        let path = format!("{path}.content.{j}");
        let mut block = object(block, &path)?;
        match block_type(&block, &path)?.as_str() {
            "text" => parts.push(text_part(take_string(&mut block, "text", &path)?)),
            "image" => parts.push(image_part(&mut block, &path)?),
            "document" => document_parts(&mut block, &path, &mut parts)?,
            "tool_result" => messages.push(tool_result(&mut block, &path, &mut parts)?),
            other => return Err(unsupported_block(&path, other)),
        }
    }
    if !parts.is_empty() {
        messages.push(json!({ "role": "user", "content": parts_content(parts) }));
    }
    Ok(())
}

fn assistant_message(
    path: &str,
    content: Value,
    messages: &mut Vec<Value>,
) -> Result<(), TranslateError> {
    let Some(blocks) = content_blocks(path, "assistant", content, messages)? else {
        return Ok(());
    };
    let mut text = String::new();
    let mut calls = Vec::new();
    for (j, block) in blocks.into_iter().enumerate() {
        let path = format!("{path}.content.{j}");
        let mut block = object(block, &path)?;
        match block_type(&block, &path)?.as_str() {
            "text" => text.push_str(&take_string(&mut block, "text", &path)?),
            "tool_use" => {
                let id = take_string(&mut block, "id", &path)?;
                let name = take_string(&mut block, "name", &path)?;
                let arguments = match block.remove("input") {
                    None | Some(Value::Null) => "{}".to_owned(),
                    Some(input @ Value::Object(_)) => input.to_string(),
                    Some(_) => {
                        return Err(invalid(format!(
                            "{path}.input: Input should be a valid dictionary"
                        )))
                    }
                };
                calls.push(json!({
                    "id": id,
                    "type": "function",
                    "function": { "name": name, "arguments": arguments },
                }));
            }
            "thinking" | "redacted_thinking" => {}
            other => return Err(unsupported_block(&path, other)),
        }
    }
    let mut msg = Map::new();
    msg.insert("role".into(), "assistant".into());
    if calls.is_empty() {
        msg.insert("content".into(), Value::String(text));
    } else {
        let content = if text.is_empty() {
            Value::Null
        } else {
            Value::String(text)
        };
        msg.insert("content".into(), content);
        msg.insert("tool_calls".into(), Value::Array(calls));
    }
    messages.push(Value::Object(msg));
    Ok(())
}

/// A `tool_result` block as a `tool` message; images and documents in it can't ride in a tool
/// message, so they go to `parts` (the user message that follows).
fn tool_result(
    block: &mut Map<String, Value>,
    path: &str,
    parts: &mut Vec<Value>,
) -> Result<Value, TranslateError> {
    let id = take_string(block, "tool_use_id", path)?;
    let content = match block.remove("content") {
        None | Some(Value::Null) => Value::String(String::new()),
        Some(s @ Value::String(_)) => s,
        Some(Value::Array(items)) => {
            let mut texts = Vec::new();
            for (k, item) in items.into_iter().enumerate() {
                let path = format!("{path}.content.{k}");
                let mut item = object(item, &path)?;
                match block_type(&item, &path)?.as_str() {
                    "text" => texts.push(text_part(take_string(&mut item, "text", &path)?)),
                    "image" => parts.push(image_part(&mut item, &path)?),
                    "document" => document_parts(&mut item, &path, parts)?,
                    other => return Err(unsupported_block(&path, other)),
                }
            }
            parts_content(texts)
        }
        Some(_) => {
            return Err(invalid(format!(
                "{path}.content: Input should be a valid string or list of content blocks"
            )))
        }
    };
    Ok(json!({ "role": "tool", "tool_call_id": id, "content": content }))
}

fn text_part(text: String) -> Value {
    json!({ "type": "text", "text": text })
}

/// A message's content from its parts: one text part alone is a plain string (what every
/// OpenAI-dialect server takes), nothing is an empty string, anything else the parts.
fn parts_content(mut parts: Vec<Value>) -> Value {
    if parts.len() == 1 && parts[0].get("type").and_then(Value::as_str) == Some("text") {
        if let Some(Value::String(text)) = parts[0].get_mut("text").map(Value::take) {
            return Value::String(text);
        }
    }
    if parts.is_empty() {
        return Value::String(String::new());
    }
    Value::Array(parts)
}

fn image_part(block: &mut Map<String, Value>, path: &str) -> Result<Value, TranslateError> {
    let path = format!("{path}.source");
    let mut source = object(block.remove("source").unwrap_or(Value::Null), &path)?;
    let url = match block_type(&source, &path)?.as_str() {
        "base64" => {
            let media_type = take_string(&mut source, "media_type", &path)?;
            let data = take_string(&mut source, "data", &path)?;
            format!("data:{media_type};base64,{data}")
        }
        "url" => take_string(&mut source, "url", &path)?,
        other => {
            return Err(invalid(format!(
                "{path}.type: image source `{}` can't be sent to this model (use base64 or url)",
                truncate(other, 64)
            )))
        }
    };
    Ok(json!({ "type": "image_url", "image_url": { "url": url } }))
}

fn document_parts(
    block: &mut Map<String, Value>,
    path: &str,
    parts: &mut Vec<Value>,
) -> Result<(), TranslateError> {
    let title = match block.remove("title") {
        Some(Value::String(t)) if !t.is_empty() => Some(t),
        _ => None,
    };
    let path = format!("{path}.source");
    let mut source = object(block.remove("source").unwrap_or(Value::Null), &path)?;
    match block_type(&source, &path)?.as_str() {
        "base64" => {
            let media_type = take_string(&mut source, "media_type", &path)?;
            let data = take_string(&mut source, "data", &path)?;
            parts.push(json!({
                "type": "file",
                "file": {
                    "filename": title.unwrap_or_else(|| "document.pdf".to_owned()),
                    "file_data": format!("data:{media_type};base64,{data}"),
                },
            }));
        }
        "text" => parts.push(text_part(take_string(&mut source, "data", &path)?)),
        "content" => match source.remove("content") {
            Some(Value::String(s)) => parts.push(text_part(s)),
            Some(Value::Array(items)) => {
                for (k, item) in items.into_iter().enumerate() {
                    let path = format!("{path}.content.{k}");
                    let mut item = object(item, &path)?;
                    match block_type(&item, &path)?.as_str() {
                        "text" => parts.push(text_part(take_string(&mut item, "text", &path)?)),
                        "image" => parts.push(image_part(&mut item, &path)?),
                        other => return Err(unsupported_block(&path, other)),
                    }
                }
            }
            _ => return Err(invalid(format!("{path}.content: Field required"))),
        },
        other => {
            return Err(invalid(format!(
                "{path}.type: document source `{}` can't be sent to this model (use base64, text or content)",
                truncate(other, 64)
            )))
        }
    }
    Ok(())
}

/// `tools` and `tool_choice` into `chat`. A tool choice without tools is left out (OpenAI
/// refuses one), as is `parallel_tool_calls` then.
fn tools(
    tools: Option<Value>,
    tool_choice: Option<Value>,
    chat: &mut Map<String, Value>,
) -> Result<(), TranslateError> {
    let functions = function_tools(tools)?;
    let (choice, parallel) = chat_tool_choice(tool_choice)?;
    if functions.is_empty() {
        return Ok(());
    }
    let none = choice.as_ref().and_then(Value::as_str) == Some("none");
    chat.insert("tools".into(), Value::Array(functions));
    if let Some(choice) = choice {
        chat.insert("tool_choice".into(), choice);
    }
    if !parallel && !none {
        chat.insert("parallel_tool_calls".into(), Value::Bool(false));
    }
    Ok(())
}

/// `tools` (absent, null or a list of custom tools) as chat `function` tools.
fn function_tools(tools: Option<Value>) -> Result<Vec<Value>, TranslateError> {
    let mut functions = Vec::new();
    match tools {
        Some(Value::Array(list)) => {
            for (k, tool) in list.into_iter().enumerate() {
                let path = format!("tools.{k}");
                functions.push(function_tool(tool, &path)?);
            }
        }
        None | Some(Value::Null) => {}
        Some(_) => return Err(invalid("tools: Input should be a valid list")),
    }
    Ok(functions)
}

/// One custom tool (at `path`) as a chat `function` tool; a server tool is refused.
fn function_tool(tool: Value, path: &str) -> Result<Value, TranslateError> {
    let mut tool = object(tool, path)?;
    match tool.get("type") {
        None | Some(Value::Null) => {}
        Some(Value::String(t)) if t == "custom" => {}
        Some(Value::String(t)) => {
            return Err(invalid(format!(
                "{path}.type: the server tool `{}` is not available on this model",
                truncate(t, 64)
            )))
        }
        Some(_) => {
            return Err(invalid(format!(
                "{path}.type: Input should be a valid string"
            )))
        }
    }
    let name = take_string(&mut tool, "name", path)?;
    let mut function = Map::new();
    function.insert("name".into(), Value::String(name));
    match tool.remove("description") {
        Some(d @ Value::String(_)) => {
            function.insert("description".into(), d);
        }
        None | Some(Value::Null) => {}
        Some(_) => {
            return Err(invalid(format!(
                "{path}.description: Input should be a valid string"
            )))
        }
    }
    match tool.remove("input_schema") {
        Some(schema @ Value::Object(_)) => {
            function.insert("parameters".into(), schema);
        }
        Some(_) => {
            return Err(invalid(format!(
                "{path}.input_schema: Input should be a valid dictionary"
            )))
        }
        None => return Err(invalid(format!("{path}.input_schema: Field required"))),
    }
    if let Some(strict @ Value::Bool(true)) = tool.remove("strict") {
        function.insert("strict".into(), strict);
    }
    Ok(json!({ "type": "function", "function": function }))
}

/// `tool_choice` as the chat `tool_choice` (none when absent or null), and whether parallel
/// tool calls stay allowed (`disable_parallel_tool_use` not true).
fn chat_tool_choice(tool_choice: Option<Value>) -> Result<(Option<Value>, bool), TranslateError> {
    let mut choice = None;
    let mut parallel = true;
    match tool_choice {
        Some(Value::Object(mut tc)) => {
            let kind = block_type(&tc, "tool_choice")?;
            choice = Some(match kind.as_str() {
                "auto" => Value::from("auto"),
                "any" => Value::from("required"),
                "none" => Value::from("none"),
                "tool" => {
                    let name = take_string(&mut tc, "name", "tool_choice")?;
                    json!({ "type": "function", "function": { "name": name } })
                }
                other => {
                    return Err(invalid(format!(
                    "tool_choice.type: Input should be 'auto', 'any', 'tool' or 'none', not `{}`",
                    truncate(other, 64)
                )))
                }
            });
            match tc.get("disable_parallel_tool_use") {
                Some(Value::Bool(disable)) => parallel = !disable,
                None | Some(Value::Null) => {}
                Some(_) => {
                    return Err(invalid(
                        "tool_choice.disable_parallel_tool_use: Input should be a valid boolean",
                    ))
                }
            }
        }
        None | Some(Value::Null) => {}
        Some(_) => return Err(invalid("tool_choice: Input should be a valid dictionary")),
    }
    Ok((choice, parallel))
}

fn invalid(message: impl Into<String>) -> TranslateError {
    TranslateError::new(message)
}

fn unsupported_block(path: &str, kind: &str) -> TranslateError {
    invalid(format!(
        "{path}.type: content blocks of type `{}` can't be sent to this model",
        truncate(kind, 64)
    ))
}

fn utf8(body: &[u8]) -> Result<&str, TranslateError> {
    std::str::from_utf8(body).map_err(|e| {
        invalid(format!(
            "The request body is not valid UTF-8 (byte {}).",
            e.valid_up_to()
        ))
    })
}

fn json_error(e: serde_json::Error) -> TranslateError {
    if e.is_data() {
        invalid(format!("The request body is invalid: {e}."))
    } else {
        invalid(format!("The request body is not valid JSON: {e}."))
    }
}

fn object(v: Value, path: &str) -> Result<Map<String, Value>, TranslateError> {
    match v {
        Value::Object(m) => Ok(m),
        Value::Null => Err(invalid(format!("{path}: Field required"))),
        _ => Err(invalid(format!(
            "{path}: Input should be a valid dictionary"
        ))),
    }
}

/// The block's `type` (owned: the block is taken apart after).
fn block_type(block: &Map<String, Value>, path: &str) -> Result<String, TranslateError> {
    match block.get("type") {
        Some(Value::String(t)) => Ok(t.clone()),
        Some(_) => Err(invalid(format!(
            "{path}.type: Input should be a valid string"
        ))),
        None => Err(invalid(format!("{path}.type: Field required"))),
    }
}

fn take_string(
    block: &mut Map<String, Value>,
    key: &str,
    path: &str,
) -> Result<String, TranslateError> {
    match block.remove(key) {
        Some(Value::String(s)) => Ok(s),
        None | Some(Value::Null) => Err(invalid(format!("{path}.{key}: Field required"))),
        Some(_) => Err(invalid(format!(
            "{path}.{key}: Input should be a valid string"
        ))),
    }
}

fn stream_flag(v: Option<&Value>) -> Result<bool, TranslateError> {
    match v {
        Some(Value::Bool(b)) => Ok(*b),
        None | Some(Value::Null) => Ok(false),
        Some(_) => Err(invalid("stream: Input should be a valid boolean")),
    }
}

/// `max_tokens`: an integer of at least 1 (`100.0` is 100, as JSON has one number type).
fn max_tokens(v: Option<&Value>) -> Result<Option<u64>, TranslateError> {
    let n = match v {
        None | Some(Value::Null) => return Ok(None),
        Some(Value::Number(n)) => n.as_u64().or_else(|| {
            n.as_f64()
                .filter(|f| *f >= 0.0 && f.fract() == 0.0 && *f < 1e18)
                .map(|f| f as u64)
        }),
        Some(_) => None,
    };
    match n {
        Some(n) if n >= 1 => Ok(Some(n)),
        Some(_) => Err(invalid(
            "max_tokens: Input should be greater than or equal to 1",
        )),
        None => Err(invalid("max_tokens: Input should be a valid integer")),
    }
}

/// The top-level object, its keys each at most once.
struct StrictObject(Map<String, Value>);

impl<'de> Deserialize<'de> for StrictObject {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = StrictObject;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a JSON object")
            }
            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<StrictObject, A::Error> {
                let mut object = Map::new();
                while let Some(key) = map.next_key::<String>()? {
                    if object.contains_key(&key) {
                        return Err(duplicate(&key));
                    }
                    let value = map.next_value()?;
                    object.insert(key, value);
                }
                Ok(StrictObject(object))
            }
        }
        d.deserialize_map(V)
    }
}

/// The fields routing reads; every other value is checked and skipped, not built.
#[derive(Default)]
struct RoutingFields {
    model: Option<Value>,
    stream: Option<Value>,
    max_tokens: Option<Value>,
}

impl<'de> Deserialize<'de> for RoutingFields {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = RoutingFields;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a JSON object")
            }
            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<RoutingFields, A::Error> {
                let mut fields = RoutingFields::default();
                let mut seen = BTreeSet::new();
                while let Some(key) = map.next_key::<String>()? {
                    if seen.contains(&key) {
                        return Err(duplicate(&key));
                    }
                    match key.as_str() {
                        "model" => fields.model = Some(map.next_value()?),
                        "stream" => fields.stream = Some(map.next_value()?),
                        "max_tokens" => fields.max_tokens = Some(map.next_value()?),
                        _ => {
                            map.next_value::<IgnoredAny>()?;
                        }
                    }
                    seen.insert(key);
                }
                Ok(fields)
            }
        }
        d.deserialize_map(V)
    }
}

fn duplicate<E: de::Error>(key: &str) -> E {
    E::custom(format_args!(
        "duplicate top-level key `{}`",
        truncate(key, 64)
    ))
}

/// The byte span of the value of the top-level key `wanted` in `text`, a JSON object already
/// validated (by a full parse); the first such key. A key written with escapes
/// (`"\u006dodel"`) is decoded before it is compared.
fn member_span(text: &str, wanted: &str) -> Option<(usize, usize)> {
    let b = text.as_bytes();
    let mut i = skip_ws(b, 0);
    if b.get(i) != Some(&b'{') {
        return None;
    }
    i += 1;
    loop {
        i = skip_ws(b, i);
        if b.get(i) != Some(&b'"') {
            return None;
        }
        let key_end = string_end(b, i)?;
        let raw = text.get(i..key_end)?;
        let is_wanted = if raw.contains('\\') {
            serde_json::from_str::<String>(raw).is_ok_and(|k| k == wanted)
        } else {
            raw.get(1..raw.len() - 1) == Some(wanted)
        };
        i = skip_ws(b, key_end);
        if b.get(i) != Some(&b':') {
            return None;
        }
        let start = skip_ws(b, i + 1);
        let end = value_end(b, start)?;
        if is_wanted {
            return Some((start, end));
        }
        i = skip_ws(b, end);
        if b.get(i) != Some(&b',') {
            return None;
        }
        i += 1;
    }
}

fn skip_ws(b: &[u8], mut i: usize) -> usize {
    while matches!(b.get(i), Some(b' ' | b'\t' | b'\n' | b'\r')) {
        i += 1;
    }
    i
}

/// Past the closing quote of the string whose opening quote is at `i`.
fn string_end(b: &[u8], i: usize) -> Option<usize> {
    let mut j = i + 1;
    loop {
        j += memchr::memchr2(b'"', b'\\', b.get(j..)?)?;
        if b[j] == b'"' {
            return Some(j + 1);
        }
        j += 2;
    }
}

/// Past the end of the value starting at `i`.
fn value_end(b: &[u8], i: usize) -> Option<usize> {
    match *b.get(i)? {
        b'"' => string_end(b, i),
        b'{' | b'[' => {
            let mut depth = 0usize;
            let mut j = i;
            loop {
                match *b.get(j)? {
                    b'"' => {
                        j = string_end(b, j)?;
                        continue;
                    }
                    b'{' | b'[' => depth += 1,
                    b'}' | b']' => {
                        depth = depth.checked_sub(1)?;
                        if depth == 0 {
                            return Some(j + 1);
                        }
                    }
                    _ => {}
                }
                j += 1;
            }
        }
        _ => {
            let mut j = i;
            while let Some(c) = b.get(j) {
                if matches!(c, b',' | b'}' | b']' | b' ' | b'\t' | b'\n' | b'\r') {
                    break;
                }
                j += 1;
            }
            Some(j)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn inspect_ok(body: &str) -> MessagesRequest {
        match inspect_messages(body.as_bytes()) {
            Ok(r) => r,
            Err(e) => panic!("{body}: {}", e.message),
        }
    }

    fn inspect_err(body: &str) -> String {
        match inspect_messages(body.as_bytes()) {
            Ok(r) => panic!("{body} was accepted: {r:?}"),
            Err(e) => e.message,
        }
    }

    #[test]
    fn anthropic_inspect_reads_model_stream_max_tokens_and_the_model_span() {
        let body = r#"{"messages":[{"role":"user","content":"{\"model\":\"evil\"}"}],"x":{"model":"e2"}, "model" :	"claude-sonnet-4-5" ,"max_tokens":1024,"stream":true}"#;
        let r = inspect_ok(body);
        assert_eq!(r.model, "claude-sonnet-4-5");
        assert!(r.stream);
        assert_eq!(r.max_tokens, 1024);
        assert_eq!(
            &body[r.model_span.0..r.model_span.1],
            "\"claude-sonnet-4-5\""
        );
        // Escaped key and escaped value: the span is the literal as written.
        let body = r#"{"max_tokens":1e2,"\u006dodel":"a\"b","stream":null}"#;
        let r = inspect_ok(body);
        assert_eq!(r.model, "a\"b");
        assert_eq!(r.max_tokens, 100);
        assert!(!r.stream);
        assert_eq!(&body[r.model_span.0..r.model_span.1], r#""a\"b""#);
        // A passthrough rewrites the model name by the span and nothing else.
        let mut rewritten = body.as_bytes()[..r.model_span.0].to_vec();
        rewritten.extend_from_slice(b"\"claude-x\"");
        rewritten.extend_from_slice(&body.as_bytes()[r.model_span.1..]);
        assert_eq!(
            inspect_ok(std::str::from_utf8(&rewritten).unwrap()).model,
            "claude-x"
        );
    }

    #[test]
    fn anthropic_inspect_rejects_what_anthropic_would() {
        assert!(
            inspect_err(r#"{"model":"m","messages":[]}"#).contains("max_tokens: Field required")
        );
        assert!(inspect_err(r#"{"max_tokens":5}"#).contains("model: Field required"));
        assert!(inspect_err(r#"{"model":5,"max_tokens":5}"#).contains("model: Input should be"));
        assert!(
            inspect_err(r#"{"model":"m","max_tokens":0}"#).contains("greater than or equal to 1")
        );
        assert!(inspect_err(r#"{"model":"m","max_tokens":-3}"#).contains("valid integer"));
        assert!(inspect_err(r#"{"model":"m","max_tokens":1.5}"#).contains("valid integer"));
        assert!(inspect_err(r#"{"model":"m","max_tokens":"9"}"#).contains("valid integer"));
        assert!(inspect_err(r#"{"model":"m","max_tokens":9,"stream":"yes"}"#).contains("stream"));
        let dup = inspect_err(r#"{"model":"a","max_tokens":9,"\u006dodel":"b"}"#);
        assert!(dup.contains("duplicate top-level key `model`"), "{dup}");
        assert!(inspect_err(r#"{"model":"a","max_tokens":9,"x":1,"x":2}"#).contains("`x`"));
        assert!(inspect_err(r#"["model"]"#).contains("expected a JSON object"));
        assert!(inspect_err(r#"{"model":"a","max_tokens":9"#).contains("not valid JSON"));
        assert!(inspect_err(r#"{"model":"a","max_tokens":9} x"#).contains("not valid JSON"));
        assert!(inspect_err("").contains("not valid JSON"));
        let utf8 = inspect_messages(b"{\"model\":\"a\",\"max_tokens\":9,\"q\":\"\xff\"}")
            .map(|_| ())
            .unwrap_err();
        assert!(utf8.message.contains("UTF-8 (byte 33)"), "{}", utf8.message);
        // Nested duplicates are the upstream's business, as on the OpenAI endpoints.
        inspect_ok(r#"{"model":"a","max_tokens":9,"metadata":{"k":1,"k":2}}"#);
    }

    #[test]
    fn anthropic_count_tokens_needs_no_max_tokens() {
        let r = inspect_count_tokens(br#"{"model":"m","messages":[]}"#).unwrap();
        assert_eq!((r.model.as_str(), r.max_tokens), ("m", 0));
        assert!(inspect_count_tokens(br#"{"messages":[]}"#).is_err());
    }

    #[test]
    fn anthropic_member_span_walks_every_value_kind() {
        let body = r#"{"a":[1,{"b":"]}\\\""},[]],"n":-1.5e3,"t":true,"s":"x\"}","model":"m"}"#;
        assert_eq!(
            member_span(body, "model").map(|(a, b)| &body[a..b]),
            Some("\"m\"")
        );
        assert_eq!(
            member_span(body, "n").map(|(a, b)| &body[a..b]),
            Some("-1.5e3")
        );
        assert_eq!(member_span(body, "missing"), None);
        assert_eq!(member_span("{}", "model"), None);
    }

    fn chat(body: &str) -> Value {
        let mut out = Vec::new();
        if let Err(e) = messages_to_chat(body.as_bytes(), "mapped-model", &mut out) {
            panic!("{body}: {}", e.message);
        }
        serde_json::from_slice(&out).unwrap()
    }

    fn chat_err(body: &str) -> String {
        let mut out = Vec::new();
        match messages_to_chat(body.as_bytes(), "m", &mut out) {
            Ok(()) => panic!("{body} was accepted: {}", String::from_utf8_lossy(&out)),
            Err(e) => e.message,
        }
    }

    #[test]
    fn anthropic_request_minimal_and_streaming() {
        let c = chat(
            r#"{"model":"claude","max_tokens":5,"messages":[{"role":"user","content":"hi"}]}"#,
        );
        assert_eq!(
            c,
            json!({"model":"mapped-model","max_tokens":5,"messages":[{"role":"user","content":"hi"}]})
        );
        let c = chat(r#"{"model":"claude","max_tokens":5,"stream":true,"messages":[]}"#);
        assert_eq!(c["stream"], json!(true));
        assert_eq!(c["stream_options"], json!({"include_usage": true}));
        let c = chat(r#"{"model":"claude","max_tokens":5,"stream":false,"messages":[]}"#);
        assert!(c.get("stream").is_none() && c.get("stream_options").is_none());
    }

    #[test]
    fn anthropic_request_errors_name_the_field() {
        let base =
            |messages: &str| format!(r#"{{"model":"c","max_tokens":5,"messages":{messages}}}"#);
        let cases = [
            (base(r#"[{"role":"system","content":"x"}]"#), "messages.0.role"),
            (base(r#"[{"role":"user"}]"#), "messages.0.content: Field required"),
            (base(r#"[{"role":"user","content":5}]"#), "messages.0.content"),
            (base(r#"[{"role":"user","content":[{"type":"audio"}]}]"#), "messages.0.content.0.type: content blocks of type `audio`"),
            (base(r#"[{"role":"user","content":[{"text":"x"}]}]"#), "messages.0.content.0.type: Field required"),
            (base(r#"[{"role":"user","content":[{"type":"image","source":{"type":"file","file_id":"f"}}]}]"#), "messages.0.content.0.source.type: image source `file`"),
            (base(r#"[{"role":"user","content":[{"type":"image","source":{"type":"base64","data":"x"}}]}]"#), "messages.0.content.0.source.media_type: Field required"),
            (base(r#"[{"role":"user","content":[{"type":"tool_result","content":"x"}]}]"#), "tool_use_id: Field required"),
            (base(r#"[{"role":"assistant","content":[{"type":"tool_use","id":"t","name":"n","input":[1]}]}]"#), "messages.0.content.0.input"),
            (base(r#"[{"role":"user","content":[{"type":"document","source":{"type":"url","url":"u"}}]}]"#), "document source `url`"),
            (base("{}"), "messages: Input should be a valid list"),
            (r#"{"model":"c","max_tokens":5}"#.to_owned(), "messages: Field required"),
            (r#"{"model":"c","messages":[]}"#.to_owned(), "max_tokens: Field required"),
            (r#"{"model":"c","max_tokens":5,"messages":[],"system":[{"type":"image"}]}"#.to_owned(), "system.0.type"),
            (r#"{"model":"c","max_tokens":5,"messages":[],"system":7}"#.to_owned(), "system:"),
            (r#"{"model":"c","max_tokens":5,"messages":[],"stop_sequences":[1]}"#.to_owned(), "stop_sequences"),
            (r#"{"model":"c","max_tokens":5,"messages":[],"temperature":"hot"}"#.to_owned(), "temperature"),
            (r#"{"model":"c","max_tokens":5,"messages":[],"tools":[{"type":"web_search_20250305","name":"web_search"}]}"#.to_owned(), "server tool `web_search_20250305`"),
            (r#"{"model":"c","max_tokens":5,"messages":[],"tools":[{"name":"t"}]}"#.to_owned(), "tools.0.input_schema: Field required"),
            (r#"{"model":"c","max_tokens":5,"messages":[],"tools":[{"name":"t","input_schema":{}}],"tool_choice":{"type":"maybe"}}"#.to_owned(), "tool_choice.type"),
            (r#"{"model":"c","max_tokens":5,"messages":[],"tools":[{"name":"t","input_schema":{}}],"tool_choice":{"type":"tool"}}"#.to_owned(), "tool_choice.name: Field required"),
            (r#"{"model":"c","max_tokens":5,"messages":[],"model":"d"}"#.to_owned(), "duplicate top-level key `model`"),
        ];
        for (body, want) in cases {
            let got = chat_err(&body);
            assert!(got.contains(want), "{body}\n  -> {got}\n  wanted {want}");
        }
    }

    #[test]
    fn anthropic_request_tool_choice_without_tools_is_left_out() {
        let c = chat(
            r#"{"model":"c","max_tokens":5,"messages":[],"tool_choice":{"type":"any","disable_parallel_tool_use":true}}"#,
        );
        assert!(
            c.get("tool_choice").is_none()
                && c.get("parallel_tool_calls").is_none()
                && c.get("tools").is_none()
        );
        let c = chat(r#"{"model":"c","max_tokens":5,"messages":[],"tools":[]}"#);
        assert!(c.get("tools").is_none());
    }
}

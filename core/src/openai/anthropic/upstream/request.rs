//! A chat completion request → a Messages request.
//!
//! The body is parsed once into a `serde_json::Value` and the Messages body built beside it and
//! serialized once. What maps, field by field:
//! - `model` → the model the upstream is sent ([`RequestOptions::model`], not the client's).
//! - `system` / `developer` messages → the top-level `system` text blocks, in order, wherever
//!   they stand; `cache_control` on a part (or on the message: its last block) is kept.
//! - `user` content → text and image blocks: an image URL → a `url` source, a `data:` URI → a
//!   `base64` source with its media type; a PDF `file` with `file_data` → a `document` block.
//! - `assistant` content → text blocks, its `tool_calls` → `tool_use` blocks (the arguments
//!   string parsed into `input`; invalid JSON or not an object is a [`TranslateError`]).
//! - `tool` messages → `tool_result` blocks in a user message; consecutive messages that land
//!   on the same role (tool results, then a user message) are merged into one, because the
//!   Messages API wants user and assistant turns to alternate.
//! - `tools[].function` → `{name, description, input_schema}` (`parameters`; an empty object
//!   schema when absent); `tool_choice` auto / required / none / a named function → auto /
//!   any / none / tool; `parallel_tool_calls: false` → `disable_parallel_tool_use: true`. Tool
//!   choices go only with a non-empty `tools`.
//! - `max_completion_tokens`, else `max_tokens`, else [`RequestOptions::default_max_tokens`]
//!   (the Messages API requires one) → `max_tokens`.
//! - `stop` (a string or an array) → `stop_sequences`; `user` → `metadata.user_id`;
//!   `temperature`, `top_p`, `stream` carried as they are.
//! - `stream_options` is dropped (the stream translator always reports usage); `n` above 1 is
//!   refused (one answer only); every other field is dropped, never forwarded, and named to the
//!   caller of [`chat_to_messages_with`] so it can log it.
//!
//! Empty text is left out (the Messages API refuses empty text blocks), and so is a message
//! left with no blocks at all.

use serde_json::{Map, Value};

use super::TranslateError;

/// What the translation needs besides the body.
#[derive(Debug, Clone, Copy)]
pub(crate) struct RequestOptions<'a> {
    /// The model the upstream is sent (after the route's mapping).
    pub(crate) model: &'a str,
    /// `max_tokens` when the client set none (the Messages API requires it).
    pub(crate) default_max_tokens: u64,
}

/// OpenAI chat completions request body → Anthropic Messages request body (appended to `out`).
/// Returns whether the request streams.
pub(crate) fn chat_to_messages(
    body: &[u8],
    opts: &RequestOptions<'_>,
    out: &mut Vec<u8>,
) -> Result<bool, TranslateError> {
    chat_to_messages_with(body, opts, out, &mut |_| {})
}

/// [`chat_to_messages`], naming to `dropped` each top-level field it leaves out (unknown to
/// the translation, or with no Messages counterpart), for a debug log.
pub(crate) fn chat_to_messages_with(
    body: &[u8],
    opts: &RequestOptions<'_>,
    out: &mut Vec<u8>,
    dropped: &mut dyn FnMut(&str),
) -> Result<bool, TranslateError> {
    let request: Value = serde_json::from_slice(body)
        .map_err(|e| TranslateError::body(format!("the body is not valid JSON: {e}")))?;
    let Value::Object(request) = request else {
        return Err(TranslateError::body("the body must be a JSON object"));
    };
    let fields = ChatFields::read(request, dropped)?;
    let stream = fields.stream;
    let m = fields.into_messages(opts, dropped)?;
    serde_json::to_writer(&mut *out, &Value::Object(m))
        .map_err(|e| TranslateError::body(format!("the request could not be written: {e}")))?;
    Ok(stream.unwrap_or(false))
}

/// The top-level fields of a chat request the translation reads, each checked as it is read;
/// `None` where the request leaves it out (or sets it to null).
#[derive(Default)]
struct ChatFields {
    messages: Option<Value>,
    max_tokens: Option<u64>,
    max_completion_tokens: Option<u64>,
    stop: Option<Vec<Value>>,
    user: Option<String>,
    temperature: Option<Value>,
    top_p: Option<Value>,
    stream: Option<bool>,
    tools: Option<Vec<Value>>,
    tool_choice: Option<Value>,
    parallel_tool_calls: Option<bool>,
}

impl ChatFields {
    /// The fields of `request`, in its order: the first wrong one is the error; each field the
    /// translation has no use for is named to `dropped`.
    fn read(
        request: Map<String, Value>,
        dropped: &mut dyn FnMut(&str),
    ) -> Result<ChatFields, TranslateError> {
        let mut f = ChatFields::default();
        for (key, value) in request {
            if value.is_null() {
                continue; // OpenAI reads an explicit null as "not set".
            }
            match key.as_str() {
                "model" | "stream_options" => {}
                "messages" => f.messages = Some(value),
                "max_tokens" => f.max_tokens = Some(positive_int(&value, "max_tokens")?),
                "max_completion_tokens" => {
                    f.max_completion_tokens = Some(positive_int(&value, "max_completion_tokens")?)
                }
                "stop" => f.stop = Some(stop_sequences(value)?),
                "user" => match value {
                    Value::String(s) => f.user = Some(s),
                    _ => return Err(TranslateError::new("user", "`user` must be a string")),
                },
                "temperature" => f.temperature = Some(number(value, "temperature")?),
                "top_p" => f.top_p = Some(number(value, "top_p")?),
                "stream" => match value {
                    Value::Bool(b) => f.stream = Some(b),
                    _ => return Err(TranslateError::new("stream", "`stream` must be a boolean")),
                },
                "tools" => f.tools = Some(translate_tools(value)?),
                "tool_choice" => f.tool_choice = Some(value),
                "parallel_tool_calls" => match value {
                    Value::Bool(b) => f.parallel_tool_calls = Some(b),
                    _ => {
                        return Err(TranslateError::new(
                            "parallel_tool_calls",
                            "`parallel_tool_calls` must be a boolean",
                        ))
                    }
                },
                "n" => one_choice(&value)?,
                other => dropped(other),
            }
        }
        Ok(f)
    }

    /// The Messages request these fields make, for the model and default `max_tokens` in
    /// `opts`; a tool choice with no tools to choose from is named to `dropped`.
    fn into_messages(
        self,
        opts: &RequestOptions<'_>,
        dropped: &mut dyn FnMut(&str),
    ) -> Result<Map<String, Value>, TranslateError> {
        let Some(messages) = self.messages else {
            return Err(TranslateError::new("messages", "`messages` is required"));
        };
        let (system, turns) = translate_messages(messages)?;
        if turns.is_empty() {
            return Err(TranslateError::new(
                "messages",
                "`messages` needs at least one user or assistant message with content",
            ));
        }
        let mut m = Map::new();
        m.insert("model".into(), Value::String(opts.model.to_owned()));
        let max = self
            .max_completion_tokens
            .or(self.max_tokens)
            .unwrap_or(opts.default_max_tokens);
        m.insert("max_tokens".into(), Value::from(max));
        if !system.is_empty() {
            m.insert("system".into(), Value::Array(system));
        }
        m.insert("messages".into(), Value::Array(turns));
        if let Some(stop) = self.stop.filter(|s| !s.is_empty()) {
            m.insert("stop_sequences".into(), Value::Array(stop));
        }
        if let Some(t) = self.temperature {
            m.insert("temperature".into(), t);
        }
        if let Some(p) = self.top_p {
            m.insert("top_p".into(), p);
        }
        if let Some(s) = self.stream {
            m.insert("stream".into(), Value::Bool(s));
        }
        if let Some(user) = self.user {
            let mut metadata = Map::new();
            metadata.insert("user_id".into(), Value::String(user));
            m.insert("metadata".into(), Value::Object(metadata));
        }
        let (tools, choice, parallel) = (self.tools, self.tool_choice, self.parallel_tool_calls);
        insert_tools(&mut m, tools, choice, parallel, dropped)?;
        Ok(m)
    }
}

/// `n`: 1, the one choice the Messages API answers with.
fn one_choice(n: &Value) -> Result<(), TranslateError> {
    match n.as_u64() {
        Some(1) => Ok(()),
        Some(_) => Err(TranslateError::new(
            "n",
            "this model returns one choice per request: `n` must be 1",
        )),
        None => Err(TranslateError::new("n", "`n` must be a positive integer")),
    }
}

/// The translated `tools` and the client's tool choice into `m`, when there are tools; else
/// the choice, which upstream would refuse alone, is named to `dropped`.
fn insert_tools(
    m: &mut Map<String, Value>,
    tools: Option<Vec<Value>>,
    tool_choice: Option<Value>,
    parallel_tool_calls: Option<bool>,
    dropped: &mut dyn FnMut(&str),
) -> Result<(), TranslateError> {
    match tools.filter(|t| !t.is_empty()) {
        Some(tools) => {
            let choice = translate_tool_choice(tool_choice, parallel_tool_calls)?;
            m.insert("tools".into(), Value::Array(tools));
            if let Some(choice) = choice {
                m.insert("tool_choice".into(), choice);
            }
        }
        None => {
            // No tools to choose from: a choice alone would be refused upstream.
            if tool_choice.is_some() {
                dropped("tool_choice");
            }
            if parallel_tool_calls.is_some() {
                dropped("parallel_tool_calls");
            }
        }
    }
    Ok(())
}

fn positive_int(v: &Value, param: &'static str) -> Result<u64, TranslateError> {
    match v.as_u64() {
        Some(n) if n > 0 => Ok(n),
        _ => Err(TranslateError::new(
            param,
            format!("`{param}` must be a positive integer"),
        )),
    }
}

fn number(v: Value, param: &'static str) -> Result<Value, TranslateError> {
    if v.is_number() {
        Ok(v)
    } else {
        Err(TranslateError::new(
            param,
            format!("`{param}` must be a number"),
        ))
    }
}

/// `stop`: a string or an array of strings.
fn stop_sequences(v: Value) -> Result<Vec<Value>, TranslateError> {
    let bad = || TranslateError::new("stop", "`stop` must be a string or an array of strings");
    match v {
        Value::String(s) => Ok(vec![Value::String(s)]),
        Value::Array(items) => {
            if items.iter().all(Value::is_string) {
                Ok(items)
            } else {
                Err(bad())
            }
        }
        _ => Err(bad()),
    }
}

/// The two roles of the Messages API.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Role {
    User,
    Assistant,
}

impl Role {
    fn name(self) -> &'static str {
        match self {
            Role::User => "user",
            Role::Assistant => "assistant",
        }
    }
}

/// `messages` → (the `system` blocks, the alternating `messages`).
fn translate_messages(messages: Value) -> Result<(Vec<Value>, Vec<Value>), TranslateError> {
    let Value::Array(messages) = messages else {
        return Err(TranslateError::new(
            "messages",
            "`messages` must be an array",
        ));
    };
    let mut system = Vec::new();
    let mut turns: Vec<(Role, Vec<Value>)> = Vec::new();
    for (i, message) in messages.into_iter().enumerate() {
        let Value::Object(mut message) = message else {
            return Err(invalid(format!("messages[{i}] must be an object")));
        };
        let role = match message.get("role") {
            Some(Value::String(r)) => r.clone(),
            _ => return Err(invalid(format!("messages[{i}].role must be a string"))),
        };
        let content = message.remove("content").unwrap_or(Value::Null);
        let cache_control = message.remove("cache_control").filter(|c| !c.is_null());
        let mut blocks = Vec::new();
        let role = match role.as_str() {
            "system" | "developer" => {
                content_blocks(content, i, Parts::TextOnly, &mut blocks)?;
                mark_last(&mut blocks, cache_control);
                system.append(&mut blocks);
                continue;
            }
            "user" => {
                content_blocks(content, i, Parts::User, &mut blocks)?;
                Role::User
            }
            "assistant" => {
                content_blocks(content, i, Parts::Assistant, &mut blocks)?;
                if let Some(calls) = message.remove("tool_calls").filter(|c| !c.is_null()) {
                    tool_uses(calls, i, &mut blocks)?;
                }
                Role::Assistant
            }
            "tool" => {
                blocks.push(tool_result(&mut message, content, i)?);
                Role::User
            }
            other => {
                return Err(invalid(format!(
                    "messages[{i}].role `{other}` is not supported by this model"
                )))
            }
        };
        mark_last(&mut blocks, cache_control);
        if blocks.is_empty() {
            continue;
        }
        match turns.last_mut() {
            Some((last, existing)) if *last == role => existing.append(&mut blocks),
            _ => turns.push((role, blocks)),
        }
    }
    let turns = turns
        .into_iter()
        .map(|(role, blocks)| {
            let mut m = Map::new();
            m.insert("role".into(), Value::String(role.name().into()));
            m.insert("content".into(), Value::Array(blocks));
            Value::Object(m)
        })
        .collect();
    Ok((system, turns))
}

fn invalid(message: String) -> TranslateError {
    TranslateError::new("messages", message)
}

/// Put a message-level `cache_control` on its last block, unless that block has its own.
fn mark_last(blocks: &mut [Value], cache_control: Option<Value>) {
    let (Some(cache_control), Some(Value::Object(last))) = (cache_control, blocks.last_mut())
    else {
        return;
    };
    last.entry("cache_control").or_insert(cache_control);
}

/// Which content parts a role may carry.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Parts {
    /// `text` only (system and developer messages, tool results).
    TextOnly,
    /// `text`, `image_url`, `file` (PDF).
    User,
    /// `text`, `refusal`.
    Assistant,
}

/// A message's `content` (null, a string or an array of parts) → blocks appended to `out`.
fn content_blocks(
    content: Value,
    i: usize,
    parts: Parts,
    out: &mut Vec<Value>,
) -> Result<(), TranslateError> {
    match content {
        Value::Null => Ok(()),
        Value::String(text) => {
            push_text(out, text, None);
            Ok(())
        }
        Value::Array(items) => {
            for (j, part) in items.into_iter().enumerate() {
                content_part(part, i, j, parts, out)?;
            }
            Ok(())
        }
        _ => Err(invalid(format!(
            "messages[{i}].content must be a string or an array of content parts"
        ))),
    }
}

fn push_text(out: &mut Vec<Value>, text: String, cache_control: Option<Value>) {
    if text.is_empty() {
        return;
    }
    let mut m = Map::new();
    m.insert("type".into(), Value::String("text".into()));
    m.insert("text".into(), Value::String(text));
    if let Some(c) = cache_control {
        m.insert("cache_control".into(), c);
    }
    out.push(Value::Object(m));
}

fn content_part(
    part: Value,
    i: usize,
    j: usize,
    parts: Parts,
    out: &mut Vec<Value>,
) -> Result<(), TranslateError> {
    let at = || format!("messages[{i}].content[{j}]");
    let Value::Object(mut part) = part else {
        return Err(invalid(format!("{} must be an object", at())));
    };
    let kind = match part.get("type") {
        Some(Value::String(t)) => t.clone(),
        _ => return Err(invalid(format!("{}.type must be a string", at()))),
    };
    let cache_control = part.remove("cache_control").filter(|c| !c.is_null());
    let text_of = |part: &mut Map<String, Value>, field: &str| match part.remove(field) {
        Some(Value::String(s)) => Ok(s),
        _ => Err(invalid(format!("{}.{field} must be a string", at()))),
    };
    match (kind.as_str(), parts) {
        ("text", _) => {
            let text = text_of(&mut part, "text")?;
            push_text(out, text, cache_control);
        }
        ("refusal", Parts::Assistant) => {
            let text = text_of(&mut part, "refusal")?;
            push_text(out, text, cache_control);
        }
        ("image_url", Parts::User) => {
            let url = match part.remove("image_url") {
                Some(Value::String(url)) => url,
                Some(Value::Object(mut image)) => match image.remove("url") {
                    Some(Value::String(url)) => url,
                    _ => return Err(invalid(format!("{}.image_url.url must be a string", at()))),
                },
                _ => return Err(invalid(format!("{}.image_url must be an object", at()))),
            };
            let source = image_source(&url).map_err(|e| invalid(format!("{}: {e}", at())))?;
            out.push(block_with_source("image", source, cache_control));
        }
        ("file", Parts::User) => {
            let data = match part.remove("file") {
                Some(Value::Object(mut file)) => match file.remove("file_data") {
                    Some(Value::String(data)) => data,
                    _ => {
                        return Err(invalid(format!(
                            "{}: only a file given inline as `file_data` (a data: URI) can be sent to this model",
                            at()
                        )))
                    }
                },
                _ => return Err(invalid(format!("{}.file must be an object", at()))),
            };
            let source = match image_source(&data) {
                Ok(source) if data.starts_with("data:application/pdf") => source,
                _ => {
                    return Err(invalid(format!(
                        "{}: only PDF files (a data:application/pdf;base64 URI) can be sent to this model",
                        at()
                    )))
                }
            };
            out.push(block_with_source("document", source, cache_control));
        }
        (other, _) => {
            return Err(invalid(format!(
                "{}: content parts of type `{other}` are not supported here by this model",
                at()
            )))
        }
    }
    Ok(())
}

fn block_with_source(kind: &str, source: Value, cache_control: Option<Value>) -> Value {
    let mut m = Map::new();
    m.insert("type".into(), Value::String(kind.into()));
    m.insert("source".into(), source);
    if let Some(c) = cache_control {
        m.insert("cache_control".into(), c);
    }
    Value::Object(m)
}

/// An image's `source`: a `data:<media type>;base64,<data>` URI → `base64` with its media type;
/// any other URL → `url`.
fn image_source(url: &str) -> Result<Value, &'static str> {
    let mut source = Map::new();
    match url.strip_prefix("data:") {
        Some(rest) => {
            let (meta, data) = rest.split_once(',').ok_or("a data: URI needs a comma")?;
            let is_base64 = meta
                .rsplit_once(';')
                .is_some_and(|(_, enc)| enc.eq_ignore_ascii_case("base64"));
            if !is_base64 {
                return Err("only base64 data: URIs are supported");
            }
            let media_type = meta.split(';').next().unwrap_or_default();
            if media_type.is_empty() {
                return Err("a data: URI needs a media type");
            }
            source.insert("type".into(), Value::String("base64".into()));
            source.insert(
                "media_type".into(),
                Value::String(media_type.to_ascii_lowercase()),
            );
            source.insert("data".into(), Value::String(data.to_owned()));
        }
        None => {
            if url.is_empty() {
                return Err("the image URL is empty");
            }
            source.insert("type".into(), Value::String("url".into()));
            source.insert("url".into(), Value::String(url.to_owned()));
        }
    }
    Ok(Value::Object(source))
}

/// An assistant message's `tool_calls` → `tool_use` blocks appended to `out`.
fn tool_uses(calls: Value, i: usize, out: &mut Vec<Value>) -> Result<(), TranslateError> {
    let Value::Array(calls) = calls else {
        return Err(invalid(format!(
            "messages[{i}].tool_calls must be an array"
        )));
    };
    for (j, call) in calls.into_iter().enumerate() {
        let at = || format!("messages[{i}].tool_calls[{j}]");
        let Value::Object(mut call) = call else {
            return Err(invalid(format!("{} must be an object", at())));
        };
        match call.get("type") {
            None | Some(Value::Null) => {}
            Some(Value::String(t)) if t == "function" => {}
            Some(_) => {
                return Err(invalid(format!(
                    "{}: only tool calls of type `function` are supported by this model",
                    at()
                )))
            }
        }
        let id = match call.remove("id") {
            Some(Value::String(id)) => id,
            _ => return Err(invalid(format!("{}.id must be a string", at()))),
        };
        let Some(Value::Object(mut function)) = call.remove("function") else {
            return Err(invalid(format!("{}.function must be an object", at())));
        };
        let name = match function.remove("name") {
            Some(Value::String(name)) => name,
            _ => return Err(invalid(format!("{}.function.name must be a string", at()))),
        };
        let input = match function.remove("arguments") {
            None | Some(Value::Null) => Value::Object(Map::new()),
            Some(Value::String(args)) if args.trim().is_empty() => Value::Object(Map::new()),
            Some(Value::String(args)) => match serde_json::from_str::<Value>(&args) {
                Ok(v @ Value::Object(_)) => v,
                Ok(_) => {
                    return Err(invalid(format!(
                        "{}.function.arguments must be a JSON object",
                        at()
                    )))
                }
                Err(e) => {
                    return Err(invalid(format!(
                        "{}.function.arguments is not valid JSON: {e}",
                        at()
                    )))
                }
            },
            Some(_) => {
                return Err(invalid(format!(
                    "{}.function.arguments must be a string",
                    at()
                )))
            }
        };
        let mut m = Map::new();
        m.insert("type".into(), Value::String("tool_use".into()));
        m.insert("id".into(), Value::String(id));
        m.insert("name".into(), Value::String(name));
        m.insert("input".into(), input);
        out.push(Value::Object(m));
    }
    Ok(())
}

/// A `tool` message → a `tool_result` block.
fn tool_result(
    message: &mut Map<String, Value>,
    content: Value,
    i: usize,
) -> Result<Value, TranslateError> {
    let id = match message.remove("tool_call_id") {
        Some(Value::String(id)) => id,
        _ => {
            return Err(invalid(format!(
                "messages[{i}].tool_call_id must be a string"
            )))
        }
    };
    let mut m = Map::new();
    m.insert("type".into(), Value::String("tool_result".into()));
    m.insert("tool_use_id".into(), Value::String(id));
    match content {
        Value::String(s) if !s.is_empty() => {
            m.insert("content".into(), Value::String(s));
        }
        Value::Array(_) => {
            let mut blocks = Vec::new();
            content_blocks(content, i, Parts::TextOnly, &mut blocks)?;
            if !blocks.is_empty() {
                m.insert("content".into(), Value::Array(blocks));
            }
        }
        // Null or empty: a result with no content.
        Value::Null | Value::String(_) => {}
        _ => {
            return Err(invalid(format!(
                "messages[{i}].content must be a string or an array of content parts"
            )))
        }
    }
    Ok(Value::Object(m))
}

/// `tools` → the Messages API's tool definitions.
fn translate_tools(tools: Value) -> Result<Vec<Value>, TranslateError> {
    let bad = |msg: String| TranslateError::new("tools", msg);
    let Value::Array(tools) = tools else {
        return Err(bad("`tools` must be an array".into()));
    };
    let mut out = Vec::with_capacity(tools.len());
    for (j, tool) in tools.into_iter().enumerate() {
        let Value::Object(mut tool) = tool else {
            return Err(bad(format!("tools[{j}] must be an object")));
        };
        match tool.get("type") {
            Some(Value::String(t)) if t == "function" => {}
            None | Some(Value::Null) => {}
            Some(_) => {
                return Err(bad(format!(
                    "tools[{j}]: only tools of type `function` are supported by this model"
                )))
            }
        }
        let Some(Value::Object(mut function)) = tool.remove("function") else {
            return Err(bad(format!("tools[{j}].function must be an object")));
        };
        let name = match function.remove("name") {
            Some(Value::String(name)) => name,
            _ => return Err(bad(format!("tools[{j}].function.name must be a string"))),
        };
        let mut schema = match function.remove("parameters") {
            None | Some(Value::Null) => Map::new(),
            Some(Value::Object(schema)) => schema,
            Some(_) => {
                return Err(bad(format!(
                    "tools[{j}].function.parameters must be an object"
                )))
            }
        };
        // The Messages API requires an object schema; OpenAI reads `{}` as "no parameters".
        if !schema.contains_key("type") {
            schema.insert("type".into(), Value::String("object".into()));
            schema
                .entry("properties")
                .or_insert_with(|| Value::Object(Map::new()));
        }
        let mut m = Map::new();
        m.insert("name".into(), Value::String(name));
        match function.remove("description") {
            Some(Value::String(d)) if !d.is_empty() => {
                m.insert("description".into(), Value::String(d));
            }
            None | Some(Value::Null) | Some(Value::String(_)) => {}
            Some(_) => {
                return Err(bad(format!(
                    "tools[{j}].function.description must be a string"
                )))
            }
        }
        m.insert("input_schema".into(), Value::Object(schema));
        if let Some(c) = tool.remove("cache_control").filter(|c| !c.is_null()) {
            m.insert("cache_control".into(), c);
        }
        out.push(Value::Object(m));
    }
    Ok(out)
}

/// `tool_choice` and `parallel_tool_calls` → the Messages API's `tool_choice` (none when the
/// client set neither).
fn translate_tool_choice(
    choice: Option<Value>,
    parallel: Option<bool>,
) -> Result<Option<Value>, TranslateError> {
    let bad = || {
        TranslateError::new(
            "tool_choice",
            "`tool_choice` must be `auto`, `required`, `none` or {\"type\":\"function\",\"function\":{\"name\":…}}",
        )
    };
    let mut m = Map::new();
    match choice {
        None => {
            if parallel != Some(false) {
                return Ok(None);
            }
            m.insert("type".into(), Value::String("auto".into()));
        }
        Some(Value::String(s)) => {
            let kind = match s.as_str() {
                "auto" => "auto",
                "required" => "any",
                "none" => "none",
                _ => return Err(bad()),
            };
            m.insert("type".into(), Value::String(kind.into()));
        }
        Some(Value::Object(mut named)) => {
            if named.get("type").and_then(Value::as_str) != Some("function") {
                return Err(bad());
            }
            let name = match named.remove("function") {
                Some(Value::Object(mut f)) => match f.remove("name") {
                    Some(Value::String(name)) => name,
                    _ => return Err(bad()),
                },
                _ => return Err(bad()),
            };
            m.insert("type".into(), Value::String("tool".into()));
            m.insert("name".into(), Value::String(name));
        }
        Some(_) => return Err(bad()),
    }
    // `none` takes no other field.
    if parallel == Some(false) && m.get("type").and_then(Value::as_str) != Some("none") {
        m.insert("disable_parallel_tool_use".into(), Value::Bool(true));
    }
    Ok(Some(Value::Object(m)))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    const OPTS: RequestOptions<'static> = RequestOptions {
        model: "claude-sonnet-4-5",
        default_max_tokens: 4096,
    };

    /// Translate `request`; the Messages body as a value, whether it streams, and the fields
    /// reported dropped.
    fn translate(request: Value) -> Result<(Value, bool, Vec<String>), TranslateError> {
        let body = serde_json::to_vec(&request).unwrap();
        let mut out = b"prefix:".to_vec();
        let mut dropped = Vec::new();
        let stream =
            chat_to_messages_with(&body, &OPTS, &mut out, &mut |f| dropped.push(f.to_owned()))?;
        let rest = out
            .strip_prefix(b"prefix:")
            .expect("appended, not overwritten");
        Ok((serde_json::from_slice(rest).unwrap(), stream, dropped))
    }

    fn ok(request: Value) -> Value {
        translate(request).unwrap().0
    }

    fn err(request: Value) -> TranslateError {
        translate(request).unwrap_err()
    }

    fn user(text: &str) -> Value {
        json!({"role": "user", "content": text})
    }

    #[test]
    fn anthropic_request_plain_chat() {
        let (m, stream, dropped) = translate(json!({
            "model": "gpt-4o",
            "messages": [{"role": "user", "content": "Hello"}],
        }))
        .unwrap();
        assert_eq!(
            m,
            json!({
                "model": "claude-sonnet-4-5",
                "max_tokens": 4096,
                "messages": [{"role": "user", "content": [{"type": "text", "text": "Hello"}]}],
            })
        );
        assert!(!stream);
        assert!(dropped.is_empty());
        // The plain entry point writes the same body.
        let mut out = Vec::new();
        let body = br#"{"model":"gpt-4o","messages":[{"role":"user","content":"Hello"}]}"#;
        assert_eq!(chat_to_messages(body, &OPTS, &mut out), Ok(false));
        assert_eq!(serde_json::from_slice::<Value>(&out).unwrap(), m);
    }

    #[test]
    fn anthropic_request_system_and_developer_become_system_blocks_with_cache_control() {
        let m = ok(json!({
            "messages": [
                {"role": "system", "content": "You are terse."},
                {"role": "developer", "content": [
                    {"type": "text", "text": "A long reference text.", "cache_control": {"type": "ephemeral"}},
                    {"type": "text", "text": ""},
                ]},
                {"role": "system", "content": "Marked as a whole.", "cache_control": {"type": "ephemeral", "ttl": "1h"}},
                user("Hi"),
                {"role": "system", "content": "A late instruction."},
            ],
        }));
        assert_eq!(
            m["system"],
            json!([
                {"type": "text", "text": "You are terse."},
                {"type": "text", "text": "A long reference text.", "cache_control": {"type": "ephemeral"}},
                {"type": "text", "text": "Marked as a whole.", "cache_control": {"type": "ephemeral", "ttl": "1h"}},
                {"type": "text", "text": "A late instruction."},
            ])
        );
        assert_eq!(
            m["messages"],
            json!([{"role": "user", "content": [{"type": "text", "text": "Hi"}]}])
        );
        // No system message: no `system` field.
        assert!(ok(json!({"messages": [user("Hi")]}))
            .get("system")
            .is_none());
        // An image in a system message is refused.
        let e = err(json!({"messages": [
            {"role": "system", "content": [{"type": "image_url", "image_url": {"url": "https://x/y.png"}}]},
            user("Hi"),
        ]}));
        assert_eq!(e.param, Some("messages"));
    }

    #[test]
    fn anthropic_request_images_by_url_and_data_uri() {
        let m = ok(json!({"messages": [{"role": "user", "content": [
            {"type": "text", "text": "What is in these?"},
            {"type": "image_url", "image_url": {"url": "https://example.com/cat.jpg", "detail": "high"}},
            {"type": "image_url", "image_url": {"url": "data:image/PNG;base64,iVBORw0KGgo="}, "cache_control": {"type": "ephemeral"}},
            {"type": "image_url", "image_url": "https://example.com/dog.webp"},
            {"type": "file", "file": {"filename": "a.pdf", "file_data": "data:application/pdf;base64,JVBERi0x"}},
        ]}]}));
        assert_eq!(
            m["messages"][0]["content"],
            json!([
                {"type": "text", "text": "What is in these?"},
                {"type": "image", "source": {"type": "url", "url": "https://example.com/cat.jpg"}},
                {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}, "cache_control": {"type": "ephemeral"}},
                {"type": "image", "source": {"type": "url", "url": "https://example.com/dog.webp"}},
                {"type": "document", "source": {"type": "base64", "media_type": "application/pdf", "data": "JVBERi0x"}},
            ])
        );
        for bad in [
            json!({"type": "image_url", "image_url": {"url": "data:image/png,rawbytes"}}),
            json!({"type": "image_url", "image_url": {"url": "data:;base64,AAAA"}}),
            json!({"type": "image_url", "image_url": {"url": "data:image/png;base64"}}),
            json!({"type": "image_url", "image_url": {}}),
            json!({"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}}),
            json!({"type": "file", "file": {"file_id": "file-abc"}}),
            json!({"type": "file", "file": {"file_data": "data:text/plain;base64,aGk="}}),
        ] {
            let e = err(json!({"messages": [{"role": "user", "content": [bad.clone()]}]}));
            assert_eq!(e.param, Some("messages"), "{bad}");
            assert!(
                e.message.starts_with("messages[0].content[0]"),
                "{}",
                e.message
            );
        }
    }

    #[test]
    fn anthropic_request_assistant_tool_calls_become_tool_use() {
        let m = ok(json!({"messages": [
            user("Weather in SF and Paris?"),
            {"role": "assistant", "content": "Checking.", "tool_calls": [
                {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": "{\"location\": \"San Francisco\", \"n\": [1, 2.5]}"}},
                {"id": "call_2", "type": "function", "function": {"name": "get_time", "arguments": ""}},
            ]},
            {"role": "tool", "tool_call_id": "call_1", "content": "15 C"},
            {"role": "tool", "tool_call_id": "call_2", "content": [{"type": "text", "text": "09:00"}]},
        ]}));
        assert_eq!(
            m["messages"],
            json!([
                {"role": "user", "content": [{"type": "text", "text": "Weather in SF and Paris?"}]},
                {"role": "assistant", "content": [
                    {"type": "text", "text": "Checking."},
                    {"type": "tool_use", "id": "call_1", "name": "get_weather", "input": {"location": "San Francisco", "n": [1, 2.5]}},
                    {"type": "tool_use", "id": "call_2", "name": "get_time", "input": {}},
                ]},
                {"role": "user", "content": [
                    {"type": "tool_result", "tool_use_id": "call_1", "content": "15 C"},
                    {"type": "tool_result", "tool_use_id": "call_2", "content": [{"type": "text", "text": "09:00"}]},
                ]},
            ])
        );
        // content null with tool calls: the tool_use blocks alone.
        let m = ok(json!({"messages": [
            user("Hi"),
            {"role": "assistant", "content": null, "tool_calls": [
                {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}},
            ]},
            {"role": "tool", "tool_call_id": "c", "content": ""},
        ]}));
        assert_eq!(
            m["messages"][1]["content"],
            json!([{"type": "tool_use", "id": "c", "name": "f", "input": {}}])
        );
        assert_eq!(
            m["messages"][2]["content"],
            json!([{"type": "tool_result", "tool_use_id": "c"}])
        );
    }

    #[test]
    fn anthropic_request_invalid_tool_arguments_are_refused() {
        for args in ["{\"a\": ", "not json", "[1, 2]", "\"a string\""] {
            let e = err(json!({"messages": [
                user("Hi"),
                {"role": "assistant", "tool_calls": [
                    {"id": "c", "type": "function", "function": {"name": "f", "arguments": args}},
                ]},
            ]}));
            assert_eq!(e.param, Some("messages"), "{args}");
            assert!(
                e.message
                    .starts_with("messages[1].tool_calls[0].function.arguments"),
                "{}",
                e.message
            );
        }
        let e = err(json!({"messages": [
            user("Hi"),
            {"role": "assistant", "tool_calls": [{"type": "function", "function": {"name": "f", "arguments": "{}"}}]},
        ]}));
        assert!(e.message.contains("tool_calls[0].id"), "{}", e.message);
        let e = err(json!({"messages": [user("Hi"), {"role": "tool", "content": "x"}]}));
        assert!(e.message.contains("tool_call_id"), "{}", e.message);
    }

    #[test]
    fn anthropic_request_consecutive_tool_messages_make_one_user_message() {
        let m = ok(json!({"messages": [
            user("Go"),
            {"role": "assistant", "tool_calls": [
                {"id": "a", "type": "function", "function": {"name": "f", "arguments": "{}"}},
                {"id": "b", "type": "function", "function": {"name": "f", "arguments": "{}"}},
                {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}},
            ]},
            {"role": "tool", "tool_call_id": "a", "content": "1"},
            {"role": "tool", "tool_call_id": "b", "content": "2"},
            {"role": "tool", "tool_call_id": "c", "content": "3"},
            {"role": "assistant", "content": "Done."},
        ]}));
        let messages = m["messages"].as_array().unwrap();
        assert_eq!(messages.len(), 4);
        assert_eq!(messages[2]["role"], "user");
        let ids: Vec<&str> = messages[2]["content"]
            .as_array()
            .unwrap()
            .iter()
            .map(|b| {
                assert_eq!(b["type"], "tool_result");
                b["tool_use_id"].as_str().unwrap()
            })
            .collect();
        assert_eq!(ids, ["a", "b", "c"]);
    }

    #[test]
    fn anthropic_request_same_role_messages_are_merged() {
        let m = ok(json!({"messages": [
            user("One"),
            user("Two"),
            {"role": "assistant", "content": "A"},
            {"role": "assistant", "content": [{"type": "text", "text": "B"}, {"type": "refusal", "refusal": "No."}]},
            {"role": "assistant", "content": ""},
            {"role": "tool", "tool_call_id": "t", "content": "r"},
            user("After the tool"),
        ]}));
        assert_eq!(
            m["messages"],
            json!([
                {"role": "user", "content": [{"type": "text", "text": "One"}, {"type": "text", "text": "Two"}]},
                {"role": "assistant", "content": [
                    {"type": "text", "text": "A"}, {"type": "text", "text": "B"}, {"type": "text", "text": "No."},
                ]},
                {"role": "user", "content": [
                    {"type": "tool_result", "tool_use_id": "t", "content": "r"},
                    {"type": "text", "text": "After the tool"},
                ]},
            ])
        );
        // Roles alternate in every translation.
        let roles: Vec<&str> = m["messages"]
            .as_array()
            .unwrap()
            .iter()
            .map(|t| t["role"].as_str().unwrap())
            .collect();
        assert!(roles.windows(2).all(|w| w[0] != w[1]), "{roles:?}");
    }

    #[test]
    fn anthropic_request_tools_become_input_schema() {
        let m = ok(json!({
            "messages": [user("Hi")],
            "tools": [
                {"type": "function", "function": {
                    "name": "get_weather",
                    "description": "Current weather",
                    "parameters": {"type": "object", "properties": {"location": {"type": "string"}}, "required": ["location"]},
                    "strict": true,
                }},
                {"type": "function", "function": {"name": "no_args"}},
                {"type": "function", "function": {"name": "empty_schema", "parameters": {}}, "cache_control": {"type": "ephemeral"}},
            ],
        }));
        assert_eq!(
            m["tools"],
            json!([
                {"name": "get_weather", "description": "Current weather", "input_schema":
                    {"type": "object", "properties": {"location": {"type": "string"}}, "required": ["location"]}},
                {"name": "no_args", "input_schema": {"type": "object", "properties": {}}},
                {"name": "empty_schema", "input_schema": {"type": "object", "properties": {}}, "cache_control": {"type": "ephemeral"}},
            ])
        );
        assert!(m.get("tool_choice").is_none());
        for bad in [
            json!("not an array"),
            json!([{"type": "custom", "custom": {"name": "x"}}]),
            json!([{"type": "function"}]),
            json!([{"type": "function", "function": {"parameters": {}}}]),
            json!([{"type": "function", "function": {"name": "f", "parameters": "{}"}}]),
        ] {
            let e = err(json!({"messages": [user("Hi")], "tools": bad.clone()}));
            assert_eq!(e.param, Some("tools"), "{bad}");
        }
    }

    #[test]
    fn anthropic_request_tool_choice_and_parallel_tool_calls() {
        let tools = json!([{"type": "function", "function": {"name": "f"}}]);
        let choice = |tool_choice: Value, parallel: Value| {
            ok(json!({
                "messages": [user("Hi")],
                "tools": tools.clone(),
                "tool_choice": tool_choice,
                "parallel_tool_calls": parallel,
            }))
            .get("tool_choice")
            .cloned()
        };
        assert_eq!(
            choice(json!("auto"), Value::Null),
            Some(json!({"type": "auto"}))
        );
        assert_eq!(
            choice(json!("required"), Value::Null),
            Some(json!({"type": "any"}))
        );
        assert_eq!(
            choice(json!("none"), Value::Null),
            Some(json!({"type": "none"}))
        );
        assert_eq!(
            choice(
                json!({"type": "function", "function": {"name": "f"}}),
                Value::Null
            ),
            Some(json!({"type": "tool", "name": "f"}))
        );
        assert_eq!(choice(Value::Null, Value::Null), None);
        assert_eq!(choice(Value::Null, json!(true)), None);
        assert_eq!(
            choice(Value::Null, json!(false)),
            Some(json!({"type": "auto", "disable_parallel_tool_use": true}))
        );
        assert_eq!(
            choice(json!("required"), json!(false)),
            Some(json!({"type": "any", "disable_parallel_tool_use": true}))
        );
        assert_eq!(
            choice(
                json!({"type": "function", "function": {"name": "f"}}),
                json!(false)
            ),
            Some(json!({"type": "tool", "name": "f", "disable_parallel_tool_use": true}))
        );
        assert_eq!(
            choice(json!("none"), json!(false)),
            Some(json!({"type": "none"}))
        );
        assert_eq!(
            choice(json!("auto"), json!(true)),
            Some(json!({"type": "auto"}))
        );
        for bad in [
            json!("sometimes"),
            json!({"type": "function"}),
            json!({"type": "allowed_tools", "allowed_tools": {}}),
            json!(3),
        ] {
            let e = translate(json!({"messages": [user("Hi")], "tools": tools.clone(), "tool_choice": bad.clone()}))
                .unwrap_err();
            assert_eq!(e.param, Some("tool_choice"), "{bad}");
        }
        // No tools: the choice is dropped (and reported), never sent alone.
        let (m, _, dropped) = translate(json!({
            "messages": [user("Hi")], "tool_choice": "auto", "parallel_tool_calls": false,
        }))
        .unwrap();
        assert!(m.get("tool_choice").is_none() && m.get("tools").is_none());
        assert_eq!(dropped, ["tool_choice", "parallel_tool_calls"]);
    }

    #[test]
    fn anthropic_request_max_tokens() {
        let max = |extra: Value| {
            let mut r = json!({"messages": [user("Hi")]});
            for (k, v) in extra.as_object().unwrap() {
                r[k] = v.clone();
            }
            translate(r).map(|(m, _, _)| m["max_tokens"].clone())
        };
        assert_eq!(max(json!({})), Ok(json!(4096)));
        assert_eq!(max(json!({"max_tokens": 100})), Ok(json!(100)));
        assert_eq!(max(json!({"max_completion_tokens": 200})), Ok(json!(200)));
        assert_eq!(
            max(json!({"max_tokens": 100, "max_completion_tokens": 200})),
            Ok(json!(200))
        );
        assert_eq!(max(json!({"max_tokens": null})), Ok(json!(4096)));
        for bad in [json!(0), json!(-1), json!(1.5), json!("100")] {
            let e = max(json!({ "max_tokens": bad.clone() })).unwrap_err();
            assert_eq!(e.param, Some("max_tokens"), "{bad}");
            let e = max(json!({ "max_completion_tokens": bad.clone() })).unwrap_err();
            assert_eq!(e.param, Some("max_completion_tokens"), "{bad}");
        }
    }

    #[test]
    fn anthropic_request_stop_becomes_stop_sequences() {
        let stop = |v: Value| {
            translate(json!({"messages": [user("Hi")], "stop": v}))
                .map(|(m, _, _)| m.get("stop_sequences").cloned())
        };
        assert_eq!(stop(json!("END")), Ok(Some(json!(["END"]))));
        assert_eq!(stop(json!(["a", "b"])), Ok(Some(json!(["a", "b"]))));
        assert_eq!(stop(json!([])), Ok(None));
        assert_eq!(stop(Value::Null), Ok(None));
        assert_eq!(stop(json!([1])).unwrap_err().param, Some("stop"));
        assert_eq!(stop(json!(true)).unwrap_err().param, Some("stop"));
    }

    #[test]
    fn anthropic_request_user_becomes_metadata_user_id() {
        let m = ok(json!({"messages": [user("Hi")], "user": "user-123"}));
        assert_eq!(m["metadata"], json!({"user_id": "user-123"}));
        let e = err(json!({"messages": [user("Hi")], "user": 5}));
        assert_eq!(e.param, Some("user"));
    }

    #[test]
    fn anthropic_request_sampling_and_stream_carried() {
        let (m, stream, dropped) = translate(json!({
            "messages": [user("Hi")],
            "temperature": 0.5,
            "top_p": 1,
            "stream": true,
            "stream_options": {"include_usage": true},
        }))
        .unwrap();
        assert!(stream);
        assert_eq!(m["temperature"], json!(0.5));
        assert_eq!(m["top_p"], json!(1));
        assert_eq!(m["stream"], json!(true));
        assert!(m.get("stream_options").is_none());
        assert!(dropped.is_empty(), "stream_options is handled, not unknown");
        let (m, stream, _) = translate(json!({"messages": [user("Hi")], "stream": false})).unwrap();
        assert!(!stream);
        assert_eq!(m["stream"], json!(false));
        assert_eq!(
            err(json!({"messages": [user("Hi")], "temperature": "hot"})).param,
            Some("temperature")
        );
        assert_eq!(
            err(json!({"messages": [user("Hi")], "top_p": []})).param,
            Some("top_p")
        );
        assert_eq!(
            err(json!({"messages": [user("Hi")], "stream": "yes"})).param,
            Some("stream")
        );
    }

    #[test]
    fn anthropic_request_unknown_fields_dropped_and_named() {
        let (m, _, dropped) = translate(json!({
            "model": "gpt-4o",
            "messages": [user("Hi")],
            "frequency_penalty": 0.5,
            "logit_bias": {"1": 2},
            "response_format": {"type": "json_object"},
            "seed": 7,
            "n": 1,
            "something_new": {"x": 1},
        }))
        .unwrap();
        let keys: Vec<&String> = m.as_object().unwrap().keys().collect();
        assert_eq!(keys, ["max_tokens", "messages", "model"]);
        let mut dropped = dropped;
        dropped.sort();
        assert_eq!(
            dropped,
            [
                "frequency_penalty",
                "logit_bias",
                "response_format",
                "seed",
                "something_new"
            ]
        );
        assert_eq!(
            err(json!({"messages": [user("Hi")], "n": 2})).param,
            Some("n")
        );
    }

    #[test]
    fn anthropic_request_malformed_bodies_are_refused() {
        let mut out = Vec::new();
        for body in [&b"not json"[..], b"[1]", b"{\"messages\": 5}", b"{}"] {
            let e = chat_to_messages(body, &OPTS, &mut out).unwrap_err();
            assert!(!e.message.is_empty());
        }
        assert!(out.is_empty(), "nothing written on error");
        for bad in [
            json!([]),
            json!([{"role": "system", "content": "only a system prompt"}]),
            json!([{"role": "user", "content": ""}]),
            json!([5]),
            json!([{"content": "no role"}]),
            json!([{"role": "function", "name": "f", "content": "x"}]),
            json!([{"role": "user", "content": 5}]),
            json!([{"role": "user", "content": [{"text": "no type"}]}]),
            json!([{"role": "user", "content": [{"type": "text"}]}]),
        ] {
            let e = err(json!({ "messages": bad.clone() }));
            assert_eq!(e.param, Some("messages"), "{bad}");
        }
    }
}

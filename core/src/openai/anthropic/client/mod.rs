//! Anthropic client → OpenAI-dialect upstream: an Anthropic SDK's `POST /v1/messages` served by
//! a cluster that speaks chat completions (the reverse of [`super::upstream`]), and Anthropic
//! usage metering for requests passed through to an Anthropic cluster. Pure functions, no I/O.
//!
//! - [`inspect_messages`]: what routing needs of a Messages request (model and its byte span,
//!   stream, `max_tokens`), read strictly: valid UTF-8 and JSON, an object, no duplicate
//!   top-level key.
//! - [`messages_to_chat`]: the Messages request as a chat completions request for the mapped
//!   model ([`request`] lists what maps to what and what is dropped).
//! - [`chat_to_message`], [`error_to_anthropic`], [`count_tokens_body`]: the answers, whole.
//! - [`ChatStreamToMessages`]: a chat completions stream turned into Messages events as it
//!   arrives.
//! - [`message_usage`], [`AnthropicStreamMeter`]: usage from Anthropic's own answers, in
//!   OpenAI's terms (`prompt_tokens` = input + cache reads + cache writes, `cached_tokens` = cache
//!   reads), with the cache writes beside it.
//!
//! Every error here is a [`TranslateError`]: on a request, the client's fault (answer 400
//! `invalid_request_error`, [`TranslateError::write_body`]); on an upstream answer, the
//! upstream's (answer 502 `api_error`: the client asked nothing wrong).

mod request;
mod response;
mod stream;
mod usage;

pub(crate) use request::{inspect_count_tokens, inspect_messages, messages_to_chat};
pub(crate) use response::{
    chat_to_message, count_tokens_body, error_to_anthropic,
    type_for_status as error_type_for_status,
};
pub(crate) use stream::ChatStreamToMessages;
pub(crate) use usage::{message_usage, AnthropicStreamMeter};
#[cfg(test)]
use {crate::openai::meter::Usage, request::MessagesRequest};

#[cfg(test)]
mod fixtures;

/// Why a body can't be translated, in words for the client.
#[derive(Debug)]
pub(crate) struct TranslateError {
    pub(crate) message: String,
}

impl TranslateError {
    pub(crate) fn new(message: impl Into<String>) -> TranslateError {
        TranslateError {
            message: message.into(),
        }
    }

    /// The Anthropic error body for a request the client got wrong (status 400):
    /// `{"type":"error","error":{"type":"invalid_request_error","message":…}}`. (The gateway
    /// answers through its own error catalogue, which renders the same shape.)
    #[cfg(test)]
    pub(crate) fn write_body(&self, out: &mut Vec<u8>) {
        response::write_error_body("invalid_request_error", &self.message, out);
    }
}

impl std::fmt::Display for TranslateError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.message)
    }
}

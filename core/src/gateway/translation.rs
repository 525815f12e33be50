//! Translation: how one attempt's request is built for its target, and how the answer goes back
//! to the client, by the client's dialect and the target's.
//!
//! Runs inside each attempt (see [`attempt`](crate::gateway::attempt)). [`Translation::plan`]
//! takes the client's endpoint and the target cluster and returns the plan for that pair — or
//! `None` when the target's dialect cannot answer that endpoint (the attempt passes it over,
//! [`unservable`] is the answer when none is left). [`Translation::build`] writes the upstream
//! request (400 when the client's request cannot be said in the target's dialect);
//! [`Translation::relay_with`] says how the answer is relayed back ([`RelayWith`]: as it
//! arrives, a stream translated event by event, or read whole and translated); the attempt
//! calls the relay with it (see [`relay`](crate::gateway::relay) for what that raises).
//! [`read_client_request`] reads a client's body by its own dialect's rules, once, before
//! routing.
//!
//! This is the one place that knows dialects: the pipeline, the attempt and the fallback walk
//! hold a plan and call it. A new client or upstream dialect is a new variant here, its
//! translator modules under `openai`, and nothing else.

use crate::config::dialect::{AnthropicSettings, Dialect};
use crate::config::Cluster;
use crate::gateway::context::{BodyHold, PerCore, Request};
use crate::gateway::error::{ErrorKind, GatewayError, UpstreamFault};
use crate::gateway::forward;
use crate::gateway::relay::translate::StreamTranslate;
use crate::gateway::route::Target;
use crate::openai::anthropic::bound::Shape;
use crate::openai::anthropic::client as anthropic_client;
use crate::openai::anthropic::upstream as anthropic_upstream;
use crate::openai::endpoint::{ClientDialect, Endpoint};
use crate::openai::inspect::Inspection;

/// How one client endpoint meets one target's dialect.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Translation<'s> {
    /// An OpenAI client, an OpenAI-compatible upstream: the body byte for byte but the mapped
    /// model (and, per `upstream.request_stream_usage`, the stream's usage asked for).
    OpenAiPassthrough { request_usage: bool },
    /// A chat completion for an Anthropic upstream: sent as a Messages request, its answer (or
    /// stream) translated back.
    ChatToMessages(&'s AnthropicSettings),
    /// An Anthropic client's Messages request for an OpenAI-compatible upstream: sent as a chat
    /// completion asking for usage, its answer (or stream) translated back.
    MessagesToChat,
    /// An Anthropic client, an Anthropic upstream: passed through but the mapped model.
    AnthropicPassthrough(&'s AnthropicSettings),
}

/// What [`Translation::build`] wrote.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Built {
    /// Where the end of the client's body that goes from where it lies starts (a long one is
    /// not copied into the upstream request).
    pub(crate) tail_from: usize,
    /// Usage was asked of the upstream for a client that did not ask: the usage-only chunk is
    /// metered, not relayed.
    pub(crate) strip_usage: bool,
}

impl<'s> Translation<'s> {
    /// The plan for a request to `endpoint` sent to `cluster`, or `None` when the cluster's
    /// dialect cannot answer it (an Anthropic cluster answers chat completions and Messages).
    /// `request_usage` is `upstream.request_stream_usage`.
    pub(crate) fn plan(
        endpoint: Option<Endpoint>,
        cluster: &'s Cluster,
        request_usage: bool,
    ) -> Option<Translation<'s>> {
        // The client's dialect by the one rule that decides it (the endpoint's path).
        let client = endpoint.map_or(ClientDialect::OpenAi, |e| {
            ClientDialect::of_path(e.path().as_bytes())
        });
        Some(match (client, &cluster.dialect) {
            (ClientDialect::OpenAi, Dialect::OpenAi) => {
                Translation::OpenAiPassthrough { request_usage }
            }
            (ClientDialect::OpenAi, Dialect::Anthropic(settings)) => {
                if endpoint != Some(Endpoint::ChatCompletions) {
                    return None;
                }
                Translation::ChatToMessages(settings)
            }
            (ClientDialect::Anthropic, Dialect::OpenAi) => Translation::MessagesToChat,
            (ClientDialect::Anthropic, Dialect::Anthropic(settings)) => {
                Translation::AnthropicPassthrough(settings)
            }
        })
    }

    /// Build the upstream request into `out` (see the builders in
    /// [`forward`](crate::gateway::forward)), or the client's 400 when its request cannot be
    /// said in the target's dialect, or is too many JSON values to translate; a translation's
    /// working memory is held from the worker's body memory while it is built (503 when that
    /// is full, as for a body).
    pub(crate) fn build(
        self,
        out: &mut Vec<u8>,
        core: PerCore<'_>,
        request: &Request<'_>,
        inspection: &Inspection,
        target: &Target<'_>,
    ) -> Result<Built, GatewayError> {
        let whole = request.body.len();
        Ok(match self {
            Translation::OpenAiPassthrough { request_usage } => {
                let (tail_from, strip_usage) =
                    forward::build_request(out, request, inspection, target, request_usage);
                Built {
                    tail_from,
                    strip_usage,
                }
            }
            Translation::ChatToMessages(settings) => {
                let _held = hold_translation(core, request.body, true)?;
                forward::build_anthropic_request(out, request, inspection, target, settings)?;
                Built {
                    tail_from: whole,
                    strip_usage: inspection.include_usage != Some(true),
                }
            }
            Translation::MessagesToChat => {
                let _held = hold_translation(core, request.body, false)?;
                forward::build_chat_from_messages(out, request, inspection, target)?;
                Built {
                    tail_from: whole,
                    strip_usage: false,
                }
            }
            Translation::AnthropicPassthrough(settings) => Built {
                tail_from: forward::build_messages_passthrough(
                    out, request, inspection, target, settings,
                ),
                strip_usage: false,
            },
        })
    }

    /// Whether the relay meters the answer in Anthropic's terms (an Anthropic answer passed
    /// through); every other answer reaches the meter as OpenAI's.
    pub(crate) fn meters_anthropic(self) -> bool {
        matches!(self, Translation::AnthropicPassthrough(_))
    }

    /// How the answer is relayed, translated where the dialects differ: a stream event by
    /// event, anything else read whole and translated. `streamed`: the answer is a 2xx event
    /// stream; `model` is the one the client asked for (a translated answer names it).
    pub(crate) fn relay_with(self, streamed: bool, model: &str) -> RelayWith<'_> {
        match self {
            Translation::OpenAiPassthrough { .. } | Translation::AnthropicPassthrough(_) => {
                RelayWith::AsItArrives(None)
            }
            // An OpenAI-dialect stream for an Anthropic client: metered as the upstream sent
            // it, translated on the way out.
            Translation::MessagesToChat if streamed => {
                RelayWith::AsItArrives(Some(Box::new(StreamTranslate::to_messages(model))))
            }
            Translation::ChatToMessages(_) if streamed => {
                RelayWith::AsItArrives(Some(Box::new(StreamTranslate::anthropic(model))))
            }
            Translation::MessagesToChat => RelayWith::Whole(WholeAnswer {
                to_messages: true,
                model,
            }),
            Translation::ChatToMessages(_) => RelayWith::Whole(WholeAnswer {
                to_messages: false,
                model,
            }),
        }
    }
}

/// A body about to be translated, sized up before any of it is built: more JSON values than
/// `http.max_translated_json_values` is the client's 400; its working memory (see
/// [`Shape::working_memory`]) is held from the worker's body memory until the returned hold
/// drops, or it is a 503 when that memory is full. `arguments`: a chat request, whose tool-call
/// arguments are parsed too.
fn hold_translation<'c>(
    core: PerCore<'c>,
    body: &[u8],
    arguments: bool,
) -> Result<BodyHold<'c>, GatewayError> {
    let max = core.snapshot.http.max_translated_json_values;
    let shape = Shape::of(body, arguments, max);
    if shape.values > max {
        return Err(GatewayError::invalid_request(
            format!(
                "This request has more than {max} JSON values (content blocks, messages, \
                 tool arguments and their fields), the most a request translated for this \
                 model's provider may have."
            ),
            Some("messages"),
        ));
    }
    let mut hold = core
        .load
        .hold_body(core.snapshot.server.max_body_memory_per_worker);
    if !hold.grow_to(shape.working_memory(body.len())) {
        return Err(GatewayError::body_memory_full());
    }
    Ok(hold)
}

/// How an attempt's answer goes to the client (see [`Translation::relay_with`]).
pub(crate) enum RelayWith<'m> {
    /// With [`relay`](crate::gateway::relay::relay), as it arrives; an event stream translated
    /// by this, if any (boxed: the relay's future, moved at each await it is passed through,
    /// stays small on the paths that translate nothing).
    AsItArrives(Option<Box<StreamTranslate>>),
    /// With [`relay_translated_whole`](crate::gateway::relay::relay_translated_whole): read
    /// whole, then translated.
    Whole(WholeAnswer<'m>),
}

/// A whole answer (or error) of an upstream of the other dialect, to translate.
#[derive(Clone, Copy)]
pub(crate) struct WholeAnswer<'m> {
    /// An OpenAI upstream's answer for an Anthropic client (else an Anthropic upstream's for an
    /// OpenAI client).
    to_messages: bool,
    /// The model the client asked for.
    model: &'m str,
}

impl WholeAnswer<'_> {
    /// Whether the meter reads the upstream's body (it speaks OpenAI) rather than the
    /// translated one.
    pub(crate) fn meter_upstream(self) -> bool {
        self.to_messages
    }

    /// Translate `body` (the upstream's, with `status`) into `out`: the status the client gets,
    /// or a 502 when a 2xx answer cannot be read.
    pub(crate) fn translate(
        self,
        status: u16,
        body: &[u8],
        out: &mut Vec<u8>,
    ) -> Result<u16, GatewayError> {
        if self.to_messages {
            chat_answer_to_message(status, body, self.model, out)
        } else {
            message_answer_to_chat(status, body, out)
        }
    }
}

/// The answer when no candidate's dialect can answer the client's endpoint.
pub(crate) fn unservable(model: &str) -> GatewayError {
    let message = format!(
        "`{}` is served by Anthropic's Messages API here, which answers \
         /v1/chat/completions only",
        crate::openai::json::truncate(model, 128)
    );
    GatewayError::new(ErrorKind::InvalidRequest, message)
}

/// Read the client's body by its own dialect's rules over what the inspector found: a Messages
/// request's model (and its span), stream and the required `max_tokens`; 400 when they are
/// broken. An OpenAI client's body needs nothing more.
pub(crate) fn read_client_request(
    request: &Request<'_>,
    inspection: &mut Inspection,
) -> Result<(), GatewayError> {
    if request.dialect() == ClientDialect::Anthropic {
        read_messages(request.body, inspection)?;
    }
    Ok(())
}

/// Out of line: the OpenAI endpoints' path never runs it.
#[inline(never)]
fn read_messages(body: &[u8], inspection: &mut Inspection) -> Result<(), GatewayError> {
    let m = anthropic_client::inspect_messages(body)
        .map_err(|e| GatewayError::invalid_request(e.message, None))?;
    inspection.model.clear();
    inspection.model.push_str(&m.model);
    inspection.model_span = m.model_span;
    inspection.stream = m.stream;
    inspection.max_tokens = Some(m.max_tokens);
    Ok(())
}

/// An OpenAI upstream's whole answer (or error) for an Anthropic client: the status it gets.
fn chat_answer_to_message(
    status: u16,
    body: &[u8],
    model: &str,
    out: &mut Vec<u8>,
) -> Result<u16, GatewayError> {
    if !(200..300).contains(&status) {
        return Ok(anthropic_client::error_to_anthropic(status, body, out));
    }
    anthropic_client::chat_to_message(body, model, out).map_err(|e| {
        GatewayError::bad_gateway(
            UpstreamFault::Protocol,
            format!("the upstream's answer could not be read: {}", e.message),
        )
    })?;
    Ok(status)
}

/// An Anthropic upstream's whole answer (or error) for an OpenAI client: the status it gets.
fn message_answer_to_chat(
    status: u16,
    body: &[u8],
    out: &mut Vec<u8>,
) -> Result<u16, GatewayError> {
    if !(200..300).contains(&status) {
        return Ok(anthropic_upstream::error_to_openai(status, body, out));
    }
    anthropic_upstream::message_to_chat(body, out).map_err(|e| {
        GatewayError::bad_gateway(
            UpstreamFault::Protocol,
            format!(
                "the Anthropic upstream's answer could not be read: {}",
                e.message
            ),
        )
    })?;
    Ok(status)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use crate::config::Snapshot;

    fn snapshot() -> Snapshot {
        let config = r#"
            [clusters.gpt]
            backends = [{ base_url = "http://127.0.0.1:9/v1" }]
            [clusters.claude]
            dialect = "anthropic"
            backends = [{ base_url = "http://127.0.0.1:9/v1" }]
            [[routes]]
            model = "gpt"
            cluster = "gpt"
            [[routes]]
            model = "claude"
            cluster = "claude"
            "#;
        crate::config::load(config, &|_| None).unwrap()
    }

    /// The plan for each endpoint and dialect, by name: which pairs are served, and how.
    fn planned(endpoint: Endpoint, cluster: &Cluster) -> &'static str {
        match Translation::plan(Some(endpoint), cluster, true) {
            Some(Translation::OpenAiPassthrough {
                request_usage: true,
            }) => "openai",
            Some(Translation::OpenAiPassthrough { .. }) => "openai without usage",
            Some(Translation::ChatToMessages(_)) => "chat -> messages",
            Some(Translation::MessagesToChat) => "messages -> chat",
            Some(Translation::AnthropicPassthrough(_)) => "anthropic",
            None => "unservable",
        }
    }

    #[test]
    fn each_endpoint_meets_each_dialect_as_planned() {
        let snapshot = snapshot();
        let cluster = |name: &str| snapshot.clusters.iter().find(|c| c.name == name).unwrap();
        let (gpt, claude) = (cluster("gpt"), cluster("claude"));
        for endpoint in Endpoint::ALL {
            let (to_openai, to_anthropic) = match endpoint {
                Endpoint::Messages => ("messages -> chat", "anthropic"),
                Endpoint::ChatCompletions => ("openai", "chat -> messages"),
                _ => ("openai", "unservable"),
            };
            assert_eq!(planned(endpoint, gpt), to_openai, "{endpoint:?}");
            assert_eq!(planned(endpoint, claude), to_anthropic, "{endpoint:?}");
        }
        // Only the passthrough of an Anthropic answer is metered in Anthropic's terms.
        let passthrough = Translation::plan(Some(Endpoint::Messages), claude, true).unwrap();
        assert!(passthrough.meters_anthropic());
        let translated = Translation::plan(Some(Endpoint::Messages), gpt, true).unwrap();
        assert!(!translated.meters_anthropic());
    }

    #[test]
    fn answers_of_the_other_dialect_are_translated_streams_included() {
        let snapshot = snapshot();
        let claude = snapshot
            .clusters
            .iter()
            .find(|c| matches!(c.dialect, Dialect::Anthropic(_)))
            .unwrap();
        let chat = Translation::plan(Some(Endpoint::ChatCompletions), claude, true).unwrap();
        assert!(matches!(
            chat.relay_with(true, "m"),
            RelayWith::AsItArrives(Some(_))
        ));
        let whole = match chat.relay_with(false, "m") {
            RelayWith::Whole(whole) => whole,
            RelayWith::AsItArrives(_) => panic!("a whole answer is read whole"),
        };
        assert!(
            !whole.meter_upstream(),
            "the meter reads the translated chat answer"
        );
        // An Anthropic error becomes an OpenAI one, its status kept.
        let mut out = Vec::new();
        let body = br#"{"type":"error","error":{"type":"rate_limit_error","message":"slow down"}}"#;
        assert_eq!(whole.translate(429, body, &mut out).unwrap(), 429);
        let v: serde_json::Value = serde_json::from_slice(&out).unwrap();
        assert_eq!(v["error"]["message"], "slow down");
        // A 2xx that cannot be read is the upstream's fault: 502.
        let e = whole
            .translate(200, b"not json", &mut Vec::new())
            .unwrap_err();
        assert_eq!(e.status(), 502);
    }
}

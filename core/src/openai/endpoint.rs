//! The API endpoints Sluice proxies, known by path: the one list the connection loop
//! dispatches on, the forward phase asks about stream usage and metrics label routes by. All
//! are OpenAI's but [`Endpoint::Messages`], Anthropic's, whose clients get every answer in
//! Anthropic's shapes ([`ClientDialect`]).

/// A proxied endpoint.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Endpoint {
    ChatCompletions,
    Completions,
    Embeddings,
    Responses,
    /// Anthropic's Messages API, for Anthropic SDK clients.
    Messages,
}

/// Anthropic's token counting, answered by Sluice itself from its estimate.
pub(crate) const COUNT_TOKENS_PATH: &[u8] = b"/v1/messages/count_tokens";

/// The API a client speaks, by the path it called: what shape its errors (and, from an upstream
/// of the other dialect, its answers) take.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub(crate) enum ClientDialect {
    #[default]
    OpenAi,
    Anthropic,
}

impl ClientDialect {
    /// `/v1/messages` and what is under it speak Anthropic; everything else OpenAI.
    pub(crate) fn of_path(path: &[u8]) -> ClientDialect {
        if path.starts_with(b"/v1/messages") && matches!(path.get(12), None | Some(b'/' | b'?')) {
            ClientDialect::Anthropic
        } else {
            ClientDialect::OpenAi
        }
    }
}

impl Endpoint {
    pub(crate) const ALL: [Endpoint; 5] = [
        Endpoint::ChatCompletions,
        Endpoint::Completions,
        Endpoint::Embeddings,
        Endpoint::Responses,
        Endpoint::Messages,
    ];

    /// The endpoint a request path names (exactly; no query string is accepted on these).
    pub(crate) fn from_path(path: &[u8]) -> Option<Endpoint> {
        Endpoint::ALL
            .into_iter()
            .find(|e| e.path().as_bytes() == path)
    }

    pub(crate) fn path(self) -> &'static str {
        match self {
            Endpoint::ChatCompletions => "/v1/chat/completions",
            Endpoint::Completions => "/v1/completions",
            Endpoint::Embeddings => "/v1/embeddings",
            Endpoint::Responses => "/v1/responses",
            Endpoint::Messages => "/v1/messages",
        }
    }

    /// Its metric `route` label.
    pub(crate) fn label(self) -> &'static str {
        match self {
            Endpoint::ChatCompletions => "chat_completions",
            Endpoint::Completions => "completions",
            Endpoint::Embeddings => "embeddings",
            Endpoint::Responses => "responses",
            Endpoint::Messages => "messages",
        }
    }

    /// A stream from it reports usage only when asked (`stream_options.include_usage`); the
    /// Responses API always reports it in `response.completed`.
    pub(crate) fn usage_on_request(self) -> bool {
        matches!(self, Endpoint::ChatCompletions | Endpoint::Completions)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn paths_round_trip_and_nothing_else_matches() {
        for e in Endpoint::ALL {
            assert_eq!(Endpoint::from_path(e.path().as_bytes()), Some(e));
        }
        for other in [
            &b"/v1/models"[..],
            b"/v1/chat/completions/",
            b"/v1/Completions",
            b"/v1/messages/count_tokens",
            b"",
        ] {
            assert_eq!(Endpoint::from_path(other), None);
        }
    }

    #[test]
    fn messages_paths_speak_anthropic() {
        for (path, dialect) in [
            (&b"/v1/messages"[..], ClientDialect::Anthropic),
            (COUNT_TOKENS_PATH, ClientDialect::Anthropic),
            (b"/v1/messagesx", ClientDialect::OpenAi),
            (b"/v1/chat/completions", ClientDialect::OpenAi),
            (b"/v1/models", ClientDialect::OpenAi),
        ] {
            assert_eq!(ClientDialect::of_path(path), dialect, "{path:?}");
        }
    }
}

//! The OpenAI endpoints Sluice proxies, known by path: the one list the connection loop
//! dispatches on, the forward phase asks about stream usage and metrics label routes by.

/// A proxied OpenAI endpoint.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Endpoint {
    ChatCompletions,
    Completions,
    Embeddings,
    Responses,
}

impl Endpoint {
    pub(crate) const ALL: [Endpoint; 4] = [
        Endpoint::ChatCompletions,
        Endpoint::Completions,
        Endpoint::Embeddings,
        Endpoint::Responses,
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
        }
    }

    /// Its metric `route` label.
    pub(crate) fn label(self) -> &'static str {
        match self {
            Endpoint::ChatCompletions => "chat_completions",
            Endpoint::Completions => "completions",
            Endpoint::Embeddings => "embeddings",
            Endpoint::Responses => "responses",
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
            b"",
        ] {
            assert_eq!(Endpoint::from_path(other), None);
        }
    }
}

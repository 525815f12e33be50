//! `[clusters.x] dialect`: the API a cluster's backends speak. `"openai"` (the default: OpenAI
//! and every OpenAI-compatible server — vLLM, SGLang, DeepSeek, Qwen …) gets requests as the
//! client sent them; `"anthropic"` gets chat completions translated into Anthropic's Messages
//! API (`POST {base_url}/messages`, `anthropic-version`, optionally `anthropic-beta`), and its
//! answers translated back. Read here, validated once.

use serde::Deserialize;

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[cfg_attr(test, derive(serde::Serialize))]
#[serde(rename_all = "snake_case")]
pub(crate) enum DialectName {
    #[default]
    Openai,
    Anthropic,
}

/// `[clusters.x] anthropic`: what an Anthropic-dialect cluster's requests carry.
#[derive(Debug, Deserialize)]
#[cfg_attr(test, derive(serde::Serialize))]
#[serde(deny_unknown_fields)]
pub(super) struct RawAnthropic {
    #[serde(default = "default_version")]
    version: String,
    /// `anthropic-beta` on every request (a client's own is passed through when this is unset).
    beta: Option<String>,
    /// `max_tokens` for a request that sets none (Anthropic requires one).
    #[serde(default = "default_max_tokens")]
    default_max_tokens: u64,
}

fn default_version() -> String {
    "2023-06-01".into()
}

fn default_max_tokens() -> u64 {
    4096
}

/// The API a cluster speaks, with what it needs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Dialect {
    OpenAi,
    Anthropic(AnthropicSettings),
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct AnthropicSettings {
    /// `anthropic-version: …\r\n`, ready to write.
    pub(crate) version_line: Vec<u8>,
    /// `anthropic-beta: …\r\n` when the cluster sets one.
    pub(crate) beta_line: Option<Vec<u8>>,
    pub(crate) default_max_tokens: u64,
}

/// A header value Sluice writes as it is: visible ASCII and spaces, not empty.
fn header_safe(v: &str) -> bool {
    !v.is_empty() && v.bytes().all(|b| b == b' ' || b.is_ascii_graphic())
}

pub(super) fn resolve_dialect(
    name: DialectName,
    raw: Option<&RawAnthropic>,
    path: &str,
    err: &mut dyn FnMut(String, String),
) -> Dialect {
    match name {
        DialectName::Openai => {
            if raw.is_some() {
                err(
                    format!("{path}.anthropic"),
                    "only a cluster with dialect = \"anthropic\" has these settings".into(),
                );
            }
            Dialect::OpenAi
        }
        DialectName::Anthropic => {
            let defaults = RawAnthropic {
                version: default_version(),
                beta: None,
                default_max_tokens: default_max_tokens(),
            };
            let raw = raw.unwrap_or(&defaults);
            if !header_safe(&raw.version) {
                err(
                    format!("{path}.anthropic.version"),
                    "must be a header value like \"2023-06-01\"".into(),
                );
            }
            if raw.beta.as_deref().is_some_and(|b| !header_safe(b)) {
                err(
                    format!("{path}.anthropic.beta"),
                    "must be a header value like \"prompt-caching-2024-07-31\"".into(),
                );
            }
            if raw.default_max_tokens == 0 {
                err(
                    format!("{path}.anthropic.default_max_tokens"),
                    "must be at least 1".into(),
                );
            }
            Dialect::Anthropic(AnthropicSettings {
                version_line: format!("anthropic-version: {}\r\n", raw.version).into_bytes(),
                beta_line: raw
                    .beta
                    .as_ref()
                    .map(|b| format!("anthropic-beta: {b}\r\n").into_bytes()),
                default_max_tokens: raw.default_max_tokens.max(1),
            })
        }
    }
}

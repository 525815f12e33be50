//! Anthropic's Messages API (`POST /v1/messages`) next to OpenAI's chat completions: wire
//! knowledge only, no I/O (issue #14).
//!
//! - [`upstream`]: an OpenAI client's request to an Anthropic-dialect cluster — the chat
//!   completion request turned into a Messages request, and the Messages response (whole, or
//!   event by event as it streams) and errors turned back into OpenAI's shapes.
//! - [`client`]: an Anthropic client's request (`/v1/messages`) to an OpenAI-dialect cluster —
//!   the reverse of [`upstream`].
//!
//! Both directions report usage in OpenAI's terms (`prompt_tokens` includes cache reads and
//! writes; `cached_tokens` is the cache reads), so limits, quotas, cost and the access log see
//! the same numbers whatever the dialect.

pub(crate) mod bound;
pub(crate) mod client;
pub(crate) mod upstream;

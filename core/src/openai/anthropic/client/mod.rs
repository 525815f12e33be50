//! Anthropic client → OpenAI-dialect upstream: see the parent module.

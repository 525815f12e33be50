//! OpenAI client → Anthropic upstream: see the parent module.

//! An upstream's event stream in another dialect, translated for the client as it arrives.
//!
//! Anthropic upstream → OpenAI client ([`StreamTranslate::anthropic`]): sits where the decoded
//! upstream bytes enter the relay, before the meter and the usage strip, so the meter, the usage
//! strip and the client's framing see an OpenAI stream, exactly as if the upstream had sent one.
//!
//! OpenAI upstream → Anthropic client ([`StreamTranslate::to_messages`]): sits after the meter
//! (which reads the upstream's own chat completion chunks, usage chunk included) and instead of
//! the usage strip: the translator needs the usage chunk for `message_delta`'s usage.
//!
//! Either way a [`StreamTranslate`] splits the stream into events (across any read boundary, an
//! unfinished event held up to the meter's event limit), hands each to the translator, and
//! passes on the events it writes. Nothing is held back beyond the unfinished event at the end
//! of a read.

use crate::openai::anthropic::client::ChatStreamToMessages;
use crate::openai::anthropic::upstream::StreamTranslator;
use crate::openai::meter::{event_data, event_name, SseSplitter};

/// A stream on its way to a client of the other dialect.
pub(crate) struct StreamTranslate {
    splitter: SseSplitter,
    translator: Translator,
    /// An event's `data`, joined when it spans lines.
    data: Vec<u8>,
    /// What the translator wrote for this read's events.
    out: Vec<u8>,
}

enum Translator {
    /// Anthropic events → OpenAI chunks (before the meter).
    FromAnthropic(StreamTranslator),
    /// OpenAI chunks → Anthropic events (after the meter).
    ToMessages(Box<ChatStreamToMessages>),
}

impl StreamTranslate {
    /// An Anthropic stream for an OpenAI client that asked for `model` (its chunks name it).
    pub(crate) fn anthropic(model: &str) -> StreamTranslate {
        StreamTranslate::with(Translator::FromAnthropic(StreamTranslator::new(
            model,
            crate::sys::time::unix_secs(),
        )))
    }

    /// A chat completions stream for an Anthropic client that asked for `model`.
    pub(crate) fn to_messages(model: &str) -> StreamTranslate {
        StreamTranslate::with(Translator::ToMessages(Box::new(ChatStreamToMessages::new(
            model,
        ))))
    }

    fn with(translator: Translator) -> StreamTranslate {
        StreamTranslate {
            splitter: SseSplitter::new(),
            translator,
            data: Vec::new(),
            out: Vec::new(),
        }
    }

    /// Whether it translates what the meter saw (the meter reads the upstream's dialect).
    pub(super) fn after_meter(&self) -> bool {
        matches!(self.translator, Translator::ToMessages(_))
    }

    /// Take the next decoded bytes of the upstream body; `emit` gets the translated events
    /// that end in them (whole events), once per call when there are any.
    pub(super) fn feed(&mut self, input: &[u8], mut emit: impl FnMut(&[u8])) {
        let StreamTranslate {
            splitter,
            translator,
            data,
            out,
        } = self;
        splitter.feed(input, |event| {
            let name = event_name(event);
            if let Some(payload) = event_data(event, data) {
                match translator {
                    Translator::FromAnthropic(t) => t.event(name, payload, out),
                    Translator::ToMessages(t) => t.event(payload, out),
                }
            }
        });
        if !out.is_empty() {
            emit(out);
            out.clear();
        }
    }

    /// The upstream body ended whole (the meter saw its stream end): a chat completions stream
    /// that finished without `[DONE]` gets its `message_delta` and `message_stop` now.
    pub(super) fn finish(&mut self, mut emit: impl FnMut(&[u8])) {
        if let Translator::ToMessages(t) = &mut self.translator {
            t.upstream_closed(&mut self.out);
        }
        if !self.out.is_empty() {
            emit(&self.out);
            self.out.clear();
        }
    }
}

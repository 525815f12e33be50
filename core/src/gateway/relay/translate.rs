//! An upstream's event stream in another dialect, translated for the client as it arrives.
//!
//! Sits where the decoded upstream bytes enter the relay, before the meter and the usage strip:
//! a [`StreamTranslate`] splits the Anthropic stream into events (across any read boundary, an
//! unfinished event held up to the meter's event limit), hands each to the translator, and
//! passes on the OpenAI events it writes — so the meter, the usage strip and the client's
//! framing see an OpenAI stream, exactly as if the upstream had sent one. Nothing is held back
//! beyond the unfinished event at the end of a read.

use crate::openai::anthropic::upstream::StreamTranslator;
use crate::openai::meter::{event_data, SseSplitter};

/// An Anthropic Messages stream on its way to an OpenAI client.
pub(crate) struct StreamTranslate {
    splitter: SseSplitter,
    translator: StreamTranslator,
    /// An event's `data`, joined when it spans lines.
    data: Vec<u8>,
    /// What the translator wrote for this read's events.
    out: Vec<u8>,
}

impl StreamTranslate {
    /// For a client that asked for `model` (its chunks name it).
    pub(crate) fn anthropic(model: &str) -> StreamTranslate {
        StreamTranslate {
            splitter: SseSplitter::new(),
            translator: StreamTranslator::new(model, crate::sys::time::unix_secs()),
            data: Vec::new(),
            out: Vec::new(),
        }
    }

    /// Take the next decoded bytes of the upstream body; `emit` gets the translated events
    /// that end in them (whole OpenAI events), once per call when there are any.
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
                translator.event(name, payload, out);
            }
        });
        if !out.is_empty() {
            emit(out);
            out.clear();
        }
    }
}

/// The `event:` field of an event (its first such line), without the optional space.
fn event_name(event: &[u8]) -> Option<&[u8]> {
    event
        .split(|&b| b == b'\n' || b == b'\r')
        .find_map(|line| line.strip_prefix(b"event:"))
        .map(|v| v.strip_prefix(b" ").unwrap_or(v))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn event_names_are_read_with_or_without_the_space() {
        assert_eq!(
            event_name(b"event: message_start\ndata: {}"),
            Some(&b"message_start"[..])
        );
        assert_eq!(event_name(b"data: {}\r\nevent:ping"), Some(&b"ping"[..]));
        assert_eq!(event_name(b"data: {}"), None);
    }
}

//! Withhold the usage-only chunk from a client that did not ask for it.
//!
//! When the forward phase asked the upstream for `stream_options.include_usage` on a client's
//! behalf, the upstream ends its stream with an extra event (`choices: []` and a `usage` object,
//! just before `data: [DONE]`). The meter must read it; the client must not see it. A
//! [`UsageStrip`] sits between the decoded upstream bytes and the client's framing: it passes
//! every byte on as soon as it arrives, except the unfinished event at the end of a read, which
//! it holds until the event ends and it can tell whether to drop it. The hold is bounded: an
//! event that grows past `max_event` bytes (the meter's own limit, past which it would not read
//! the event either) is released and passed through to its end. Line endings are CRLF, LF or CR,
//! as in [`crate::openai::meter::SseSplitter`]; a dropped event takes its own bytes only, from its first
//! line through the blank line that ends it (blank lines between events go through).

use crate::openai::meter::{Framed, SseFraming};

/// Drops usage-only events from an event stream, holding back at most one unfinished event.
#[derive(Debug)]
pub(super) struct UsageStrip {
    /// The unfinished event's bytes from earlier reads (empty while none is held).
    held: Vec<u8>,
    max_event: usize,
    framing: SseFraming,
    /// The open event outgrew `max_event`: its bytes pass straight through to its end.
    passing: bool,
    /// The event just dropped ended in a CR that ended the read: an LF opening the next read
    /// belongs to it.
    drop_lf: bool,
}

/// Where the bytes of one read stand while [`UsageStrip::feed`] walks it.
struct Cursor {
    /// The next byte to look at.
    pos: usize,
    /// The first byte not yet passed on, dropped or held.
    start: usize,
    /// Where the open event starts (bytes before it are blank lines; 0 for an event held from
    /// an earlier read).
    event_start: usize,
}

impl UsageStrip {
    /// A filter that holds at most `max_event` bytes of an unfinished event, in `held` (an empty
    /// buffer the caller lends; get it back with [`UsageStrip::into_buffer`]).
    pub(super) fn new(max_event: usize, mut held: Vec<u8>) -> UsageStrip {
        held.clear();
        UsageStrip {
            held,
            max_event,
            framing: SseFraming::new(),
            passing: false,
            drop_lf: false,
        }
    }

    /// Give the hold buffer back.
    pub(super) fn into_buffer(self) -> Vec<u8> {
        self.held
    }

    /// Take the next bytes of the stream: `emit` gets every byte to pass on, in order and never
    /// an empty slice; `is_usage_only` is asked about each event that ends here (its bytes, from
    /// its first line through the blank line that ends it) and drops it by answering true.
    pub(super) fn feed(
        &mut self,
        chunk: &[u8],
        mut is_usage_only: impl FnMut(&[u8]) -> bool,
        mut emit: impl FnMut(&[u8]),
    ) {
        let mut at = Cursor {
            pos: 0,
            start: 0,
            event_start: 0,
        };
        loop {
            if !self.framing.in_event() {
                at.event_start = at.pos;
            }
            let Some(framed) = self.framing.step(chunk, &mut at.pos) else {
                break;
            };
            match framed {
                // The LF of a CRLF that ended a dropped event in the previous read.
                Framed::CrlfTail => {
                    if std::mem::take(&mut self.drop_lf) {
                        at.start = at.pos;
                    }
                }
                Framed::Blank { ended_event: true } => {
                    self.drop_lf = false;
                    self.framing.take_crlf_tail(chunk, &mut at.pos);
                    self.event_ended(chunk, &mut at, &mut is_usage_only, &mut emit);
                }
                Framed::Line { .. } | Framed::Blank { .. } | Framed::Partial => {
                    self.drop_lf = false
                }
            }
        }
        if at.start < chunk.len() {
            self.read_ended(chunk, &at, &mut emit);
        }
    }

    /// An event ended at `at.pos`: pass it on, or drop it when it is the usage-only chunk.
    fn event_ended(
        &mut self,
        chunk: &[u8],
        at: &mut Cursor,
        is_usage_only: &mut impl FnMut(&[u8]) -> bool,
        emit: &mut impl FnMut(&[u8]),
    ) {
        let event = &chunk[at.event_start..at.pos];
        let drop = if std::mem::take(&mut self.passing) {
            false
        } else if self.held.is_empty() {
            is_usage_only(event)
        } else if self.held.len() + event.len() > self.max_event {
            // Too long for the meter to read, so not a chunk it could settle on either.
            emit(&self.held);
            self.held.clear();
            false
        } else {
            self.held.extend_from_slice(event);
            let drop = is_usage_only(&self.held);
            if !drop {
                emit(&self.held);
            }
            self.held.clear();
            if drop {
                self.drop_lf = self.framing.after_cr();
            }
            at.start = at.pos;
            return;
        };
        if drop {
            // The blank lines before it still go out; a CR ending this read may have its LF
            // at the start of the next.
            if at.event_start > at.start {
                emit(&chunk[at.start..at.event_start]);
            }
            self.drop_lf = self.framing.after_cr();
        } else {
            emit(&chunk[at.start..at.pos]);
        }
        at.start = at.pos;
    }

    /// The read ended with bytes not yet passed on: blank lines, the rest of an event too long
    /// to hold, or an unfinished event to hold.
    fn read_ended(&mut self, chunk: &[u8], at: &Cursor, emit: &mut impl FnMut(&[u8])) {
        if !self.framing.in_event() || self.passing {
            emit(&chunk[at.start..]);
            return;
        }
        // An unfinished event: the blank lines before it go out now; it is held, unless that
        // would make it too long.
        let event = &chunk[at.event_start..];
        if self.held.len() + event.len() > self.max_event {
            // Let it through, this read and every read until it ends.
            self.passing = true;
            if !self.held.is_empty() {
                emit(&self.held);
                self.held.clear();
            }
            emit(&chunk[at.start..]);
        } else {
            if at.event_start > at.start {
                emit(&chunk[at.start..at.event_start]);
            }
            self.held.extend_from_slice(event);
        }
    }

    /// The stream ended (or was cut): pass on whatever is held, as it arrived.
    pub(super) fn finish(&mut self, mut emit: impl FnMut(&[u8])) {
        if !self.held.is_empty() {
            emit(&self.held);
            self.held.clear();
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use crate::openai::meter::SseMeter;

    /// A chat stream as OpenAI sends it with `include_usage`: the usage chunk before `[DONE]`.
    const STREAM: &str = concat!(
        ": echo\n\n",
        "data: {\"choices\":[{\"index\":0,\"delta\":{\"role\":\"assistant\"}}],\"usage\":null}\n\n",
        "data: {\"choices\":[{\"index\":0,\"delta\":{\"content\":\"Hi 中文\"}}],\"usage\":null}\n\n",
        "data: {\"choices\":[{\"index\":0,\"delta\":{},\"finish_reason\":\"stop\"}],\"usage\":null}\n\n",
        "data: {\"id\":\"x\",\"choices\":[],\"usage\":{\"prompt_tokens\":3,\"completion_tokens\":2,\"total_tokens\":5}}\n\n",
        "data: [DONE]\n\n",
    );

    const USAGE_EVENT: &str = "data: {\"id\":\"x\",\"choices\":[],\"usage\":{\"prompt_tokens\":3,\"completion_tokens\":2,\"total_tokens\":5}}\n\n";

    /// Run `chunks` through a filter that asks a real meter; the bytes passed on, the number of
    /// events dropped, and the most bytes held at once.
    fn strip(chunks: &[&[u8]], max_event: usize) -> (Vec<u8>, u64, usize) {
        let mut meter = SseMeter::new();
        let mut filter = UsageStrip::new(max_event, Vec::new());
        let mut out = Vec::new();
        let mut most_held = 0;
        let mut dropped = 0;
        for c in chunks {
            filter.feed(
                c,
                |e| {
                    let drop = meter.is_usage_only_event(e);
                    dropped += u64::from(drop);
                    drop
                },
                |b| {
                    assert!(!b.is_empty());
                    out.extend_from_slice(b)
                },
            );
            most_held = most_held.max(filter.held.len());
        }
        filter.finish(|b| out.extend_from_slice(b));
        (out, dropped, most_held)
    }

    /// Whole, split in two at every offset, and byte by byte: the same output.
    fn check_every_split(stream: &str, want: &str, dropped: u64) {
        let s = stream.as_bytes();
        let max = 1 << 20;
        let (out, n, _) = strip(&[s], max);
        assert_eq!((String::from_utf8_lossy(&out).as_ref(), n), (want, dropped));
        for cut in 0..=s.len() {
            let (out, n, _) = strip(&[&s[..cut], &s[cut..]], max);
            assert_eq!(
                String::from_utf8_lossy(&out),
                want,
                "split at {cut}: {:?} | {:?}",
                String::from_utf8_lossy(&s[..cut]),
                String::from_utf8_lossy(&s[cut..])
            );
            assert_eq!(n, dropped, "split at {cut}");
        }
        let bytes: Vec<&[u8]> = s.chunks(1).collect();
        let (out, n, _) = strip(&bytes, max);
        assert_eq!(String::from_utf8_lossy(&out), want, "byte by byte");
        assert_eq!(n, dropped);
    }

    #[test]
    fn drops_the_usage_chunk_at_every_split() {
        let want = STREAM.replace(USAGE_EVENT, "");
        check_every_split(STREAM, &want, 1);
    }

    #[test]
    fn crlf_cr_and_mixed_line_endings() {
        let want = STREAM.replace(USAGE_EVENT, "");
        for (from, to) in [
            ("\n", "\r\n"),
            ("\n", "\r"),
            ("\n\n", "\r\n\n"),
            ("\n\n", "\n\r\n"),
        ] {
            let stream = STREAM.replace(from, to);
            let want = want.replace(from, to);
            check_every_split(&stream, &want, 1);
        }
    }

    #[test]
    fn multi_line_data_and_other_fields() {
        // The usage chunk's JSON spread over data lines (joined with LF it is one document),
        // with an `id` field and Python's spacing; the blank lines before it stay.
        let usage = "\n\nid: 7\r\ndata: {\"choices\": [ ],\r\ndata:  \"usage\": {\"prompt_tokens\": 1,\r\ndata: \"completion_tokens\": 1}}\r\n\r\n";
        let stream = format!("data: {{\"choices\":[{{\"delta\":{{\"content\":\"a\"}}}}]}}\n\n{usage}data: [DONE]\n\n");
        let want = "data: {\"choices\":[{\"delta\":{\"content\":\"a\"}}]}\n\n\n\ndata: [DONE]\n\n";
        check_every_split(&stream, want, 1);
    }

    #[test]
    fn keeps_what_only_looks_like_usage() {
        // Usage on a chunk with choices, `usage: null`, usage nested deeper, an error event, a
        // comment naming the fields: all pass untouched.
        let stream = concat!(
            "data: {\"choices\":[{\"delta\":{},\"finish_reason\":\"stop\"}],\"usage\":{\"prompt_tokens\":1}}\n\n",
            "data: {\"choices\":[],\"usage\":null}\n\n",
            "data: {\"choices\":[],\"x\":{\"usage\":{\"prompt_tokens\":1}}}\n\n",
            ": \"choices\":[],\"usage\":{}\n\n",
            "data: {\"choices\":[],\"usage\":{\"prompt_tokens\":1}\n\n",
            "data: {\"error\":{\"message\":\"boom\"}}\n\n",
            "data: [DONE]\n\n",
        );
        check_every_split(stream, stream, 0);
    }

    #[test]
    fn an_unfinished_event_is_passed_on_at_the_end() {
        let stream = "data: {\"choices\":[]}\n\ndata: {\"choices\":[],\"usage\":{\"a\":1}}\n";
        check_every_split(stream, stream, 0);
        // Held while unfinished, released by finish().
        let mut filter = UsageStrip::new(1024, Vec::new());
        let mut out = Vec::new();
        filter.feed(
            b"data: a\n\ndata: b",
            |_| false,
            |b| out.extend_from_slice(b),
        );
        assert_eq!(out, b"data: a\n\n");
        filter.finish(|b| out.extend_from_slice(b));
        assert_eq!(out, b"data: a\n\ndata: b");
    }

    #[test]
    fn the_hold_is_bounded() {
        // An event longer than the limit is released as soon as it outgrows it, and passes
        // through to its end; the usage chunk after it is still dropped.
        let max = 100;
        let big = format!("data: {}\n\n", "x".repeat(300));
        let stream = format!("{big}{USAGE_EVENT}data: [DONE]\n\n");
        let want = format!("{big}data: [DONE]\n\n");
        for size in [1, 7, 50, 99, 100, 101, 250, 1000] {
            let chunks: Vec<&[u8]> = stream.as_bytes().chunks(size).collect();
            let (out, n, most_held) = strip(&chunks, max);
            assert_eq!(String::from_utf8_lossy(&out), want, "reads of {size}");
            assert_eq!(n, 1, "reads of {size}");
            assert!(most_held <= max, "held {most_held} with reads of {size}");
        }
        // An endless line never holds more than the limit.
        let mut filter = UsageStrip::new(max, Vec::new());
        let mut passed = 0;
        for _ in 0..100 {
            filter.feed(&[b'x'; 64], |_| true, |b| passed += b.len());
            assert!(filter.held.len() <= max);
        }
        assert_eq!(passed, 6400);
    }

    #[test]
    fn held_bytes_are_passed_on_in_order() {
        // A held event that turns out not to be usage goes out whole before what follows it.
        let mut filter = UsageStrip::new(1024, Vec::new());
        let mut out = Vec::new();
        for c in [&b"data: {\"a\":"[..], b"1}\n", b"\ndata: b\n\n:c"] {
            filter.feed(c, |_| false, |b| out.extend_from_slice(b));
        }
        assert_eq!(out, b"data: {\"a\":1}\n\ndata: b\n\n");
        filter.finish(|b| out.extend_from_slice(b));
        assert_eq!(out, b"data: {\"a\":1}\n\ndata: b\n\n:c");
    }
}

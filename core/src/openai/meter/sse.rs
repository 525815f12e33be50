//! Server-sent events: find event boundaries in a byte stream and read an event's `data`.
//!
//! [`SseSplitter`] watches the decoded body of a `text/event-stream` response, one upstream read
//! at a time, and calls back with each complete event. It only observes: the caller has already
//! relayed (or will relay) the same bytes untouched. An event that lies wholly inside one read
//! is handed out as a slice of that read; only the unfinished event at the end of a read is
//! copied, into a buffer bounded by [`SseSplitter::with_max_event`] (an event longer than that is
//! skipped and counted, never buffered). Line endings are CRLF, LF or CR, mixed freely, as the
//! SSE specification allows; an event ends at an empty line.
//!
//! [`data_lines`] and [`event_data`] read an event's `data` field the way a browser's
//! `EventSource` does: `data:` with or without one space, several lines joined with LF;
//! comments (`:`) and the `event`, `id` and `retry` fields are ignored.

use memchr::{memchr, memchr2};

/// The longest event [`SseSplitter::new`] passes on, in bytes (line endings inside it included,
/// the blank line that ends it not). Chat chunks are a few hundred bytes; a Responses API
/// `response.completed` event repeats the whole output and can be far larger.
pub(crate) const DEFAULT_MAX_EVENT: usize = 256 * 1024;

/// Where lines and events end in an event stream read in pieces: the one framing loop of the
/// gateway, shared by [`SseSplitter`] (which reads events) and the relay's usage filter (which
/// drops one). Line endings are CRLF, LF or CR, mixed freely, a CRLF may be split across reads,
/// and an event ends at an empty line.
#[derive(Debug, Clone, Copy)]
pub(crate) struct SseFraming {
    /// The last byte seen ended a line (true before the first byte).
    line_start: bool,
    /// The last byte seen was CR: an LF right after it completes the same line ending.
    after_cr: bool,
    /// An event has a non-empty line and has not ended.
    in_event: bool,
}

/// What [`SseFraming::step`] found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Framed {
    /// The LF of a CRLF whose CR was the last byte stepped over (perhaps in the previous read).
    CrlfTail,
    /// A non-empty line ended; its line ending starts at `end`.
    Line { end: usize },
    /// An empty line; `ended_event` when it closed an open event.
    Blank { ended_event: bool },
    /// The rest of the read is an unfinished line (part of an event).
    Partial,
}

impl SseFraming {
    /// The framing at the start of a stream.
    pub(crate) const fn new() -> Self {
        Self {
            line_start: true,
            after_cr: false,
            in_event: false,
        }
    }

    /// An event has begun and not ended.
    pub(crate) fn in_event(&self) -> bool {
        self.in_event
    }

    /// The last byte stepped over ended a line.
    pub(crate) fn line_start(&self) -> bool {
        self.line_start
    }

    /// Step from `*pos` over the next line ending of `chunk` (or over the unfinished rest) and
    /// say what it ended; `None` once `*pos` is at the end of `chunk`.
    #[inline]
    pub(crate) fn step(&mut self, chunk: &[u8], pos: &mut usize) -> Option<Framed> {
        let rest = chunk.get(*pos..).filter(|rest| !rest.is_empty())?;
        if std::mem::take(&mut self.after_cr) && rest[0] == b'\n' {
            *pos += 1;
            return Some(Framed::CrlfTail);
        }
        let Some(off) = memchr2(b'\n', b'\r', rest) else {
            self.line_start = false;
            self.in_event = true;
            *pos = chunk.len();
            return Some(Framed::Partial);
        };
        if off > 0 {
            self.line_start = false;
            self.in_event = true;
        }
        self.after_cr = rest[off] == b'\r';
        let end = *pos + off;
        *pos = end + 1;
        if !self.line_start {
            self.line_start = true;
            return Some(Framed::Line { end });
        }
        let ended_event = std::mem::replace(&mut self.in_event, false);
        Some(Framed::Blank { ended_event })
    }

    /// After a blank line that ended in CR: step over its LF too when it is next in `chunk`, so
    /// the whole line ending goes with the event it closed.
    pub(crate) fn take_crlf_tail(&mut self, chunk: &[u8], pos: &mut usize) {
        if self.after_cr && chunk.get(*pos) == Some(&b'\n') {
            *pos += 1;
            self.after_cr = false;
        }
    }

    /// The last byte stepped over was a CR, so an LF at the start of the next read ends the
    /// same line.
    pub(crate) fn after_cr(&self) -> bool {
        self.after_cr
    }
}

/// Splits an event stream into events across arbitrary read boundaries.
#[derive(Debug)]
pub struct SseSplitter {
    /// The current event's bytes from earlier reads (empty when it started in this read).
    pending: Vec<u8>,
    max_event: usize,
    oversized_events: u64,
    framing: SseFraming,
    /// The current event outgrew `max_event` and is being skipped to its end.
    discarding: bool,
    /// Where the current event's last finished line ends, counted from the event's first byte.
    line_end: usize,
}

impl Default for SseSplitter {
    fn default() -> Self {
        Self::new()
    }
}

impl SseSplitter {
    /// A splitter that passes on events up to [`DEFAULT_MAX_EVENT`] bytes.
    pub fn new() -> Self {
        Self::with_max_event(DEFAULT_MAX_EVENT)
    }

    /// A splitter that passes on events up to `max_event` bytes; it never holds more than that
    /// (plus one line ending) of an unfinished event.
    pub fn with_max_event(max_event: usize) -> Self {
        Self {
            pending: Vec::new(),
            max_event,
            oversized_events: 0,
            framing: SseFraming::new(),
            discarding: false,
            line_end: 0,
        }
    }

    /// Events skipped because they were longer than the limit.
    pub fn oversized_events(&self) -> u64 {
        self.oversized_events
    }

    /// Whether an event has begun and not ended: at the end of the stream, it was cut short.
    pub fn has_partial(&self) -> bool {
        self.framing.in_event()
    }

    /// Bytes held for the unfinished event.
    pub fn pending_len(&self) -> usize {
        self.pending.len()
    }

    /// Forget the stream, keeping the buffer's allocation (up to the limit) for the next one.
    pub fn reset(&mut self) {
        self.pending.clear();
        if self.pending.capacity() > self.max_event.saturating_add(2) {
            self.pending = Vec::new();
        }
        self.oversized_events = 0;
        self.framing = SseFraming::new();
        self.discarding = false;
        self.line_end = 0;
    }

    /// Look at the next bytes of the stream; call `on_event` with each event that ends in them,
    /// without its final line ending and the blank line after it. Events that lie wholly in
    /// `chunk` are slices of it.
    pub fn feed(&mut self, chunk: &[u8], mut on_event: impl FnMut(&[u8])) {
        let mut pos = 0;
        // Where the current event starts in `chunk`, and how many of its bytes came before
        // `chunk` (then `start` is 0). While no event is open, `start == pos`.
        let mut start = 0;
        let mut carried = if self.framing.in_event() {
            self.pending.len()
        } else {
            0
        };
        while let Some(framed) = self.framing.step(chunk, &mut pos) {
            match framed {
                Framed::CrlfTail if !self.framing.in_event() => start = pos,
                Framed::CrlfTail | Framed::Partial => {}
                Framed::Line { end } => self.line_end = carried + (end - start),
                Framed::Blank { ended_event } => {
                    if ended_event {
                        self.dispatch(chunk, start, carried, &mut on_event);
                        carried = 0;
                    }
                    start = pos;
                }
            }
        }
        if self.framing.in_event() && !self.discarding {
            self.hold_tail(chunk.get(start..).unwrap_or_default(), carried);
        }
    }

    /// Keep the unfinished event's bytes from this read, or start skipping it once it is too
    /// long to pass on.
    fn hold_tail(&mut self, tail: &[u8], carried: usize) {
        let len = if self.framing.line_start() {
            self.line_end
        } else {
            carried + tail.len()
        };
        if len > self.max_event {
            self.oversized_events += 1;
            self.discarding = true;
            self.pending.clear();
        } else {
            self.pending.extend_from_slice(tail);
        }
    }

    fn dispatch(
        &mut self,
        chunk: &[u8],
        start: usize,
        carried: usize,
        on_event: &mut impl FnMut(&[u8]),
    ) {
        if self.discarding {
            self.discarding = false;
            return;
        }
        let len = self.line_end;
        if len > self.max_event {
            self.oversized_events += 1;
            self.pending.clear();
            return;
        }
        if carried == 0 {
            if let Some(event) = chunk.get(start..start + len) {
                on_event(event);
            }
        } else {
            if len <= carried {
                self.pending.truncate(len);
            } else if let Some(rest) = chunk.get(..len - carried) {
                self.pending.extend_from_slice(rest);
            }
            on_event(&self.pending);
            self.pending.clear();
        }
    }
}

/// The values of an event's `data` lines, in order (see [`data_lines`]).
#[derive(Debug, Clone)]
pub(crate) struct DataLines<'a> {
    rest: &'a [u8],
}

/// Iterate the values of the `data` field lines of one event (as [`SseSplitter`] passes it):
/// `data:x` and `data: x` both give `x`, a bare `data` line gives an empty value; comments and
/// other fields are skipped.
pub(crate) fn data_lines(event: &[u8]) -> DataLines<'_> {
    DataLines { rest: event }
}

impl<'a> Iterator for DataLines<'a> {
    type Item = &'a [u8];

    fn next(&mut self) -> Option<&'a [u8]> {
        while !self.rest.is_empty() {
            let rest = self.rest;
            let (line, next) = match memchr2(b'\n', b'\r', rest) {
                Some(i) => {
                    let skip = if rest[i] == b'\r' && rest.get(i + 1) == Some(&b'\n') {
                        2
                    } else {
                        1
                    };
                    (&rest[..i], &rest[i + skip..])
                }
                None => (rest, &rest[rest.len()..]),
            };
            self.rest = next;
            if !line.starts_with(b"data") {
                continue;
            }
            let (field, value) = match memchr(b':', line) {
                Some(c) => {
                    let value = &line[c + 1..];
                    (&line[..c], value.strip_prefix(b" ").unwrap_or(value))
                }
                None => (line, &line[line.len()..]),
            };
            if field == b"data" {
                return Some(value);
            }
        }
        None
    }
}

/// The `event:` field of an event (its first such line), without the optional space; a
/// line may end in LF, CRLF or CR.
pub(crate) fn event_name(event: &[u8]) -> Option<&[u8]> {
    event
        .split(|&b| b == b'\n' || b == b'\r')
        .find_map(|line| line.strip_prefix(b"event:"))
        .map(|v| v.strip_prefix(b" ").unwrap_or(v))
}

/// An event's data: its `data` lines joined with LF, or `None` when it has none. One data line
/// (the usual case) is returned as a slice of `event`; several are joined into `buf`.
pub(crate) fn event_data<'a>(event: &'a [u8], buf: &'a mut Vec<u8>) -> Option<&'a [u8]> {
    let mut lines = data_lines(event);
    let first = lines.next()?;
    let Some(second) = lines.next() else {
        return Some(first);
    };
    buf.clear();
    buf.extend_from_slice(first);
    buf.push(b'\n');
    buf.extend_from_slice(second);
    for line in lines {
        buf.push(b'\n');
        buf.extend_from_slice(line);
    }
    Some(buf)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
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

    fn split_whole(input: &[u8]) -> Vec<Vec<u8>> {
        let mut s = SseSplitter::new();
        let mut out = Vec::new();
        s.feed(input, |e| out.push(e.to_vec()));
        out
    }

    fn split_chunks(s: &mut SseSplitter, chunks: &[&[u8]]) -> Vec<Vec<u8>> {
        let mut out = Vec::new();
        for c in chunks {
            s.feed(c, |e| out.push(e.to_vec()));
        }
        out
    }

    fn strs(events: &[Vec<u8>]) -> Vec<&str> {
        events
            .iter()
            .map(|e| std::str::from_utf8(e).unwrap())
            .collect()
    }

    /// Same events for the whole input, every two-way split and byte-by-byte feeding.
    fn assert_split_invariant(input: &[u8]) -> Vec<Vec<u8>> {
        let whole = split_whole(input);
        for cut in 0..=input.len() {
            let mut s = SseSplitter::new();
            let got = split_chunks(&mut s, &[&input[..cut], &input[cut..]]);
            assert_eq!(got, whole, "split at {cut}");
        }
        let mut s = SseSplitter::new();
        let bytes: Vec<&[u8]> = input.chunks(1).collect();
        assert_eq!(split_chunks(&mut s, &bytes), whole, "byte by byte");
        whole
    }

    #[test]
    fn lf_events() {
        let input = b"data: a\n\ndata: b\nid: 2\n\n: comment\n\n";
        let events = assert_split_invariant(input);
        assert_eq!(strs(&events), ["data: a", "data: b\nid: 2", ": comment"]);
    }

    #[test]
    fn every_line_ending() {
        for (input, want) in [
            (
                &b"data: a\r\n\r\ndata: b\r\n\r\n"[..],
                &["data: a", "data: b"][..],
            ),
            (b"data: a\r\rdata: b\r\r", &["data: a", "data: b"]),
            (b"data: a\r\n\ndata: b\n\r\n", &["data: a", "data: b"]),
            (b"data: a\n\rdata: b\r\n\r", &["data: a", "data: b"]),
            (b"data: a\r\nid: 1\rx\n\n", &["data: a\r\nid: 1\rx"]),
            // Blank lines between events (and before the first) give no events.
            (
                b"\r\n\n\r\rdata: a\n\n\n\n\r\n\rdata: b\n\n",
                &["data: a", "data: b"],
            ),
        ] {
            let events = assert_split_invariant(input);
            assert_eq!(strs(&events), want, "{:?}", String::from_utf8_lossy(input));
        }
    }

    #[test]
    fn cr_then_lf_in_the_next_read_is_one_line_ending() {
        let mut s = SseSplitter::new();
        let got = split_chunks(&mut s, &[b"data: a\r", b"\ndata: b\r", b"\n\r", b"\n"]);
        assert_eq!(strs(&got), ["data: a\r\ndata: b"]);
        assert!(!s.has_partial());
        assert_eq!(s.pending_len(), 0);
    }

    #[test]
    fn whole_events_are_not_copied() {
        let input = b"data: a\n\ndata: b\n\ndata: c";
        let mut s = SseSplitter::new();
        let mut ptrs = Vec::new();
        s.feed(input, |e| {
            ptrs.push(e.as_ptr() as usize - input.as_ptr() as usize)
        });
        assert_eq!(ptrs, [0, 9]);
        assert_eq!(s.pending_len(), 7);
        assert!(s.has_partial());
    }

    #[test]
    fn unterminated_event_is_not_passed_on() {
        let mut s = SseSplitter::new();
        assert!(split_chunks(&mut s, &[b"data: a\n"]).is_empty());
        assert!(s.has_partial());
        s.reset();
        assert!(!s.has_partial());
        assert_eq!(strs(&split_chunks(&mut s, &[b"data: b\n\n"])), ["data: b"]);
    }

    #[test]
    fn oversized_events_are_skipped_and_counted() {
        let max = 1000;
        let mut big = b"data: ".to_vec();
        big.extend(std::iter::repeat_n(b'x', 5000));
        let mut input = b"data: before\n\n".to_vec();
        input.extend_from_slice(&big);
        input.extend_from_slice(b"\n\ndata: after\n\n");

        // Whole, in small reads, and split everywhere: the same events and the same count.
        let mut whole = SseSplitter::with_max_event(max);
        let mut events = Vec::new();
        whole.feed(&input, |e| events.push(e.to_vec()));
        assert_eq!(strs(&events), ["data: before", "data: after"]);
        assert_eq!(whole.oversized_events(), 1);
        for size in [1, 7, 64, 999, 1000, 1001, 4096] {
            let mut s = SseSplitter::with_max_event(max);
            let mut got = Vec::new();
            for c in input.chunks(size) {
                s.feed(c, |e| got.push(e.to_vec()));
                assert!(s.pending_len() <= max + 2, "{}", s.pending_len());
            }
            assert_eq!(got, events, "reads of {size}");
            assert_eq!(s.oversized_events(), 1);
            assert!(s.pending.capacity() <= 2 * max + 2);
        }

        // An event of exactly the limit passes, in any framing.
        let mut exact = b"data: ".to_vec();
        exact.extend(std::iter::repeat_n(b'y', max - 6));
        exact.extend_from_slice(b"\r\n\r\n");
        for size in [1, 3, max - 1, max, max + 1, max + 3] {
            let mut s = SseSplitter::with_max_event(max);
            let mut got = Vec::new();
            for c in exact.chunks(size) {
                s.feed(c, |e| got.push(e.len()));
            }
            assert_eq!(got, [max], "reads of {size}");
            assert_eq!(s.oversized_events(), 0);
        }
    }

    #[test]
    fn endless_event_stays_bounded() {
        let mut s = SseSplitter::new();
        let chunk = vec![b'x'; 64 * 1024];
        for _ in 0..64 {
            s.feed(&chunk, |_| panic!("no event"));
            assert!(s.pending_len() <= DEFAULT_MAX_EVENT);
        }
        assert_eq!(s.oversized_events(), 1);
        let mut got = Vec::new();
        s.feed(b"\n\ndata: ok\n\n", |e| got.push(e.to_vec()));
        assert_eq!(strs(&got), ["data: ok"]);
        assert_eq!(s.oversized_events(), 1);
    }

    /// The SSE specification's line reading, one byte at a time: each event as its lines.
    fn reference(input: &[u8]) -> Vec<Vec<Vec<u8>>> {
        let (mut events, mut lines, mut line) = (Vec::new(), Vec::new(), Vec::new());
        let mut i = 0;
        while i < input.len() {
            match input[i] {
                b'\r' | b'\n' => {
                    if input[i] == b'\r' && input.get(i + 1) == Some(&b'\n') {
                        i += 1;
                    }
                    if line.is_empty() {
                        if !lines.is_empty() {
                            events.push(std::mem::take(&mut lines));
                        }
                    } else {
                        lines.push(std::mem::take(&mut line));
                    }
                }
                b => line.push(b),
            }
            i += 1;
        }
        events
    }

    fn lines_of(event: &[u8]) -> Vec<Vec<u8>> {
        let mut out = Vec::new();
        let mut rest = event;
        loop {
            match memchr2(b'\n', b'\r', rest) {
                Some(i) => {
                    out.push(rest[..i].to_vec());
                    let skip = if rest[i] == b'\r' && rest.get(i + 1) == Some(&b'\n') {
                        2
                    } else {
                        1
                    };
                    rest = &rest[i + skip..];
                }
                None => {
                    out.push(rest.to_vec());
                    return out;
                }
            }
        }
    }

    #[test]
    fn matches_the_specification_on_random_input() {
        let mut x = 0x2545_f491_4f6c_dd1du64;
        let mut next = move || {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x
        };
        for _ in 0..2000 {
            let len = (next() % 200) as usize;
            let input: Vec<u8> = (0..len)
                .map(|_| b"ab\r\n:"[(next() % 5) as usize])
                .collect();
            let want = reference(&input);
            let mut s = SseSplitter::new();
            let mut got = Vec::new();
            let mut rest = &input[..];
            while !rest.is_empty() {
                let n = ((next() % 8) as usize + 1).min(rest.len());
                s.feed(&rest[..n], |e| got.push(lines_of(e)));
                rest = &rest[n..];
            }
            assert_eq!(got, want, "{:?}", String::from_utf8_lossy(&input));
        }
    }

    #[test]
    fn data_fields() {
        let lines = |e: &'static [u8]| -> Vec<&'static str> {
            data_lines(e)
                .map(|l| std::str::from_utf8(l).unwrap())
                .collect()
        };
        assert_eq!(lines(b"data: a"), ["a"]);
        assert_eq!(lines(b"data:a"), ["a"]);
        assert_eq!(lines(b"data:  a "), [" a "]);
        assert_eq!(lines(b"data"), [""]);
        assert_eq!(lines(b"data:"), [""]);
        assert_eq!(
            lines(b": c\r\nevent: x\rid: 1\nretry: 5\ndata: a\r\ndata:b\ndatax: no\ndata : no\rdata: c"),
            ["a", "b", "c"]
        );
        assert!(lines(b"event: ping\n:keepalive").is_empty());

        let mut buf = Vec::new();
        let single = b"event: e\ndata: {\"a\":1}";
        let d = event_data(single, &mut buf).unwrap();
        assert_eq!(d, b"{\"a\":1}");
        assert!(std::ptr::eq(d.as_ptr(), single[15..].as_ptr()));
        assert_eq!(
            event_data(b"data: {\"a\":\r\ndata: 1}\ndata:", &mut buf).unwrap(),
            b"{\"a\":\n1}\n"
        );
        assert_eq!(event_data(b": only a comment", &mut buf), None);
    }
}

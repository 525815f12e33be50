//! SSE: a response body read as a browser's EventSource would.

use std::time::{Duration, Instant};

use crate::client::{Conn, Piece, Response};
use serde_json::Value;

/// One server-sent event.
#[derive(Clone, Debug)]
pub struct SseEvent {
    /// When the blank line ending the event arrived.
    pub at: Instant,
    pub event: Option<String>,
    /// `data:` lines joined with `\n`.
    pub data: String,
    /// Comment lines (`: ...`), without the colon.
    pub comments: Vec<String>,
}

impl SseEvent {
    pub fn is_done(&self) -> bool {
        self.data == "[DONE]"
    }

    /// The data as JSON, if it is JSON.
    pub fn json(&self) -> Option<Value> {
        serde_json::from_str(&self.data).ok()
    }

    /// Whether the data is an OpenAI-shaped error object.
    pub fn is_error(&self) -> bool {
        self.json().is_some_and(|v| v.get("error").is_some())
    }

    /// Non-empty `choices[0].delta.content` (chat), `choices[0].text` (completions) or `delta`
    /// of a `response.output_text.delta` event, if present.
    pub fn content(&self) -> Option<String> {
        let v = self.json()?;
        let text = match v.get("choices").and_then(|c| c.get(0)) {
            Some(c) => c
                .get("delta")
                .and_then(|d| d.get("content"))
                .or_else(|| c.get("text"))
                .and_then(Value::as_str),
            None if v.get("type").and_then(Value::as_str) == Some("response.output_text.delta") => {
                v.get("delta").and_then(Value::as_str)
            }
            None => None,
        }?;
        (!text.is_empty()).then(|| text.to_string())
    }
}

/// Parse SSE events from timestamped body pieces. Lines end in LF, CRLF or CR; an event ends
/// at a blank line, and is stamped with the arrival of the piece holding that blank line. An
/// unterminated trailing event is dropped.
pub fn parse_sse(pieces: &[Piece]) -> Vec<SseEvent> {
    let mut events = Vec::new();
    let mut line: Vec<u8> = Vec::new();
    let mut cur = SseEvent {
        at: Instant::now(),
        event: None,
        data: String::new(),
        comments: Vec::new(),
    };
    let mut has_fields = false;
    let mut data_lines: Vec<String> = Vec::new();
    let mut prev_cr = false;
    for piece in pieces {
        for &b in &piece.data {
            if prev_cr && b == b'\n' {
                prev_cr = false;
                continue;
            }
            prev_cr = b == b'\r';
            if b != b'\n' && b != b'\r' {
                line.push(b);
                continue;
            }
            // End of a line.
            if line.is_empty() {
                if has_fields {
                    cur.data = data_lines.join("\n");
                    cur.at = piece.at;
                    events.push(cur.clone());
                }
                cur = SseEvent {
                    at: piece.at,
                    event: None,
                    data: String::new(),
                    comments: Vec::new(),
                };
                data_lines.clear();
                has_fields = false;
                continue;
            }
            let l = String::from_utf8_lossy(&line).into_owned();
            line.clear();
            has_fields = true;
            if let Some(c) = l.strip_prefix(':') {
                cur.comments.push(c.trim_start().to_string());
                continue;
            }
            let (field, value) = match l.split_once(':') {
                Some((f, v)) => (f.to_string(), v.strip_prefix(' ').unwrap_or(v).to_string()),
                None => (l.clone(), String::new()),
            };
            match field.as_str() {
                "data" => data_lines.push(value),
                "event" => cur.event = Some(value),
                _ => {}
            }
        }
    }
    events
}

/// A response's body read as events.
impl Response {
    /// Server-sent events in the body, each stamped with the arrival of its last byte.
    pub fn sse_events(&self) -> Vec<SseEvent> {
        parse_sse(&self.pieces)
    }
}

/// A stream read until enough events arrived.
impl Conn {
    /// Read a streamed response's body (after its head) until `n` SSE events with content have
    /// arrived, within 5 s; panics if the stream ends or stalls first. The bytes are kept
    /// (still chunk-framed, which does not hide the SSE lines from the parser).
    pub fn read_until_content_events(&mut self, n: usize) {
        let deadline = Instant::now() + Duration::from_secs(5);
        loop {
            let piece = Piece {
                at: Instant::now(),
                data: self.buffered().to_vec(),
            };
            let seen = parse_sse(&[piece])
                .iter()
                .filter(|e| e.content().is_some())
                .count();
            if seen >= n {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "{n} content events did not arrive"
            );
            assert!(
                self.read_more().expect("read stream") > 0,
                "stream ended early"
            );
        }
    }
}

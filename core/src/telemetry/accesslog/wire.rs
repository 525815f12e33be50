//! The access record's protobuf encoding, written out by hand for the request path; and its
//! JSON form, for `sluice logs`.
//!
//! **When it runs.** Once per logged request, from [`AccessLog::record_view`](super::AccessLog::record_view)
//! (and from [`AccessLog::record`](super::AccessLog::record), which borrows its record as a view).
//!
//! **What it takes and returns.** A [`RecordView`]: every field of
//! [`AccessRecord`](super::AccessRecord), borrowed from wherever the value already lives. It
//! appends the record length-delimited (a varint length, then the message) to a batch, byte for
//! byte what prost's `AccessRecord::encode_length_delimited` writes for the same values: fields
//! in number order, proto3 defaults (0, "", false) left out, every element of `tags` written.
//! Its `Serialize` writes the same fields as JSON. Raises nothing.
//!
//! **Why not prost's encoder.** prost encodes an owned `AccessRecord`, so each string had first
//! to be copied into one, and it walks the message twice (`encoded_len`, then `encode`), pushing
//! every byte through `BufMut`'s capacity check: `observe::emit` cost 3,683 instructions a
//! request in the AI pipeline with it, 2,539 with this (perf/history/RESULTS-diary-2026-12.md, tenth session). The
//! schema, the generated type and every reader stay prost's;
//! `the_hand_encoder_writes_what_prost_writes` holds this file to prost's bytes for every
//! field, and [`RecordView::of`] names every field of the generated struct, so a field added to
//! `accesslog.proto` does not compile until it is encoded here.

use serde::{Serialize, Serializer};

use super::{AccessRecord, UsageSource};

/// One access record, its fields borrowed. The meaning of each is in `proto/accesslog.proto`.
///
/// Its `Serialize` is the record's JSON form (`sluice logs`): the fields in proto order under
/// their proto names, the enum as its value name (its number when this build does not know
/// it), 64-bit integers as exact numbers, a non-finite `cost` as `null`.
#[derive(Debug, Clone, Copy, Default, Serialize)]
pub(crate) struct RecordView<'a> {
    pub(crate) time_unix_us: u64,
    pub(crate) client_addr: &'a str,
    pub(crate) method: &'a str,
    pub(crate) path: &'a str,
    pub(crate) status: u32,
    pub(crate) key_id: &'a str,
    pub(crate) entity: &'a str,
    pub(crate) tags: &'a [String],
    pub(crate) requested_model: &'a str,
    pub(crate) mapped_model: &'a str,
    pub(crate) cluster: &'a str,
    pub(crate) backend: &'a str,
    pub(crate) stream: bool,
    pub(crate) prompt_tokens: u64,
    pub(crate) completion_tokens: u64,
    pub(crate) cached_tokens: u64,
    pub(crate) total_tokens: u64,
    /// A [`UsageSource`] as its number.
    #[serde(serialize_with = "usage_source_name")]
    pub(crate) usage_source: i32,
    pub(crate) cost: f64,
    pub(crate) ttft_us: u64,
    pub(crate) tpot_us: u64,
    pub(crate) latency_us: u64,
    pub(crate) upstream_connect_us: u64,
    pub(crate) upstream_header_us: u64,
    pub(crate) overhead_us: u64,
    pub(crate) bytes_in: u64,
    pub(crate) bytes_out: u64,
    pub(crate) rejected_policy: &'a str,
    pub(crate) rejected_dimension: &'a str,
    pub(crate) auth_rejection_reason: &'a str,
    pub(crate) error_class: &'a str,
    pub(crate) fallback_attempts: u32,
    pub(crate) sticky_id_hash: u64,
    pub(crate) worker_id: u32,
    pub(crate) fallback_reason: &'a str,
    pub(crate) cache_write_tokens: u64,
    pub(crate) queued_us: u64,
    pub(crate) priority_class: &'a str,
    pub(crate) queue_outcome: &'a str,
}

/// The enum's proto name, or its number when this build does not know it.
fn usage_source_name<S: Serializer>(value: &i32, s: S) -> Result<S::Ok, S::Error> {
    match UsageSource::try_from(*value) {
        Ok(known) => s.serialize_str(known.as_str_name()),
        Err(_) => s.serialize_i32(*value),
    }
}

/// The schema's fields, and the most bytes one takes besides a string's own: a two-byte key
/// and a ten-byte varint (or a string's length).
const FIELDS: usize = 39;
const FIELD: usize = 12;

/// The room [`RecordView::encode_length_delimited`] makes in the batch beyond the strings' and
/// tags' bytes: the length prefix held, and every field at its longest.
pub(super) const ROOM_BESIDES_STRINGS: usize = 2 + FIELDS * FIELD;

/// Protobuf wire types.
const VARINT: u32 = 0;
const FIXED64: u32 = 1;
const LEN: u32 = 2;

impl<'a> RecordView<'a> {
    /// `rec`'s fields, borrowed. Destructures without `..`: a new field in the schema is a
    /// compile error here until the encoder writes it.
    pub(crate) fn of(rec: &'a AccessRecord) -> RecordView<'a> {
        let AccessRecord {
            time_unix_us,
            client_addr,
            method,
            path,
            status,
            key_id,
            entity,
            tags,
            requested_model,
            mapped_model,
            cluster,
            backend,
            stream,
            prompt_tokens,
            completion_tokens,
            cached_tokens,
            total_tokens,
            usage_source,
            cost,
            ttft_us,
            tpot_us,
            latency_us,
            upstream_connect_us,
            upstream_header_us,
            overhead_us,
            bytes_in,
            bytes_out,
            rejected_policy,
            rejected_dimension,
            auth_rejection_reason,
            error_class,
            fallback_attempts,
            sticky_id_hash,
            worker_id,
            fallback_reason,
            cache_write_tokens,
            queued_us,
            priority_class,
            queue_outcome,
        } = rec;
        RecordView {
            time_unix_us: *time_unix_us,
            client_addr,
            method,
            path,
            status: *status,
            key_id,
            entity,
            tags,
            requested_model,
            mapped_model,
            cluster,
            backend,
            stream: *stream,
            prompt_tokens: *prompt_tokens,
            completion_tokens: *completion_tokens,
            cached_tokens: *cached_tokens,
            total_tokens: *total_tokens,
            usage_source: *usage_source,
            cost: *cost,
            ttft_us: *ttft_us,
            tpot_us: *tpot_us,
            latency_us: *latency_us,
            upstream_connect_us: *upstream_connect_us,
            upstream_header_us: *upstream_header_us,
            overhead_us: *overhead_us,
            bytes_in: *bytes_in,
            bytes_out: *bytes_out,
            rejected_policy,
            rejected_dimension,
            auth_rejection_reason,
            error_class,
            fallback_attempts: *fallback_attempts,
            sticky_id_hash: *sticky_id_hash,
            worker_id: *worker_id,
            fallback_reason,
            cache_write_tokens: *cache_write_tokens,
            queued_us: *queued_us,
            priority_class,
            queue_outcome,
        }
    }

    /// Appends the record to `out`: its length as a varint, then the message. Returns false,
    /// leaving `out` as it was, if the message outgrew the room made for it, which
    /// [`longest_message`](Self::longest_message) rules out: a record cut short would make the
    /// rest of its file unreadable.
    pub(crate) fn encode_length_delimited(&self, out: &mut Vec<u8>) -> bool {
        // The message is written once, into room made for the longest it could be, behind two
        // bytes held for its length: that fits nearly every record (128 to 16,383 bytes), and
        // the rare record of another size moves its bytes to fit its prefix.
        let start = out.len();
        let room = self.longest_message();
        out.resize(start + 2 + room, 0);
        let mut w = Cursor {
            buf: out.get_mut(start + 2..).unwrap_or_default(),
            at: 0,
        };
        self.encode_message(&mut w);
        let len = w.at;
        if len > room {
            debug_assert!(false, "longest_message is not a bound");
            out.truncate(start);
            return false;
        }
        out.truncate(start + 2 + len);
        let mut prefix = [0u8; 10];
        let mut p = Cursor {
            buf: &mut prefix,
            at: 0,
        };
        p.varint(len as u64);
        let n = p.at;
        let prefix = prefix.get(..n).unwrap_or_default();
        match n {
            2 => {
                if let Some(held) = out.get_mut(start..start + 2) {
                    held.copy_from_slice(prefix);
                }
            }
            1 => {
                out.copy_within(start + 2.., start + 1);
                out.truncate(out.len() - 1);
                if let Some(held) = out.get_mut(start) {
                    *held = len as u8;
                }
            }
            _ => {
                out.splice(start..start + 2, prefix.iter().copied());
            }
        }
        true
    }

    /// At least the message's encoded length: every field at its longest (a two-byte key and a
    /// ten-byte varint or length), the strings' bytes, and each tag as a field of its own.
    fn longest_message(&self) -> usize {
        let strings = [
            self.client_addr,
            self.method,
            self.path,
            self.key_id,
            self.entity,
            self.requested_model,
            self.mapped_model,
            self.cluster,
            self.backend,
            self.rejected_policy,
            self.rejected_dimension,
            self.auth_rejection_reason,
            self.error_class,
            self.fallback_reason,
            self.priority_class,
            self.queue_outcome,
        ];
        let tags: usize = self.tags.iter().map(|t| FIELD + t.len()).sum();
        FIELDS * FIELD + tags + strings.iter().map(|s| s.len()).sum::<usize>()
    }

    /// The message's fields, in number order, as prost writes them.
    fn encode_message(&self, w: &mut Cursor<'_>) {
        w.uint(1, self.time_unix_us);
        w.string(2, self.client_addr);
        w.string(3, self.method);
        w.string(4, self.path);
        w.uint(5, u64::from(self.status));
        w.string(6, self.key_id);
        w.string(7, self.entity);
        for tag in self.tags {
            // Repeated: every element, the empty ones too.
            w.key(8, LEN);
            w.varint(tag.len() as u64);
            w.bytes(tag.as_bytes());
        }
        w.string(9, self.requested_model);
        w.string(10, self.mapped_model);
        w.string(11, self.cluster);
        w.string(12, self.backend);
        w.uint(13, u64::from(self.stream));
        w.uint(14, self.prompt_tokens);
        w.uint(15, self.completion_tokens);
        w.uint(16, self.cached_tokens);
        w.uint(17, self.total_tokens);
        // An enum is an int32: a negative one is sign-extended to ten bytes.
        w.uint(18, self.usage_source as i64 as u64);
        // prost leaves out a double that compares equal to 0 (-0.0 too) and writes a NaN.
        if self.cost != 0.0 {
            w.key(19, FIXED64);
            w.bytes(&self.cost.to_bits().to_le_bytes());
        }
        w.uint(20, self.ttft_us);
        w.uint(21, self.tpot_us);
        w.uint(22, self.latency_us);
        w.uint(23, self.upstream_connect_us);
        w.uint(24, self.upstream_header_us);
        w.uint(25, self.overhead_us);
        w.uint(26, self.bytes_in);
        w.uint(27, self.bytes_out);
        w.string(28, self.rejected_policy);
        w.string(29, self.rejected_dimension);
        w.string(30, self.auth_rejection_reason);
        w.string(31, self.error_class);
        w.uint(32, u64::from(self.fallback_attempts));
        if self.sticky_id_hash != 0 {
            w.key(33, FIXED64);
            w.bytes(&self.sticky_id_hash.to_le_bytes());
        }
        w.uint(34, u64::from(self.worker_id));
        w.string(35, self.fallback_reason);
        w.uint(36, self.cache_write_tokens);
        w.uint(37, self.queued_us);
        w.string(38, self.priority_class);
        w.string(39, self.queue_outcome);
    }
}

/// Where the message is written: room already made, and how much of it is used. A local slice
/// and index, not pushes to the `Vec`: each byte stored through the `Vec` made the compiler
/// reload its length and capacity, which cost more than the bytes.
struct Cursor<'b> {
    buf: &'b mut [u8],
    at: usize,
}

impl Cursor<'_> {
    /// A varint field, left out when 0.
    #[inline(always)]
    fn uint(&mut self, field: u32, value: u64) {
        if value != 0 {
            self.key(field, VARINT);
            self.varint(value);
        }
    }

    /// A string field, left out when empty.
    #[inline(always)]
    fn string(&mut self, field: u32, value: &str) {
        if !value.is_empty() {
            self.key(field, LEN);
            self.varint(value.len() as u64);
            self.bytes(value.as_bytes());
        }
    }

    /// A field's key; with the field a constant, one or two constant bytes.
    #[inline(always)]
    fn key(&mut self, field: u32, wire_type: u32) {
        self.varint(u64::from(field << 3 | wire_type));
    }

    #[inline(always)]
    fn varint(&mut self, mut value: u64) {
        while value >= 0x80 {
            self.byte(value as u8 | 0x80);
            value >>= 7;
        }
        self.byte(value as u8);
    }

    // The room is made for the longest message, so the writes below always land; were it ever
    // short, a byte is skipped rather than a worker panicking, and `at` still counts it, which
    // is how `encode_length_delimited` sees the record outgrew its room and drops it.
    #[inline(always)]
    fn byte(&mut self, b: u8) {
        if let Some(slot) = self.buf.get_mut(self.at) {
            *slot = b;
        }
        self.at += 1;
    }

    #[inline(always)]
    fn bytes(&mut self, b: &[u8]) {
        if let Some(room) = self.buf.get_mut(self.at..self.at + b.len()) {
            room.copy_from_slice(b);
        }
        self.at += b.len();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use prost::Message;

    /// A deterministic stream of test values (xorshift), so a failure names its case.
    struct Values(u64);

    impl Values {
        fn next(&mut self) -> u64 {
            self.0 ^= self.0 << 13;
            self.0 ^= self.0 >> 7;
            self.0 ^= self.0 << 17;
            self.0
        }

        /// 0 often (left out), else numbers of every varint length.
        fn number(&mut self) -> u64 {
            match self.next() % 6 {
                0..=2 => 0,
                3 => self.next() % 128,
                4 => self.next() >> (self.next() % 64),
                _ => u64::MAX >> (self.next() % 8),
            }
        }

        /// Mostly empty or short; now and then long enough for a two- or three-byte length.
        fn text(&mut self) -> String {
            let len = match self.next() % 64 {
                0..=39 => 0,
                40..=59 => (self.next() % 20) as usize,
                60..=62 => 100 + (self.next() % 60) as usize,
                _ => (self.next() % 20_000) as usize,
            };
            (0..len)
                .map(|i| match (self.next() + i as u64) % 5 {
                    0 => 'é',
                    1 => '\u{1F600}',
                    _ => (b'a' + (self.next() % 26) as u8) as char,
                })
                .collect()
        }

        fn record(&mut self) -> AccessRecord {
            AccessRecord {
                time_unix_us: self.number(),
                client_addr: self.text(),
                method: self.text(),
                path: self.text(),
                status: self.number() as u32,
                key_id: self.text(),
                entity: self.text(),
                tags: (0..self.next() % 4).map(|_| self.text()).collect(),
                requested_model: self.text(),
                mapped_model: self.text(),
                cluster: self.text(),
                backend: self.text(),
                stream: self.next() % 2 == 1,
                prompt_tokens: self.number(),
                completion_tokens: self.number(),
                cached_tokens: self.number(),
                total_tokens: self.number(),
                usage_source: match self.next() % 5 {
                    0 => -1,
                    1 => i32::MIN,
                    n => n as i32 - 2,
                },
                cost: match self.next() % 5 {
                    0 => 0.0,
                    1 => -0.0,
                    2 => f64::NAN,
                    _ => self.next() as f64 / 1e12,
                },
                ttft_us: self.number(),
                tpot_us: self.number(),
                latency_us: self.number(),
                upstream_connect_us: self.number(),
                upstream_header_us: self.number(),
                overhead_us: self.number(),
                bytes_in: self.number(),
                bytes_out: self.number(),
                rejected_policy: self.text(),
                rejected_dimension: self.text(),
                auth_rejection_reason: self.text(),
                error_class: self.text(),
                fallback_attempts: self.number() as u32,
                sticky_id_hash: self.number(),
                worker_id: self.number() as u32,
                fallback_reason: self.text(),
                cache_write_tokens: self.number(),
                queued_us: self.number(),
                priority_class: self.text(),
                queue_outcome: self.text(),
            }
        }
    }

    #[test]
    fn the_hand_encoder_writes_what_prost_writes() {
        let mut values = Values(0x9e37_79b9_7f4a_7c15);
        let mut ours = Vec::new();
        let mut theirs = Vec::new();
        let mut lengths = std::collections::BTreeSet::new();
        for case in 0..3_000 {
            let rec = values.record();
            // Appended behind earlier records, as in a batch.
            assert!(RecordView::of(&rec).encode_length_delimited(&mut ours));
            rec.encode_length_delimited(&mut theirs).unwrap();
            assert_eq!(ours, theirs, "case {case}: {rec:?}");
            lengths.insert(prost::encoding::encoded_len_varint(rec.encoded_len() as u64));
        }
        // Every branch of the length prefix ran: 1, 2 and 3 bytes.
        assert_eq!(lengths.into_iter().collect::<Vec<_>>(), vec![1, 2, 3]);
    }

    /// Messages of 127, 128, 16,383 and 16,384 bytes: each side of the one- and two-byte length
    /// prefixes. A path alone of `n` bytes is a message of 1 + (its length's varint) + `n`.
    #[test]
    fn the_length_prefix_is_right_at_its_edges() {
        for (path_len, message_len, prefix_len) in [
            (125, 127, 1),
            (126, 128, 2),
            (16_380, 16_383, 2),
            (16_381, 16_384, 3),
        ] {
            let rec = AccessRecord {
                path: "p".repeat(path_len),
                ..AccessRecord::default()
            };
            assert_eq!(rec.encoded_len(), message_len);
            let mut ours = vec![9];
            assert!(RecordView::of(&rec).encode_length_delimited(&mut ours));
            assert_eq!(ours.len(), 1 + prefix_len + message_len);
            let mut theirs = vec![9];
            rec.encode_length_delimited(&mut theirs).unwrap();
            assert_eq!(ours, theirs, "{message_len}-byte message");
        }
    }

    #[test]
    fn an_empty_record_is_one_zero_byte() {
        let mut out = vec![7];
        assert!(RecordView::default().encode_length_delimited(&mut out));
        assert_eq!(out, [7, 0]);
        let rec = AccessRecord::decode_length_delimited(&out[1..]).unwrap();
        assert_eq!(rec, AccessRecord::default());
    }

    #[test]
    fn every_field_reads_back() {
        let mut values = Values(42);
        for _ in 0..200 {
            let rec = values.record();
            let mut out = Vec::new();
            assert!(RecordView::of(&rec).encode_length_delimited(&mut out));
            let back = AccessRecord::decode_length_delimited(out.as_slice()).unwrap();
            // NaN is not equal to itself: compare its bits; -0.0 is left out, as prost does, and
            // reads back as 0.0.
            let cost = if rec.cost == 0.0 { 0.0 } else { rec.cost };
            assert_eq!(back.cost.to_bits(), cost.to_bits());
            assert_eq!(
                AccessRecord { cost: 0.0, ..back },
                AccessRecord { cost: 0.0, ..rec }
            );
        }
    }
}

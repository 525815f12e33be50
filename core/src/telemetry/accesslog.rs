//! Access log: one protobuf [`AccessRecord`] per request, written to disk off the worker thread.
//!
//! **When it runs.** After a request settles, the worker calls `AccessLog::record_view` (the
//! gateway's records, fields borrowed; [`AccessLog::record`] takes an owned one); a worker
//! timer calls [`AccessLog::flush_if_due`] every [`AccessLogConfig::flush_interval`]. Reading a
//! log back ([`dump`], [`JsonDecoder`]) is for the `sluice logs` command, never the gateway.
//!
//! **What it takes and returns.** Either takes a record and returns nothing: it encodes the
//! record length-delimited (varint length, then the message) into an in-memory batch
//! and, once the batch reaches [`AccessLogConfig::batch_bytes`] or the flush interval has passed,
//! hands the batch to this worker's writer thread with a non-blocking `try_send` on a bounded
//! channel ([`AccessLogConfig::queue_batches`] batches deep). The worker thread never blocks and
//! never touches a file.
//!
//! **Errors.** None reach the request path. When the queue is full (the disk cannot keep up) the
//! batch is dropped and counted ([`AccessLog::dropped_records`]); when the writer fails to write
//! (disk full, permissions) it drops that part of the batch, counts it and starts a new file on
//! the next batch. Only [`AccessLog::open`] returns an error — at startup, when the directory or
//! the first file cannot be created or the writer thread cannot be spawned.
//!
//! **Files.** The writer appends whole records to `DIR/access-w{worker}-{unix_us}.pb`, where
//! `unix_us` is the file's opening time in microseconds since the Unix epoch (16 digits, so name
//! order is time order; bumped by 1 µs if a name is taken). It starts a new file before a record
//! would take the current one past [`AccessLogConfig::max_file_bytes`] (a single record larger
//! than that gets a file of its own) and before writing to a file older than
//! [`AccessLogConfig::max_file_age`]. A record is never split across files, and a failed write is
//! cut back to the last whole record. A file is only ever appended to, and once its successor
//! exists it is complete.

// Sleeps here run on the log writer thread and in `sluice logs --follow`, never on a worker.
#![allow(clippy::disallowed_methods)]

use std::fs::{File, OpenOptions};
use std::io::{self, Read, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{self, Receiver, SyncSender, TrySendError};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use prost::Message;

pub use sluice_proto::{AccessRecord, UsageSource};

mod wire;
pub(crate) use wire::RecordView;

/// Where and how the access log is written. A plain struct: the config layer fills it in.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AccessLogConfig {
    /// Directory for the `.pb` files; created if missing.
    pub dir: PathBuf,
    /// Start a new file before one would grow past this many bytes.
    pub max_file_bytes: u64,
    /// Start a new file before writing to one opened longer ago than this.
    pub max_file_age: Duration,
    /// Hand the in-memory batch to the writer once it holds this many bytes.
    pub batch_bytes: usize,
    /// Batches that may wait for the writer; when they are all taken, new batches are dropped.
    /// At least 1.
    pub queue_batches: usize,
    /// A non-empty batch older than this is handed over by [`AccessLog::flush_if_due`].
    pub flush_interval: Duration,
}

impl AccessLogConfig {
    /// Default [`max_file_bytes`](Self::max_file_bytes): 256 MiB.
    pub const DEFAULT_MAX_FILE_BYTES: u64 = 256 << 20;
    /// Default [`max_file_age`](Self::max_file_age): one hour.
    pub const DEFAULT_MAX_FILE_AGE: Duration = Duration::from_secs(3600);
    /// Default [`batch_bytes`](Self::batch_bytes): 64 KiB.
    pub const DEFAULT_BATCH_BYTES: usize = 64 << 10;
    /// Default [`queue_batches`](Self::queue_batches): 64 batches (4 MiB at the default size).
    pub const DEFAULT_QUEUE_BATCHES: usize = 64;
    /// Default [`flush_interval`](Self::flush_interval): 200 ms.
    pub const DEFAULT_FLUSH_INTERVAL: Duration = Duration::from_millis(200);

    /// The defaults, writing into `dir`.
    pub fn new(dir: impl Into<PathBuf>) -> AccessLogConfig {
        AccessLogConfig {
            dir: dir.into(),
            max_file_bytes: Self::DEFAULT_MAX_FILE_BYTES,
            max_file_age: Self::DEFAULT_MAX_FILE_AGE,
            batch_bytes: Self::DEFAULT_BATCH_BYTES,
            queue_batches: Self::DEFAULT_QUEUE_BATCHES,
            flush_interval: Self::DEFAULT_FLUSH_INTERVAL,
        }
    }
}

impl From<&crate::config::AccessLogSettings> for AccessLogConfig {
    /// The `[access_log]` section of the config file, as validated by the config layer.
    fn from(s: &crate::config::AccessLogSettings) -> AccessLogConfig {
        AccessLogConfig {
            dir: s.dir.clone(),
            max_file_bytes: s.max_file_bytes,
            max_file_age: s.max_file_age,
            batch_bytes: s.batch_bytes,
            queue_batches: s.queue_batches,
            flush_interval: s.flush_interval,
        }
    }
}

/// How long dropping / closing an [`AccessLog`] waits for the writer to take the last batch and
/// finish writing before giving up (the rest is then counted as dropped).
pub(crate) const SHUTDOWN_WAIT: Duration = Duration::from_secs(10);

/// Counters of one worker's access log; see [`AccessLog::stats`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct AccessLogStats {
    /// Records passed to [`AccessLog::record`].
    pub records: u64,
    /// Records dropped because the writer's queue was full (or the writer was gone).
    pub dropped_queue_full: u64,
    /// Batches dropped for the same reason.
    pub dropped_batches: u64,
    /// Records the writer dropped because writing them failed.
    pub lost_write_error: u64,
    /// Records written to files.
    pub records_written: u64,
    /// Bytes written to files.
    pub bytes_written: u64,
    /// Files created.
    pub files_opened: u64,
    /// Failed writes / file creations.
    pub write_errors: u64,
}

/// Counters the writer thread updates and the worker reads (single writer, rare reads).
#[derive(Debug, Default)]
struct WriterCounters {
    records_written: AtomicU64,
    bytes_written: AtomicU64,
    files_opened: AtomicU64,
    write_errors: AtomicU64,
    lost_records: AtomicU64,
}

impl WriterCounters {
    fn add(counter: &AtomicU64, n: u64) {
        counter.fetch_add(n, Ordering::Relaxed);
    }
}

/// A batch of whole length-delimited records.
struct Batch {
    bytes: Vec<u8>,
    records: u64,
}

/// One worker's access-log handle. Owned by the worker thread; records are buffered here and
/// written by a dedicated writer thread (named `sluice-log-w{worker}`).
///
/// Dropping it hands the buffered batch to the writer and waits (up to [`SHUTDOWN_WAIT`]) for
/// the writer to finish — do that at shutdown, not on the request path.
pub struct AccessLog {
    buf: Vec<u8>,
    buf_records: u64,
    batch_bytes: usize,
    flush_interval: Duration,
    last_flush: Instant,
    tx: Option<SyncSender<Batch>>,
    recycled: Receiver<Vec<u8>>,
    writer: Option<JoinHandle<()>>,
    counters: Arc<WriterCounters>,
    records: u64,
    dropped_records: u64,
    dropped_batches: u64,
}

impl AccessLog {
    /// Creates `cfg.dir` if needed, creates this worker's first file (so a bad directory fails
    /// at startup, not later) and starts the writer thread. Call at startup.
    pub fn open(cfg: &AccessLogConfig, worker: u32) -> io::Result<AccessLog> {
        std::fs::create_dir_all(&cfg.dir)?;
        let counters = Arc::new(WriterCounters::default());
        let mut writer = Writer {
            dir: cfg.dir.clone(),
            worker,
            max_file_bytes: cfg.max_file_bytes,
            max_file_age: cfg.max_file_age,
            file: None,
            last_name_us: 0,
            counters: Arc::clone(&counters),
        };
        writer.open_file()?;
        let (tx, rx) = mpsc::sync_channel::<Batch>(cfg.queue_batches.max(1));
        let (recycle_tx, recycled) = mpsc::sync_channel::<Vec<u8>>(cfg.queue_batches.max(1));
        let handle = std::thread::Builder::new()
            .name(format!("sluice-log-w{worker}"))
            .spawn(move || writer.run(&rx, &recycle_tx))?;
        Ok(AccessLog::from_parts(
            cfg,
            tx,
            recycled,
            Some(handle),
            counters,
        ))
    }

    fn from_parts(
        cfg: &AccessLogConfig,
        tx: SyncSender<Batch>,
        recycled: Receiver<Vec<u8>>,
        writer: Option<JoinHandle<()>>,
        counters: Arc<WriterCounters>,
    ) -> AccessLog {
        let batch_bytes = cfg.batch_bytes.max(1);
        AccessLog {
            buf: Vec::with_capacity(batch_capacity(batch_bytes)),
            buf_records: 0,
            batch_bytes,
            flush_interval: cfg.flush_interval,
            last_flush: Instant::now(),
            tx: Some(tx),
            recycled,
            writer,
            counters,
            records: 0,
            dropped_records: 0,
            dropped_batches: 0,
        }
    }

    /// Appends `rec` to the batch; hands the batch to the writer once it reaches `batch_bytes`.
    /// Never blocks and never does file I/O.
    pub fn record(&mut self, rec: &AccessRecord) {
        self.record_view(&RecordView::of(rec));
    }

    /// [`record`](Self::record) for a record whose fields are borrowed where they lie: what
    /// the gateway logs each request with, copying no field into an owned record first.
    pub(crate) fn record_view(&mut self, rec: &RecordView<'_>) {
        self.records += 1;
        if !rec.encode_length_delimited(&mut self.buf) {
            // Not reached (the encoder's room is a bound), but never a corrupt file.
            self.dropped_records += 1;
            return;
        }
        self.buf_records += 1;
        if self.buf.len() >= self.batch_bytes {
            self.hand_over(Instant::now());
        }
    }

    /// Hands a non-empty batch to the writer if the last hand-over was at least
    /// `flush_interval` before `now`. Returns whether it handed one over (or dropped it because
    /// the queue was full). Call from a worker timer; never blocks.
    pub fn flush_if_due(&mut self, now: Instant) -> bool {
        if self.buf.is_empty()
            || now.saturating_duration_since(self.last_flush) < self.flush_interval
        {
            return false;
        }
        self.hand_over(now);
        true
    }

    /// Hands the current batch (if any) to the writer now. Never blocks; drops and counts the
    /// batch if the queue is full.
    pub fn flush(&mut self) {
        if !self.buf.is_empty() {
            self.hand_over(Instant::now());
        }
    }

    /// The interval [`flush_if_due`](Self::flush_if_due) uses; run the timer at about this rate.
    pub fn flush_interval(&self) -> Duration {
        self.flush_interval
    }

    /// Bytes waiting in the current, not yet handed over, batch.
    pub fn buffered_bytes(&self) -> usize {
        self.buf.len()
    }

    /// Records that will never reach a file: dropped because the writer's queue was full, plus
    /// those the writer failed to write. See [`stats`](Self::stats) for the split.
    pub fn dropped_records(&self) -> u64 {
        self.dropped_records + self.counters.lost_records.load(Ordering::Relaxed)
    }

    /// All counters of this log.
    pub fn stats(&self) -> AccessLogStats {
        let c = &self.counters;
        AccessLogStats {
            records: self.records,
            dropped_queue_full: self.dropped_records,
            dropped_batches: self.dropped_batches,
            lost_write_error: c.lost_records.load(Ordering::Relaxed),
            records_written: c.records_written.load(Ordering::Relaxed),
            bytes_written: c.bytes_written.load(Ordering::Relaxed),
            files_opened: c.files_opened.load(Ordering::Relaxed),
            write_errors: c.write_errors.load(Ordering::Relaxed),
        }
    }

    /// Flushes the buffered records, waits for the writer to write them and stop (up to
    /// [`SHUTDOWN_WAIT`]), and returns the final counters. Dropping the handle does the same.
    pub fn close(mut self) -> AccessLogStats {
        self.shutdown(SHUTDOWN_WAIT);
        self.stats()
    }

    fn take_batch(&mut self) -> Batch {
        let next = self
            .recycled
            .try_recv()
            .unwrap_or_else(|_| Vec::with_capacity(batch_capacity(self.batch_bytes)));
        let bytes = std::mem::replace(&mut self.buf, next);
        let records = std::mem::take(&mut self.buf_records);
        Batch { bytes, records }
    }

    fn hand_over(&mut self, now: Instant) {
        self.last_flush = now;
        let batch = self.take_batch();
        let rejected = match &self.tx {
            Some(tx) => match tx.try_send(batch) {
                Ok(()) => return,
                Err(TrySendError::Full(b) | TrySendError::Disconnected(b)) => b,
            },
            None => batch,
        };
        self.drop_batch(rejected);
    }

    fn drop_batch(&mut self, mut batch: Batch) {
        self.dropped_records += batch.records;
        self.dropped_batches += 1;
        // Keep the allocation: it becomes the next batch's buffer if ours is still empty.
        if self.buf.is_empty() && batch.bytes.capacity() > self.buf.capacity() {
            batch.bytes.clear();
            self.buf = batch.bytes;
        }
    }

    fn shutdown(&mut self, wait: Duration) {
        let Some(tx) = self.tx.take() else {
            return;
        };
        let deadline = Instant::now() + wait;
        if !self.buf.is_empty() {
            let mut batch = self.take_batch();
            loop {
                match tx.try_send(batch) {
                    Ok(()) => break,
                    Err(TrySendError::Full(b)) if Instant::now() < deadline => {
                        batch = b;
                        std::thread::sleep(Duration::from_millis(1));
                    }
                    Err(TrySendError::Full(b) | TrySendError::Disconnected(b)) => {
                        self.drop_batch(b);
                        break;
                    }
                }
            }
        }
        drop(tx);
        if let Some(handle) = self.writer.take() {
            while !handle.is_finished() && Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(1));
            }
            if handle.is_finished() {
                let _ = handle.join();
            }
            // Otherwise the writer is stuck on the disk: leave it detached rather than hang.
        }
    }
}

/// Capacity to reserve for a batch: its size plus room for the record that crosses it (the
/// encoder makes room for a record's longest encoding before writing it; a record with up to
/// 1 KiB of strings fits), capped so a huge `batch_bytes` does not reserve memory up front.
fn batch_capacity(batch_bytes: usize) -> usize {
    batch_bytes.min(4 << 20) + wire::ROOM_BESIDES_STRINGS + 1024
}

impl Drop for AccessLog {
    fn drop(&mut self) {
        self.shutdown(SHUTDOWN_WAIT);
    }
}

impl std::fmt::Debug for AccessLog {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AccessLog")
            .field("buffered_bytes", &self.buf.len())
            .field("stats", &self.stats())
            .finish()
    }
}

// ---------------------------------------------------------------------------------------------
// The writer thread
// ---------------------------------------------------------------------------------------------

struct OpenFile {
    file: File,
    len: u64,
    opened: Instant,
}

struct Writer {
    dir: PathBuf,
    worker: u32,
    max_file_bytes: u64,
    max_file_age: Duration,
    file: Option<OpenFile>,
    last_name_us: u64,
    counters: Arc<WriterCounters>,
}

impl Writer {
    fn run(mut self, rx: &Receiver<Batch>, recycle: &SyncSender<Vec<u8>>) {
        while let Ok(mut batch) = rx.recv() {
            self.write_batch(&batch.bytes);
            batch.bytes.clear();
            let _ = recycle.try_send(batch.bytes);
        }
        self.close_file();
    }

    /// The path of a new file, `access-w{worker}-{unix_us}.pb`, with a time strictly after the
    /// last one this writer used.
    fn next_name(&mut self) -> PathBuf {
        let now_us = crate::sys::time::unix_us();
        self.last_name_us = now_us.max(self.last_name_us.saturating_add(1));
        self.dir.join(format!(
            "access-w{}-{:016}.pb",
            self.worker, self.last_name_us
        ))
    }

    fn open_file(&mut self) -> io::Result<()> {
        let mut tries = 0;
        loop {
            let path = self.next_name();
            // 0640 (less the umask): records name keys, entities and client addresses, for the
            // operator's group to read, not for every user of the host.
            let mut options = OpenOptions::new();
            options.append(true).create_new(true);
            std::os::unix::fs::OpenOptionsExt::mode(&mut options, 0o640);
            match options.open(&path) {
                Ok(file) => {
                    WriterCounters::add(&self.counters.files_opened, 1);
                    self.file = Some(OpenFile {
                        file,
                        len: 0,
                        opened: Instant::now(),
                    });
                    return Ok(());
                }
                Err(e) if e.kind() == io::ErrorKind::AlreadyExists && tries < 1000 => tries += 1,
                Err(e) => return Err(e),
            }
        }
    }

    fn close_file(&mut self) {
        if let Some(f) = self.file.take() {
            // Completed files are durable; this runs on the writer thread only.
            let _ = f.file.sync_data();
        }
    }

    fn write_batch(&mut self, bytes: &[u8]) {
        let mut rest = bytes;
        while !rest.is_empty() {
            if self
                .file
                .as_ref()
                .is_some_and(|f| f.opened.elapsed() >= self.max_file_age && f.len > 0)
            {
                self.close_file();
            }
            let room = match &self.file {
                Some(f) => self.max_file_bytes.saturating_sub(f.len),
                None => self.max_file_bytes,
            };
            let (mut take, mut records) = split_records(rest, room);
            if take == 0 {
                if self.file.as_ref().is_some_and(|f| f.len > 0) {
                    self.close_file();
                    continue;
                }
                // A record larger than max_file_bytes: a file of its own.
                (take, records) = first_record(rest);
            }
            if self.file.is_none() && self.open_file().is_err() {
                WriterCounters::add(&self.counters.write_errors, 1);
                let (_, lost) = split_records(rest, u64::MAX);
                WriterCounters::add(&self.counters.lost_records, lost);
                return;
            }
            let Some(f) = self.file.as_mut() else {
                return;
            };
            let chunk = &rest[..take];
            match f.file.write_all(chunk) {
                Ok(()) => {
                    f.len += chunk.len() as u64;
                    WriterCounters::add(&self.counters.records_written, records);
                    WriterCounters::add(&self.counters.bytes_written, chunk.len() as u64);
                }
                Err(_) => {
                    WriterCounters::add(&self.counters.write_errors, 1);
                    WriterCounters::add(&self.counters.lost_records, records);
                    // Cut a partial write back to the last whole record, then leave the file.
                    let _ = f.file.set_len(f.len);
                    self.close_file();
                }
            }
            rest = &rest[take..];
        }
    }
}

/// The longest prefix of `buf` made of whole records and at most `room` bytes: (bytes, records).
/// A malformed tail (impossible for batches we encoded) counts as one record.
fn split_records(buf: &[u8], room: u64) -> (usize, u64) {
    let mut pos = 0usize;
    let mut records = 0u64;
    while pos < buf.len() {
        let end = match read_varint(&buf[pos..]) {
            Ok(Some((len, n))) => usize::try_from(len)
                .ok()
                .and_then(|len| pos.checked_add(n)?.checked_add(len))
                .filter(|&end| end <= buf.len())
                .unwrap_or(buf.len()),
            _ => buf.len(),
        };
        if end as u64 > room {
            break;
        }
        pos = end;
        records += 1;
    }
    (pos, records)
}

/// The first record of `buf` alone: (bytes, records) with records 1, or 0 for an empty `buf`.
fn first_record(buf: &[u8]) -> (usize, u64) {
    if buf.is_empty() {
        return (0, 0);
    }
    let end = match read_varint(buf) {
        Ok(Some((len, n))) => usize::try_from(len)
            .ok()
            .and_then(|len| n.checked_add(len))
            .filter(|&end| end <= buf.len())
            .unwrap_or(buf.len()),
        _ => buf.len(),
    };
    (end, 1)
}

/// Reads a base-128 varint from the front of `buf`: `Ok(None)` if `buf` ends inside it,
/// `Err(())` if it is longer than 10 bytes.
fn read_varint(buf: &[u8]) -> Result<Option<(u64, usize)>, ()> {
    let mut value = 0u64;
    for i in 0..10 {
        let Some(&b) = buf.get(i) else {
            return Ok(None);
        };
        value |= u64::from(b & 0x7f) << (7 * i);
        if b < 0x80 {
            return Ok(Some((value, i + 1)));
        }
    }
    Err(())
}

// ---------------------------------------------------------------------------------------------
// Reading logs back: JSON lines
// ---------------------------------------------------------------------------------------------

/// Records larger than this are treated as corruption by the readers (the gateway's bounded
/// request heads keep real records far smaller).
pub(crate) const MAX_RECORD_BYTES: u64 = 16 << 20;

/// How often `sluice logs --follow` looks for new bytes.
pub(crate) const FOLLOW_POLL: Duration = Duration::from_millis(200);

/// What went wrong reading a log.
#[derive(Debug)]
pub enum LogError {
    /// Opening or reading a log file failed.
    Read { path: PathBuf, source: io::Error },
    /// Writing the JSON output failed (`BrokenPipe` when the reader went away).
    Write(io::Error),
    /// The bytes at `offset` are not a valid length-delimited record.
    Corrupt {
        path: PathBuf,
        offset: u64,
        reason: String,
    },
    /// The input ends inside the record that starts at `offset`.
    Truncated {
        path: PathBuf,
        offset: u64,
        bytes: u64,
    },
}

impl LogError {
    fn with_path(self, p: &Path) -> LogError {
        match self {
            LogError::Corrupt { offset, reason, .. } => LogError::Corrupt {
                path: p.to_path_buf(),
                offset,
                reason,
            },
            LogError::Truncated { offset, bytes, .. } => LogError::Truncated {
                path: p.to_path_buf(),
                offset,
                bytes,
            },
            other => other,
        }
    }
}

impl std::fmt::Display for LogError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            LogError::Read { path, source } => write!(f, "{}: {source}", path.display()),
            LogError::Write(e) => write!(f, "writing output: {e}"),
            LogError::Corrupt {
                path,
                offset,
                reason,
            } => write!(
                f,
                "{}: corrupt record at byte {offset}: {reason}",
                path.display()
            ),
            LogError::Truncated {
                path,
                offset,
                bytes,
            } => write!(
                f,
                "{}: ends inside the record at byte {offset} ({bytes} trailing bytes)",
                path.display()
            ),
        }
    }
}

impl std::error::Error for LogError {}

/// Writes `rec` as one JSON object followed by `\n`: every field (defaults included) under its
/// proto name, in proto order; enums as their proto value names (`"USAGE_SOURCE_REPORTED"`);
/// 64-bit integers as exact JSON numbers; a non-finite `cost` as `null`. The fields are
/// [`RecordView`]'s, which names every field of the generated struct.
pub(crate) fn write_json_line<W: Write>(rec: &AccessRecord, out: &mut W) -> io::Result<()> {
    serde_json::to_writer(&mut *out, &RecordView::of(rec)).map_err(io::Error::from)?;
    out.write_all(b"\n")
}

/// Decodes the first length-delimited record of `buf`: `Ok(Some((record, bytes used)))`,
/// `Ok(None)` when `buf` holds only the start of one (wait for more), or `Err` (offset 0, no
/// path) when the bytes cannot be a record.
pub(crate) fn decode_record(buf: &[u8]) -> Result<Option<(AccessRecord, usize)>, LogError> {
    let corrupt = |reason: String| LogError::Corrupt {
        path: PathBuf::new(),
        offset: 0,
        reason,
    };
    let (len, n) = match read_varint(buf) {
        Ok(Some(v)) => v,
        Ok(None) => return Ok(None),
        Err(()) => return Err(corrupt("length prefix longer than 10 bytes".into())),
    };
    if len > MAX_RECORD_BYTES {
        return Err(corrupt(format!(
            "length prefix {len} exceeds {MAX_RECORD_BYTES} bytes"
        )));
    }
    let end = n + len as usize;
    if buf.len() < end {
        return Ok(None);
    }
    match AccessRecord::decode(&buf[n..end]) {
        Ok(rec) => Ok(Some((rec, end))),
        Err(e) => Err(corrupt(e.to_string())),
    }
}

/// Decodes all of `buf` (a whole log file's bytes) to JSON lines on `out`; returns the number
/// of records. A record cut off at the end is an error ([`LogError::Truncated`]), after the
/// records before it were written.
#[cfg(test)]
pub(crate) fn decode_to_json<W: Write>(buf: &[u8], out: &mut W) -> Result<u64, LogError> {
    let mut dec = JsonDecoder::new();
    dec.feed(buf, out)?;
    dec.finish()?;
    Ok(dec.records())
}

/// Incremental decoder: feed it bytes as they arrive (in any split), it writes one JSON line per
/// complete record and keeps a partial trailing record until the rest comes.
#[derive(Debug, Default)]
pub(crate) struct JsonDecoder {
    pending: Vec<u8>,
    offset: u64,
    records: u64,
}

impl JsonDecoder {
    /// A decoder at the start of a file.
    pub(crate) fn new() -> JsonDecoder {
        JsonDecoder::default()
    }

    /// Decodes the complete records in what was pending plus `bytes`, writing their JSON lines.
    pub(crate) fn feed<W: Write>(&mut self, bytes: &[u8], out: &mut W) -> Result<(), LogError> {
        let mut start = 0usize;
        if self.pending.is_empty() {
            // Common case: decode straight from the caller's bytes, keep only a partial tail.
            let r = self.decode_from(bytes, &mut start, out);
            self.pending.extend_from_slice(&bytes[start..]);
            return r;
        }
        self.pending.extend_from_slice(bytes);
        let mut pending = std::mem::take(&mut self.pending);
        let r = self.decode_from(&pending, &mut start, out);
        pending.drain(..start);
        self.pending = pending;
        r
    }

    fn decode_from<W: Write>(
        &mut self,
        buf: &[u8],
        start: &mut usize,
        out: &mut W,
    ) -> Result<(), LogError> {
        loop {
            match decode_record(&buf[*start..]) {
                Ok(Some((rec, used))) => {
                    write_json_line(&rec, out).map_err(LogError::Write)?;
                    *start += used;
                    self.offset += used as u64;
                    self.records += 1;
                }
                Ok(None) => return Ok(()),
                Err(LogError::Corrupt { reason, .. }) => {
                    return Err(LogError::Corrupt {
                        path: PathBuf::new(),
                        offset: self.offset,
                        reason,
                    })
                }
                Err(e) => return Err(e),
            }
        }
    }

    /// Records decoded so far.
    pub(crate) fn records(&self) -> u64 {
        self.records
    }

    /// At the end of the input: an error if it ended inside a record.
    pub(crate) fn finish(&self) -> Result<(), LogError> {
        if self.pending.is_empty() {
            Ok(())
        } else {
            Err(LogError::Truncated {
                path: PathBuf::new(),
                offset: self.offset,
                bytes: self.pending.len() as u64,
            })
        }
    }
}

/// Decodes every file in `paths`, in the order given, to JSON lines on `out`; returns the number
/// of records. With `follow`, the last file is then watched like `tail -f`: new bytes are polled
/// every [`FOLLOW_POLL`], a partially written record waits for its rest, and when the writer
/// rotates to a newer `access-w{N}-{ts}.pb` in the same directory the reader finishes this file
/// and moves on to that one. Following never returns unless an error occurs.
///
/// `warn` receives problems that do not stop the dump (a followed file that turned out to end
/// inside a record when its successor appeared).
pub fn dump<W: Write>(
    paths: &[PathBuf],
    follow: bool,
    out: &mut W,
    warn: &mut dyn FnMut(&LogError),
) -> Result<u64, LogError> {
    let mut records = 0;
    for (i, path) in paths.iter().enumerate() {
        if follow && i + 1 == paths.len() {
            return follow_file(path, out, warn);
        }
        let mut file = File::open(path).map_err(|source| LogError::Read {
            path: path.clone(),
            source,
        })?;
        let mut dec = JsonDecoder::new();
        drain(&mut file, path, &mut dec, out)?;
        out.flush().map_err(LogError::Write)?;
        dec.finish().map_err(|e| e.with_path(path))?;
        records += dec.records();
    }
    Ok(records)
}

/// Reads `file` to its current end, feeding `dec`; returns the bytes read.
fn drain<W: Write>(
    file: &mut File,
    path: &Path,
    dec: &mut JsonDecoder,
    out: &mut W,
) -> Result<u64, LogError> {
    let mut chunk = vec![0u8; 64 << 10];
    let mut total = 0u64;
    loop {
        let n = match file.read(&mut chunk) {
            Ok(0) => return Ok(total),
            Ok(n) => n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(source) => {
                return Err(LogError::Read {
                    path: path.to_path_buf(),
                    source,
                })
            }
        };
        total += n as u64;
        dec.feed(&chunk[..n], out).map_err(|e| e.with_path(path))?;
    }
}

fn follow_file<W: Write>(
    path: &Path,
    out: &mut W,
    warn: &mut dyn FnMut(&LogError),
) -> Result<u64, LogError> {
    let open = |p: &Path| {
        File::open(p).map_err(|source| LogError::Read {
            path: p.to_path_buf(),
            source,
        })
    };
    let mut current = path.to_path_buf();
    let mut file = open(&current)?;
    let mut dec = JsonDecoder::new();
    loop {
        let n = drain(&mut file, &current, &mut dec, out)?;
        out.flush().map_err(LogError::Write)?;
        if n > 0 {
            continue;
        }
        // At the end for now. If the writer has moved on to a newer file, this one is complete:
        // read what arrived since, then switch.
        if let Some(next) = newer_sibling(&current) {
            drain(&mut file, &current, &mut dec, out)?;
            out.flush().map_err(LogError::Write)?;
            if let Err(e) = dec.finish() {
                warn(&e.with_path(&current));
            }
            file = open(&next)?;
            current = next;
            dec = JsonDecoder::new();
            continue;
        }
        std::thread::sleep(FOLLOW_POLL);
    }
}

/// Splits `access-w{N}-{ts}.pb` into (`access-w{N}-`, ts).
fn parse_log_name(name: &str) -> Option<(&str, u64)> {
    let stem = name.strip_suffix(".pb")?;
    let dash = stem.rfind('-')?;
    let (prefix, ts) = stem.split_at(dash + 1);
    let worker = prefix.strip_prefix("access-w")?.strip_suffix('-')?;
    if worker.is_empty() || !worker.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    if ts.is_empty() || !ts.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    Some((prefix, ts.parse().ok()?))
}

/// The oldest log file of the same worker in the same directory that is newer than `path`.
fn newer_sibling(path: &Path) -> Option<PathBuf> {
    let name = path.file_name()?.to_str()?;
    let (prefix, ts) = parse_log_name(name)?;
    let dir = match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d,
        _ => Path::new("."),
    };
    let mut best: Option<(u64, PathBuf)> = None;
    for entry in std::fs::read_dir(dir).ok()?.flatten() {
        let file_name = entry.file_name();
        let Some(other) = file_name.to_str() else {
            continue;
        };
        if let Some((p, t)) = parse_log_name(other) {
            if p == prefix && t > ts && best.as_ref().is_none_or(|(b, _)| t < *b) {
                best = Some((t, dir.join(other)));
            }
        }
    }
    best.map(|(_, p)| p)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]

    use super::*;
    use std::sync::atomic::AtomicUsize;

    /// A fresh directory under the system temp dir, removed on drop.
    struct TempDir(PathBuf);

    impl TempDir {
        fn new(tag: &str) -> TempDir {
            static N: AtomicUsize = AtomicUsize::new(0);
            let p = std::env::temp_dir().join(format!(
                "sluice-accesslog-{tag}-{}-{}",
                std::process::id(),
                N.fetch_add(1, Ordering::Relaxed)
            ));
            let _ = std::fs::remove_dir_all(&p);
            std::fs::create_dir_all(&p).unwrap();
            TempDir(p)
        }
    }

    impl Drop for TempDir {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }

    fn sample(i: u64) -> AccessRecord {
        AccessRecord {
            time_unix_us: 1_700_000_000_000_000 + i,
            client_addr: "10.0.0.7:51234".into(),
            method: "POST".into(),
            path: "/v1/chat/completions".into(),
            status: 200,
            key_id: format!("key-{i}"),
            entity: "team-a".into(),
            tags: vec!["prod".into(), "tier=\"gold\" ü".into()],
            requested_model: "gpt-4o".into(),
            mapped_model: "gpt-4o-2024-08-06".into(),
            cluster: "openai".into(),
            backend: "api.openai.com:443".into(),
            stream: i.is_multiple_of(2),
            prompt_tokens: 1200 + i,
            completion_tokens: 300,
            cached_tokens: 1024,
            total_tokens: 1500 + i,
            usage_source: UsageSource::Reported as i32,
            cost: 0.00725,
            ttft_us: 180_000,
            tpot_us: 21_000,
            latency_us: 6_500_000,
            upstream_connect_us: 900,
            upstream_header_us: 150_000,
            overhead_us: 85,
            bytes_in: 2048,
            bytes_out: 40_000,
            rejected_policy: String::new(),
            rejected_dimension: String::new(),
            auth_rejection_reason: String::new(),
            error_class: String::new(),
            fallback_attempts: 1,
            sticky_id_hash: u64::MAX - i,
            worker_id: 3,
            fallback_reason: String::new(),
            cache_write_tokens: 256,
            queued_us: 1_500 * i,
            priority_class: "interactive".into(),
            queue_outcome: "dispatched".into(),
        }
    }

    /// The log files in `dir`, in name (= time) order.
    fn log_files(dir: &Path) -> Vec<PathBuf> {
        let mut v: Vec<PathBuf> = std::fs::read_dir(dir)
            .unwrap()
            .map(|e| e.unwrap().path())
            .filter(|p| p.extension().is_some_and(|e| e == "pb"))
            .collect();
        v.sort();
        v
    }

    /// All records of `file`; panics if it does not decode completely.
    fn read_records(file: &Path) -> Vec<AccessRecord> {
        let bytes = std::fs::read(file).unwrap();
        let mut pos = 0;
        let mut out = Vec::new();
        while pos < bytes.len() {
            let (rec, used) = decode_record(&bytes[pos..])
                .unwrap()
                .unwrap_or_else(|| panic!("{}: truncated at {pos}", file.display()));
            out.push(rec);
            pos += used;
        }
        out
    }

    fn config(dir: &Path) -> AccessLogConfig {
        AccessLogConfig::new(dir)
    }

    #[test]
    fn round_trip_through_the_writer() {
        let dir = TempDir::new("roundtrip");
        let mut log = AccessLog::open(&config(&dir.0), 3).unwrap();
        let recs: Vec<AccessRecord> = (0..10).map(sample).collect();
        for r in &recs {
            log.record(r);
        }
        // Below batch_bytes and not yet due: still buffered on the worker side.
        assert!(log.buffered_bytes() > 0);
        assert!(!log.flush_if_due(Instant::now()));
        let stats = log.close();
        assert_eq!(stats.records, 10);
        assert_eq!(stats.records_written, 10);
        assert_eq!(stats.dropped_queue_full + stats.lost_write_error, 0);
        let files = log_files(&dir.0);
        assert_eq!(files.len(), 1, "{files:?}");
        let name = files[0].file_name().unwrap().to_str().unwrap().to_owned();
        assert!(
            parse_log_name(&name).is_some_and(|(p, _)| p == "access-w3-"),
            "{name}"
        );
        assert_eq!(read_records(&files[0]), recs);
        // Not readable by other users of the host (0640 less the umask).
        use std::os::unix::fs::PermissionsExt;
        let mode = std::fs::metadata(&files[0]).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode & 0o007, 0, "{mode:o}");
        assert_eq!(mode & 0o600, 0o600, "{mode:o}");
    }

    #[test]
    fn json_has_every_field_in_proto_order_with_enum_names() {
        let mut rec = sample(0);
        rec.tags = vec!["a\"b".into()];
        let mut out = Vec::new();
        write_json_line(&rec, &mut out).unwrap();
        let line = String::from_utf8(out).unwrap();
        assert!(line.ends_with("}\n"));
        assert!(line.starts_with(r#"{"time_unix_us":1700000000000000,"client_addr":"#));
        assert!(
            line.contains(r#""usage_source":"USAGE_SOURCE_REPORTED""#),
            "{line}"
        );
        assert!(
            line.contains(&format!(r#""sticky_id_hash":{}"#, u64::MAX)),
            "{line}"
        );
        assert!(
            line.trim_end()
                .ends_with(r#""cache_write_tokens":256,"queued_us":0,"priority_class":"interactive","queue_outcome":"dispatched"}"#),
            "{line}"
        );
        let v: serde_json::Value = serde_json::from_str(&line).unwrap();
        assert_eq!(v.as_object().unwrap().len(), 39);
        assert_eq!(v["tags"], serde_json::json!(["a\"b"]));
        assert_eq!(v["cost"].as_f64(), Some(0.00725));
        // Defaults are written too, and an enum number this build does not know stays a number.
        let mut out = Vec::new();
        let unknown = AccessRecord {
            usage_source: 9,
            cost: f64::NAN,
            ..AccessRecord::default()
        };
        write_json_line(&unknown, &mut out).unwrap();
        let v: serde_json::Value = serde_json::from_slice(&out).unwrap();
        assert_eq!(v.as_object().unwrap().len(), 39);
        assert_eq!(v["usage_source"], 9);
        assert!(v["cost"].is_null(), "{v}");
        assert_eq!(v["path"], "");
        assert_eq!(v["tags"], serde_json::json!([]));
    }

    #[test]
    fn decoder_accepts_any_split_and_waits_for_a_partial_record() {
        let mut bytes = Vec::new();
        for i in 0..5 {
            sample(i).encode_length_delimited(&mut bytes).unwrap();
        }
        let mut whole = Vec::new();
        assert_eq!(decode_to_json(&bytes, &mut whole).unwrap(), 5);
        let mut dec = JsonDecoder::new();
        let mut split = Vec::new();
        for b in &bytes {
            dec.feed(std::slice::from_ref(b), &mut split).unwrap();
        }
        dec.finish().unwrap();
        assert_eq!(split, whole);
        // A file cut inside its last record: the complete records come out, then an error.
        let cut = &bytes[..bytes.len() - 7];
        let mut out = Vec::new();
        let err = decode_to_json(cut, &mut out).unwrap_err();
        assert!(matches!(err, LogError::Truncated { .. }), "{err}");
        assert_eq!(out.iter().filter(|&&b| b == b'\n').count(), 4);
    }

    #[test]
    fn garbage_is_reported_as_corrupt() {
        let mut bytes = Vec::new();
        sample(0).encode_length_delimited(&mut bytes).unwrap();
        let good = bytes.len() as u64;
        bytes.extend_from_slice(&[0xff; 12]);
        let mut out = Vec::new();
        match decode_to_json(&bytes, &mut out).unwrap_err() {
            LogError::Corrupt { offset, .. } => assert_eq!(offset, good),
            e => panic!("{e}"),
        }
        // A length far beyond MAX_RECORD_BYTES is corruption, not a record to wait for.
        let mut huge = Vec::new();
        prost::encoding::encode_varint(MAX_RECORD_BYTES + 1, &mut huge);
        assert!(matches!(
            decode_record(&huge),
            Err(LogError::Corrupt { .. })
        ));
    }

    #[test]
    fn size_rotation_keeps_records_whole_and_in_order() {
        let dir = TempDir::new("rotate");
        let cfg = AccessLogConfig {
            max_file_bytes: 4096,
            batch_bytes: 1500,
            ..config(&dir.0)
        };
        let mut log = AccessLog::open(&cfg, 0).unwrap();
        let recs: Vec<AccessRecord> = (0..200).map(sample).collect();
        let mut recorded = 0u64;
        for r in &recs {
            log.record(r);
            recorded += 1;
            if recorded.is_multiple_of(20) {
                // Give the writer a chance, so no batch is dropped for a full queue.
                while log.stats().records_written + log.dropped_records() < recorded - 20 {
                    std::thread::sleep(Duration::from_millis(1));
                }
            }
        }
        let stats = log.close();
        assert_eq!(stats.dropped_queue_full, 0, "{stats:?}");
        assert_eq!(stats.records_written, 200);
        let files = log_files(&dir.0);
        assert!(files.len() >= 5, "expected several files, got {files:?}");
        assert_eq!(stats.files_opened, files.len() as u64);
        let mut all = Vec::new();
        for f in &files {
            let len = std::fs::metadata(f).unwrap().len();
            assert!(len <= 4096, "{} has {len} bytes", f.display());
            let got = read_records(f);
            assert!(!got.is_empty(), "{} is empty", f.display());
            all.extend(got);
        }
        assert_eq!(all, recs);
        // The CLI path reads them in the same order.
        let mut out = Vec::new();
        assert_eq!(
            dump(&files, false, &mut out, &mut |e| panic!("{e}")).unwrap(),
            200
        );
    }

    #[test]
    fn a_record_larger_than_max_file_bytes_gets_a_file_of_its_own() {
        let dir = TempDir::new("big");
        let cfg = AccessLogConfig {
            max_file_bytes: 100,
            ..config(&dir.0)
        };
        let mut log = AccessLog::open(&cfg, 1).unwrap();
        for i in 0..3 {
            log.record(&sample(i));
        }
        let stats = log.close();
        assert_eq!(stats.records_written, 3);
        let files = log_files(&dir.0);
        // The (empty) startup file is used for the first record.
        assert_eq!(files.len(), 3, "{files:?}");
        for (i, f) in files.iter().enumerate() {
            assert_eq!(read_records(f), vec![sample(i as u64)]);
        }
    }

    #[test]
    fn age_rotation_starts_a_new_file() {
        let dir = TempDir::new("age");
        let cfg = AccessLogConfig {
            max_file_age: Duration::from_millis(50),
            ..config(&dir.0)
        };
        let mut log = AccessLog::open(&cfg, 2).unwrap();
        log.record(&sample(0));
        log.flush();
        while log.stats().records_written < 1 {
            std::thread::sleep(Duration::from_millis(1));
        }
        std::thread::sleep(Duration::from_millis(80));
        log.record(&sample(1));
        log.close();
        let files = log_files(&dir.0);
        assert_eq!(files.len(), 2, "{files:?}");
        assert_eq!(read_records(&files[0]), vec![sample(0)]);
        assert_eq!(read_records(&files[1]), vec![sample(1)]);
    }

    #[test]
    fn flush_if_due_waits_for_the_interval() {
        let dir = TempDir::new("due");
        let mut log = AccessLog::open(&config(&dir.0), 0).unwrap();
        let t0 = Instant::now();
        assert!(
            !log.flush_if_due(t0 + Duration::from_secs(5)),
            "nothing buffered"
        );
        log.record(&sample(0));
        assert!(!log.flush_if_due(t0));
        assert!(log.flush_if_due(t0 + log.flush_interval() + Duration::from_millis(1)));
        assert_eq!(log.buffered_bytes(), 0);
        let stats = log.close();
        assert_eq!(stats.records_written, 1);
    }

    #[test]
    fn a_full_queue_drops_and_counts_instead_of_blocking() {
        let dir = TempDir::new("full");
        let cfg = AccessLogConfig {
            batch_bytes: 1, // every record is a batch
            queue_batches: 1,
            ..config(&dir.0)
        };
        // A writer that never drains: we hold the receiving end and do not read it.
        let (tx, rx) = mpsc::sync_channel::<Batch>(cfg.queue_batches);
        let (_recycle_tx, recycled) = mpsc::sync_channel::<Vec<u8>>(1);
        let mut log = AccessLog::from_parts(
            &cfg,
            tx,
            recycled,
            None,
            Arc::new(WriterCounters::default()),
        );
        let t0 = Instant::now();
        for i in 0..1000 {
            log.record(&sample(i));
        }
        log.record(&sample(1000));
        log.flush();
        assert!(
            t0.elapsed() < Duration::from_secs(2),
            "recording took {:?}",
            t0.elapsed()
        );
        // One batch fits the queue; every other record was dropped and counted.
        assert_eq!(log.dropped_records(), 1000);
        let stats = log.stats();
        assert_eq!(stats.records, 1001);
        assert_eq!(stats.dropped_queue_full, 1000);
        assert_eq!(stats.dropped_batches, 1000);
        let queued = rx.try_recv().unwrap();
        assert_eq!(queued.records, 1);
        assert_eq!(decode_record(&queued.bytes).unwrap().unwrap().0, sample(0));
        assert!(rx.try_recv().is_err());
        // Closing with a full queue and no writer gives up after the wait instead of hanging.
        log.batch_bytes = usize::MAX;
        log.record(&sample(1));
        assert!(log.buffered_bytes() > 0);
        let (tx2, _rx2) = mpsc::sync_channel::<Batch>(1);
        tx2.try_send(Batch {
            bytes: Vec::new(),
            records: 0,
        })
        .unwrap();
        log.tx = Some(tx2);
        log.shutdown(Duration::from_millis(20));
        assert_eq!(log.dropped_records(), 1001);
    }

    #[test]
    fn dropping_the_handle_writes_what_is_buffered() {
        let dir = TempDir::new("drop");
        {
            let mut log = AccessLog::open(&config(&dir.0), 5).unwrap();
            log.record(&sample(7));
            log.record(&sample(8));
        }
        let files = log_files(&dir.0);
        assert_eq!(files.len(), 1);
        assert_eq!(read_records(&files[0]), vec![sample(7), sample(8)]);
    }

    #[test]
    fn open_fails_at_startup_on_a_bad_directory() {
        let dir = TempDir::new("bad");
        let file = dir.0.join("not-a-dir");
        std::fs::write(&file, b"x").unwrap();
        assert!(AccessLog::open(&config(&file), 0).is_err());
    }

    #[test]
    fn newer_sibling_follows_rotation_of_the_same_worker_only() {
        let dir = TempDir::new("sibling");
        for name in [
            "access-w1-0000000000000010.pb",
            "access-w1-0000000000000030.pb",
            "access-w1-0000000000000020.pb",
            "access-w11-0000000000000015.pb",
            "access-w1-0000000000000040.pb.tmp",
            "other.pb",
        ] {
            std::fs::write(dir.0.join(name), b"").unwrap();
        }
        let first = dir.0.join("access-w1-0000000000000010.pb");
        assert_eq!(
            newer_sibling(&first),
            Some(dir.0.join("access-w1-0000000000000020.pb"))
        );
        assert_eq!(
            newer_sibling(&dir.0.join("access-w1-0000000000000030.pb")),
            None
        );
        assert_eq!(newer_sibling(&dir.0.join("other.pb")), None);
    }
}

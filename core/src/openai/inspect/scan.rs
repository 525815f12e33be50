//! A validating JSON scanner (RFC 8259) that reads the body where it lies, front to back, once:
//! no copy, no tape. The inspector drives it member by member at the top level; everything
//! below is skipped whole (validated, not kept) by [`Scanner::value`], which tells where a value
//! lies and what kind it is. String text, the bulk of any prompt, is looked at sixteen or
//! thirty-two bytes at a time for the three bytes that end plain text: a quote, a backslash, a
//! control character.
//!
//! It refuses exactly what simd-json (the inspector's parser before #15) refused: the grammar,
//! control characters and bad escapes in strings (a `\u` that is half a surrogate pair
//! included), integers beyond `u64` / `i64`, floats beyond `f64`, and more than [`MAX_DEPTH`]
//! nested containers. UTF-8 is the caller's: it hands over a `&str`.

use crate::sys::cpu::Avx2;

/// Objects and arrays nested deeper than this are refused: simd-json's `DEFAULT_MAX_DEPTH`,
/// which bounded inspection before (serde_json's 128 would refuse bodies served today).
pub(super) const MAX_DEPTH: usize = 1024;

/// Why the scanner stopped, and at which byte. The kind matters only where serde_json (which
/// words the client's message) takes the body: for a number out of range, half a surrogate
/// pair, or too deep a nesting, the message is this one's.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(in crate::openai) enum Fault {
    /// Not JSON: grammar, a control character or bad escape in a string, the end of the body.
    Syntax { at: usize },
    /// A number the gateway cannot hold, at the byte simd-json named: an integer beyond `u64`
    /// (or below `i64::MIN`) at the digit where it overflowed (past its last digit for a
    /// negative beyond `i64` alone); a float beyond `f64` at its first byte.
    Number { at: usize },
    /// A `\u` escape that is half of a UTF-16 surrogate pair, at its backslash.
    Surrogate { at: usize },
    /// An object or array opened inside [`MAX_DEPTH`] others, at its bracket.
    Depth { at: usize },
}

/// What a value is, as far as the inspector reads values.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(in crate::openai) enum Kind {
    /// A string; `escaped` when its text has a backslash (its bytes are not its value).
    String {
        escaped: bool,
    },
    /// A number with neither fraction nor exponent: its sign and magnitude.
    Int {
        negative: bool,
        magnitude: u64,
    },
    /// Any other number (finite).
    Float,
    True,
    False,
    Null,
    Object,
    Array,
}

/// A value's place in the body (`start..end`, no whitespace around it) and kind.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(in crate::openai) struct Value {
    pub(in crate::openai) start: usize,
    pub(in crate::openai) end: usize,
    pub(in crate::openai) kind: Kind,
}

impl Value {
    pub(in crate::openai) fn span(&self) -> (usize, usize) {
        (self.start, self.end)
    }
}

/// A cursor over the body's bytes.
pub(in crate::openai) struct Scanner<'b> {
    text: &'b str,
    b: &'b [u8],
    /// The next byte to read.
    pub(in crate::openai) pos: usize,
}

impl<'b> Scanner<'b> {
    pub(in crate::openai) fn new(text: &'b str) -> Scanner<'b> {
        Scanner::at(text, 0)
    }

    /// A scanner reading `text` from `pos`.
    pub(super) fn at(text: &'b str, pos: usize) -> Scanner<'b> {
        Scanner {
            text,
            b: text.as_bytes(),
            pos,
        }
    }

    pub(super) fn syntax(&self) -> Fault {
        Fault::Syntax { at: self.pos }
    }

    /// Past JSON whitespace; the byte there, if the body goes on.
    #[inline]
    pub(in crate::openai) fn skip_ws(&mut self) -> Option<u8> {
        loop {
            let c = *self.b.get(self.pos)?;
            if !matches!(c, b' ' | b'\t' | b'\n' | b'\r') {
                return Some(c);
            }
            self.pos += 1;
        }
    }

    /// Nothing but whitespace is left.
    pub(in crate::openai) fn end(&mut self) -> Result<(), Fault> {
        match self.skip_ws() {
            None => Ok(()),
            Some(_) => Err(self.syntax()),
        }
    }

    /// An object key and its colon, from the key's opening quote to the value's first byte.
    pub(in crate::openai) fn key(&mut self) -> Result<Value, Fault> {
        if self.b.get(self.pos) != Some(&b'"') {
            return Err(self.syntax());
        }
        let key = self.string()?;
        if self.skip_ws() != Some(b':') {
            return Err(self.syntax());
        }
        self.pos += 1;
        self.skip_ws();
        Ok(key)
    }

    /// After a member or element: its `,` (then whitespace) or the closing `close`, consumed.
    /// True when there is another.
    #[inline]
    pub(in crate::openai) fn next_or_close(&mut self, close: u8) -> Result<bool, Fault> {
        match self.skip_ws() {
            Some(b',') => {
                self.pos += 1;
                self.skip_ws();
                Ok(true)
            }
            Some(c) if c == close => {
                self.pos += 1;
                Ok(false)
            }
            _ => Err(self.syntax()),
        }
    }

    /// The value starting at `pos` (whitespace already skipped), validated and passed over.
    /// `open` containers enclose it, for the depth bound.
    pub(in crate::openai) fn value(&mut self, open: usize) -> Result<Value, Fault> {
        let start = self.pos;
        let kind = match self.b.get(start) {
            Some(b'"') => return self.string(),
            Some(b'-' | b'0'..=b'9') => return self.number(),
            Some(b't') => self.atom(b"true", Kind::True)?,
            Some(b'f') => self.atom(b"false", Kind::False)?,
            Some(b'n') => self.atom(b"null", Kind::Null)?,
            Some(b'{') => {
                self.containers(open)?;
                Kind::Object
            }
            Some(b'[') => {
                self.containers(open)?;
                Kind::Array
            }
            _ => return Err(self.syntax()),
        };
        Ok(Value {
            start,
            end: self.pos,
            kind,
        })
    }

    fn atom(&mut self, word: &[u8], kind: Kind) -> Result<Kind, Fault> {
        if self.b.get(self.pos..self.pos + word.len()) != Some(word) {
            return Err(self.syntax());
        }
        self.pos += word.len();
        Ok(kind)
    }

    /// The object or array at `pos` and everything in it, without recursion: one bit per
    /// open container (set for an object) says what closes it and whether keys follow commas.
    fn containers(&mut self, open: usize) -> Result<(), Fault> {
        let mut objects = [0u64; MAX_DEPTH / 64];
        let mut depth = 0usize;
        loop {
            // At the start of a value.
            match self.b.get(self.pos) {
                Some(&c @ (b'{' | b'[')) => {
                    if open + depth >= MAX_DEPTH {
                        return Err(Fault::Depth { at: self.pos });
                    }
                    let object = c == b'{';
                    let Some(word) = objects.get_mut(depth / 64) else {
                        return Err(Fault::Depth { at: self.pos });
                    };
                    let bit = 1u64 << (depth % 64);
                    *word = if object { *word | bit } else { *word & !bit };
                    depth += 1;
                    self.pos += 1;
                    let close = if object { b'}' } else { b']' };
                    if self.skip_ws() == Some(close) {
                        self.pos += 1;
                        depth -= 1;
                    } else {
                        if object {
                            self.key()?;
                        }
                        continue;
                    }
                }
                Some(b'"') => {
                    self.string()?;
                }
                Some(b'-' | b'0'..=b'9') => {
                    self.number()?;
                }
                Some(b't') => {
                    self.atom(b"true", Kind::True)?;
                }
                Some(b'f') => {
                    self.atom(b"false", Kind::False)?;
                }
                Some(b'n') => {
                    self.atom(b"null", Kind::Null)?;
                }
                _ => return Err(self.syntax()),
            }
            // A value ended: close what it ended, up to the next element or member.
            loop {
                let Some(inner) = depth.checked_sub(1) else {
                    return Ok(());
                };
                let object = objects
                    .get(inner / 64)
                    .is_some_and(|w| w & (1u64 << (inner % 64)) != 0);
                if self.next_or_close(if object { b'}' } else { b']' })? {
                    if object {
                        self.key()?;
                    }
                    break;
                }
                depth = inner;
            }
        }
    }

    /// The string whose opening quote is at `pos`.
    #[inline]
    pub(super) fn string(&mut self) -> Result<Value, Fault> {
        let start = self.pos;
        // Most strings (keys, roles, model names, ids) end plainly within sixteen or
        // thirty-two bytes: one or two compares, here, and no call.
        let block_at = |at: usize| {
            self.b
                .get(at..at + 16)
                .and_then(|c| <&[u8; 16]>::try_from(c).ok())
        };
        if let Some(block) = block_at(start + 1) {
            let mut mask = stops16(block);
            let mut base = start + 1;
            if mask == 0 {
                if let Some(second) = block_at(start + 17) {
                    mask = stops16(second);
                    base = start + 17;
                }
            }
            let stop = base + mask.trailing_zeros() as usize;
            if mask != 0 && self.b.get(stop) == Some(&b'"') {
                self.pos = stop + 1;
                return Ok(Value {
                    start,
                    end: stop + 1,
                    kind: Kind::String { escaped: false },
                });
            }
        }
        self.long_string()
    }

    /// The string at `pos`, whatever its length.
    ///
    /// Its text is read a block at a time ([`next_stops`]); within a block, each stop in turn:
    /// the closing quote ends the string, an escape is checked and passed over (the bits it
    /// covers cleared), a control character is refused. A long prompt costs its blocks plus a
    /// few instructions per escape.
    #[inline(never)]
    fn long_string(&mut self) -> Result<Value, Fault> {
        let b = self.b;
        let start = self.pos;
        let mut at = start + 1;
        let mut escaped = false;
        let avx2 = Avx2::detect();
        loop {
            // Blocks of plain text: nothing to do but look.
            let (block_at, mut mask, width) = next_stops(b, at, avx2);
            at = block_at;
            if width == 0 {
                return Err(Fault::Syntax { at });
            }
            // Where the block's text is read up to (past an escape that ends beyond it).
            let mut read = at + width;
            while mask != 0 {
                let stop = at + mask.trailing_zeros() as usize;
                match b.get(stop) {
                    Some(b'"') => {
                        self.pos = stop + 1;
                        return Ok(Value {
                            start,
                            end: stop + 1,
                            kind: Kind::String { escaped },
                        });
                    }
                    Some(b'\\') => {
                        escaped = true;
                        let letter = b.get(stop + 1).copied().unwrap_or(0);
                        let next = if SHORT_ESCAPE[usize::from(letter)] {
                            stop + 2
                        } else {
                            self.unicode_escape(stop)?
                        };
                        // The escape's own bytes (an escaped quote or backslash) are text.
                        let covered = next - at;
                        if covered >= width {
                            read = next;
                            break;
                        }
                        mask &= u64::MAX << covered;
                    }
                    // A control character, which a string may only hold escaped.
                    _ => return Err(Fault::Syntax { at: stop }),
                }
            }
            at = read;
        }
    }

    /// The escape whose backslash is at `at` when it is not one of the two-byte ones: `\u` and
    /// four hex digits (the first half of a surrogate pair followed by the second), or else no
    /// escape at all. Where the string goes on after it. Half a pair is refused as simd-json
    /// refused it (serde_json, skipping a string, does not look).
    #[inline(never)]
    fn unicode_escape(&self, at: usize) -> Result<usize, Fault> {
        if self.b.get(at + 1) != Some(&b'u') {
            return Err(Fault::Syntax { at });
        }
        let unit = hex4(self.b, at + 2).ok_or(Fault::Syntax { at })?;
        if (0xDC00..0xE000).contains(&unit) {
            return Err(Fault::Surrogate { at });
        }
        if !(0xD800..0xDC00).contains(&unit) {
            return Ok(at + 6);
        }
        if self.b.get(at + 6..at + 8) != Some(b"\\u") {
            return Err(Fault::Surrogate { at });
        }
        match hex4(self.b, at + 8) {
            Some(low) if (0xDC00..0xE000).contains(&low) => Ok(at + 12),
            Some(_) => Err(Fault::Surrogate { at }),
            None => Err(Fault::Syntax { at: at + 6 }),
        }
    }

    /// The number at `pos` (a `-` or a digit): RFC 8259's grammar, then the range simd-json
    /// held (see [`Fault::Number`]).
    fn number(&mut self) -> Result<Value, Fault> {
        let b = self.b;
        let start = self.pos;
        let negative = b.get(start) == Some(&b'-');
        let int_start = start + usize::from(negative);
        let (mut at, magnitude, overflow_at) = integer_part(b, int_start)?;
        let int_digits = at - int_start;
        let mut float = false;
        // Where the first non-zero digit is, when the integer part is 0: `0.00` is zero;
        // `0.001` is 3 places down.
        let mut first_significant = None;
        if b.get(at) == Some(&b'.') {
            float = true;
            (at, first_significant) = fraction_part(b, at + 1)?;
        }
        let mut exponent = 0i64;
        if matches!(b.get(at), Some(b'e' | b'E')) {
            float = true;
            (at, exponent) = exponent_part(b, at + 1)?;
        }
        self.pos = at;
        let kind = if float {
            let int_is_zero = b.get(int_start) == Some(&b'0');
            // The value lies in [10^(e-1), 10^e): e is where its first significant digit is.
            let e = match (int_is_zero, first_significant) {
                (false, _) => i64::try_from(int_digits).unwrap_or(i64::MAX),
                (true, Some(zeros)) => -i64::try_from(zeros).unwrap_or(i64::MAX),
                (true, None) => i64::MIN, // zero
            }
            .saturating_add(exponent);
            if self.float_is_infinite(start, at, e) {
                return Err(Fault::Number { at: start });
            }
            Kind::Float
        } else {
            if let Some(at) = overflow_at {
                return Err(Fault::Number { at });
            }
            if negative && magnitude > 1 << 63 {
                return Err(Fault::Number { at });
            }
            Kind::Int {
                negative,
                magnitude,
            }
        };
        Ok(Value {
            start,
            end: at,
            kind,
        })
    }

    /// Whether the float at `start..end`, which lies below 10^`e`, is beyond `f64`.
    #[inline]
    fn float_is_infinite(&self, start: usize, end: usize, e: i64) -> bool {
        // f64::MAX is 1.8e308: below 10^308 a float is finite, from 10^309 infinite; in
        // between, the correctly rounded value (simd-json's as well) decides.
        e >= 310
            || (e == 309
                && self
                    .text
                    .get(start..end)
                    .and_then(|t| t.parse::<f64>().ok())
                    .is_none_or(f64::is_infinite))
    }
}

/// A number's integer part, at `at` in `b`: where it ends, its magnitude (as far as `u64`
/// holds it), and the digit where it overflowed `u64`, if it did.
#[inline(always)]
fn integer_part(b: &[u8], mut at: usize) -> Result<(usize, u64, Option<usize>), Fault> {
    let mut magnitude = 0u64;
    let mut overflow_at = None;
    match b.get(at) {
        Some(b'0') => at += 1,
        Some(b'1'..=b'9') => {
            // The first eight bytes at once: most numbers here (counts, `created`) have at
            // most eight digits, and the loop below costs ~10 instructions a digit. Eight
            // digits cannot overflow; the loop takes any that follow.
            if let Some(word) = b.get(at..at + 8).and_then(|w| <[u8; 8]>::try_from(w).ok()) {
                let (value, digits) = leading_digits(u64::from_le_bytes(word));
                magnitude = value;
                at += digits;
            }
            while let Some(&d @ b'0'..=b'9') = b.get(at) {
                if overflow_at.is_none() {
                    match magnitude
                        .checked_mul(10)
                        .and_then(|m| m.checked_add(u64::from(d - b'0')))
                    {
                        Some(m) => magnitude = m,
                        None => overflow_at = Some(at),
                    }
                }
                at += 1;
            }
        }
        _ => return Err(Fault::Syntax { at }),
    }
    Ok((at, magnitude, overflow_at))
}

/// A number's fraction digits, from `at` (past its `.`) in `b`: where they end, and how many
/// places down the first non-zero one is (none when all are zero).
#[inline(always)]
fn fraction_part(b: &[u8], mut at: usize) -> Result<(usize, Option<usize>), Fault> {
    let fraction_start = at;
    let mut first_significant = None;
    while let Some(&d @ b'0'..=b'9') = b.get(at) {
        if d != b'0' && first_significant.is_none() {
            first_significant = Some(at - fraction_start);
        }
        at += 1;
    }
    if at == fraction_start {
        return Err(Fault::Syntax { at });
    }
    Ok((at, first_significant))
}

/// A number's exponent, from `at` (past its `e` or `E`) in `b`: where it ends, and its value
/// (held at 10^10 and over, where the number is 0 or infinite whatever digits follow).
#[inline(always)]
fn exponent_part(b: &[u8], mut at: usize) -> Result<(usize, i64), Fault> {
    let negative = b.get(at) == Some(&b'-');
    if matches!(b.get(at), Some(b'-' | b'+')) {
        at += 1;
    }
    let digits_start = at;
    let mut exponent = 0i64;
    while let Some(&d @ b'0'..=b'9') = b.get(at) {
        // Past 10^10 the number is 0 or infinite whatever digits follow.
        if exponent < 10_000_000_000 {
            exponent = exponent * 10 + i64::from(d - b'0');
        }
        at += 1;
    }
    if at == digits_start {
        return Err(Fault::Syntax { at });
    }
    Ok((at, if negative { -exponent } else { exponent }))
}

/// The letters of the two-byte escapes: `\"`, `\\`, `\/`, `\b`, `\f`, `\n`, `\r`, `\t`.
static SHORT_ESCAPE: [bool; 256] = {
    let mut t = [false; 256];
    let letters = *b"\"\\/bfnrt";
    let mut i = 0;
    while i < letters.len() {
        t[letters[i] as usize] = true;
        i += 1;
    }
    t
};

/// The decimal digits at the start of `word` (eight bytes read little-endian, so its first
/// byte is the most significant digit): their value and how many there are (0 to 8).
#[inline]
fn leading_digits(word: u64) -> (u64, usize) {
    const ONES: u64 = 0x0101_0101_0101_0101;
    let less_zero = word.wrapping_sub(0x30 * ONES);
    // A byte's top bit is set when it is below b'0' (the subtraction wraps it) or above b'9'
    // (adding 0x76 carries into it). A borrow or carry only reaches the bytes after the first
    // byte that is not a digit, which are not counted.
    let not_digit = (less_zero | less_zero.wrapping_add(0x76 * ONES)) & (0x80 * ONES);
    let digits = (not_digit.trailing_zeros() / 8) as usize;
    if digits == 0 {
        return (0, 0);
    }
    // The digits moved to the top, behind zero bytes that read as leading zeros, then summed
    // pairwise: 2 digits per 16 bits, 4 per 32, 8 per 64.
    let v = (word << (8 * (8 - digits))) & (0x0f * ONES);
    let v = (v.wrapping_mul(10 << 8 | 1) >> 8) & 0x00ff_00ff_00ff_00ff;
    let v = (v.wrapping_mul(100 << 16 | 1) >> 16) & 0x0000_ffff_0000_ffff;
    let v = v.wrapping_mul(10_000 << 32 | 1) >> 32;
    (v, digits)
}

/// From `at` in string text, past the blocks that hold no stop: the first block that does (where
/// it starts, its stops as a mask, its width), or the text left at the body's end (as [`stops`]
/// gives it; width 0 at the end itself). With AVX2, sixty-four bytes a step.
#[inline]
fn next_stops(b: &[u8], at: usize, avx2: Option<Avx2>) -> (usize, u64, usize) {
    #[cfg(target_arch = "x86_64")]
    if avx2.is_some() {
        // SAFETY: an `Avx2` exists only where the CPU has AVX2 (`Avx2::detect`).
        return unsafe { next_stops_avx2(b, at) };
    }
    let _ = avx2;
    next_stops_32(b, at)
}

/// [`next_stops`] thirty-two bytes a step, with SSE2 (or portably).
fn next_stops_32(b: &[u8], mut at: usize) -> (usize, u64, usize) {
    loop {
        let block = b
            .get(at..at + 32)
            .and_then(|c| <&[u8; 32]>::try_from(c).ok());
        let Some(block) = block else {
            let (mask, width) = stops(b, at);
            return (at, mask, width);
        };
        let mask = stops32(block);
        if mask != 0 {
            return (at, mask, 32);
        }
        at += 32;
    }
}

/// [`next_stops`] with AVX2: two registers of thirty-two bytes a step, tested at once (a 64 KB
/// prompt is nearly all plain text; the SSE2 steps were a tenth of a 64 KB request's CPU).
///
/// # Safety
/// The CPU must have AVX2.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn next_stops_avx2(b: &[u8], mut at: usize) -> (usize, u64, usize) {
    use std::arch::x86_64::{
        __m256i, _mm256_cmpeq_epi8, _mm256_loadu_si256, _mm256_min_epu8, _mm256_movemask_epi8,
        _mm256_or_si256, _mm256_set1_epi8, _mm256_testz_si256,
    };
    let quote = _mm256_set1_epi8(b'"' as i8);
    let backslash = _mm256_set1_epi8(b'\\' as i8);
    let control = _mm256_set1_epi8(0x1f);
    // As `stops16`: a quote, a backslash, or min(c, 0x1f) == c (unsigned).
    let stops = |v: __m256i| {
        _mm256_or_si256(
            _mm256_or_si256(_mm256_cmpeq_epi8(v, quote), _mm256_cmpeq_epi8(v, backslash)),
            _mm256_cmpeq_epi8(_mm256_min_epu8(v, control), v),
        )
    };
    while let Some(block) = b.get(at..at + 64) {
        // SAFETY: `block` is sixty-four bytes; each load reads thirty-two of them, unaligned.
        let (low, high) = unsafe {
            (
                stops(_mm256_loadu_si256(block.as_ptr().cast())),
                stops(_mm256_loadu_si256(block.as_ptr().add(32).cast())),
            )
        };
        let any = _mm256_or_si256(low, high);
        if _mm256_testz_si256(any, any) == 0 {
            // A mask bit per byte: the low register's thirty-two, then the high one's.
            let low = u64::from(_mm256_movemask_epi8(low) as u32);
            let high = u64::from(_mm256_movemask_epi8(high) as u32);
            return (at, low | (high << 32), 64);
        }
        at += 64;
    }
    next_stops_32(b, at)
}

/// The stops among thirty-two bytes of string text: bit i for byte i when it is a `"`, a `\`,
/// or a control character (below U+0020, which a string may only hold escaped).
#[inline]
fn stops32(block: &[u8; 32]) -> u64 {
    let (low, high) = block.split_at(16);
    match (<&[u8; 16]>::try_from(low), <&[u8; 16]>::try_from(high)) {
        (Ok(low), Ok(high)) => stops16(low) | (stops16(high) << 16),
        // Not reached: the halves of thirty-two bytes are sixteen each.
        _ => tail_stops(block),
    }
}

/// The text at `at` when fewer than thirty-two bytes of the body are left: a mask of its stops
/// (as [`stops32`]) and its width; width 0 at the body's end. The body's last thirty-two bytes
/// are looked at together and the mask shifted to start at `at`; only a body shorter than that
/// is looked at byte by byte.
fn stops(b: &[u8], at: usize) -> (u64, usize) {
    let width = b.len().saturating_sub(at);
    let last = b.len().saturating_sub(32);
    match b.get(last..).and_then(|c| <&[u8; 32]>::try_from(c).ok()) {
        Some(block) if at >= last => {
            let skip = u32::try_from(at - last).unwrap_or(u32::MAX);
            (stops32(block).checked_shr(skip).unwrap_or(0), width)
        }
        _ => (tail_stops(b.get(at..).unwrap_or_default()), width),
    }
}

/// The stops among a few bytes (at most 64), one by one.
fn tail_stops(bytes: &[u8]) -> u64 {
    bytes
        .iter()
        .take(64)
        .enumerate()
        .fold(0, |m, (i, &c)| m | (u64::from(is_stop(c)) << i))
}

fn is_stop(c: u8) -> bool {
    c == b'"' || c == b'\\' || c < 0x20
}

/// The stops among sixteen bytes: SSE2 (every x86_64 has it) compares them at once and its
/// mask says which.
#[cfg(target_arch = "x86_64")]
#[inline]
fn stops16(chunk: &[u8; 16]) -> u64 {
    use std::arch::x86_64::{
        _mm_cmpeq_epi8, _mm_loadu_si128, _mm_min_epu8, _mm_movemask_epi8, _mm_or_si128,
        _mm_set1_epi8,
    };
    // SAFETY: SSE2 is in every x86_64 target, so its intrinsics are always there to call; the
    // load reads the sixteen bytes `chunk` borrows, and `loadu` asks no alignment of them.
    let mask = unsafe {
        let v = _mm_loadu_si128(chunk.as_ptr().cast());
        let quote = _mm_cmpeq_epi8(v, _mm_set1_epi8(b'"' as i8));
        let backslash = _mm_cmpeq_epi8(v, _mm_set1_epi8(b'\\' as i8));
        // c <= 0x1f exactly when min(c, 0x1f) == c (unsigned).
        let control = _mm_cmpeq_epi8(_mm_min_epu8(v, _mm_set1_epi8(0x1f)), v);
        _mm_movemask_epi8(_mm_or_si128(_mm_or_si128(quote, backslash), control))
    };
    // The mask is sixteen bits, one per byte.
    u64::from(mask as u16)
}

/// The stops among sixteen bytes, elsewhere.
#[cfg(not(target_arch = "x86_64"))]
#[inline]
fn stops16(chunk: &[u8; 16]) -> u64 {
    portable_stops16(chunk)
}

/// The stops among sixteen bytes without SSE2: a branch-free test of all of them (which the
/// compiler vectorizes), and the mask built only when there is one. (Compiled for the tests on
/// x86_64 too, which hold it to the SSE2 version.)
#[cfg(any(test, not(target_arch = "x86_64")))]
#[inline]
fn portable_stops16(chunk: &[u8; 16]) -> u64 {
    // A byte is a stop when one of these is zero: c ^ '"', c ^ '\\', c - 0x1f (saturating).
    let any = chunk.iter().fold(false, |acc, &c| {
        acc | ((c ^ b'"').min(c ^ b'\\').min(c.saturating_sub(0x1f)) == 0)
    });
    if any {
        tail_stops(chunk)
    } else {
        0
    }
}

/// The four hex digits at `at`, as a UTF-16 code unit.
fn hex4(b: &[u8], at: usize) -> Option<u32> {
    let digits = b.get(at..at + 4)?;
    digits.iter().try_fold(0u32, |acc, &d| {
        Some((acc << 4) | char::from(d).to_digit(16)?)
    })
}

/// Append the value of a validated string's text (between its quotes) to `out`: escapes
/// decoded, surrogate pairs joined.
pub(in crate::openai) fn unescape(raw: &str, out: &mut String) {
    let b = raw.as_bytes();
    let mut at = 0;
    while let Some(run) = memchr::memchr(b'\\', b.get(at..).unwrap_or_default()) {
        out.push_str(raw.get(at..at + run).unwrap_or_default());
        at += run;
        let (c, len) = match b.get(at + 1) {
            Some(b'b') => ('\u{8}', 2),
            Some(b'f') => ('\u{c}', 2),
            Some(b'n') => ('\n', 2),
            Some(b'r') => ('\r', 2),
            Some(b't') => ('\t', 2),
            Some(b'u') => {
                let unit = hex4(b, at + 2).unwrap_or(0xFFFD);
                if (0xD800..0xDC00).contains(&unit) {
                    let low = hex4(b, at + 8).unwrap_or(0xDC00);
                    let code = 0x10000 + ((unit - 0xD800) << 10) + (low.wrapping_sub(0xDC00));
                    (char::from_u32(code).unwrap_or('\u{FFFD}'), 12)
                } else {
                    (char::from_u32(unit).unwrap_or('\u{FFFD}'), 6)
                }
            }
            // `"`, `\` and `/` stand for themselves.
            Some(&c) => (char::from(c), 2),
            None => break,
        };
        out.push(c);
        at += len;
    }
    out.push_str(raw.get(at..).unwrap_or_default());
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every byte value in every position, after digit runs of every length: the count and
    /// value `leading_digits` gives are the ones a byte-by-byte walk finds.
    #[test]
    fn eight_digits_at_once_read_as_one_at_a_time() {
        let walk = |w: [u8; 8]| {
            let digits = w.iter().take_while(|c| c.is_ascii_digit()).count();
            let value = w[..digits]
                .iter()
                .fold(0u64, |v, &c| v * 10 + u64::from(c - b'0'));
            (value, digits)
        };
        let mut words = Vec::new();
        for run in 0..=8 {
            for digit in [b'0', b'1', b'5', b'9'] {
                for stop in 0..=255u8 {
                    let mut w = [b'7'; 8];
                    w[..run].fill(digit);
                    if run < 8 {
                        w[run] = stop;
                        // What follows the first non-digit: digits, bytes that borrow, bytes
                        // that carry.
                        for (i, c) in w[run + 1..].iter_mut().enumerate() {
                            *c = [b'3', 0x00, 0xff, b'/', b':'][(i + usize::from(stop)) % 5];
                        }
                    }
                    words.push(w);
                }
            }
        }
        let mut x = 0x2545_f491_4f6c_dd1du64;
        for _ in 0..100_000 {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            // Mostly digits, now and then anything.
            let w: [u8; 8] = std::array::from_fn(|i| match (x >> (8 * i)) as u8 {
                c @ 0..=199 => b'0' + c % 10,
                c => c,
            });
            words.push(w);
        }
        for w in words {
            assert_eq!(leading_digits(u64::from_le_bytes(w)), walk(w), "{w:?}");
        }
    }

    /// What `next_stops(text, at)` must answer `got` to be right: no stop before the block it
    /// names, its mask exactly the stops within the block, the block within the text, and a
    /// block without stops only where the text ends.
    fn check_next_stops(text: &[u8], at: usize, got: (usize, u64, usize)) {
        let (block_at, mask, width) = got;
        let at_most_end = block_at + width <= text.len();
        assert!(
            block_at >= at && at_most_end && width <= 64,
            "{got:?} from {at}"
        );
        assert!(
            !text[at..block_at].iter().any(|&c| is_stop(c)),
            "{got:?} from {at}"
        );
        for i in 0..width {
            let bit = mask >> i & 1 == 1;
            assert_eq!(
                bit,
                is_stop(text[block_at + i]),
                "{got:?} from {at}, byte {i}"
            );
        }
        assert_eq!(
            mask >> width.min(63) >> u32::from(width == 64),
            0,
            "{got:?}"
        );
        assert_eq!(width == 0, block_at == text.len(), "{got:?} from {at}");
        assert!(
            mask != 0 || block_at + width == text.len(),
            "{got:?} from {at}"
        );
    }

    #[test]
    fn both_run_skippers_stop_at_the_first_block_with_a_stop() {
        let mut texts = Vec::new();
        // Plain text with a stop (or none) at every place of a few blocks.
        for len in [0, 1, 31, 32, 33, 63, 64, 65, 127, 128, 200] {
            for stop in (0..len).map(Some).chain([None]) {
                for c in [b'"', b'\\', 0x00, 0x1f] {
                    let mut text = vec![b'a'; len];
                    if let Some(i) = stop {
                        text[i] = c;
                    }
                    texts.push(text);
                }
            }
        }
        // Random text with a few random bytes here and there.
        let mut x = 0x9e37_79b9_7f4a_7c15u64;
        for _ in 0..2_000 {
            let mut text = vec![b'x'; 300];
            for _ in 0..3 {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                let at = (x % 300) as usize;
                text[at] = (x >> 32) as u8;
            }
            texts.push(text);
        }
        for text in &texts {
            for at in (0..=text.len().min(70)).chain([text.len()]) {
                check_next_stops(text, at, next_stops_32(text, at));
                #[cfg(target_arch = "x86_64")]
                if std::is_x86_feature_detected!("avx2") {
                    // SAFETY: the CPU has AVX2, checked just above.
                    check_next_stops(text, at, unsafe { next_stops_avx2(text, at) });
                }
            }
        }
    }

    /// `string`'s one- and two-block shortcut answers as `long_string` does: for strings of
    /// every length around the blocks' edges, ended by a quote, holding an escape or a control
    /// character at every place, with more text after them or none.
    #[test]
    fn the_string_shortcut_reads_as_the_long_way() {
        for len in 0..70 {
            for at in (0..len).map(Some).chain([None]) {
                for c in [b'\\', 0x01, b'"'] {
                    for after in ["", ":1,\"k\":\"0123456789012345678901234567890123\"}"] {
                        let mut text = vec![b'"'];
                        text.extend(std::iter::repeat_n(b'a', len));
                        if let Some(i) = at {
                            text[1 + i] = c;
                            if c == b'\\' && i + 1 < len {
                                text[2 + i] = b'n';
                            }
                        }
                        text.push(b'"');
                        text.extend_from_slice(after.as_bytes());
                        let Ok(text) = std::str::from_utf8(&text) else {
                            continue;
                        };
                        let (mut short, mut long) = (Scanner::new(text), Scanner::new(text));
                        let got = (short.string(), short.pos);
                        assert_eq!(got, (long.long_string(), long.pos), "{text:?}");
                    }
                }
            }
        }
    }

    #[test]
    fn both_block_tests_find_the_same_stops() {
        // Every byte value at every place among plain text, then blocks of random bytes.
        for c in 0..=255u8 {
            for i in 0..16 {
                let mut chunk = [b'a'; 16];
                chunk[i] = c;
                let want = if is_stop(c) { 1 << i } else { 0 };
                assert_eq!(stops16(&chunk), want, "{c:#x} at {i}");
                assert_eq!(portable_stops16(&chunk), want, "{c:#x} at {i}");
            }
        }
        let mut x = 0x9e37_79b9_7f4a_7c15u64;
        for _ in 0..10_000 {
            let mut chunk = [0u8; 16];
            for byte in &mut chunk {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                *byte = (x >> 24) as u8;
            }
            assert_eq!(stops16(&chunk), portable_stops16(&chunk), "{chunk:?}");
        }
    }
}

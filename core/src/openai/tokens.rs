//! Tokens: a cheap estimate of what a text will cost in tokens, and exact counts where configured.
//!
//! [`estimate_tokens`] runs on every request: at admission over the raw JSON request body, to size
//! the token reservation before the request is forwarded, and while relaying over streamed content
//! text. It takes bytes (any bytes; UTF-8 is not checked) and returns a token count, rounded up,
//! in one pass that allocates nothing. It is a linear model over byte classes whose weights were
//! fitted to tiktoken's cl100k_base and o200k_base counts (see `weights` in this file and
//! `perf/RESULTS.md`, "Prompt-token estimator"); it leans towards over-estimating, because a
//! reservation that is too small lets a client overrun its limit until settlement.
//!
//! [`count_tokens`] counts exactly with tiktoken where a route asks for it. It costs about a
//! hundred times more than the estimate, so it is never on the default path; call [`warm_up`]
//! at startup so the first request does not pay the table build.
//!
//! Errors raised: none. Both functions always return a count; see [`count_tokens`] for the one
//! fallback.

use std::sync::OnceLock;

use tiktoken_rs::CoreBPE;

use crate::sys::cpu::Avx2;

/// Fixed point of [`WEIGHTS`]: one token is `1 << WEIGHT_SHIFT` units.
const WEIGHT_SHIFT: u32 = 10;

/// What one byte adds to the estimate, by the class of the byte, in 1/1024 of a token.
///
/// Fitted on the first half of each corpus in `bench/corpus/` (`cargo run --release -p sluice
/// --example estimator -- fit` reproduces the numbers): least squares on relative error over 384-byte chunks. ASCII classes are fitted on
/// English, Rust, Python and a chat request body against the mean of cl100k and o200k (which
/// agree within 1% there), then scaled up until no fitted corpus is under-estimated. UTF-8 lead
/// bytes are fitted on Chinese and a mixed-script corpus against the geometric mean of the two
/// encodings, which differ by 1.4x (Chinese) to 2.6x (Greek, Arabic): no estimate that does not
/// know the encoding can be close to both, so it sits between them. Emoji (4-byte leads) are too
/// rare in the corpora to fit and are set by hand. Continuation bytes cost nothing: their lead
/// byte carries the character's weight.
mod weights {
    pub(super) const LETTER: u16 = 239;
    pub(super) const DIGIT: u16 = 889;
    pub(super) const PUNCT: u16 = 612;
    pub(super) const SPACE: u16 = 67;
    pub(super) const NEWLINE: u16 = 456;
    pub(super) const LEAD2: u16 = 519;
    pub(super) const LEAD3: u16 = 1069;
    /// Emoji and other astral characters: 2 tokens each (cl100k spends 2-3, o200k 1-2).
    pub(super) const LEAD4: u16 = 2048;
    /// Bytes that never occur in UTF-8 (0xC0, 0xC1, 0xF5-0xFF): byte-level BPE spends a token
    /// on each.
    pub(super) const INVALID: u16 = 1024;
    /// `\r` (it pairs with the `\n` that follows) and UTF-8 continuation bytes.
    pub(super) const FREE: u16 = 0;
}

/// The byte classes the estimate distinguishes. Public for the tool that fits their weights
/// (`bench/tools/src/bin/estimator.rs`); the gateway only calls [`estimate_tokens`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Class {
    Letter,
    Digit,
    Punct,
    Space,
    Newline,
    Free,
    Lead2,
    Lead3,
    Lead4,
    Invalid,
}

/// The class of byte `b`.
pub const fn class_of(b: u8) -> Class {
    match b {
        b'a'..=b'z' | b'A'..=b'Z' => Class::Letter,
        b'0'..=b'9' => Class::Digit,
        b' ' | b'\t' => Class::Space,
        b'\n' => Class::Newline,
        b'\r' | 0x80..=0xBF => Class::Free,
        // Other ASCII, control characters included: each is usually a token or part of a short
        // punctuation run.
        0x00..=0x7F => Class::Punct,
        0xC2..=0xDF => Class::Lead2,
        0xE0..=0xEF => Class::Lead3,
        0xF0..=0xF4 => Class::Lead4,
        0xC0 | 0xC1 | 0xF5..=0xFF => Class::Invalid,
    }
}

/// What one byte of `class` adds to the estimate, in 1/1024 of a token.
pub const fn class_weight(class: Class) -> u16 {
    match class {
        Class::Letter => weights::LETTER,
        Class::Digit => weights::DIGIT,
        Class::Punct => weights::PUNCT,
        Class::Space => weights::SPACE,
        Class::Newline => weights::NEWLINE,
        Class::Free => weights::FREE,
        Class::Lead2 => weights::LEAD2,
        Class::Lead3 => weights::LEAD3,
        Class::Lead4 => weights::LEAD4,
        Class::Invalid => weights::INVALID,
    }
}

/// Per-byte weight, so the hot loop is one table load and one add per byte.
const WEIGHTS: [u16; 256] = {
    let mut table = [0u16; 256];
    let mut b = 0;
    while b < 256 {
        table[b] = class_weight(class_of(b as u8));
        b += 1;
    }
    table
};

#[inline(always)]
fn weight(b: u8) -> u64 {
    u64::from(WEIGHTS[usize::from(b)])
}

/// Estimates how many tokens `bytes` hold, rounded up; 0 for empty input.
///
/// On held-out text: 0-12% over tiktoken (cl100k and o200k alike) on English, code and a chat
/// request body; on Chinese 9% under cl100k and 31% over o200k, which itself spends 1.4x fewer
/// tokens. Allocates nothing; with AVX2 the bytes are weighed thirty-two at a time (counts of
/// each class), else one table load and add per byte (about 0.28 ns a byte).
///
/// Applied to a JSON body it counts the JSON syntax too, so it lands about 20% above what the
/// upstream bills for the messages. It sees bytes, not meaning: a body that escapes non-ASCII
/// text as `\uXXXX` (Python's `json.dumps` default) is estimated 3-4x above the billed count for
/// Chinese, and base64 data (inline images) far above.
pub fn estimate_tokens(bytes: &[u8]) -> u64 {
    let (blocks, rest) = match Avx2::detect() {
        #[cfg(target_arch = "x86_64")]
        Some(_) if bytes.len() >= 32 => {
            // SAFETY: an `Avx2` exists only where the CPU has AVX2 (`Avx2::detect`).
            let (weight, covered) = unsafe { weigh_blocks_avx2(bytes) };
            (weight, bytes.get(covered..).unwrap_or_default())
        }
        _ => (0, bytes),
    };
    (blocks + weigh_bytes(rest)).div_ceil(1 << WEIGHT_SHIFT)
}

/// What `bytes` weigh, one table load and add per byte, in 1/1024 of a token.
fn weigh_bytes(bytes: &[u8]) -> u64 {
    // Four accumulators so the adds do not wait on each other.
    let mut acc = [0u64; 4];
    let mut chunks = bytes.chunks_exact(8);
    for chunk in &mut chunks {
        if let &[b0, b1, b2, b3, b4, b5, b6, b7] = chunk {
            acc[0] += weight(b0) + weight(b4);
            acc[1] += weight(b1) + weight(b5);
            acc[2] += weight(b2) + weight(b6);
            acc[3] += weight(b3) + weight(b7);
        }
    }
    let mut total = acc[0] + acc[1] + acc[2] + acc[3];
    for &b in chunks.remainder() {
        total += weight(b);
    }
    total
}

/// What the whole 32-byte blocks at the start of `bytes` weigh (as [`weigh_bytes`] would say),
/// and how many bytes that is. A block's weight is its count of each class times the class's
/// weight. Each class is one compare of the 32 bytes at once, whose all-ones lanes are
/// subtracted from a counter per byte lane (so a lane adds 1 where its byte is of the class);
/// the lanes are summed every 255 blocks, before a byte lane can overflow. About 0.7
/// instructions a byte, against the table's three. The bytes above ASCII and their four classes
/// are counted only in blocks that hold such bytes.
///
/// # Safety
/// The CPU must have AVX2.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn weigh_blocks_avx2(bytes: &[u8]) -> (u64, usize) {
    use std::arch::x86_64::{
        __m256i, _mm256_cmpeq_epi8, _mm256_cmpgt_epi8, _mm256_extract_epi64, _mm256_loadu_si256,
        _mm256_min_epu8, _mm256_movemask_epi8, _mm256_or_si256, _mm256_sad_epu8, _mm256_set1_epi8,
        _mm256_setzero_si256, _mm256_sub_epi8,
    };
    // The bytes of `v` in `low..=high` (unsigned), as all-ones lanes: c - low wraps below `low`,
    // so it is at most high - low exactly for those.
    let in_range = |v: __m256i, low: u8, high: u8| {
        let offset = _mm256_sub_epi8(v, _mm256_set1_epi8(low as i8));
        let most = _mm256_set1_epi8((high - low) as i8);
        _mm256_cmpeq_epi8(_mm256_min_epu8(offset, most), offset)
    };
    let is = |v: __m256i, c: u8| _mm256_cmpeq_epi8(v, _mm256_set1_epi8(c as i8));
    let zero = _mm256_setzero_si256();
    // The sum of a counter's byte lanes.
    let total_of = |lanes: __m256i| {
        let sums = _mm256_sad_epu8(lanes, zero);
        (_mm256_extract_epi64::<0>(sums)
            + _mm256_extract_epi64::<1>(sums)
            + _mm256_extract_epi64::<2>(sums)
            + _mm256_extract_epi64::<3>(sums)) as u64
    };
    // letter, digit, space, newline, carriage return, above ASCII, continuation, lead 2, 3, 4.
    let mut counts = [0u64; 10];
    let whole = bytes.len() / 32 * 32;
    for group in bytes[..whole].chunks(255 * 32) {
        let mut lanes = [zero; 10];
        for block in group.chunks_exact(32) {
            // SAFETY: `block` is thirty-two bytes, and `loadu` asks no alignment of them.
            let v = unsafe { _mm256_loadu_si256(block.as_ptr().cast()) };
            // Bit 5 folds upper-case ASCII letters onto lower-case, and nothing else onto them.
            let folded = _mm256_or_si256(v, _mm256_set1_epi8(0x20));
            let found = [
                in_range(folded, b'a', b'z'),
                in_range(v, b'0', b'9'),
                _mm256_or_si256(is(v, b' '), is(v, b'\t')),
                is(v, b'\n'),
                is(v, b'\r'),
            ];
            for (lane, found) in lanes.iter_mut().zip(found) {
                *lane = _mm256_sub_epi8(*lane, found);
            }
            if _mm256_movemask_epi8(v) != 0 {
                let above = [
                    _mm256_cmpgt_epi8(zero, v),
                    in_range(v, 0x80, 0xBF),
                    in_range(v, 0xC2, 0xDF),
                    in_range(v, 0xE0, 0xEF),
                    in_range(v, 0xF0, 0xF4),
                ];
                for (lane, found) in lanes[5..].iter_mut().zip(above) {
                    *lane = _mm256_sub_epi8(*lane, found);
                }
            }
        }
        for (count, lane) in counts.iter_mut().zip(lanes) {
            *count += total_of(lane);
        }
    }
    let [letter, digit, space, newline, carriage, non_ascii, continuation, lead2, lead3, lead4] =
        counts;
    // What no count above took: ASCII punctuation and control bytes, and bytes UTF-8 never has.
    let punct = whole as u64 - non_ascii - letter - digit - space - newline - carriage;
    let invalid = non_ascii - continuation - lead2 - lead3 - lead4;
    let weight = |n: u64, class: Class| n * u64::from(class_weight(class));
    let total = weight(letter, Class::Letter)
        + weight(digit, Class::Digit)
        + weight(space, Class::Space)
        + weight(newline, Class::Newline)
        + weight(carriage + continuation, Class::Free)
        + weight(punct, Class::Punct)
        + weight(lead2, Class::Lead2)
        + weight(lead3, Class::Lead3)
        + weight(lead4, Class::Lead4)
        + weight(invalid, Class::Invalid);
    (total, whole)
}

/// A tiktoken encoding that exact counting can use.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Encoding {
    /// `cl100k_base`: GPT-4, GPT-3.5-turbo, text-embedding-3.
    Cl100k,
    /// `o200k_base`: GPT-4o, GPT-4.1, GPT-4.5, GPT-5 and the o-series.
    O200k,
}

impl Encoding {
    /// The encoding OpenAI uses for `model`: o200k for `gpt-4o*`, `gpt-4.1*`, `gpt-4.5*`,
    /// `gpt-5*`, `o1*`, `o3*`, `o4*` and `chatgpt-4o*`; cl100k for anything else. A provider
    /// prefix (`openai/gpt-4o`) and a fine-tune prefix (`ft:gpt-4o-mini:org::id`) are looked
    /// through; case is ignored.
    pub fn for_model(model: &str) -> Encoding {
        let name = model.rsplit('/').next().unwrap_or(model);
        let name = strip_prefix_ignore_case(name, "ft:").unwrap_or(name);
        const O200K_PREFIXES: [&str; 8] = [
            "gpt-4o",
            "gpt-4.1",
            "gpt-4.5",
            "gpt-5",
            "o1",
            "o3",
            "o4",
            "chatgpt-4o",
        ];
        if O200K_PREFIXES
            .iter()
            .any(|prefix| strip_prefix_ignore_case(name, prefix).is_some())
        {
            Encoding::O200k
        } else {
            Encoding::Cl100k
        }
    }

    /// The encoding's tiktoken name, as configuration spells it.
    pub fn name(self) -> &'static str {
        match self {
            Encoding::Cl100k => "cl100k_base",
            Encoding::O200k => "o200k_base",
        }
    }

    /// The encoding named `name` (`cl100k_base` or `o200k_base`), if it is one of these.
    pub fn from_name(name: &str) -> Option<Encoding> {
        match name {
            "cl100k_base" => Some(Encoding::Cl100k),
            "o200k_base" => Some(Encoding::O200k),
            _ => None,
        }
    }
}

fn strip_prefix_ignore_case<'a>(s: &'a str, prefix: &str) -> Option<&'a str> {
    let head = s.get(..prefix.len())?;
    if head.eq_ignore_ascii_case(prefix) {
        s.get(prefix.len()..)
    } else {
        None
    }
}

/// The encoding's tables, built once per process on first use and shared read-only by every
/// worker. Building decodes the embedded tables (a few hundred ms), hence [`warm_up`]. `None`
/// only if tiktoken-rs rejects its own embedded data.
fn bpe(encoding: Encoding) -> Option<&'static CoreBPE> {
    static CL100K: OnceLock<Option<CoreBPE>> = OnceLock::new();
    static O200K: OnceLock<Option<CoreBPE>> = OnceLock::new();
    // tiktoken-rs's own `*_singleton()` helpers panic if the build fails; this keeps the error.
    match encoding {
        Encoding::Cl100k => CL100K.get_or_init(|| tiktoken_rs::cl100k_base().ok()),
        Encoding::O200k => O200K.get_or_init(|| tiktoken_rs::o200k_base().ok()),
    }
    .as_ref()
}

/// Builds `encoding`'s tables now, so the first request that counts does not wait for them.
/// Returns whether exact counting is available (always, unless the embedded tables are broken).
pub fn warm_up(encoding: Encoding) -> bool {
    bpe(encoding).is_some()
}

/// Longest text handed to tiktoken in one call. tiktoken-rs unwraps its regex's result, and the
/// backtracking regex gives up (so tiktoken-rs panics, which aborts the process) on runs of
/// several hundred KiB: o200k fails on 1 MiB of spaces, passes at 256 KiB. 8 KiB keeps every
/// call 30x below that and keeps its time linear in the text.
const MAX_PIECE: usize = 8 * 1024;

/// Counts the tokens of `text` exactly, as tiktoken's `encode_ordinary` does: special-token
/// strings such as `<|endoftext|>` count as the ordinary text they are.
///
/// Long text is counted in pieces of at most 8 KiB, cut where tiktoken's pre-tokenizer would cut
/// anyway, so the sum is exact; only a stretch of 4 KiB with no space or line break (a run of
/// one character, say) is cut blindly, which may move the count by a token per cut. If the
/// encoding's tables cannot be built this returns [`estimate_tokens`] instead.
pub fn count_tokens(encoding: Encoding, text: &str) -> usize {
    let Some(bpe) = bpe(encoding) else {
        return usize::try_from(estimate_tokens(text.as_bytes())).unwrap_or(usize::MAX);
    };
    let mut total = 0;
    let mut rest = text;
    while !rest.is_empty() {
        // piece_len returns a char boundary, so the split always succeeds.
        let Some((piece, tail)) = rest.split_at_checked(piece_len(rest)) else {
            return total + bpe.encode_ordinary(rest).len();
        };
        total += bpe.encode_ordinary(piece).len();
        rest = tail;
    }
    total
}

/// Length of the next piece of `text` to count: all of it if it is short, else the last exact
/// cut in `MAX_PIECE / 2 ..= MAX_PIECE`, else the last char boundary at or below `MAX_PIECE`.
/// Always a char boundary above 0 for non-empty text.
fn piece_len(text: &str) -> usize {
    if text.len() <= MAX_PIECE {
        return text.len();
    }
    let bytes = text.as_bytes();
    if let Some(cut) = (MAX_PIECE / 2..=MAX_PIECE)
        .rev()
        .find(|&i| is_exact_cut(text, bytes, i))
    {
        return cut;
    }
    // A char is at most 4 bytes, so a boundary lies within the last 4.
    (MAX_PIECE - 3..=MAX_PIECE)
        .rev()
        .find(|&i| text.is_char_boundary(i))
        .unwrap_or(MAX_PIECE)
}

/// Whether no pre-token of cl100k or o200k spans byte `i` of `text` (0 < i < len), so counting
/// the two sides apart gives the same total. Both patterns match left to right with no
/// look-behind, so the right side always splits as before; the left side does if the pre-token
/// that ends at `i` ends there for reasons inside the left side. Two cases are certain:
/// - a space or tab after a printable ASCII character: no letter, digit or punctuation run takes
///   in a space, and whitespace runs start after `i`;
/// - a line break followed by a character that is neither whitespace nor `/`: runs of line
///   breaks (alone, after whitespace, or after punctuation, where o200k also takes `/`) end
///   there.
fn is_exact_cut(text: &str, bytes: &[u8], i: usize) -> bool {
    let (Some(&before), Some(&at)) = (bytes.get(i.wrapping_sub(1)), bytes.get(i)) else {
        return false;
    };
    if (at == b' ' || at == b'\t') && before.is_ascii_graphic() {
        return true;
    }
    if before == b'\n' {
        // `i` follows an ASCII byte, so it is a char boundary and `get` succeeds.
        if let Some(next) = text.get(i..).and_then(|s| s.chars().next()) {
            return !next.is_whitespace() && next != '/';
        }
    }
    false
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    /// name, text, and the lowest and highest error (in %) the estimate may show on the held-out
    /// half against either encoding. `bench/tools/src/bin/estimator.rs` fits the weights on the first
    /// halves of the same corpora, cut the same way (`halves`), and reports on the second.
    const CORPORA: [(&str, &str, f64, f64); 6] = [
        // Typical text: within 20%, and never more than a little under (the ASCII weights were
        // scaled so the fitted halves are not under-estimated).
        (
            "english",
            include_str!("../../../bench/corpus/english.txt"),
            -5.0,
            20.0,
        ),
        (
            "rust",
            include_str!("../../../bench/corpus/rust.txt"),
            -5.0,
            20.0,
        ),
        (
            "python",
            include_str!("../../../bench/corpus/python.txt"),
            -5.0,
            20.0,
        ),
        (
            "chat-json",
            include_str!("../../../bench/corpus/chat-request.json"),
            -5.0,
            20.0,
        ),
        // cl100k spends 1.4x the tokens of o200k here, so no estimate is within 18% of both.
        // The weight sits between them: not far under cl100k, at most a third over o200k.
        (
            "chinese",
            include_str!("../../../bench/corpus/chinese.txt"),
            -20.0,
            35.0,
        ),
        // Greek and Arabic differ 2.6x between the encodings, the whole corpus 1.6x.
        (
            "mixed",
            include_str!("../../../bench/corpus/mixed.txt"),
            -30.0,
            30.0,
        ),
    ];

    /// The first half (fitted on) and second half (held out) of a corpus, cut at a char boundary.
    fn halves(text: &str) -> (&str, &str) {
        let mut mid = text.len() / 2;
        while !text.is_char_boundary(mid) {
            mid += 1;
        }
        text.split_at(mid)
    }

    fn exact(encoding: Encoding, text: &str) -> usize {
        bpe(encoding).unwrap().encode_ordinary(text).len()
    }

    fn error_pct(estimate: u64, exact: usize) -> f64 {
        100.0 * (estimate as f64 / exact as f64 - 1.0)
    }

    #[test]
    fn estimate_tracks_tiktoken_on_held_out_halves() {
        for (name, text, lowest, highest) in CORPORA {
            let (_, held_out) = halves(text);
            let estimate = estimate_tokens(held_out.as_bytes());
            for encoding in [Encoding::Cl100k, Encoding::O200k] {
                let exact = exact(encoding, held_out);
                let err = error_pct(estimate, exact);
                assert!(
                    (lowest..=highest).contains(&err),
                    "{name} / {}: estimate {estimate} vs {exact} exact is {err:+.1}%, \
                     allowed {lowest:+}% to {highest:+}%",
                    encoding.name()
                );
            }
        }
    }

    #[test]
    fn estimate_basics() {
        assert_eq!(estimate_tokens(b""), 0);
        // Rounds up: one letter is a fraction of a token, but costs one.
        assert_eq!(estimate_tokens(b"a"), 1);
        // A Han character is about a token; its continuation bytes add nothing.
        let han = estimate_tokens("中".repeat(100).as_bytes());
        assert!((90..=120).contains(&han), "{han}");
        // Every length, so the 8-byte loop and the remainder agree with a plain sum.
        let text = include_bytes!("../../../bench/corpus/mixed.txt");
        for len in 0..64 {
            let plain: u64 = text[..len].iter().map(|&b| weight(b)).sum();
            assert_eq!(
                estimate_tokens(&text[..len]),
                plain.div_ceil(1024),
                "len {len}"
            );
        }
        // Concatenation never costs more than the parts (up to their rounding), nor less than
        // either.
        let (a, b) = text.split_at(1000);
        let whole = estimate_tokens(text);
        assert!(whole <= estimate_tokens(a) + estimate_tokens(b));
        assert!(whole >= estimate_tokens(a).max(estimate_tokens(b)));
        // Arbitrary bytes are fine.
        assert_eq!(estimate_tokens(&[0xFF; 10]), 10);
    }

    #[test]
    #[cfg(target_arch = "x86_64")]
    fn blocks_weigh_what_their_bytes_weigh() {
        let Some(_) = Avx2::detect() else {
            eprintln!("no AVX2 here: only the table runs");
            return;
        };
        // SAFETY: the CPU has AVX2, checked just above.
        let blocks = |b: &[u8]| unsafe { weigh_blocks_avx2(b) };
        // Every byte value at every place of a block, among ASCII letters and among Han text
        // (so each sits in a block with and without other bytes above ASCII).
        let han = "中文".repeat(6).into_bytes();
        for c in 0..=255u8 {
            for i in 0..32 {
                for base in [&[b'a'; 32][..], &han[..32]] {
                    let mut block = base.to_vec();
                    block[i] = c;
                    assert_eq!(blocks(&block), (weigh_bytes(&block), 32), "{c:#x} at {i}");
                }
            }
        }
        // Random bytes and the corpora, at lengths that leave every remainder.
        let mut x = 0x9E37_79B9_7F4A_7C15u64;
        let mut random = vec![0u8; 4096];
        for b in random.iter_mut() {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            *b = (x >> 24) as u8;
        }
        let mixed = include_bytes!("../../../bench/corpus/mixed.txt");
        // One class in every byte lane for more blocks than a lane counts to (255).
        let runs = [b"a".repeat(40_000), "\u{e9}".repeat(20_000).into_bytes()];
        for text in [&random[..], &mixed[..], &runs[0][..], &runs[1][..]] {
            for len in (0..200).chain([text.len() - 1, text.len()]) {
                let text = &text[..len];
                let (weight, covered) = blocks(text);
                assert_eq!(covered, len / 32 * 32);
                assert_eq!(weight, weigh_bytes(&text[..covered]), "len {len}");
                assert_eq!(
                    estimate_tokens(text),
                    weigh_bytes(text).div_ceil(1024),
                    "len {len}"
                );
            }
        }
    }

    #[test]
    fn table_matches_classes() {
        assert_eq!(WEIGHTS[usize::from(b'q')], weights::LETTER);
        assert_eq!(WEIGHTS[usize::from(b'7')], weights::DIGIT);
        assert_eq!(WEIGHTS[usize::from(b'{')], weights::PUNCT);
        assert_eq!(WEIGHTS[usize::from(b' ')], weights::SPACE);
        assert_eq!(WEIGHTS[usize::from(b'\n')], weights::NEWLINE);
        assert_eq!(WEIGHTS[0xA9], weights::FREE);
        assert_eq!(WEIGHTS[0xD0], weights::LEAD2);
        assert_eq!(WEIGHTS[0xE4], weights::LEAD3);
        assert_eq!(WEIGHTS[0xF0], weights::LEAD4);
        assert_eq!(WEIGHTS[0xC0], weights::INVALID);
    }

    #[test]
    fn encoding_for_model() {
        for model in [
            "gpt-4o",
            "gpt-4o-mini-2024-07-18",
            "GPT-4o",
            "gpt-4.1-nano",
            "gpt-4.5-preview",
            "gpt-5",
            "gpt-5-mini",
            "o1",
            "o1-preview",
            "o3-mini",
            "o4-mini",
            "chatgpt-4o-latest",
            "openai/gpt-4o",
            "ft:gpt-4o-mini:acme::abc123",
        ] {
            assert_eq!(Encoding::for_model(model), Encoding::O200k, "{model}");
        }
        for model in [
            "gpt-4",
            "gpt-4-turbo",
            "gpt-3.5-turbo",
            "text-embedding-3-small",
            "llama-3.1-70b",
            "",
            "o",
            "ft:gpt-3.5-turbo:acme::x",
        ] {
            assert_eq!(Encoding::for_model(model), Encoding::Cl100k, "{model}");
        }
        for encoding in [Encoding::Cl100k, Encoding::O200k] {
            assert_eq!(Encoding::from_name(encoding.name()), Some(encoding));
        }
        assert_eq!(Encoding::from_name("p50k_base"), None);
    }

    #[test]
    fn count_is_exact_across_pieces() {
        // Well past MAX_PIECE, with prose, code, JSON and paragraphs of Chinese, so pieces are
        // cut at spaces and at line breaks before CJK text.
        let mut text = String::new();
        while text.len() < 6 * MAX_PIECE {
            for (_, corpus, ..) in CORPORA {
                text.push_str(corpus);
            }
        }
        for encoding in [Encoding::Cl100k, Encoding::O200k] {
            assert!(warm_up(encoding));
            assert_eq!(count_tokens(encoding, &text), exact(encoding, &text));
        }
        assert_eq!(count_tokens(Encoding::O200k, ""), 0);
        assert_eq!(count_tokens(Encoding::Cl100k, "hello world"), 2);
        // Special-token strings are ordinary text.
        assert!(count_tokens(Encoding::Cl100k, "<|endoftext|>") > 1);
    }

    #[test]
    fn exact_cuts_are_exact() {
        // Every place is_exact_cut accepts in the corpora really is a pre-token boundary.
        for (name, text, ..) in CORPORA {
            let bytes = text.as_bytes();
            for encoding in [Encoding::Cl100k, Encoding::O200k] {
                let whole = exact(encoding, text);
                for i in (1..bytes.len())
                    .filter(|&i| is_exact_cut(text, bytes, i))
                    .step_by(7)
                {
                    let (a, b) = text.split_at(i);
                    assert_eq!(
                        exact(encoding, a) + exact(encoding, b),
                        whole,
                        "{name} / {} cut at {i}",
                        encoding.name()
                    );
                }
            }
        }
    }

    #[test]
    fn long_runs_do_not_reach_tiktoken_whole() {
        // One tiktoken call on 1 MiB of spaces exceeds o200k's regex limit and panics; in pieces
        // it is counted.
        let spaces = " ".repeat(1 << 20);
        assert!(count_tokens(Encoding::O200k, &spaces) > 0);
        let carets = "^".repeat(1 << 20);
        assert!(count_tokens(Encoding::Cl100k, &carets) > 0);
        // Blind cuts land on char boundaries.
        let han = "中".repeat(10_000);
        assert!(count_tokens(Encoding::O200k, &han) > 0);
    }
}

//! xorshift64*: a fast, deterministic generator — good enough to spread load (and to make
//! reproducible test noise), never for secrets.

/// Advance `state` (never 0) and return the next number.
#[inline]
pub(crate) fn xorshift64star(state: &mut u64) -> u64 {
    let mut x = *state;
    x ^= x >> 12;
    x ^= x << 25;
    x ^= x >> 27;
    *state = x;
    x.wrapping_mul(0x2545_f491_4f6c_dd1d)
}

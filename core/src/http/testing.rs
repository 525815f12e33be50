//! Tests only: generating heads. Here, in the HTTP layer, which may not import the layers
//! below it (`sys` included).

/// A reproducible stream of numbers for tests that generate inputs: each call gives one below
/// its argument (xorshift64 from `seed`, which must not be 0).
pub(crate) fn numbers(seed: u64) -> impl FnMut(usize) -> usize {
    let mut state = seed;
    move |below: usize| {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        (state % below as u64) as usize
    }
}

/// One to three bytes of `bytes` changed to one of `noise` or (one time in four) dropped, at
/// places `next` picks: a generated input made slightly wrong.
pub(crate) fn damage(bytes: &mut Vec<u8>, next: &mut impl FnMut(usize) -> usize, noise: &[u8]) {
    for _ in 0..1 + next(3) {
        if bytes.is_empty() {
            break;
        }
        let at = next(bytes.len());
        if next(4) == 0 {
            bytes.remove(at);
        } else {
            bytes[at] = noise[next(noise.len())];
        }
    }
}

//! What the CPU can do beyond the build's baseline, asked at run time: the SIMD paths of the
//! JSON scan and the token estimate take a proof that it has AVX2 instead of asking again.

/// Proof that this CPU has AVX2: made only by [`Avx2::detect`], so a function that holds one
/// may call an `avx2` target-feature function.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Avx2(());

impl Avx2 {
    /// `Some` where the CPU has AVX2 (std caches the answer: asking costs a load and a test).
    #[inline]
    pub(crate) fn detect() -> Option<Avx2> {
        #[cfg(target_arch = "x86_64")]
        if std::is_x86_feature_detected!("avx2") {
            return Some(Avx2(()));
        }
        None
    }
}

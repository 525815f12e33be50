//! Tests only: monoio runtimes to run a future on, as the workers build theirs. Here, in the
//! lowest layer, so every layer's tests may use them.

use std::future::Future;

/// Run `f` to completion on a monoio runtime with timers, built as the workers build theirs
/// (io_uring when the kernel has it, epoll otherwise).
pub(crate) fn block_on<F: Future>(f: F) -> F::Output {
    #[allow(clippy::expect_used)]
    let mut rt = monoio::RuntimeBuilder::<monoio::FusionDriver>::new()
        .enable_timer()
        .build()
        .expect("monoio runtime");
    rt.block_on(f)
}

/// [`block_on`] on the epoll driver, whatever the kernel has.
pub(crate) fn block_on_legacy<F: Future>(f: F) -> F::Output {
    #[allow(clippy::expect_used)]
    let mut rt = monoio::RuntimeBuilder::<monoio::LegacyDriver>::new()
        .enable_timer()
        .build()
        .expect("monoio runtime");
    rt.block_on(f)
}

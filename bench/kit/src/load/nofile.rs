//! The open-file limit, raised for tools that hold thousands of sockets. Shared by sluice-load
//! and `sluice-probe uring`.

/// Raises the open-file soft limit to the hard limit. Returns the limit now in force when it is
/// still below `needed` descriptors (for the caller to say so), else `None`.
pub(crate) fn raise_nofile(needed: usize) -> Option<u64> {
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: `lim` is a valid, writable rlimit.
    if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) } != 0 {
        return None;
    }
    if lim.rlim_cur < lim.rlim_max {
        let want = libc::rlimit {
            rlim_cur: lim.rlim_max,
            rlim_max: lim.rlim_max,
        };
        // SAFETY: `want` is a valid rlimit; raising the soft limit up to the hard one is allowed.
        if unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &want) } == 0 {
            lim = want;
        }
    }
    ((lim.rlim_cur as u128) < needed as u128).then_some(lim.rlim_cur)
}

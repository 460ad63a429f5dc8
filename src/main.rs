//! The `agentrace` binary: parses the command line and hands over to the library.

use std::process::ExitCode;

/// The proxy and the replayer allocate and free small buffers on every request from several
/// threads; mimalloc does that with far less work than the system allocator.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// mimalloc's options, by their number in its header (`mi_option_purge_delay`,
/// `mi_option_allow_thp`).
const MI_OPTION_PURGE_DELAY: libmimalloc_sys::mi_option_t = 15;
const MI_OPTION_ALLOW_THP: libmimalloc_sys::mi_option_t = 43;

fn main() -> ExitCode {
    hold_bodies_in_small_pages();
    return_freed_memory_promptly();
    agentrace::cli::main()
}

/// mimalloc keeps freed memory for a second before giving it back to the system. Request
/// bodies of tens of MiB come and go faster than that, so a proxy under upload load would
/// hold far more than its body budget; purge at once instead, unless the user set
/// `MIMALLOC_PURGE_DELAY` themselves.
fn return_freed_memory_promptly() {
    if std::env::var_os("MIMALLOC_PURGE_DELAY").is_none() {
        // SAFETY: called first thing in `main`, before any other thread exists, as
        // mimalloc requires of `mi_option_set`.
        unsafe { libmimalloc_sys::mi_option_set(MI_OPTION_PURGE_DELAY, 0) }
    }
}

/// With transparent huge pages, the first byte read into a held body's part makes the
/// kernel zero 2 MiB at once on the worker that serves every other connection, and freed
/// memory goes back only in 2 MiB pieces: under 24 concurrent 60 MiB uploads that was a
/// tenth more peak memory and the slowest small requests. Bodies live for seconds, so huge
/// pages buy them nothing. `MIMALLOC_ALLOW_THP` set by the user wins.
fn hold_bodies_in_small_pages() {
    if std::env::var_os("MIMALLOC_ALLOW_THP").is_none() {
        // SAFETY: as above, before any other thread exists.
        unsafe { libmimalloc_sys::mi_option_set(MI_OPTION_ALLOW_THP, 0) }
        // Also for memory not from mimalloc and on systems whose THP mode is `always`; a
        // kernel without the call keeps its default, which is only slower.
        let _ = rustix::thread::disable_transparent_huge_pages(true);
    }
}

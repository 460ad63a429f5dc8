//! The `agentrace` binary: parses the command line and hands over to the library.

use std::process::ExitCode;

/// The proxy and the replayer allocate and free small buffers on every request from several
/// threads; mimalloc does that with far less work than the system allocator.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// mimalloc's `purge_delay` option (`mi_option_purge_delay` in its header).
const MI_OPTION_PURGE_DELAY: libmimalloc_sys::mi_option_t = 15;

fn main() -> ExitCode {
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

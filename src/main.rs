//! The `agentrace` binary: parses the command line and hands over to the library.

use std::process::ExitCode;

/// The proxy and the replayer allocate and free small buffers on every request from several
/// threads; mimalloc does that with far less work than the system allocator.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn main() -> ExitCode {
    agentrace::cli::main()
}

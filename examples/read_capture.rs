//! Reading a capture directory (what `agentrace proxy` records with `capture.enabled`) from a
//! program: every exchange with its session, backend, status and timings, request bodies
//! rebuilt from their deltas, in the order the requests arrived, and whatever the recorder
//! reported dropped or a segment cut.
//!
//! ```sh
//! cargo run --example read_capture -- captures/
//! ```

use std::path::PathBuf;
use std::process::ExitCode;

use agentrace::capture::reader;

fn main() -> ExitCode {
    let Some(dir) = std::env::args_os().nth(1).map(PathBuf::from) else {
        eprintln!("usage: read_capture <capture directory>");
        return ExitCode::from(2);
    };
    let mut capture = match reader::read_dir(&dir) {
        Ok(capture) => capture,
        Err(e) => {
            eprintln!("{}: {e}", dir.display());
            return ExitCode::FAILURE;
        }
    };
    // Exchanges are stored as they finish; list them in the order their requests arrived.
    capture.exchanges.sort_by_key(|e| e.record.id);
    for e in &capture.exchanges {
        let r = &e.record;
        let ms =
            |us: Option<u64>| us.map_or("-".to_string(), |us| format!("{:.1}", us as f64 / 1e3));
        println!(
            "{} {} {} session={} backend={} status={} first_byte_ms={} end_ms={} request_bytes={} response_bytes={} events={}",
            r.id,
            r.method,
            r.path,
            r.session.as_deref().unwrap_or("-"),
            r.backend,
            r.response.as_ref().map_or("-".to_string(), |resp| resp.status.to_string()),
            ms(r.t.first_byte_us),
            ms(Some(r.t.end_us)),
            e.request_body.as_ref().map_or(0, Vec::len),
            e.response_body.as_ref().map_or(0, Vec::len),
            e.event_offsets_us().len(),
        );
    }
    println!(
        "{} exchanges in {} segments; {} dropped; {} cut segments",
        capture.exchanges.len(),
        capture.segments.len(),
        capture.dropped,
        capture.cuts.len()
    );
    ExitCode::SUCCESS
}

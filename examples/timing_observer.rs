//! The server of `scripts/bench-timing.sh`, not an example of the crate's API: answers every
//! chat completion with SSE events on a fixed script of pauses and prints one JSON line per
//! answered request, with its kernel arrival times and each event's write time on
//! CLOCK_MONOTONIC, the clock of the replayer's `events.jsonl` (see
//! `tests/support/observer.rs`).
//!
//!   timing_observer PORT_FILE [FIRST_MS=20] [GAP_MS=5] [EVENTS=8]
//!
//! Listens on 127.0.0.1 on a port the system picks, writes it to PORT_FILE once listening,
//! and serves until killed.

#[path = "../tests/support/observer.rs"]
mod observer;

use std::io::Write;
use std::time::Duration;

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let Some(port_file) = args.first() else {
        eprintln!("usage: timing_observer PORT_FILE [FIRST_MS] [GAP_MS] [EVENTS]");
        std::process::exit(64);
    };
    let number = |i: usize, default: f64| -> f64 {
        args.get(i).map_or(default, |v| {
            v.parse().unwrap_or_else(|_| {
                eprintln!("timing_observer: argument {i} ({v:?}) is not a number");
                std::process::exit(64)
            })
        })
    };
    let script = observer::Script {
        first: Duration::from_secs_f64(number(1, 20.0) / 1e3),
        gap: Duration::from_secs_f64(number(2, 5.0) / 1e3),
        events: number(3, 8.0) as usize,
    };
    let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind 127.0.0.1:0");
    let (tx, rx) = std::sync::mpsc::channel();
    let addr = observer::spawn(listener, script, tx);
    std::fs::write(port_file, addr.port().to_string()).expect("write the port file");
    let stdout = std::io::stdout();
    for exchange in rx {
        let mut out = stdout.lock();
        let _ = writeln!(out, "{}", exchange.to_json());
        let _ = out.flush();
    }
}

//! The programs in `examples/` run, against real servers on ports the system picks, and print
//! what they claim to: an example that no longer compiles, or that compiles but no longer does
//! what its doc comment says, fails here.
//!
//! `cargo test` builds the examples with the tests; each test here builds its example again
//! with the same cargo (a no-op then), so that `cargo test --test examples_run` alone runs
//! fresh binaries too.

mod support;

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use support::backends::{client, fetch};
use support::capture::{config, start_proxy, start_sim};

/// The example `name`'s binary, built by the cargo running this test, into its target
/// directory and profile.
fn example(name: &str) -> PathBuf {
    let exe = std::env::current_exe().unwrap();
    // <target>/<profile>/deps/examples_run-<hash>
    let profile_dir = exe.parent().and_then(Path::parent).unwrap();
    let target_dir = profile_dir.parent().unwrap();
    let profile = match profile_dir.file_name().and_then(|n| n.to_str()) {
        Some("debug") => "dev",
        Some(other) => other,
        None => panic!("no profile directory above {}", exe.display()),
    };
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let status = Command::new(cargo)
        .args(["build", "--quiet", "--example", name, "--profile", profile])
        .arg("--target-dir")
        .arg(target_dir)
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .status()
        .unwrap();
    assert!(status.success(), "cargo build --example {name}: {status}");
    profile_dir
        .join("examples")
        .join(format!("{name}{}", std::env::consts::EXE_SUFFIX))
}

/// Runs the example to its end (it stops its own servers) and returns its output.
async fn run(name: &str, args: &[&Path]) -> Output {
    let path = example(name);
    let mut command = tokio::process::Command::new(&path);
    command.args(args).kill_on_drop(true);
    tokio::time::timeout(std::time::Duration::from_secs(60), command.output())
        .await
        .unwrap_or_else(|_| panic!("{name} did not finish within 60 s"))
        .unwrap()
}

fn stdout(out: &Output) -> String {
    assert!(
        out.status.success(),
        "{}\nstdout:\n{}\nstderr:\n{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout.clone()).unwrap()
}

/// The value after `key=` on `line` (up to the next space).
fn field<'a>(line: &'a str, key: &str) -> &'a str {
    let start = line
        .find(&format!(" {key}="))
        .unwrap_or_else(|| panic!("no {key}= in {line:?}"))
        + key.len()
        + 2;
    line[start..].split(' ').next().unwrap()
}

fn line_starting<'a>(text: &'a str, prefix: &str) -> &'a str {
    text.lines()
        .find(|l| l.starts_with(prefix))
        .unwrap_or_else(|| panic!("no line starting {prefix:?} in:\n{text}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn embed_proxy_sink_sees_every_byte_the_client_received() {
    let text = stdout(&run("embed_proxy", &[]).await);
    let client = line_starting(&text, "client: ");
    assert!(client.starts_with("client: status 200 and "), "{client}");
    let words: Vec<&str> = client.split(' ').collect();
    let (bytes, events) = (words[4], words[7]);
    assert!(events.parse::<u32>().unwrap() >= 2, "{client}");
    let sink = line_starting(&text, "sink: ");
    assert_eq!(field(sink, "session"), "example-session", "{sink}");
    assert_eq!(field(sink, "backend"), "sim", "{sink}");
    assert_eq!(field(sink, "status"), "200", "{sink}");
    assert_eq!(field(sink, "bytes"), bytes, "{text}");
    assert_eq!(field(sink, "end"), "Complete", "{sink}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn drive_sim_second_turn_hits_the_prefix_cache_of_its_replica() {
    let text = stdout(&run("drive_sim", &[]).await);
    assert_eq!(text.matches(", turn ").count(), 3, "{text}");
    let first = line_starting(&text, "sim-0: ");
    assert_eq!(field(first, "requests"), "2", "{first}");
    assert!(
        field(first, "prefix_cache_hits").parse::<u64>().unwrap() > 0,
        "{first}"
    );
    let second = line_starting(&text, "sim-1: ");
    assert_eq!(field(second, "requests"), "1", "{second}");
    assert_eq!(field(second, "prefix_cache_hits"), "0", "{second}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn read_capture_lists_every_exchange_the_proxy_recorded() {
    let (stop, shutdown) = agentrace::shutdown::channel();
    let sim = start_sim(shutdown.clone());
    let dir = tempfile::tempdir().unwrap();
    let proxy = start_proxy(&sim.addrs(), Some(config(dir.path())), shutdown).await;
    let url = format!("http://{}/v1/chat/completions", proxy.addr);
    let http = client();
    for (session, question) in [("s-a", "one"), ("s-b", "two"), ("s-a", "three")] {
        let body = serde_json::json!({
            "messages": [{"role": "user", "content": question}],
            "max_completion_tokens": 4,
            "stream": true,
        });
        let (status, _, _) = fetch(
            &http,
            "POST",
            &url,
            &[
                ("x-session-id", session),
                ("content-type", "application/json"),
            ],
            body.to_string(),
        )
        .await;
        assert_eq!(status, 200);
    }
    // Stopping the proxy closes the segment.
    stop.fire();
    proxy.join().await;
    sim.join().await;

    let text = stdout(&run("read_capture", &[dir.path()]).await);
    let exchanges: Vec<&str> = text.lines().filter(|l| l.contains(" POST ")).collect();
    assert_eq!(exchanges.len(), 3, "{text}");
    let sessions: Vec<&str> = exchanges.iter().map(|l| field(l, "session")).collect();
    assert_eq!(sessions, ["s-a", "s-b", "s-a"], "{text}");
    for line in &exchanges {
        assert_eq!(field(line, "status"), "200", "{line}");
        assert_ne!(field(line, "response_bytes"), "0", "{line}");
        assert_ne!(field(line, "first_byte_ms"), "-", "{line}");
    }
    assert!(
        text.contains("3 exchanges in 1 segments; 0 dropped; 0 cut segments"),
        "{text}"
    );
}

#[tokio::test]
async fn read_capture_without_a_directory_says_how_to_use_it() {
    let out = run("read_capture", &[]).await;
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).starts_with("usage: read_capture"));
    let missing = Path::new("/nonexistent/capture");
    let out = run("read_capture", &[missing]).await;
    assert!(!out.status.success());
    assert!(
        String::from_utf8_lossy(&out.stderr).starts_with("/nonexistent/capture: "),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

//! What a session costs the proxy does not depend on how long a client makes its session key.
//!
//! Invariant: the session table keeps a fixed-size digest per session, never the key, so a
//! flood of requests with unique 60 KiB session keys leaves the process's live heap larger by
//! about the table's fixed entry size per session, not by the keys' 60 KiB each; and a session
//! is still found by its full key (the admin API hashes the key it is given).
//!
//! The live heap is counted by a wrapper around the system allocator, which every thread of
//! this test binary allocates through: this file therefore holds this one test only.

mod support;

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicI64, Ordering};

use support::backends::*;

/// The system allocator, counting the bytes currently allocated.
struct Counting;

static LIVE_BYTES: AtomicI64 = AtomicI64::new(0);

// SAFETY: every call is passed through to `System` unchanged; only a counter is updated.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        let p = unsafe { System.alloc(layout) };
        if !p.is_null() {
            LIVE_BYTES.fetch_add(layout.size() as i64, Ordering::Relaxed);
        }
        p
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        let p = unsafe { System.alloc_zeroed(layout) };
        if !p.is_null() {
            LIVE_BYTES.fetch_add(layout.size() as i64, Ordering::Relaxed);
        }
        p
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        unsafe { System.dealloc(ptr, layout) };
        LIVE_BYTES.fetch_sub(layout.size() as i64, Ordering::Relaxed);
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        let p = unsafe { System.realloc(ptr, layout, new_size) };
        if !p.is_null() {
            LIVE_BYTES.fetch_add(new_size as i64 - layout.size() as i64, Ordering::Relaxed);
        }
        p
    }
}

#[global_allocator]
static ALLOCATOR: Counting = Counting;

/// A session key of 60 KiB, unique by `i`, in characters a URL path carries as they are.
fn long_key(i: usize) -> String {
    let mut key = format!("{i:08}-");
    key.extend(std::iter::repeat_n('k', 60 * 1024 - key.len()));
    key
}

async fn keyed_request(client: &HttpClient, proxy: &TestProxy, key: &str) -> String {
    let (status, headers, body) = fetch(
        client,
        "POST",
        &proxy.url("/v1/chat/completions"),
        &[("x-session-id", key), ("content-type", "application/json")],
        "{}",
    )
    .await;
    assert_eq!(status, 200, "{}", String::from_utf8_lossy(&body));
    served_by(&headers)
}

#[tokio::test]
async fn session_keys_cost_bounded_bytes() {
    const WARM_UP: usize = 20;
    const FLOOD: usize = 500;
    let a = TestBackend::spawn("a").await;
    let b = TestBackend::spawn("b").await;
    let proxy = start_proxy(config_for(&[&a, &b])).await;
    let client = client();

    // Every buffer on the way (connections, pools) grows to its size for such heads first.
    for i in 0..WARM_UP {
        keyed_request(&client, &proxy, &long_key(i)).await;
    }
    let before = LIVE_BYTES.load(Ordering::Relaxed);
    let mut first_home = String::new();
    for i in WARM_UP..WARM_UP + FLOOD {
        let home = keyed_request(&client, &proxy, &long_key(i)).await;
        if i == WARM_UP {
            first_home = home;
        }
    }
    let grown = LIVE_BYTES.load(Ordering::Relaxed) - before;

    let metrics = proxy.metrics().await;
    let remembered = format!("agentrace_sessions {}", WARM_UP + FLOOD);
    assert!(
        metrics.lines().any(|l| l == remembered),
        "every session is remembered: {remembered:?} in\n{metrics}"
    );
    // 60 KiB per key would be 30 MiB; a fixed-size entry is a few hundred bytes at most.
    let per_session = grown / FLOOD as i64;
    assert!(
        per_session < 2048,
        "{FLOOD} sessions with 60 KiB keys grew the live heap by {grown} bytes \
         ({per_session} per session)"
    );

    // The table still answers for a session by its full key.
    let (status, _, body) = fetch(
        &client,
        "GET",
        &proxy.admin_url(&format!("/admin/sessions/{}", long_key(WARM_UP))),
        &[],
        "",
    )
    .await;
    assert_eq!(status, 200);
    let view: serde_json::Value = serde_json::from_slice(&body).unwrap();
    assert_eq!(view["known"]["backend"], first_home.as_str(), "{view:.200}");
    assert_eq!(view["key"].as_str().map(str::len), Some(60 * 1024));
    proxy.shutdown().await;
}

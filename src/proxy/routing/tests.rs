use std::collections::HashMap;

use http::Method;
use tokio::time::Instant;

use super::usage::CacheUsage;
use super::*;
use crate::http1::WireFields;
use crate::proxy::metrics::ProxyMetrics;
use crate::tap::KeySource;

fn id_of(t: &SessionTable, key: &str) -> SessionId {
    t.id(&SessionKey::new(key.to_string(), KeySource::Header))
}

/// Places session `key` on `b` now, as the router does for a request of `bytes`.
fn put_now(t: &SessionTable, key: &str, b: &Arc<Backend>, pinned: bool, o: Outcome, bytes: u64) {
    t.put(id_of(t, key), b, pinned, o, bytes, Instant::now());
}

/// A session costs the table the same whatever its key's length: the table keeps a
/// 16-byte id, equal for equal keys, different for keys that differ only in their last
/// byte 60 KiB in, and keyed per table (another table's ids differ).
#[test]
fn session_ids_have_a_fixed_size_whatever_the_key() {
    assert_eq!(std::mem::size_of::<SessionId>(), 16);
    let t = SessionTable::new(10, Duration::from_secs(60));
    let long = "k".repeat(60 * 1024);
    let other = format!("{}j", &long[1..]);
    assert_eq!(id_of(&t, &long), id_of(&t, &long.clone()));
    assert_ne!(id_of(&t, &long), id_of(&t, &other));
    let elsewhere = SessionTable::new(10, Duration::from_secs(60));
    assert_ne!(id_of(&t, "s").tag, id_of(&elsewhere, "s").tag);
    assert_eq!(id_of(&t, "s").hash, id_of(&elsewhere, "s").hash);
}

fn router(pool: Pool) -> Router {
    Router::new(pool, 1_000_000, Duration::from_secs(1800))
}

fn place(r: &Router, key: &str) -> String {
    let pool = r.pool();
    let k = SessionKey::new(key.to_string(), KeySource::Header);
    let d = r.route(&pool, Some(&k), &[], Commit::Placement).unwrap();
    pool.backends[d.index].name.to_string()
}

/// Frozen vectors, the published XXH3-64 of each input (as the reference C library and its
/// Python binding give them): a change here would move every session of every deployed proxy,
/// and another implementation reproduces a placement from them.
#[test]
fn hash_is_stable_across_builds() {
    let vectors: [(&[u8], u64); 4] = [
        (b"", 0x2d06_8005_38d3_94c2),
        (b"abc", 0x78af_5f94_892f_3950),
        (b"session-1", 0xc07e_a649_48c9_a305),
        (b"django__django-16899__repeat_2", 0x70e0_5ff1_4abf_b3e7),
    ];
    for (input, expected) in vectors {
        assert_eq!(
            hash64(0, input),
            expected,
            "{:?}",
            std::str::from_utf8(input)
        );
    }
    assert_ne!(hash64(0, b"abc"), hash64(1, b"abc"));
    assert_ne!(hash64(0, b"abcdefgh"), hash64(0, b"abcdefgh\0"));
}

#[test]
fn same_key_always_reaches_the_same_backend() {
    let r = router(pool_of(&["a", "b", "c", "d"], 0.0));
    for i in 0..200 {
        let key = format!("s{i}");
        let first = place(&r, &key);
        for _ in 0..5 {
            assert_eq!(place(&r, &key), first);
        }
    }
}

/// The cheap first choice is always the head of the full ranking, weights and ties included.
#[test]
fn first_choice_is_the_head_of_the_ranking() {
    let mut pool = pool_of(&["a", "b", "c", "d", "e"], 1.5);
    let weighted = Arc::new(Backend::new(
        "w",
        BackendUrl::parse("http://127.0.0.1:1").unwrap(),
        3.0,
        ProxyMetrics::new().backend("w"),
    ));
    pool.backends.push(weighted);
    for k in 0..5_000 {
        let h = hash64(0, format!("key-{k}").as_bytes());
        assert_eq!(pool.first_choice(h), pool.ranking(h)[0], "key-{k}");
    }
}

/// With equal weights the ranking skips the logarithm; it must still be the order of the
/// published scores, so another implementation reproduces every placement.
#[test]
fn equal_weights_rank_in_the_order_of_the_published_scores() {
    let pool = pool_of(&["a", "b", "c", "d", "e", "f", "g", "h"], 0.0);
    for k in 0..5_000 {
        let h = hash64(0, format!("key-{k}").as_bytes());
        let mut by_score: Vec<usize> = (0..pool.backends.len()).collect();
        by_score.sort_by(|&x, &y| {
            let score = |i: usize| {
                let b = &pool.backends[i];
                rendezvous_score(h, b.seed, b.weight)
            };
            score(y).total_cmp(&score(x))
        });
        assert_eq!(pool.ranking(h), by_score, "key-{k}");
        assert_eq!(pool.first_choice(h), by_score[0], "key-{k}");
    }
}

/// 10,000 random keys over 4 equal backends land within ±10% of 2,500 each.
#[test]
fn random_keys_spread_evenly() {
    let r = router(pool_of(&["gpu-0", "gpu-1", "gpu-2", "gpu-3"], 0.0));
    let mut counts: HashMap<String, usize> = HashMap::new();
    let mut rng = rand::thread_rng();
    for _ in 0..10_000 {
        let key = format!("{:032x}", rand::Rng::gen::<u128>(&mut rng));
        *counts.entry(place(&r, &key)).or_default() += 1;
    }
    for (name, n) in &counts {
        assert!(
            (2250..=2750).contains(n),
            "{name}: {n} of 10000 ({counts:?})"
        );
    }
    assert_eq!(counts.len(), 4);
}

#[test]
fn weights_give_proportional_shares() {
    let metrics = ProxyMetrics::new();
    let mut pool = pool_of(&["a", "b"], 0.0);
    pool.backends[1] = Arc::new(Backend::new(
        "b",
        BackendUrl::parse("http://127.0.0.1:1").unwrap(),
        3.0,
        metrics.backend("b"),
    ));
    let r = router(pool);
    let on_b = (0..8000)
        .filter(|i| place(&r, &format!("k{i}")) == "b")
        .count();
    assert!(
        (5600..=6400).contains(&on_b),
        "b got {on_b} of 8000, expected ~6000"
    );
}

/// Removing a backend moves exactly the keys it held, spread over all the others.
#[test]
fn removing_a_backend_moves_only_its_keys() {
    let before = router(pool_of(&["a", "b", "c", "d"], 0.0));
    let after = router(pool_of(&["a", "b", "d"], 0.0));
    let mut moved_to: HashMap<String, usize> = HashMap::new();
    for i in 0..4000 {
        let key = format!("key-{i}");
        let (x, y) = (place(&before, &key), place(&after, &key));
        if x == "c" {
            *moved_to.entry(y).or_default() += 1;
        } else {
            assert_eq!(x, y, "{key} moved from {x} to {y} though {x} stayed");
        }
    }
    assert_eq!(
        moved_to.len(),
        3,
        "c's keys spread over every survivor: {moved_to:?}"
    );
    for n in moved_to.values() {
        assert!(*n > 200, "{moved_to:?}");
    }
}

#[test]
fn adding_a_backend_moves_about_one_in_n_plus_one() {
    let before = router(pool_of(&["a", "b", "c"], 0.0));
    let after = router(pool_of(&["a", "b", "c", "d"], 0.0));
    let mut moved = 0;
    for i in 0..4000 {
        let key = format!("key-{i}");
        let (x, y) = (place(&before, &key), place(&after, &key));
        if x != y {
            assert_eq!(y, "d", "keys only move to the new backend");
            moved += 1;
        }
    }
    assert!(
        (800..=1200).contains(&moved),
        "moved {moved} of 4000, expected ~1000"
    );
}

/// A session that failed over stays on its new backend when the old one recovers.
#[test]
fn recovered_backend_does_not_pull_sessions_back() {
    let r = router(pool_of(&["a", "b", "c"], 0.0));
    let key = "sticky-session";
    let home = place(&r, key);
    let pool = r.pool();
    let home_backend = pool.backend(&home).unwrap().clone();
    home_backend.healthy.store(false, Ordering::Relaxed);
    let away = place(&r, key);
    assert_ne!(away, home);
    assert_eq!(r.sessions.bound(), 1);
    home_backend.healthy.store(true, Ordering::Relaxed);
    assert_eq!(place(&r, key), away);
    // A key never seen before still goes to the recovered backend by hash.
    let fresh = (0..1000)
        .map(|i| format!("fresh-{i}"))
        .find(|k| {
            let p = r.pool();
            let h = SessionKey::new(k.clone(), KeySource::Header).hash;
            *p.backends[p.ranking(h)[0]].name == *home
        })
        .unwrap();
    assert_eq!(place(&r, &fresh), home);
}

#[test]
fn draining_keeps_known_sessions_and_sends_new_ones_elsewhere() {
    let r = router(pool_of(&["a", "b", "c"], 0.0));
    let known = "known";
    let home = place(&r, known);
    r.pool()
        .backend(&home)
        .unwrap()
        .draining
        .store(true, Ordering::Relaxed);
    assert_eq!(place(&r, known), home);
    let pool = r.pool();
    let new_key = (0..1000)
        .map(|i| format!("new-{i}"))
        .find(|k| {
            let h = SessionKey::new(k.clone(), KeySource::Header).hash;
            *pool.backends[pool.ranking(h)[0]].name == *home
        })
        .unwrap();
    assert_ne!(place(&r, &new_key), home);
}

/// A new session, with no cache anywhere, spills off a first choice above the load bound and
/// then stays where it spilled to, with its new cache, once the load is gone.
#[test]
fn bounded_load_spills_a_new_session_then_the_session_sticks() {
    let r = router(pool_of(&["a", "b", "c", "d"], 1.5));
    let pool = r.pool();
    let key = key_homed_on(&pool, 0, "hot");
    pool.backends[0].in_flight.store(10, Ordering::Relaxed);
    let d = route_turn(&r, &key, FIRST_TURN);
    assert_eq!(d.outcome, Outcome::Spill);
    assert_ne!(d.index, 0);
    assert_eq!(d.moved, None, "a new session has no cache to move");
    pool.backends[0].in_flight.store(0, Ordering::Relaxed);
    let next = route_turn(&r, &key, LATER_TURN);
    assert_eq!(
        (next.index, next.outcome, next.moved),
        (d.index, Outcome::Bound, None),
        "the spilled session stays with its new cache"
    );
}

/// Below the absolute floor of requests in flight no new session spills, however low the
/// relative bound is at low load: one request in flight is no queue.
#[test]
fn no_new_session_spills_off_a_backend_below_the_floor() {
    let r = router(pool_of(&["a", "b", "c", "d"], 1.25));
    let pool = r.pool();
    pool.backends[0]
        .in_flight
        .store(SPILL_FLOOR - 1, Ordering::Relaxed);
    let key = key_homed_on(&pool, 0, "floor");
    let d = route_turn(&r, &key, FIRST_TURN);
    assert_eq!((d.index, d.outcome), (0, Outcome::Hash));
}

#[test]
fn failed_backend_is_skipped_on_retry_and_session_rebinds() {
    let r = router(pool_of(&["a", "b", "c"], 0.0));
    let pool = r.pool();
    let k = SessionKey::new("retry-me".into(), KeySource::Header);
    let first = r.route(&pool, Some(&k), &[], Commit::Placement).unwrap();
    let second = r
        .route(&pool, Some(&k), &[first.index], Commit::Placement)
        .unwrap();
    assert_ne!(first.index, second.index);
    assert_eq!(second.outcome, Outcome::Failover);
    let third = r.route(&pool, Some(&k), &[], Commit::Placement).unwrap();
    assert_eq!(third.index, second.index);
    assert_eq!(third.outcome, Outcome::Bound);
}

#[test]
fn no_key_goes_to_the_least_loaded_backend() {
    let r = router(pool_of(&["a", "b", "c"], 0.0));
    let pool = r.pool();
    pool.backends[0].in_flight.store(3, Ordering::Relaxed);
    pool.backends[1].in_flight.store(1, Ordering::Relaxed);
    pool.backends[2].in_flight.store(2, Ordering::Relaxed);
    for _ in 0..5 {
        let d = r.route(&pool, None, &[], Commit::Placement).unwrap();
        assert_eq!(d.index, 1);
        assert_eq!(d.outcome, Outcome::LeastLoaded);
    }
}

#[test]
fn session_table_evicts_least_recently_used_and_idle() {
    let pool = pool_of(&["a"], 0.0);
    let t = SessionTable::new(3, Duration::from_secs(1800));
    let b = &pool.backends[0];
    let known = |k: &str| t.get(id_of(&t, k), &pool.backends).is_some();
    for k in ["k1", "k2", "k3"] {
        put_now(&t, k, b, true, Outcome::Spill, 0);
    }
    put_now(&t, "k1", b, true, Outcome::Bound, 0); // k2 is now the least recently used
    put_now(&t, "k4", b, true, Outcome::Spill, 0);
    assert!(!known("k2"));
    assert!(known("k1") && known("k3") && known("k4"));
    assert_eq!(t.len(), 3);
    assert_eq!(t.bound(), 3);
    assert_eq!(b.sessions.load(Ordering::Relaxed), 3);
    t.set_limits(3, Duration::ZERO);
    t.sweep();
    assert_eq!(t.len(), 0);
    assert_eq!(t.bound(), 0);
    assert_eq!(b.sessions.load(Ordering::Relaxed), 0);
}

/// A new size limit that changes how many shards are used moves every entry to its new
/// shard (none is lost, none counted twice), and one below the count evicts the least
/// recently used at once, with the bound and per-backend counts following.
#[test]
fn changing_max_sessions_keeps_entries_and_counts_true() {
    let pool = pool_of(&["a", "b"], 0.0);
    let (a, b) = (&pool.backends[0], &pool.backends[1]);
    let t = SessionTable::new(1_000_000, Duration::from_secs(1800));
    let keys: Vec<SessionId> = (0..200).map(|i| id_of(&t, &format!("k{i}"))).collect();
    for (i, k) in keys.iter().enumerate() {
        if i == 150 {
            // The last 50 are strictly more recent than the rest, even on a coarse clock.
            let before = Instant::now();
            while Instant::now() == before {}
        }
        t.put(
            *k,
            if i % 2 == 0 { a } else { b },
            i % 4 == 0,
            Outcome::Spill,
            0,
            Instant::now(),
        );
    }
    let check = |present: &[SessionId]| {
        for k in present {
            assert!(t.get(*k, &pool.backends).is_some(), "{k:?} lost");
        }
        assert_eq!(t.len(), present.len());
        let bound = present
            .iter()
            .filter(|k| t.view(**k).unwrap().bound)
            .count();
        assert_eq!(t.bound(), bound as u64);
        let on_a = present
            .iter()
            .filter(|k| t.get(**k, &pool.backends).unwrap().index == 0);
        assert_eq!(a.sessions.load(Ordering::Relaxed), on_a.count() as i64);
    };
    check(&keys);
    for max in [1_000, 1_000_000, 500, 2_000_000] {
        t.set_limits(max, Duration::from_secs(1800));
        check(&keys);
    }
    // Down to 1 shard and 50 entries: the 50 most recently used stay.
    t.set_limits(50, Duration::from_secs(1800));
    check(&keys[150..]);
    assert!(t.get(keys[149], &pool.backends).is_none());
}

#[test]
fn header_key_wins_over_fingerprint_and_first_header_wins() {
    let names = [
        HeaderName::from_static("x-session-id"),
        HeaderName::from_static("session-id"),
    ];
    let body = br#"{"model":"m","messages":[{"role":"user","content":"hi"}]}"#;
    let key = |x_session_id: &str| {
        let h = WireFields::from_pairs([
            (&b"session-id"[..], &b"second"[..]),
            (b"x-session-id", x_session_id.as_bytes()),
        ]);
        let path = "/v1/chat/completions";
        session_key(&h, &names, true, &Method::POST, path, body).unwrap()
    };
    let k = key("");
    assert_eq!((k.text.as_str(), k.source), ("second", KeySource::Header));
    assert_eq!(key("first").text, "first");
}

#[test]
fn fingerprint_is_the_same_for_every_turn_of_a_conversation() {
    let names = [HeaderName::from_static("x-session-id")];
    let h = WireFields::default();
    let turn1 = br#"{"model":"m","messages":[{"role":"system","content":"You code."},{"role":"user","content":"fix bug 1"}],"stream":true}"#;
    let turn2 = br#"{"model":"m","messages":[{"role":"system","content":"You code."},{"role":"user","content":"fix bug 1"},{"role":"assistant","content":"done"},{"role":"user","content":"now tests"}],"stream":true}"#;
    let other = br#"{"model":"m","messages":[{"role":"system","content":"You code."},{"role":"user","content":"fix bug 2"}]}"#;
    let other_model = br#"{"model":"n","messages":[{"role":"system","content":"You code."},{"role":"user","content":"fix bug 1"}]}"#;
    let fp =
        |b: &[u8]| session_key(&h, &names, true, &Method::POST, "/v1/chat/completions", b).unwrap();
    assert_eq!(fp(turn1), fp(turn2));
    assert_eq!(fp(turn1).source, KeySource::Fingerprint);
    assert!(fp(turn1).text.starts_with("fp:"));
    assert_ne!(fp(turn1), fp(other));
    assert_ne!(fp(turn1), fp(other_model));
    assert!(session_key(
        &h,
        &names,
        false,
        &Method::POST,
        "/v1/chat/completions",
        turn1
    )
    .is_none());
    assert!(session_key(&h, &names, true, &Method::POST, "/v1/completions", turn1).is_none());
    assert!(session_key(
        &h,
        &names,
        true,
        &Method::GET,
        "/v1/chat/completions",
        turn1
    )
    .is_none());
    assert!(session_key(
        &h,
        &names,
        true,
        &Method::POST,
        "/v1/chat/completions",
        b"not json"
    )
    .is_none());
}

fn pool_choosing(names: &[&str], choices: usize) -> Pool {
    let mut pool = pool_of(names, 0.0);
    pool.affinity.choices = choices;
    pool.affinity.context_factor = 1.1;
    pool
}

const FIRST_TURN: &[u8] =
    br#"{"model":"m","messages":[{"role":"system","content":"You code."},{"role":"user","content":"fix it"}]}"#;
const LATER_TURN: &[u8] = br#"{"model":"m","messages":[{"role":"system","content":"You code."},{"role":"user","content":"fix it"},{"role": "assistant","content":"ok"},{"role":"user","content":"more"}]}"#;

fn route_turn(r: &Router, key: &str, body: &[u8]) -> Decision {
    let pool = r.pool();
    let k = SessionKey::new(key.to_string(), KeySource::Header).with_turn(Turn::of_body(body));
    r.route(&pool, Some(&k), &[], Commit::Placement).unwrap()
}

/// The first key (from `prefix`-0 on) whose first rendezvous choice is backend `index`.
fn key_homed_on(pool: &Pool, index: usize, prefix: &str) -> String {
    (0..10_000)
        .map(|i| format!("{prefix}-{i}"))
        .find(|k| pool.first_choice(hash64(0, k.as_bytes())) == index)
        .unwrap()
}

#[test]
fn turn_tells_a_continuing_conversation_from_a_first_turn() {
    assert!(!Turn::of_body(FIRST_TURN).continues);
    assert!(Turn::of_body(LATER_TURN).continues);
    assert_eq!(
        Turn::of_body(FIRST_TURN).context_bytes,
        FIRST_TURN.len() as u64
    );
    // The word inside a message's text is not a role.
    let quoted = br#"{"messages":[{"role":"user","content":"say \"assistant\" twice"}]}"#;
    assert!(!Turn::of_body(quoted).continues);
}

#[test]
fn turn_of_a_body_in_parts_equals_the_turn_of_the_whole_body_wherever_it_is_cut() {
    for body in [FIRST_TURN, LATER_TURN] {
        let whole = Turn::of_body(body);
        for cut in 0..=body.len() {
            for second in cut..=body.len() {
                let parts = [&body[..cut], &body[cut..second], &body[second..]];
                assert_eq!(Turn::of_parts(parts), whole, "cut at {cut} and {second}");
            }
        }
    }
}

/// A new session leaves its first choice for the candidate holding the least context, and its
/// later turns stay there (bound) even once that backend holds the most.
#[test]
fn new_session_starts_where_the_least_context_is_held() {
    let r = router(pool_choosing(&["a", "b", "c", "d"], 4));
    let pool = r.pool();
    let key = key_homed_on(&pool, 0, "new");
    let ranked = pool.ranking(hash64(0, key.as_bytes()));
    for (load, &i) in [4_000u64, 3_000, 1_000, 2_000].iter().zip(&ranked) {
        pool.backends[i].hold(*load);
    }
    let d = route_turn(&r, &key, FIRST_TURN);
    assert_eq!((d.index, d.outcome), (ranked[2], Outcome::Placed));
    pool.backends[ranked[2]].hold(100_000);
    let d = route_turn(&r, &key, LATER_TURN);
    assert_eq!((d.index, d.outcome), (ranked[2], Outcome::Bound));
}

/// Candidates are only the first `choices` of the ranking: a backend further down stays
/// unused however empty it is.
#[test]
fn only_the_first_choices_are_candidates() {
    let r = router(pool_choosing(&["a", "b", "c", "d"], 2));
    let pool = r.pool();
    let key = key_homed_on(&pool, 1, "short");
    let ranked = pool.ranking(hash64(0, key.as_bytes()));
    for (load, &i) in [4_000u64, 3_500, 0, 0].iter().zip(&ranked) {
        pool.backends[i].hold(*load);
    }
    let d = route_turn(&r, &key, FIRST_TURN);
    assert_eq!((d.index, d.outcome), (ranked[1], Outcome::Placed));
}

/// A first choice within its bound keeps a new session although others hold less: that is
/// what lets every replica place it alike.
#[test]
fn first_choice_within_its_bound_keeps_a_new_session() {
    let r = router(pool_choosing(&["a", "b", "c", "d"], 4));
    let pool = r.pool();
    let key = key_homed_on(&pool, 2, "within");
    let ranked = pool.ranking(hash64(0, key.as_bytes()));
    // Bound: 1.1 × (9,000 + the body) / 4 ≈ 2,500; the first choice will hold 2,300 + the body.
    for (load, &i) in [2_300u64, 2_233, 2_233, 2_234].iter().zip(&ranked) {
        pool.backends[i].hold(*load);
    }
    let d = route_turn(&r, &key, FIRST_TURN);
    assert_eq!((d.index, d.outcome), (2, Outcome::Hash));
}

/// With nothing held the hash decides, so every replica puts the session in the same place;
/// so does a continuing turn of a session this router has not seen, however loaded.
#[test]
fn hash_decides_when_holdings_are_even_or_the_conversation_continues() {
    let r = router(pool_choosing(&["a", "b", "c", "d"], 4));
    let pool = r.pool();
    for i in 0..200 {
        let key = format!("even-{i}");
        let k =
            SessionKey::new(key.clone(), KeySource::Header).with_turn(Turn::of_body(FIRST_TURN));
        let d = r.route(&pool, Some(&k), &[], Commit::Nothing).unwrap();
        assert_eq!(d.index, pool.first_choice(hash64(0, key.as_bytes())));
        assert_eq!(d.outcome, Outcome::Hash);
    }
    let r = router(pool_choosing(&["a", "b", "c", "d"], 4));
    let pool = r.pool();
    let key = key_homed_on(&pool, 3, "later");
    pool.backends[3].hold(1_000_000);
    let d = route_turn(&r, &key, LATER_TURN);
    assert_eq!((d.index, d.outcome), (3, Outcome::Hash));
}

/// Twenty equal sessions over four backends: plain hashing leaves some backend with at least
/// 3 more than another for these keys; the context bound with a choice of three keeps every
/// backend within 2.
#[test]
fn choices_even_out_what_hashing_leaves_uneven() {
    let spread = |choices: usize| {
        let r = router(pool_choosing(
            &["gpu-0", "gpu-1", "gpu-2", "gpu-3"],
            choices,
        ));
        for i in 0..20 {
            route_turn(&r, &format!("session-{i}"), FIRST_TURN);
        }
        let pool = r.pool();
        let counts: Vec<i64> = pool
            .backends
            .iter()
            .map(|b| b.sessions.load(Ordering::Relaxed))
            .collect();
        counts.iter().max().unwrap() - counts.iter().min().unwrap()
    };
    assert!(spread(1) >= 3, "plain hashing spread {}", spread(1));
    assert!(spread(3) <= 2, "choice of three spread {}", spread(3));
}

/// A session idle past the active window stops counting in its backend's context, and
/// counts again from its next request; evicting it releases nothing twice.
#[test]
fn idle_sessions_stop_counting_as_held() {
    let pool = pool_of(&["a", "b"], 0.0);
    let (a, b) = (&pool.backends[0], &pool.backends[1]);
    let t = SessionTable::new(10, Duration::from_secs(1800));
    put_now(&t, "s1", a, false, Outcome::Hash, 500);
    put_now(&t, "s2", a, false, Outcome::Hash, 300);
    put_now(&t, "s1", b, true, Outcome::Failover, 700);
    assert_eq!(a.active_bytes.load(Ordering::Relaxed), 300);
    assert_eq!(b.active_bytes.load(Ordering::Relaxed), 700);
    t.set_active_window(Duration::ZERO);
    let before = Instant::now();
    while Instant::now() == before {}
    t.sweep();
    assert_eq!(a.active_bytes.load(Ordering::Relaxed), 0);
    assert_eq!(b.active_bytes.load(Ordering::Relaxed), 0);
    t.set_active_window(Duration::from_secs(60));
    put_now(&t, "s2", a, false, Outcome::Hash, 400);
    assert_eq!(a.active_bytes.load(Ordering::Relaxed), 400);
    t.set_limits(1, Duration::from_secs(1800));
    assert_eq!(t.len(), 1);
    assert_eq!(a.active_bytes.load(Ordering::Relaxed), 400);
    assert_eq!(b.active_bytes.load(Ordering::Relaxed), 0);
    t.set_limits(1, Duration::ZERO);
    while Instant::now() == before {}
    t.sweep();
    assert_eq!(a.active_bytes.load(Ordering::Relaxed), 0);
}

/// A session whose context grows turn by turn on the same backend counts there with its
/// latest size only, and a turn of the same size leaves the count as it was.
#[test]
fn a_growing_session_counts_its_latest_size_once() {
    let pool = pool_of(&["a"], 0.0);
    let a = &pool.backends[0];
    let t = SessionTable::new(10, Duration::from_secs(1800));
    put_now(&t, "other", a, false, Outcome::Hash, 100);
    for bytes in [500, 800, 800, 2_000, 1_200] {
        put_now(&t, "s", a, false, Outcome::Hash, bytes);
        assert_eq!(a.active_bytes.load(Ordering::Relaxed), 100 + bytes as i64);
    }
    assert_eq!(a.sessions.load(Ordering::Relaxed), 2);
}

/// A pool of one backend and a table of ten sessions whose active window is `secs`.
fn one_backend_with_window(secs: u64) -> (Pool, SessionTable) {
    let t = SessionTable::new(10, Duration::from_secs(1800));
    t.set_active_window(Duration::from_secs(secs));
    (pool_of(&["a"], 0.0), t)
}

/// A session's idle time runs from the end of its last turn, not its start: while a turn is
/// in flight the session counts in its backend's context however long the turn takes, and
/// it stops counting only a whole window after the turn ended.
#[tokio::test(start_paused = true)]
async fn a_turn_in_flight_keeps_its_session_held_until_a_window_after_it_ends() {
    let (pool, t) = one_backend_with_window(20);
    let a = &pool.backends[0];
    let long = id_of(&t, "long");
    let short = id_of(&t, "short");
    for (id, bytes) in [(long, 500), (short, 300)] {
        let mut slot = t.slot(id, Instant::now());
        slot.place(a, false, Outcome::Hash, bytes);
        slot.start_turn();
    }
    t.slot(short, Instant::now()).end_turn();
    tokio::time::advance(Duration::from_secs(30)).await;
    t.sweep();
    // Thirty seconds into its turn, the long one still counts; the short one, done, does not.
    assert_eq!(a.active_bytes.load(Ordering::Relaxed), 500);
    t.slot(long, Instant::now()).end_turn();
    tokio::time::advance(Duration::from_secs(15)).await;
    t.sweep();
    assert_eq!(a.active_bytes.load(Ordering::Relaxed), 500);
    tokio::time::advance(Duration::from_secs(6)).await;
    t.sweep();
    assert_eq!(a.active_bytes.load(Ordering::Relaxed), 0);
}

/// The idle walk skips its work while the use it last stopped at is inside the active
/// window; a window shortened since still lets a session go once it has idled past the new
/// window, not the old one.
#[tokio::test(start_paused = true)]
async fn a_shortened_active_window_takes_effect_on_the_next_walk() {
    let (pool, t) = one_backend_with_window(20);
    let a = &pool.backends[0];
    put_now(&t, "s", a, false, Outcome::Hash, 700);
    t.sweep();
    tokio::time::advance(Duration::from_secs(6)).await;
    t.sweep();
    assert_eq!(a.active_bytes.load(Ordering::Relaxed), 700);
    t.set_active_window(Duration::from_secs(5));
    t.sweep();
    assert_eq!(a.active_bytes.load(Ordering::Relaxed), 0);
}

/// A request routed as a turn keeps its session in its backend's active context until the
/// turn ends, however long that takes; a placement alone (the endpoint picker's) lets it go
/// a window after it.
#[tokio::test(start_paused = true)]
async fn a_routed_turn_holds_its_session_until_it_ends() {
    let r = router(pool_of(&["a"], 0.0));
    r.sessions.set_active_window(Duration::from_secs(20));
    let pool = r.pool();
    let a = &pool.backends[0];
    let route = |key: &str, commit| {
        let k = SessionKey::new(key.to_string(), KeySource::Header)
            .with_turn(Turn::of_body(FIRST_TURN));
        r.route(&pool, Some(&k), &[], commit)
            .unwrap()
            .session
            .unwrap()
    };
    let turn = route("turn", Commit::Turn);
    let held = a.active_bytes.load(Ordering::Relaxed);
    route("placed", Commit::Placement);
    assert!(a.active_bytes.load(Ordering::Relaxed) > held);
    tokio::time::advance(Duration::from_secs(30)).await;
    r.sessions.sweep();
    assert_eq!(a.active_bytes.load(Ordering::Relaxed), held);
    r.sessions.slot(turn, Instant::now()).end_turn();
    tokio::time::advance(Duration::from_secs(21)).await;
    r.sessions.sweep();
    assert_eq!(a.active_bytes.load(Ordering::Relaxed), 0);
}

/// A turn of session `id` on `backend` ends with its response reporting `usage`.
fn report(r: &Router, id: SessionId, backend: &Arc<Backend>, usage: CacheUsage, lost_share: f64) {
    let mut slot = r.sessions.slot(id, Instant::now());
    slot.report_cache(backend, usage, lost_share, None);
    slot.end_turn();
}

fn usage(prompt_tokens: u64, cached_tokens: u64) -> CacheUsage {
    CacheUsage {
        prompt_tokens,
        cached_tokens,
    }
}

/// A session whose backend reports a continuing turn mostly uncached moves, on its next turn,
/// to the backend holding the least active context, and stays there (bound); the first turn on
/// a backend only sets what the next should find cached.
#[test]
fn a_session_whose_cache_was_lost_moves_to_the_backend_holding_least() {
    let r = router(pool_of(&["a", "b", "c"], 0.0));
    let pool = r.pool();
    let key = key_homed_on(&pool, 0, "lost");
    let id = id_of(&r.sessions, &key);
    let home = pool.backends[0].clone();
    pool.backends[0].hold(9_000);
    pool.backends[1].hold(5_000);
    pool.backends[2].hold(1_000);
    let d = route_turn(&r, &key, FIRST_TURN);
    assert_eq!(
        (d.index, d.outcome, d.session),
        (0, Outcome::Hash, Some(id))
    );
    // First turn there: nothing to compare with, whatever was cached.
    report(&r, id, &home, usage(1_000, 0), 0.5);
    assert_eq!(route_turn(&r, &key, LATER_TURN).outcome, Outcome::Hash);
    // Most of the previous prompt was served from cache: still there.
    report(&r, id, &home, usage(2_000, 900), 0.5);
    assert_eq!(route_turn(&r, &key, LATER_TURN).outcome, Outcome::Hash);
    // Less than half of the previous 2,000 tokens: lost.
    report(&r, id, &home, usage(3_000, 999), 0.5);
    let d = route_turn(&r, &key, LATER_TURN);
    assert_eq!((d.index, d.outcome), (2, Outcome::Moved));
    let d = route_turn(&r, &key, LATER_TURN);
    assert_eq!((d.index, d.outcome), (2, Outcome::Bound));
}

/// A lost cache moves a session only where less is held than where it is, only on its first
/// attempt, never when judging is off, and usage from a backend it has left changes nothing.
#[test]
fn a_lost_cache_moves_a_session_only_to_a_backend_holding_less() {
    let lose = |r: &Router, key: &str, at: &Arc<Backend>| {
        let id = id_of(&r.sessions, key);
        report(r, id, at, usage(1_000, 1_000), 0.5);
        report(r, id, at, usage(2_000, 0), 0.5);
    };
    // Everyone else holds more: it stays.
    let r = router(pool_of(&["a", "b", "c"], 0.0));
    let pool = r.pool();
    let key = key_homed_on(&pool, 0, "stay");
    route_turn(&r, &key, FIRST_TURN);
    pool.backends[1].hold(50_000);
    pool.backends[2].hold(50_000);
    lose(&r, &key, &pool.backends[0]);
    assert_eq!(route_turn(&r, &key, LATER_TURN).outcome, Outcome::Hash);

    // Usage from a backend the session is not on is ignored.
    let r = router(pool_of(&["a", "b", "c"], 0.0));
    let pool = r.pool();
    let key = key_homed_on(&pool, 0, "elsewhere");
    route_turn(&r, &key, FIRST_TURN);
    pool.backends[0].hold(50_000);
    lose(&r, &key, &pool.backends[1]);
    assert_eq!(route_turn(&r, &key, LATER_TURN).outcome, Outcome::Hash);
    // A retry after a failure fails over as before instead.
    lose(&r, &key, &pool.backends[0]);
    let k = SessionKey::new(key.clone(), KeySource::Header).with_turn(Turn::of_body(LATER_TURN));
    let d = r.route(&pool, Some(&k), &[0], Commit::Nothing).unwrap();
    assert_eq!(d.outcome, Outcome::Failover);

    // Judging off: never moves.
    let mut off = pool_of(&["a", "b", "c"], 0.0);
    off.affinity.lost_cache_share = 0.0;
    let r = router(off);
    let pool = r.pool();
    let key = key_homed_on(&pool, 0, "off");
    route_turn(&r, &key, FIRST_TURN);
    pool.backends[0].hold(50_000);
    lose(&r, &key, &pool.backends[0]);
    assert_eq!(route_turn(&r, &key, LATER_TURN).outcome, Outcome::Hash);
}

/// A backend's KV cache is judged in the body bytes its tokenizer makes of a token, learnt
/// from the usage its responses report: until a report, 4; after reports of 6 bytes a token,
/// close to 6, so a backend of 1,000 tokens holding 5,000 bytes has room left.
#[test]
fn the_bytes_a_token_takes_are_learnt_from_reported_usage() {
    let pool = pool_of(&["a"], 0.0);
    let a = &pool.backends[0];
    a.kv_cache_tokens.store(1_000, Ordering::Relaxed);
    a.hold(5_000);
    assert_eq!(a.bytes_per_token(), 4.0);
    assert!(!has_room(&pool, 0, 0));
    a.learn_bytes_per_token(6_000, 1_000);
    assert_eq!(a.bytes_per_token(), 6.0);
    a.learn_bytes_per_token(3_000, 1_000);
    assert!((a.bytes_per_token() - 5.625).abs() < 1e-3);
    for _ in 0..40 {
        a.learn_bytes_per_token(6_000, 1_000);
    }
    assert!((a.bytes_per_token() - 6.0).abs() < 0.01);
    assert!(has_room(&pool, 0, 0));
    // Reports without tokens teach nothing.
    a.learn_bytes_per_token(6_000, 0);
    assert!((a.bytes_per_token() - 6.0).abs() < 0.01);
}

/// The usage a response reports teaches the backend that served it, from the body of the
/// request it answers; a report from a backend the session has left teaches nothing.
#[test]
fn a_cache_report_teaches_its_backend_the_bytes_a_token_takes() {
    let r = router(pool_of(&["a", "b"], 0.0));
    let pool = r.pool();
    let key = key_homed_on(&pool, 0, "learn");
    route_turn(&r, &key, FIRST_TURN);
    let id = id_of(&r.sessions, &key);
    let tokens = FIRST_TURN.len() as u64 / 2;
    report(&r, id, &pool.backends[1], usage(tokens, 0), 0.5);
    assert_eq!(pool.backends[1].bytes_per_token(), 4.0);
    report(&r, id, &pool.backends[0], usage(tokens, 0), 0.5);
    let learnt = pool.backends[0].bytes_per_token();
    assert!(
        (learnt - FIRST_TURN.len() as f64 / tokens as f64).abs() < 1e-3,
        "{learnt}"
    );
}

/// Where the next turn goes of a session homed on the first of three backends, whose cache
/// there was just judged lost, when each backend states a KV cache of 1,000 tokens of 4 bytes
/// (whatever the reports taught) and holds `held` bytes of active context.
fn next_turn_after_losing_cache_on_first(held: [u64; 3]) -> (usize, Outcome) {
    let r = router(pool_of(&["a", "b", "c"], 0.0));
    let pool = r.pool();
    let key = key_homed_on(&pool, 0, "lost");
    route_turn(&r, &key, FIRST_TURN);
    let id = id_of(&r.sessions, &key);
    report(&r, id, &pool.backends[0], usage(1_000, 1_000), 0.5);
    report(&r, id, &pool.backends[0], usage(2_000, 0), 0.5);
    for (b, bytes) in pool.backends.iter().zip(held) {
        b.kv_cache_tokens.store(1_000, Ordering::Relaxed);
        b.bytes_per_token_milli.store(4_000, Ordering::Relaxed);
        b.active_bytes.store(bytes as i64, Ordering::Relaxed);
    }
    let d = route_turn(&r, &key, LATER_TURN);
    (d.index, d.outcome)
}

/// A session that lost its cache moves only onto a backend that still holds no more than its
/// KV cache with the session added: pushing a second backend past its size would spread the
/// evictions, not end them.
#[test]
fn a_lost_cache_never_moves_a_session_onto_a_backend_it_would_push_past_its_cache() {
    // b holds least but the session would take it past 4,000 bytes; c has room.
    let next = next_turn_after_losing_cache_on_first([9_000, 3_950, 3_000]);
    assert_eq!(next, (2, Outcome::Moved));
    // Nobody has room and the session's own backend is the furthest over: it stays.
    let next = next_turn_after_losing_cache_on_first([9_000, 3_990, 4_500]);
    assert_eq!(next, (0, Outcome::Hash));
}

/// When no backend has room for a session that lost its cache on a backend over its size, it
/// joins the backend furthest over its own, so that the others can shed sessions until they
/// fit; a session whose backend is within its size has nothing to gain there and stays.
#[test]
fn a_lost_cache_with_no_room_anywhere_gathers_on_the_fullest_backend() {
    let next = next_turn_after_losing_cache_on_first([4_400, 6_000, 5_000]);
    assert_eq!(next, (1, Outcome::Moved));
    let next = next_turn_after_losing_cache_on_first([3_000, 6_000, 5_000]);
    assert_eq!(next, (0, Outcome::Hash));
}

/// A session with a cache stays on its backend however many requests are in flight there,
/// whether its KV cache size is stated (and exceeded) or unknown: load is no evidence that a
/// full prefill elsewhere costs less than the queue. A first turn, with no cache to lose,
/// still spills for the queue alone.
#[test]
fn a_session_with_a_cache_never_leaves_for_load_alone() {
    for kv in [None, Some(1_000)] {
        let pool = pool_of(&["a", "b", "c", "d"], 1.5);
        if let Some(kv) = kv {
            for b in &pool.backends {
                b.kv_cache_tokens.store(kv, Ordering::Relaxed);
            }
            // 1,000 tokens of 4 bytes, and more: over its KV cache.
            pool.backends[0].hold(8_000);
        }
        let r = router(pool);
        let pool = r.pool();
        let key = key_homed_on(&pool, 0, "cached");
        assert_eq!(route_turn(&r, &key, FIRST_TURN).index, 0);
        pool.backends[0].in_flight.store(100, Ordering::Relaxed);
        let d = route_turn(&r, &key, LATER_TURN);
        assert_eq!(
            (d.index, d.outcome, d.moved),
            (0, Outcome::Hash, None),
            "KV cache {kv:?}"
        );
        // A continuing conversation the table never saw has its cache where the hash put it.
        let unknown = key_homed_on(&pool, 0, "unseen");
        assert_eq!(route_turn(&r, &unknown, LATER_TURN).index, 0);

        let fresh = key_homed_on(&pool, 0, "fresh");
        let d = route_turn(&r, &fresh, FIRST_TURN);
        assert_eq!(d.outcome, Outcome::Spill, "a first turn spills");
        assert_ne!(d.index, 0);
    }
}

/// A known session stays on its backend when a backend added since takes its key: the new
/// backend would hold none of its cache.
#[test]
fn a_backend_added_takes_new_sessions_but_no_known_one() {
    let before = pool_of(&["a", "b", "c"], 0.0);
    let r = router(before.clone());
    let mut after = pool_of(&["a", "b", "c", "d"], 0.0);
    after.backends[..3].clone_from_slice(&before.backends);
    let key = key_homed_on(&after, 3, "taken");
    let home = route_turn(&r, &key, FIRST_TURN).index;
    r.replace_pool(after);
    let d = route_turn(&r, &key, LATER_TURN);
    assert_eq!((d.index, d.outcome, d.moved), (home, Outcome::Bound, None));
    let fresh = key_homed_on(&r.pool(), 3, "fresh");
    assert_eq!(route_turn(&r, &fresh, FIRST_TURN).index, 3);
}

/// Each move of a known session says why: its backend failed, or left the pool.
#[test]
fn every_move_of_a_known_session_carries_its_reason() {
    let r = router(pool_of(&["a", "b", "c"], 0.0));
    let pool = r.pool();
    let key = key_homed_on(&pool, 0, "failing");
    route_turn(&r, &key, FIRST_TURN);
    pool.backends[0].healthy.store(false, Ordering::Relaxed);
    let d = route_turn(&r, &key, LATER_TURN);
    assert_eq!(
        (d.outcome, d.moved),
        (Outcome::Failover, Some(MoveReason::Failed))
    );
    let away = d.index;
    let d = route_turn(&r, &key, LATER_TURN);
    assert_eq!((d.index, d.moved), (away, None), "moved once, then stays");

    let mut smaller = pool_of(&["a", "b", "c"], 0.0);
    smaller.backends = pool.backends.clone();
    smaller.backends.remove(away);
    r.replace_pool(smaller);
    let d = route_turn(&r, &key, LATER_TURN);
    assert_eq!(d.moved, Some(MoveReason::Removed));
}

/// Teaches `b` `n` answers of `computed` prompt tokens computed, first byte after `ttfb_ms`.
fn learn(b: &Backend, n: usize, computed: u64, ttfb_ms: u64) {
    for _ in 0..n {
        b.waits
            .learn(usage(computed + 100, 100), Duration::from_millis(ttfb_ms));
    }
}

/// A known session leaves a backend whose answers show a queue wait longer than its own
/// prefill elsewhere (learnt from reported usage and first-byte times), with the reason given;
/// it stays while the wait is shorter than that prefill, and while nothing has been learnt of
/// the other backends.
#[test]
fn a_session_leaves_a_queue_only_when_the_wait_outlasts_its_prefill_elsewhere() {
    let r = router(pool_of(&["a", "b"], 0.0));
    let pool = r.pool();
    let key = key_homed_on(&pool, 0, "queued");
    route_turn(&r, &key, LATER_TURN);
    // a answers in 2 s what b answers in 20 ms: about 2 s of a's time is queue.
    learn(&pool.backends[0], 8, 200, 2_000);
    let d = route_turn(&r, &key, LATER_TURN);
    assert_eq!((d.index, d.moved), (0, None), "nothing learnt of b");

    // b computes 200 tokens in 20 ms: 10,000 a second. LATER_TURN is ~40 tokens: 4 ms.
    learn(&pool.backends[1], 8, 200, 20);
    let d = route_turn(&r, &key, LATER_TURN);
    assert_eq!(
        (d.index, d.outcome, d.moved),
        (1, Outcome::Moved, Some(MoveReason::QueueWait))
    );

    // Back on a, with a wait shorter than the prefill of a context this long on b.
    let long = key_homed_on(&pool, 0, "long");
    let body = format!(
        r#"{{"messages":[{{"role":"user","content":"{}"}}]}}"#,
        "x".repeat(400_000)
    );
    route_turn(&r, &long, body.as_bytes());
    let d = route_turn(&r, &long, body.as_bytes());
    assert_eq!(
        (d.index, d.moved),
        (0, None),
        "100,000 tokens take 10 s on b"
    );
}

/// Idle backends differ in the fixed cost of an answer by milliseconds; below
/// `min_queue_wait_secs` that difference is no queue, so no session leaves its cache for it,
/// however short its prefill elsewhere. The same session moves once the wait passes the floor.
#[test]
fn a_wait_below_the_floor_moves_no_session() {
    let mut pool = pool_of(&["a", "b"], 0.0);
    pool.affinity.min_queue_wait_secs = 0.25;
    let r = router(pool);
    let pool = r.pool();
    let key = key_homed_on(&pool, 0, "idle");
    route_turn(&r, &key, LATER_TURN);
    // a takes 60 ms for what b does in 20 ms: 40 ms of "queue", far more than a 4 ms prefill.
    learn(&pool.backends[0], 8, 200, 60);
    learn(&pool.backends[1], 8, 200, 20);
    let d = route_turn(&r, &key, LATER_TURN);
    assert_eq!((d.index, d.moved), (0, None), "40 ms is below the floor");

    learn(&pool.backends[0], 64, 200, 2_000);
    let d = route_turn(&r, &key, LATER_TURN);
    assert_eq!(d.moved, Some(MoveReason::QueueWait), "2 s is above it");
}

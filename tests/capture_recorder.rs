//! The recorder driven straight through its sink (a real recorder writing real files): what
//! goes in comes back out exactly, secrets never reach the disk, segments rotate and recover
//! from truncation, and a full queue or an unwritable directory is counted, never fatal.

mod support;

use std::collections::HashMap;

use agentrace::capture::format::{self, Line};
use agentrace::capture::reader::{self, Entry, SegmentReader};
use agentrace::capture::{CaptureConfig, FullPolicy, Recorder};
use bytes::Bytes;
use support::capture::*;
use tokio::time::{Duration, Instant};

// Delta encoding: interleaved sessions, a keyless exchange, a history that does not extend
// the previous one, a non-UTF-8 body: every request and response body reads back byte for
// byte, and most growing-history requests are stored as deltas far smaller than the body.
#[tokio::test]
async fn delta_encoding_reconstructs_every_body_exactly() {
    let dir = tempfile::tempdir().unwrap();
    let rec = Recorder::start(&config(dir.path())).unwrap();
    let sessions: Vec<(String, Vec<Vec<u8>>)> = (0..3)
        .map(|i| (format!("sess-{i}"), agent_bodies(&format!("#{i}"), 20)))
        .collect();
    let mut sent = Vec::new();
    for turn in 0..20 {
        for (key, bodies) in &sessions {
            let ex = FakeExchange::chat(
                Some(key),
                bodies[turn].clone(),
                &format!("turn {turn} of {key} ok"),
            );
            drive(rec.sink.as_ref(), &ex);
            sent.push(ex);
        }
        if turn == 10 {
            // A fresh history in an existing session, a keyless call, a binary body.
            let fresh = agent_bodies("restart", 1).remove(0);
            for ex in [
                FakeExchange::chat(Some("sess-0"), fresh, "restarted"),
                FakeExchange::chat(None, b"{\"model\":\"m\",\"messages\":[]}".to_vec(), "x"),
                FakeExchange::chat(Some("sess-1"), vec![0xff, 0xfe, 0x00, 0x80], "bin"),
            ] {
                drive(rec.sink.as_ref(), &ex);
                sent.push(ex);
            }
        }
    }
    rec.finish().await;

    let back = read_all(dir.path());
    assert_eq!(back.len(), sent.len());
    let raw: usize = sent.iter().map(|e| e.body.len()).sum();
    let mut deltas = 0;
    for (ex, got) in sent.iter().zip(&back) {
        assert_eq!(got.record.session, ex.session);
        assert_eq!(got.request_body.as_deref(), Some(&ex.body[..]));
        assert_eq!(got.response_body.as_deref(), Some(&ex.frames.concat()[..]));
        assert_eq!(
            got.record.response.as_ref().unwrap().frame_len.len(),
            ex.frames.len()
        );
        deltas += usize::from(got.record.request.body.base.is_some());
    }
    assert!(deltas >= 3 * 18, "only {deltas} deltas");
    let stored = std::fs::metadata(&reader::segments(dir.path()).unwrap()[0])
        .unwrap()
        .len();
    assert!(
        (stored as usize) < raw / 10,
        "stored {stored} of {raw} raw bytes"
    );
}

// Redaction: the default secret headers of requests and responses are stored as
// REDACTED-<hash>, equal secrets get equal placeholders, and no secret byte appears in any
// file, compressed or decompressed; a configured list replaces the default one.
#[tokio::test]
async fn redaction_leaves_no_secret_bytes_in_segment_files() {
    let dir = tempfile::tempdir().unwrap();
    let mut cfg = config(dir.path());
    cfg.redact_headers.push("x-team-token".into());
    let rec = Recorder::start(&cfg).unwrap();
    let secrets = [
        ("authorization", "Bearer sk-live-SECRET0123456789"),
        ("proxy-authorization", "Basic cHJveHk6U0VDUkVU"),
        ("api-key", "AZURE-SECRET-KEY-42"),
        ("x-api-key", "anthropic-SECRET-key-7"),
        ("cookie", "session=SECRETCOOKIE99"),
        ("x-team-token", "TEAMSECRET-abc"),
    ];
    for i in 0..2 {
        let mut ex = FakeExchange::chat(Some("s"), agent_bodies("r", 2).remove(i), "ok");
        ex.headers
            .extend(secrets.iter().map(|(k, v)| (*k, v.to_string())));
        ex.headers.push(("x-session-id", "visible-session".into()));
        ex.response_headers
            .push(("set-cookie", "SECRETSETCOOKIE=1; HttpOnly".into()));
        drive(rec.sink.as_ref(), &ex);
    }
    rec.finish().await;

    let bytes = all_bytes(dir.path());
    for (_, secret) in secrets {
        assert!(!contains(&bytes, secret.as_bytes()), "{secret} stored");
        assert!(
            !contains(&bytes, &secret.as_bytes()[..12]),
            "part of {secret} stored"
        );
    }
    assert!(!contains(&bytes, b"SECRETSETCOOKIE"));
    let back = read_all(dir.path());
    let auth = |e: &reader::Exchange| {
        e.record
            .request
            .headers
            .iter()
            .find(|(k, _)| k == "authorization")
            .unwrap()
            .1
            .clone()
    };
    assert_eq!(auth(&back[0]), format::redacted(secrets[0].1.as_bytes()));
    assert_eq!(auth(&back[0]), auth(&back[1]));
    let visible = back[0]
        .record
        .request
        .headers
        .iter()
        .find(|(k, _)| k == "x-session-id");
    assert_eq!(visible.unwrap().1, "visible-session");
}

/// Credentials under the names real APIs use (vendor headers, credential query parameters)
/// never reach a segment file with the default settings; session and routing keys do.
#[tokio::test]
async fn vendor_credential_headers_and_query_parameters_are_never_stored() {
    let dir = tempfile::tempdir().unwrap();
    let rec = Recorder::start(&config(dir.path())).unwrap();
    let secrets = [
        ("x-auth-token", "XAUTH-SECRET-0001"),
        ("x-goog-api-key", "AIzaGOOG-SECRET-0002"),
        ("ocp-apim-subscription-key", "APIM-SECRET-0003"),
        ("x-amz-security-token", "AMZ-SECRET-0004"),
    ];
    let mut ex = FakeExchange::chat(Some("s"), b"{}".to_vec(), "ok");
    ex.headers
        .extend(secrets.iter().map(|(k, v)| (*k, v.to_string())));
    ex.headers.push(("x-session-id", "visible-session".into()));
    ex.headers.push(("x-routing-key", "visible-routing".into()));
    ex.path = "/v1/chat/completions?api_key=QAPIKEY-SECRET-0005&key=QKEY-SECRET-0006\
               &model=m&token=QTOKEN-SECRET-0007&Access_Token=QACCESS-SECRET-0008"
        .into();
    drive(rec.sink.as_ref(), &ex);
    rec.finish().await;

    let bytes = all_bytes(dir.path());
    for secret in secrets.iter().map(|s| s.1).chain([
        "QAPIKEY-SECRET",
        "QKEY-SECRET",
        "QTOKEN-SECRET",
        "QACCESS-SECRET",
    ]) {
        assert!(!contains(&bytes, secret.as_bytes()), "{secret} stored");
    }
    let back = read_all(dir.path());
    let record = &back[0].record;
    assert!(
        record
            .path
            .starts_with("/v1/chat/completions?api_key=REDACTED-")
            && record.path.contains("&model=m&"),
        "{}",
        record.path
    );
    let header = |name: &str| {
        record
            .request
            .headers
            .iter()
            .find(|(k, _)| k == name)
            .map(|(_, v)| v.clone())
    };
    assert_eq!(
        header("x-goog-api-key"),
        Some(format::redacted(b"AIzaGOOG-SECRET-0002"))
    );
    assert_eq!(header("x-session-id").as_deref(), Some("visible-session"));
    assert_eq!(header("x-routing-key").as_deref(), Some("visible-routing"));
}

/// `header_mode = "allow"` stores only `content-type` and the headers named in
/// `keep_headers`, whatever else a client sends; a kept header that looks like a secret is
/// still hashed.
#[tokio::test]
async fn allow_mode_stores_only_the_named_headers() {
    let dir = tempfile::tempdir().unwrap();
    let rec = Recorder::start(&CaptureConfig {
        header_mode: agentrace::capture::HeaderMode::Allow,
        keep_headers: vec!["x-session-id".into(), "x-team-*".into()],
        ..config(dir.path())
    })
    .unwrap();
    let mut ex = FakeExchange::chat(Some("s"), b"{}".to_vec(), "ok");
    ex.headers.push(("x-session-id", "visible-session".into()));
    ex.headers.push(("x-team-token", "TEAM-SECRET-0009".into()));
    ex.headers
        .push(("x-custom-credential-carrier", "CUSTOM-SECRET-0010".into()));
    ex.headers.push(("user-agent", "agent/1.0".into()));
    ex.response_headers.push(("x-request-id", "req-1".into()));
    drive(rec.sink.as_ref(), &ex);
    rec.finish().await;

    let bytes = all_bytes(dir.path());
    assert!(!contains(&bytes, b"TEAM-SECRET"));
    assert!(!contains(&bytes, b"CUSTOM-SECRET"));
    let back = read_all(dir.path());
    let record = &back[0].record;
    let names: Vec<&str> = record
        .request
        .headers
        .iter()
        .map(|(k, _)| k.as_str())
        .collect();
    assert_eq!(names, ["content-type", "x-session-id", "x-team-token"]);
    assert!(record.request.headers[2].1.starts_with("REDACTED-"));
    let response = record.response.as_ref().unwrap();
    let names: Vec<&str> = response.headers.iter().map(|(k, _)| k.as_str()).collect();
    assert_eq!(names, ["content-type"]);
}

// Rotation: past `rotate_bytes` a new segment starts; names sort in creation order, every
// segment opens with its header and decodes alone (no delta reaches into a previous one), and
// together they hold every exchange in order.
#[tokio::test]
async fn rotation_starts_self_contained_segments_in_name_order() {
    let dir = tempfile::tempdir().unwrap();
    let mut cfg = config(dir.path());
    cfg.rotate_bytes = 4096;
    let rec = Recorder::start(&cfg).unwrap();
    let mut sent = Vec::new();
    for (i, body) in agent_bodies("rot", 40).into_iter().enumerate() {
        let ex = FakeExchange::chat(
            Some("rot"),
            body,
            &format!("reply {i} {}", "z".repeat(i * 50)),
        );
        drive(rec.sink.as_ref(), &ex);
        sent.push(ex);
    }
    rec.finish().await;

    let segs = reader::segments(dir.path()).unwrap();
    assert!(segs.len() >= 3, "{} segments", segs.len());
    let mut seqs = Vec::new();
    let mut bodies = Vec::new();
    for path in &segs {
        let mut r = SegmentReader::open(path).unwrap();
        match r.next() {
            Some(Entry::Segment(h)) => seqs.push(h.seq),
            other => panic!("{} starts with {other:?}", path.display()),
        }
        let mut first = true;
        for entry in r.by_ref() {
            if let Entry::Exchange(e) = entry {
                if first {
                    assert!(
                        e.record.request.body.base.is_none(),
                        "first record is a delta"
                    );
                    first = false;
                }
                bodies.push(e.request_body.unwrap());
            }
        }
        assert!(r.cut().is_none(), "{:?}", r.cut());
    }
    assert!(seqs.windows(2).all(|w| w[0] < w[1]), "{seqs:?}");
    let want: Vec<Vec<u8>> = sent.iter().map(|e| e.body.to_vec()).collect();
    assert_eq!(bodies, want);
}

// Truncation: a segment cut at any byte gives back exactly a prefix of its records (none
// damaged) and reports the cut; the whole file reports none.
#[tokio::test]
async fn truncated_segment_yields_every_complete_record_and_reports_the_cut() {
    let dir = tempfile::tempdir().unwrap();
    let rec = Recorder::start(&config(dir.path())).unwrap();
    let bodies = agent_bodies("cut", 12);
    for (i, body) in bodies.iter().enumerate() {
        drive(
            rec.sink.as_ref(),
            &FakeExchange::chat(Some("cut"), body.clone(), &format!("r{i}")),
        );
        // Separate flushes, so the segment holds several zstd blocks.
        let path = dir.path().to_path_buf();
        wait_for(|| {
            reader::read_dir(&path)
                .map(|c| c.exchanges.len() == i + 1)
                .unwrap_or(false)
        })
        .await;
    }
    rec.finish().await;
    let path = reader::segments(dir.path()).unwrap().remove(0);
    let full = std::fs::read(&path).unwrap();
    let cut_dir = tempfile::tempdir().unwrap();
    let cut_path = cut_dir.path().join(path.file_name().unwrap());
    let mut seen_counts = std::collections::BTreeSet::new();
    for len in (0..full.len())
        .step_by(97)
        .chain([full.len() - 1, full.len()])
    {
        std::fs::write(&cut_path, &full[..len]).unwrap();
        let mut r = SegmentReader::open(&cut_path).unwrap();
        let got: Vec<Vec<u8>> = r
            .by_ref()
            .filter_map(|e| match e {
                Entry::Exchange(e) => Some(e.request_body.unwrap()),
                _ => None,
            })
            .collect();
        assert_eq!(got[..], bodies[..got.len()], "cut at {len}");
        if len == full.len() {
            assert_eq!(got.len(), bodies.len());
            assert!(r.cut().is_none());
        } else {
            assert!(
                r.cut().is_some(),
                "no cut reported at {len} of {}",
                full.len()
            );
        }
        seen_counts.insert(got.len());
    }
    assert!(seen_counts.len() > 6, "recovered counts {seen_counts:?}");
}

// Flush: while the recorder keeps running, a reader sees every exchange within a flush
// interval; what a killed process leaves behind is at most that interval short.
#[tokio::test]
async fn records_reach_the_file_within_a_flush_interval_without_shutdown() {
    let dir = tempfile::tempdir().unwrap();
    let rec = Recorder::start(&config(dir.path())).unwrap();
    let bodies = agent_bodies("live", 5);
    for body in &bodies {
        drive(
            rec.sink.as_ref(),
            &FakeExchange::chat(Some("live"), body.clone(), "ok"),
        );
    }
    let path = dir.path().to_path_buf();
    wait_for(|| {
        reader::segments(&path)
            .map(|s| !s.is_empty())
            .unwrap_or(false)
    })
    .await;
    wait_for(|| reader::read_dir(&path).unwrap().exchanges.len() == bodies.len()).await;
    let capture = reader::read_dir(&path).unwrap();
    // The frame is still open: the reader says where the readable part ends.
    assert_eq!(capture.cuts.len(), 1, "{:?}", capture.cuts);
    rec.finish().await;
    assert!(reader::read_dir(&path).unwrap().cuts.is_empty());
}

// Full queue, `drop` policy: with a one-record queue and a slow compressor, records are
// dropped, and every one is counted in the stats and in the segment's `dropped` lines; with
// `block` (each exchange's end waiting for room, as the proxy's body does) nothing is dropped.
#[tokio::test]
async fn full_queue_drops_are_all_counted_and_block_drops_none() {
    let body = Bytes::from(
        (0..64 * 1024u32)
            .map(|i| (i.wrapping_mul(2_654_435_761) >> 13) as u8)
            .collect::<Vec<u8>>(),
    );
    for policy in [FullPolicy::Drop, FullPolicy::Block] {
        let dir = tempfile::tempdir().unwrap();
        let cfg = CaptureConfig {
            queue_capacity: 1,
            zstd_level: 19,
            full_policy: policy,
            ..config(dir.path())
        };
        let rec = Recorder::start(&cfg).unwrap();
        let n = 120;
        for _ in 0..n {
            let mut ex = FakeExchange::chat(None, Vec::new(), "x");
            ex.body = body.clone();
            match policy {
                FullPolicy::Drop => drive(rec.sink.as_ref(), &ex),
                FullPolicy::Block => drive_waiting(rec.sink.as_ref(), &ex).await,
            }
        }
        let stats_before_finish = rec.stats();
        rec.finish().await;
        let capture = reader::read_dir(dir.path()).unwrap();
        let written = capture.exchanges.len() as u64;
        match policy {
            FullPolicy::Drop => {
                assert!(stats_before_finish.records_dropped > 0, "nothing dropped");
                assert_eq!(written + capture.dropped, n);
                assert_eq!(capture.dropped, stats_before_finish.records_dropped);
            }
            FullPolicy::Block => {
                assert_eq!(capture.dropped, 0);
                assert_eq!(written, n);
            }
        }
    }
}

// Memory bound: an exchange whose bodies do not fit is written without its payload but with
// its timings, marked incomplete with the reason; the next fitting one is whole again.
#[tokio::test]
async fn memory_bound_keeps_timings_and_marks_the_record_incomplete() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = CaptureConfig {
        memory_bound_bytes: 2048,
        ..config(dir.path())
    };
    let rec = Recorder::start(&cfg).unwrap();
    let big = FakeExchange::chat(Some("m"), vec![b'{'; 4000], "too big");
    let small = FakeExchange::chat(Some("m"), b"{\"small\":true}".to_vec(), "fits");
    drive(rec.sink.as_ref(), &big);
    drive(rec.sink.as_ref(), &small);
    rec.finish().await;
    let back = read_all(dir.path());
    assert_eq!(back.len(), 2);
    assert!(!back[0].record.complete);
    assert_eq!(back[0].record.drop_reason.as_deref(), Some("memory_bound"));
    assert_eq!(back[0].request_body, None);
    assert_eq!(back[0].record.request.body.len, 4000);
    assert_eq!(back[0].frame_offsets_us().len(), big.frames.len());
    assert!(back[1].record.complete);
    assert_eq!(back[1].request_body.as_deref(), Some(&small.body[..]));
}

// Unwritable directory: the sink still returns at once, every record is counted as lost (the
// first because opening its segment failed, the rest because they came while the writer
// waited to retry), the failed attempts are counted as write errors, and nothing panics; the
// recorder finishes cleanly.
#[tokio::test]
async fn unwritable_directory_counts_lost_records_and_never_blocks() {
    let dir = tempfile::tempdir().unwrap();
    let blocker = dir.path().join("file");
    std::fs::write(&blocker, b"not a directory").unwrap();
    let rec = Recorder::start(&config(&blocker.join("captures"))).unwrap();
    for body in agent_bodies("nowhere", 10) {
        drive(
            rec.sink.as_ref(),
            &FakeExchange::chat(Some("n"), body, "ok"),
        );
    }
    wait_for(|| {
        let s = rec.stats();
        s.records_lost_write_failed + s.records_lost_retry_wait == 10
    })
    .await;
    let stats = rec.stats();
    assert_eq!(stats.records_written, 0);
    assert!(stats.records_lost_write_failed >= 1, "{stats:?}");
    assert!((1..=10).contains(&stats.write_errors), "{stats:?}");
    rec.finish().await;
}

// Format: every line of a segment is one of the documented record types, the first being the
// header with the current format tag, and segment names carry a sortable UTC time.
#[tokio::test]
async fn segments_follow_the_documented_format() {
    let dir = tempfile::tempdir().unwrap();
    let rec = Recorder::start(&config(dir.path())).unwrap();
    drive(
        rec.sink.as_ref(),
        &FakeExchange::chat(Some("f"), b"{}".to_vec(), "hello world"),
    );
    rec.finish().await;
    let path = reader::segments(dir.path()).unwrap().remove(0);
    let name = path.file_name().unwrap().to_string_lossy().into_owned();
    assert!(
        name.starts_with("capture-20") && name.ends_with(".jsonl.zst"),
        "{name}"
    );
    let text = String::from_utf8(decompressed(dir.path())).unwrap();
    let lines: Vec<Line> = text
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    match &lines[0] {
        Line::Segment(h) => assert_eq!(h.format, format::FORMAT),
        other => panic!("{other:?}"),
    }
    let Line::Exchange(e) = &lines[1] else {
        panic!("{:?}", lines[1])
    };
    let resp = e.response.as_ref().unwrap();
    assert_eq!(resp.status, 200);
    assert_eq!(resp.event_frames.len(), 3, "one per SSE event incl. [DONE]");
    assert!(e.t.first_byte_us.unwrap() >= e.t.head_us.unwrap());
    assert!(e.t.end_us >= e.t.first_byte_us.unwrap());
    let _: HashMap<String, serde_json::Value> =
        serde_json::from_str(text.lines().nth(1).unwrap()).unwrap();
}

/// Waits until `cond` holds, checking every few milliseconds; fails after 30 s.
async fn wait_for(mut cond: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(30);
    while !cond() {
        assert!(Instant::now() < deadline, "condition not reached in 30 s");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// Writes `hot` sessions that speak at every step and `cold` ones that speak in turn, so the
/// cold ones' bases are forgotten under a small bound while the hot ones stay deltas; returns
/// the bound and the request bodies in the order sent.
async fn many_sessions(dir: &std::path::Path) -> (u64, Vec<Vec<u8>>) {
    let bound = 32 * 1024;
    let rec = Recorder::start(&CaptureConfig {
        memory_bound_bytes: bound,
        // One record in flight at a time: the sink's hold on bodies never reaches the bound.
        queue_capacity: 1,
        full_policy: FullPolicy::Block,
        ..config(dir)
    })
    .unwrap();
    let (hot, cold, turns) = (3, 24, 8);
    let bodies: Vec<Vec<Vec<u8>>> = (0..hot + cold)
        .map(|s| agent_bodies(&format!("many-{s}"), turns))
        .collect();
    let mut next = vec![0usize; hot + cold];
    let mut sent = Vec::new();
    for step in 0..cold * turns {
        for s in (0..hot).chain([hot + step % cold]) {
            let Some(body) = bodies[s].get(next[s]) else {
                continue;
            };
            next[s] += 1;
            let ex = FakeExchange::chat(Some(&format!("many-{s}")), body.clone(), "ok");
            drive_waiting(rec.sink.as_ref(), &ex).await;
            sent.push(body.clone());
        }
    }
    rec.finish().await;
    (bound, sent)
}

/// Reads the one segment of `dir`: its request bodies, the most bytes its reader held for
/// deltas, and how many bodies were stored as deltas.
fn read_bases(dir: &std::path::Path) -> (Vec<Vec<u8>>, u64, usize) {
    let segs = reader::segments(dir).unwrap();
    assert_eq!(segs.len(), 1);
    let mut r = SegmentReader::open(&segs[0]).unwrap();
    let (mut bodies, mut most, mut deltas) = (Vec::new(), 0, 0);
    while let Some(entry) = r.next() {
        most = most.max(r.base_bytes());
        if let Entry::Exchange(e) = entry {
            deltas += usize::from(e.record.request.body.base.is_some());
            bodies.push(e.request_body.expect("every body kept"));
        }
    }
    assert!(r.cut().is_none(), "{:?}", r.cut());
    (bodies, most, deltas)
}

// A segment of many sessions reads within the delta-base bound its writer kept (recorded in
// its header), forgetting the same sessions' bases the writer forgot, and every request body
// still rebuilds byte for byte: the hot sessions' as deltas, the forgotten ones' stored whole.
#[tokio::test]
async fn segment_reader_holds_no_more_delta_bases_than_its_writer() {
    let dir = tempfile::tempdir().unwrap();
    let (bound, sent) = many_sessions(dir.path()).await;
    let (bodies, most, deltas) = read_bases(dir.path());
    assert_eq!(bodies, sent);
    let all: u64 = (0..27)
        .map(|s| format!("many-{s}").len() as u64)
        .sum::<u64>()
        + sent
            .iter()
            .rev()
            .take(27)
            .map(|b| b.len() as u64)
            .sum::<u64>();
    assert!(all > 2 * bound, "the sessions' bases ({all}) fit the bound");
    assert!(
        most <= bound,
        "reader held {most} bytes of bases, bound {bound}"
    );
    assert!(most > bound / 2, "reader held only {most} bytes of bases");
    let hot_turns = 3 * 7;
    assert!(deltas >= hot_turns, "only {deltas} deltas");
    assert!(
        deltas < sent.len() - 27,
        "{deltas} deltas: no base was forgotten"
    );
}

// A segment whose header has no `delta_bases_bytes` (written before it was recorded) still
// reads whole, keeping every session's base as readers always did.
#[tokio::test]
async fn segments_without_a_recorded_bound_read_keeping_every_base() {
    let dir = tempfile::tempdir().unwrap();
    let (bound, sent) = many_sessions(dir.path()).await;
    let path = reader::segments(dir.path()).unwrap().remove(0);
    let text = String::from_utf8(decompressed(dir.path())).unwrap();
    let (head, rest) = text.split_once('\n').unwrap();
    let mut header: serde_json::Value = serde_json::from_str(head).unwrap();
    assert!(
        header["delta_bases_bytes"].as_u64() == Some(bound),
        "{header}"
    );
    header.as_object_mut().unwrap().remove("delta_bases_bytes");
    let old = format!("{header}\n{rest}");
    std::fs::write(&path, zstd::encode_all(old.as_bytes(), 3).unwrap()).unwrap();

    let (bodies, most, _) = read_bases(dir.path());
    assert_eq!(bodies, sent);
    assert!(
        most > bound,
        "an old segment's reader held only {most} bytes"
    );
}

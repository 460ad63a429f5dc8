//! The versioned record schema of capture segments (`agentrace.capture.v1`): one JSON object
//! per line of a zstd-compressed JSONL file; `captures/README.md` documents every field.

use serde::{Deserialize, Serialize};

use crate::tap::KeySource;

/// The format tag every segment header carries; readers refuse other major versions.
pub const FORMAT: &str = "agentrace.capture.v1";

/// File name suffix of a segment.
pub const SEGMENT_SUFFIX: &str = ".jsonl.zst";

/// File name prefix of a segment.
pub const SEGMENT_PREFIX: &str = "capture-";

/// One line of a segment.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum Line {
    /// First line of every segment.
    Segment(SegmentHeader),
    /// One exchange (request and response).
    Exchange(Box<ExchangeRecord>),
    /// Records the recorder had to drop since the previous `dropped` line.
    Dropped(DroppedRecord),
}

/// Identifies a segment and the recorder that wrote it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SegmentHeader {
    /// Always [`FORMAT`].
    pub format: String,
    /// Random tag of the recorder instance (also in the file name).
    pub recorder: String,
    /// Sequence number of the segment within its recorder, from 1.
    pub seq: u64,
    /// Wall-clock time the segment was opened (ns since the Unix epoch).
    pub created_unix_ns: u64,
    /// Version of agentrace that wrote it.
    pub writer: String,
    /// The proxy replica that wrote it (`capture.replica`, by default the host name, so a
    /// Kubernetes pod name); absent in segments written before replicas were named.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub replica: Option<String>,
    /// The bound in bytes (session keys plus bodies) on the delta bases kept while writing
    /// this segment: a reader that forgets bases by the same rule needs no more memory.
    /// Absent in segments written before it was recorded, which read with every base kept.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub delta_bases_bytes: Option<u64>,
}

/// Exchanges the recorder could not keep, so a reader knows the capture has holes.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct DroppedRecord {
    /// Records dropped whole since the previous `dropped` line (queue full, memory bound,
    /// recorder shutting down).
    pub count: u64,
    /// Wall-clock time of this line (ns since the Unix epoch).
    pub at_unix_ns: u64,
}

/// One exchange as stored.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ExchangeRecord {
    /// Exchange number within its recorder, in start order.
    pub id: u64,
    /// The session key, if any.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub session: Option<String>,
    /// Where the session key came from.
    pub key_source: KeySource,
    /// Backend the request was sent to.
    pub backend: String,
    /// Wall-clock start (ns since the Unix epoch).
    pub start_unix_ns: u64,
    /// HTTP method.
    pub method: String,
    /// Path and query as sent by the client.
    pub path: String,
    /// Monotonic offsets from the start (µs).
    pub t: Offsets,
    /// What the client sent.
    pub request: StoredRequest,
    /// What the backend answered; absent when no response head arrived.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub response: Option<StoredResponse>,
    /// How the exchange ended: `complete`, `upstream_error` or `client_gone`.
    pub end: EndKind,
    /// The upstream error, when `end` is `upstream_error`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
    /// False when the recorder kept only part of the payload (see `drop_reason`).
    pub complete: bool,
    /// Why payload bytes were left out (`memory_bound`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub drop_reason: Option<String>,
}

/// How an exchange ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum EndKind {
    /// The response body ended normally.
    Complete,
    /// The upstream failed after response bytes reached the client.
    UpstreamError,
    /// The client went away before the response ended.
    ClientGone,
}

/// Monotonic offsets of an exchange, in µs from the moment its first byte was accepted.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Offsets {
    /// The request body was fully received.
    pub received_us: u64,
    /// The response head arrived.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub head_us: Option<u64>,
    /// The first response body byte was forwarded.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub first_byte_us: Option<u64>,
    /// The first token was forwarded: the first SSE event carrying content, thinking or a
    /// tool call of any of the three APIs (never `message_start`, `response.created`, a
    /// `ping` or a role-only chunk, which come before the model has produced anything).
    /// Absent for a response that is not a stream, or has no such event.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub first_token_us: Option<u64>,
    /// The exchange ended.
    pub end_us: u64,
}

/// A request as stored.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct StoredRequest {
    /// Headers in arrival order, secrets redacted.
    pub headers: Vec<(String, String)>,
    /// The body, whole or as a delta against the session's previous request.
    pub body: StoredBody,
}

/// A response as stored.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct StoredResponse {
    /// HTTP status.
    pub status: u16,
    /// Headers in arrival order, secrets redacted.
    pub headers: Vec<(String, String)>,
    /// The body forwarded to the client (never a delta).
    pub body: StoredBody,
    /// Per forwarded body frame: µs since the previous frame (the first: since the start).
    pub frame_us: Vec<u64>,
    /// Per forwarded body frame: its length in bytes.
    pub frame_len: Vec<u64>,
    /// Per SSE event (text/event-stream only): index of the frame that completed it, as the
    /// difference from the previous event's frame index (the first: the index itself).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub event_frames: Vec<u64>,
}

/// Body bytes: `text` when UTF-8, else `hex`; with `base`, the bytes are the middle of a
/// body whose start and end are shared with the same session's previous request.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct StoredBody {
    /// Length of the whole body in bytes.
    pub len: u64,
    /// What the delta is applied to; absent for a body stored whole.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub base: Option<DeltaBase>,
    /// The bytes (whole body, or the delta's middle) as UTF-8 text.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub text: Option<String>,
    /// The bytes as lowercase hex when they are not UTF-8.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hex: Option<String>,
}

/// A delta's reference to the previous request body of the same session (same segment).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DeltaBase {
    /// Bytes taken from the start of the previous body.
    pub prefix_len: u64,
    /// First 16 hex digits of the SHA-256 of those bytes.
    pub prefix_sha256: String,
    /// Bytes taken from the end of the previous body (after the middle).
    pub suffix_len: u64,
}

impl StoredBody {
    /// Stores `bytes` whole.
    pub fn whole(bytes: &[u8]) -> StoredBody {
        let mut body = StoredBody {
            len: bytes.len() as u64,
            ..StoredBody::default()
        };
        body.set_bytes(bytes);
        body
    }

    /// Puts `bytes` in `text` when UTF-8, else in `hex`.
    pub fn set_bytes(&mut self, bytes: &[u8]) {
        match std::str::from_utf8(bytes) {
            Ok(s) => self.text = Some(s.to_owned()),
            Err(_) => self.hex = Some(hex::encode(bytes)),
        }
    }

    /// The stored bytes (the whole body, or the delta's middle).
    pub fn stored_bytes(&self) -> Result<Vec<u8>, String> {
        match (&self.text, &self.hex) {
            (Some(t), None) => Ok(t.as_bytes().to_vec()),
            (None, Some(h)) => hex::decode(h).map_err(|e| format!("body.hex: {e}")),
            (None, None) if self.len == 0 || self.base.is_some() => Ok(Vec::new()),
            (None, None) => Err("body: neither text nor hex".into()),
            (Some(_), Some(_)) => Err("body: both text and hex".into()),
        }
    }
}

/// First 16 hex digits of the SHA-256 of `bytes`: short enough to store per record, long
/// enough that equal values are equal and different ones differ in practice.
pub fn short_sha256(bytes: &[u8]) -> String {
    use sha2::Digest;
    let digest = sha2::Sha256::digest(bytes);
    hex::encode(&digest[..8])
}

/// The stored form of a secret header value.
pub fn redacted(value: &[u8]) -> String {
    format!("REDACTED-{}", short_sha256(value))
}

/// UTC calendar time of `unix_ns`: (year, month, day, hour, minute, second, millisecond).
pub fn civil(unix_ns: u64) -> (i64, u32, u32, u32, u32, u32, u32) {
    let secs = (unix_ns / 1_000_000_000) as i64;
    let ms = ((unix_ns / 1_000_000) % 1000) as u32;
    let days = secs.div_euclid(86_400);
    let rem = secs.rem_euclid(86_400) as u32;
    // Days to civil date (proleptic Gregorian), after H. Hinnant's `civil_from_days`.
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let month = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    let year = yoe + era * 400 + i64::from(month <= 2);
    (year, month, day, rem / 3600, rem / 60 % 60, rem % 60, ms)
}

/// `unix_ns` as RFC 3339 UTC with milliseconds (`2026-11-29T17:06:27.123Z`).
pub fn rfc3339(unix_ns: u64) -> String {
    let (y, mo, d, h, mi, s, ms) = civil(unix_ns);
    format!("{y:04}-{mo:02}-{d:02}T{h:02}:{mi:02}:{s:02}.{ms:03}Z")
}

/// `unix_ns` in the compact form used in segment names (`20261129T170627.123Z`), which
/// sorts as text in time order.
pub fn compact_time(unix_ns: u64) -> String {
    let (y, mo, d, h, mi, s, ms) = civil(unix_ns);
    format!("{y:04}{mo:02}{d:02}T{h:02}{mi:02}{s:02}.{ms:03}Z")
}

/// Parses a time given on the command line: Unix seconds (`1764435987.5`) or RFC 3339 UTC
/// (`2026-11-29T17:06:27Z`, fraction optional).
pub fn parse_time(text: &str) -> Result<u64, String> {
    let bad = || format!("not a time (Unix seconds or YYYY-MM-DDTHH:MM:SS[.fff]Z): {text:?}");
    if let Ok(secs) = text.parse::<f64>() {
        if secs.is_finite() && secs >= 0.0 {
            return Ok((secs * 1e9) as u64);
        }
        return Err(bad());
    }
    let t = text.strip_suffix('Z').ok_or_else(bad)?;
    let (date, time) = t.split_once('T').ok_or_else(bad)?;
    let num = |s: &str| s.parse::<u64>().map_err(|_| bad());
    let d: Vec<&str> = date.split('-').collect();
    let (clock, frac) = time.split_once('.').unwrap_or((time, ""));
    let c: Vec<&str> = clock.split(':').collect();
    if d.len() != 3 || c.len() != 3 {
        return Err(bad());
    }
    let (y, mo, day) = (num(d[0])? as i64, num(d[1])?, num(d[2])?);
    let (h, mi, s) = (num(c[0])?, num(c[1])?, num(c[2])?);
    if !(1..=12).contains(&mo) || !(1..=31).contains(&day) || h > 23 || mi > 59 || s > 60 {
        return Err(bad());
    }
    // Civil date to days, after H. Hinnant's `days_from_civil`.
    let y = if mo <= 2 { y - 1 } else { y };
    let era = y.div_euclid(400);
    let yoe = y.rem_euclid(400);
    let mp = (mo as i64 + 9) % 12;
    let doy = (153 * mp + 2) / 5 + day as i64 - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    let days = era * 146_097 + doe - 719_468;
    if days < 0 {
        return Err(bad());
    }
    let mut ns = (days as u64 * 86_400 + h * 3600 + mi * 60 + s) * 1_000_000_000;
    if !frac.is_empty() {
        let digits: String = frac.chars().take(9).collect();
        let scaled = num(&digits)? * 10u64.pow(9 - digits.len() as u32);
        ns += scaled;
    }
    Ok(ns)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn times_round_trip_between_text_and_nanoseconds() {
        let ns = 1_795_972_387_123_000_000; // 2026-12-02T…
        let text = rfc3339(ns);
        assert_eq!(parse_time(&text).unwrap(), ns);
        assert_eq!(rfc3339(0), "1970-01-01T00:00:00.000Z");
        assert_eq!(
            parse_time("2000-02-29T12:00:00Z").unwrap(),
            951_825_600_000_000_000
        );
        assert_eq!(
            compact_time(951_825_600_000_000_000),
            "20000229T120000.000Z"
        );
        assert!(parse_time("yesterday").is_err());
    }

    #[test]
    fn redaction_keeps_equality_and_hides_the_value() {
        let a = redacted(b"Bearer sk-secret");
        assert_eq!(a, redacted(b"Bearer sk-secret"));
        assert_ne!(a, redacted(b"Bearer sk-other"));
        assert!(a.starts_with("REDACTED-") && a.len() == 9 + 16);
        assert!(!a.contains("secret"));
    }
}

/// Shortest shared start plus end that makes a delta worth storing instead of the whole body.
pub const MIN_SHARED_BYTES: usize = 64;

/// How `cur` extends `prev`: bytes `prev[..prefix]` and `prev[prev.len() - suffix..]` are
/// shared, `cur[prefix..cur.len() - suffix]` is new. Cut points fall on UTF-8 boundaries so a
/// text body's middle stays text. `None` when they share fewer than [`MIN_SHARED_BYTES`].
pub fn diff(prev: &[u8], cur: &[u8]) -> Option<(usize, usize)> {
    let max = prev.len().min(cur.len());
    let mut prefix = common_prefix(&prev[..max], &cur[..max]);
    while prefix > 0 && prefix < cur.len() && is_continuation(cur[prefix]) {
        prefix -= 1;
    }
    let room = (prev.len() - prefix).min(cur.len() - prefix);
    let mut suffix = common_suffix(&prev[prev.len() - room..], &cur[cur.len() - room..]);
    while suffix > 0 && is_continuation(cur[cur.len() - suffix]) {
        suffix -= 1;
    }
    (prefix + suffix >= MIN_SHARED_BYTES).then_some((prefix, suffix))
}

fn is_continuation(b: u8) -> bool {
    b & 0b1100_0000 == 0b1000_0000
}

fn common_prefix(a: &[u8], b: &[u8]) -> usize {
    const CHUNK: usize = 64;
    let mut i = 0;
    while i + CHUNK <= a.len() && a[i..i + CHUNK] == b[i..i + CHUNK] {
        i += CHUNK;
    }
    i + a[i..]
        .iter()
        .zip(&b[i..])
        .take_while(|(x, y)| x == y)
        .count()
}

fn common_suffix(a: &[u8], b: &[u8]) -> usize {
    a.iter()
        .rev()
        .zip(b.iter().rev())
        .take_while(|(x, y)| x == y)
        .count()
}

/// Rebuilds a body from the previous one and a delta, checking the shared start's hash.
pub fn patch(prev: &[u8], base: &DeltaBase, middle: &[u8]) -> Result<Vec<u8>, String> {
    let (prefix, suffix) = (base.prefix_len as usize, base.suffix_len as usize);
    if prefix + suffix > prev.len() {
        return Err(format!(
            "delta takes {prefix} + {suffix} bytes from a previous body of {}",
            prev.len()
        ));
    }
    if short_sha256(&prev[..prefix]) != base.prefix_sha256 {
        return Err("delta base: the previous body's prefix hash does not match".into());
    }
    let mut out = Vec::with_capacity(prefix + middle.len() + suffix);
    out.extend_from_slice(&prev[..prefix]);
    out.extend_from_slice(middle);
    out.extend_from_slice(&prev[prev.len() - suffix..]);
    Ok(out)
}

#[cfg(test)]
mod delta_tests {
    use super::*;

    fn round_trip(prev: &[u8], cur: &[u8]) -> Option<(usize, usize)> {
        let d = diff(prev, cur);
        if let Some((p, s)) = d {
            let base = DeltaBase {
                prefix_len: p as u64,
                prefix_sha256: short_sha256(&prev[..p]),
                suffix_len: s as u64,
            };
            let middle = &cur[p..cur.len() - s];
            assert_eq!(patch(prev, &base, middle).unwrap(), cur);
            if std::str::from_utf8(cur).is_ok() {
                assert!(
                    std::str::from_utf8(middle).is_ok(),
                    "middle must stay UTF-8"
                );
            }
        }
        d
    }

    #[test]
    fn delta_of_a_grown_history_keeps_only_the_new_messages() {
        let head = r#"{"model":"m","messages":[{"role":"system","content":"You are a helpful agent."},{"role":"user","content":"fix the bug"}"#;
        let tail =
            r#"],"temperature":1.0,"tools":[{"type":"function","function":{"name":"bash"}}]}"#;
        let prev = format!("{head}{tail}");
        let new = r#",{"role":"assistant","content":"ok"},{"role":"tool","content":"done"}"#;
        let cur = format!("{head}{new}{tail}");
        let (p, s) = round_trip(prev.as_bytes(), cur.as_bytes()).unwrap();
        assert_eq!(&cur[p..cur.len() - s], new);
    }

    #[test]
    fn delta_cut_points_never_split_a_utf8_character() {
        let base = "x".repeat(100);
        let prev = format!("{base}é{base}");
        let cur = format!("{base}è{base}");
        round_trip(prev.as_bytes(), cur.as_bytes()).unwrap();
        let prev = format!("{base}日本{base}");
        let cur = format!("{base}日本語{base}");
        round_trip(prev.as_bytes(), cur.as_bytes()).unwrap();
    }

    #[test]
    fn unrelated_or_short_bodies_are_stored_whole() {
        assert_eq!(round_trip(b"abc", b"abd"), None);
        assert_eq!(round_trip(&[1u8; 200], &[2u8; 200]), None);
        assert!(round_trip(&[], &[]).is_none());
        // Identical bodies: everything shared, nothing new.
        let same = vec![7u8; 300];
        let (p, s) = round_trip(&same, &same).unwrap();
        assert_eq!(p + s, 300);
        // A body shorter than its predecessor.
        let prev = "y".repeat(500);
        round_trip(prev.as_bytes(), &prev.as_bytes()[..200]).unwrap();
    }

    #[test]
    fn patch_refuses_a_base_whose_prefix_differs() {
        let prev = vec![b'a'; 100];
        let base = DeltaBase {
            prefix_len: 80,
            prefix_sha256: short_sha256(&[b'b'; 80]),
            suffix_len: 0,
        };
        assert!(patch(&prev, &base, b"z").is_err());
    }
}

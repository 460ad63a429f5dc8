//! Where a session's cache really is: the token usage a backend reports in its response
//! (`usage.prompt_tokens` and `usage.prompt_tokens_details.cached_tokens`, as vLLM, SGLang,
//! llama.cpp and the simulator send them, in a JSON answer or in a stream's last chunk when the
//! client asked for `stream_options.include_usage`). A continuing turn whose backend served
//! far less of its prompt from cache than the previous turn's prompt has lost that cache: the
//! session may then move to a backend holding less, at no cost to its own prefill.

use std::sync::LazyLock;

use memchr::memmem::Finder;

/// Bytes of the previous frame kept so that a key cut by a frame boundary is still found:
/// longer than a key, its separator and a number.
const SEAM: usize = 48;

/// What a backend said of one request's prompt.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct CacheUsage {
    /// `usage.prompt_tokens`.
    pub prompt_tokens: u64,
    /// `usage.prompt_tokens_details.cached_tokens` (0 when the backend reported none).
    pub cached_tokens: u64,
}

/// Finds the last `"prompt_tokens"` and `"cached_tokens"` values in a response body read frame
/// by frame, without keeping the body: a few dozen bytes of the previous frame at most.
#[derive(Debug, Default)]
pub(crate) struct UsageScan {
    seam: Vec<u8>,
    prompt: Option<u64>,
    cached: Option<u64>,
}

const PROMPT_KEY: &[u8] = b"\"prompt_tokens\"";
const CACHED_KEY: &[u8] = b"\"cached_tokens\"";
/// Built once: building a searcher costs more than scanning a small body with it.
static PROMPT_FINDER: LazyLock<Finder<'static>> = LazyLock::new(|| Finder::new(PROMPT_KEY));
static CACHED_FINDER: LazyLock<Finder<'static>> = LazyLock::new(|| Finder::new(CACHED_KEY));

impl UsageScan {
    /// Reads one more body frame.
    pub(crate) fn feed(&mut self, frame: &[u8]) {
        if frame.is_empty() {
            return;
        }
        // Keys that straddle the boundary: the stream's last bytes joined with this frame's
        // head. A value of at most `SEAM` bytes with the byte after it lies whole in one of
        // the two windows.
        if !self.seam.is_empty() {
            let kept = self.seam.len();
            self.seam.extend_from_slice(&frame[..frame.len().min(SEAM)]);
            let joined = std::mem::take(&mut self.seam);
            self.scan(&joined);
            self.seam = joined;
            self.seam.truncate(kept);
        }
        self.scan(frame);
        self.seam.extend_from_slice(frame);
        let excess = self.seam.len().saturating_sub(SEAM);
        self.seam.drain(..excess);
    }

    /// The usage the body reported, once it has a prompt size.
    pub(crate) fn usage(&self) -> Option<CacheUsage> {
        Some(CacheUsage {
            prompt_tokens: self.prompt?,
            cached_tokens: self.cached.unwrap_or(0),
        })
    }

    /// Scans `text`; a number that runs to its end does not count, as the next frame may
    /// continue it.
    fn scan(&mut self, text: &[u8]) {
        if memchr::memchr(b'_', text).is_none() {
            return;
        }
        for at in PROMPT_FINDER.find_iter(text) {
            if let Some(n) = number_after(&text[at + PROMPT_KEY.len()..]) {
                self.prompt = Some(n);
            }
        }
        for at in CACHED_FINDER.find_iter(text) {
            if let Some(n) = number_after(&text[at + CACHED_KEY.len()..]) {
                self.cached = Some(n);
            }
        }
    }
}

/// The unsigned integer after `: ` at the start of `rest`, if something follows it.
fn number_after(rest: &[u8]) -> Option<u64> {
    let rest = trim_start(rest);
    let rest = trim_start(rest.strip_prefix(b":")?);
    let digits = rest.iter().take_while(|b| b.is_ascii_digit()).count();
    if digits == 0 || digits > 19 || digits == rest.len() {
        return None;
    }
    std::str::from_utf8(&rest[..digits]).ok()?.parse().ok()
}

fn trim_start(bytes: &[u8]) -> &[u8] {
    let n = bytes
        .iter()
        .take_while(|b| matches!(b, b' ' | b'\t' | b'\r' | b'\n'))
        .count();
    &bytes[n..]
}

#[cfg(test)]
mod tests {
    use super::*;

    const STREAM_END: &str = "data: {\"id\":\"c1\",\"choices\":[],\"usage\":{\"prompt_tokens\":1234,\"completion_tokens\":32,\"total_tokens\":1266,\"prompt_tokens_details\":{\"cached_tokens\":1200}}}\n\ndata: [DONE]\n\n";

    fn scan_in_pieces(body: &[u8], piece: usize) -> Option<CacheUsage> {
        let mut scan = UsageScan::default();
        for chunk in body.chunks(piece) {
            scan.feed(chunk);
        }
        scan.usage()
    }

    #[test]
    fn usage_is_read_whatever_the_frame_boundaries() {
        let want = Some(CacheUsage {
            prompt_tokens: 1234,
            cached_tokens: 1200,
        });
        for piece in 1..STREAM_END.len() {
            assert_eq!(
                scan_in_pieces(STREAM_END.as_bytes(), piece),
                want,
                "{piece}"
            );
        }
    }

    #[test]
    fn the_last_report_wins_and_spaces_are_allowed() {
        let body = br#"{"usage": {"prompt_tokens" : 10, "prompt_tokens_details": {"cached_tokens": 0}}} {"usage": {"prompt_tokens":20,"prompt_tokens_details":{"cached_tokens": 16}}}"#;
        assert_eq!(
            scan_in_pieces(body, 7),
            Some(CacheUsage {
                prompt_tokens: 20,
                cached_tokens: 16
            })
        );
    }

    #[test]
    fn a_body_without_usage_reports_none_and_missing_cached_counts_zero() {
        assert_eq!(scan_in_pieces(b"data: {\"choices\":[]}\n\n", 5), None);
        assert_eq!(
            scan_in_pieces(br#"{"usage":{"prompt_tokens":7}}"#, 3),
            Some(CacheUsage {
                prompt_tokens: 7,
                cached_tokens: 0
            })
        );
        // Not a number, or too long for one: ignored.
        assert_eq!(
            scan_in_pieces(
                br#"{"prompt_tokens":"7","x":{"prompt_tokens":99999999999999999999999}}"#,
                4
            ),
            None
        );
    }
}

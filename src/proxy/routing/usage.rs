//! Where a session's cache really is: the token usage a backend reports in its response
//! (`usage.prompt_tokens` and `usage.prompt_tokens_details.cached_tokens`, as vLLM, SGLang,
//! llama.cpp and the simulator send them, in a JSON answer or in a stream's last chunk when the
//! client asked for `stream_options.include_usage`); for Anthropic Messages its `input_tokens`,
//! `cache_read_input_tokens` and `cache_creation_input_tokens` (in `message_start`'s
//! `message.usage` and `message_delta`'s `usage` of a stream); for OpenAI Responses its
//! `usage.input_tokens` and `usage.input_tokens_details.cached_tokens` (in
//! `response.completed` of a stream). A continuing turn whose backend served
//! far less of its prompt from cache than the previous turn's prompt has lost that cache: the
//! session may then move to a backend holding less, at no cost to its own prefill.

use std::sync::LazyLock;

use memchr::memmem::Finder;

use crate::wire::Api;

/// Bytes of the previous frame kept so that a key cut by a frame boundary is still found:
/// longer than the longest key, its separator and a number.
const SEAM: usize = 64;

/// What a backend said of one request's prompt.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct CacheUsage {
    /// `usage.prompt_tokens`.
    pub prompt_tokens: u64,
    /// `usage.prompt_tokens_details.cached_tokens` (0 when the backend reported none).
    pub cached_tokens: u64,
}

/// Finds the usage values of a response body read frame by frame, without keeping the body:
/// a few dozen bytes of the previous frame at most. The last report of a key wins, except in
/// Messages, whose counts are cumulative: there the largest does, so a stream's later
/// `message_delta` that leaves a count at 0 does not hide the `message_start` one.
#[derive(Debug)]
pub(crate) struct UsageScan {
    api: Api,
    seam: Vec<u8>,
    /// The values of [`KEYS`], in its order.
    values: [Option<u64>; 5],
}

impl Default for UsageScan {
    fn default() -> Self {
        Self::new(Api::Chat)
    }
}

/// `"prompt_tokens"`, `"cached_tokens"`, `"input_tokens"`, `"cache_read_input_tokens"`,
/// `"cache_creation_input_tokens"`: each with its quotes, so one never matches inside another.
const KEYS: [&[u8]; 5] = [
    b"\"prompt_tokens\"",
    b"\"cached_tokens\"",
    b"\"input_tokens\"",
    b"\"cache_read_input_tokens\"",
    b"\"cache_creation_input_tokens\"",
];
const PROMPT: usize = 0;
const CACHED: usize = 1;
const INPUT: usize = 2;
const CACHE_READ: usize = 3;
const CACHE_CREATION: usize = 4;
/// Built once: building a searcher costs more than scanning a small body with it.
static FINDERS: LazyLock<[Finder<'static>; 5]> = LazyLock::new(|| KEYS.map(Finder::new));

impl UsageScan {
    /// A scan of a response of `api`.
    pub(crate) fn new(api: Api) -> Self {
        Self {
            api,
            seam: Vec::new(),
            values: [None; 5],
        }
    }

    /// The keys `api` reports its usage in.
    fn keys(&self) -> &'static [usize] {
        match self.api {
            Api::Chat => &[PROMPT, CACHED],
            Api::Responses => &[INPUT, CACHED],
            Api::Messages => &[INPUT, CACHE_READ, CACHE_CREATION],
        }
    }

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
        let v = |k: usize| self.values[k].unwrap_or(0);
        match self.api {
            Api::Chat => Some(CacheUsage {
                prompt_tokens: self.values[PROMPT]?,
                cached_tokens: v(CACHED),
            }),
            Api::Responses => Some(CacheUsage {
                prompt_tokens: self.values[INPUT]?,
                cached_tokens: v(CACHED),
            }),
            // Messages counts the uncached input apart from what was read from or written to
            // the cache: the prompt is their sum.
            Api::Messages => Some(CacheUsage {
                prompt_tokens: self.values[INPUT]? + v(CACHE_READ) + v(CACHE_CREATION),
                cached_tokens: v(CACHE_READ),
            }),
        }
    }

    /// Scans `text`; a number that runs to its end does not count, as the next frame may
    /// continue it.
    fn scan(&mut self, text: &[u8]) {
        if memchr::memchr(b'_', text).is_none() {
            return;
        }
        let largest = self.api == Api::Messages;
        for &k in self.keys() {
            for at in FINDERS[k].find_iter(text) {
                if let Some(n) = number_after(&text[at + KEYS[k].len()..]) {
                    let v = &mut self.values[k];
                    *v = Some(if largest {
                        v.map_or(n, |o| o.max(n))
                    } else {
                        n
                    });
                }
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

    fn scan_api(api: Api, body: &[u8], piece: usize) -> Option<CacheUsage> {
        let mut scan = UsageScan::new(api);
        body.chunks(piece).for_each(|c| scan.feed(c));
        scan.usage()
    }

    #[test]
    fn messages_usage_sums_its_three_input_counts_from_stream_start_and_delta() {
        let stream = concat!(
            "event: message_start\ndata: {\"type\":\"message_start\",\"message\":{\"usage\":{\"input_tokens\":34,\"cache_creation_input_tokens\":0,\"cache_read_input_tokens\":1200,\"output_tokens\":1}}}\n\n",
            "event: message_delta\ndata: {\"type\":\"message_delta\",\"delta\":{\"stop_reason\":\"end_turn\"},\"usage\":{\"input_tokens\":0,\"output_tokens\":15}}\n\n",
        );
        for piece in 1..stream.len() {
            assert_eq!(
                scan_api(Api::Messages, stream.as_bytes(), piece),
                Some(CacheUsage {
                    prompt_tokens: 1234,
                    cached_tokens: 1200
                }),
                "{piece}"
            );
        }
    }

    #[test]
    fn responses_usage_reads_input_tokens_and_their_cached_details() {
        let completed = br#"event: response.completed
data: {"type":"response.completed","response":{"id":"resp_1","usage":{"input_tokens":900,"input_tokens_details":{"cached_tokens":512},"output_tokens":20,"output_tokens_details":{"reasoning_tokens":0},"total_tokens":920}}}

"#;
        for piece in 1..completed.len() {
            assert_eq!(
                scan_api(Api::Responses, completed, piece),
                Some(CacheUsage {
                    prompt_tokens: 900,
                    cached_tokens: 512
                }),
                "{piece}"
            );
        }
        // A chat scan does not read another API's counts.
        assert_eq!(scan_api(Api::Chat, completed, 7), None);
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

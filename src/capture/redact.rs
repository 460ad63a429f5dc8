//! What of a request's credentials may reach a capture: header values and query parameters
//! whose names look like secrets are stored only as `REDACTED-<hash>`, and in `allow` mode
//! only the headers named in `keep_headers` are stored at all.
//!
//! Names are matched by pattern rather than by a fixed list because every API invents its own
//! (`X-Goog-Api-Key`, `Ocp-Apim-Subscription-Key`, `X-Auth-Token`, `?key=`): a list of exact
//! names is always one vendor short.

use super::format;

/// Header name patterns whose values are stored only as a hash (case-insensitive; `*` at
/// either end matches anything). Over-matching costs little: the hash keeps equal values
/// equal. `x-session-id` and `x-routing-key` match none: a capture needs its session keys.
pub const DEFAULT_REDACTED_HEADERS: [&str; 14] = [
    "*auth*",
    "*token*",
    "*secret*",
    "*password*",
    "*passwd*",
    "*credential*",
    "*signature*",
    "*cookie*",
    "*api-key*",
    "*apikey*",
    "*api_key*",
    "*subscription-key*",
    "*access-key*",
    "*private-key*",
];

/// Query parameter name patterns whose values are stored only as a hash.
pub const DEFAULT_REDACTED_QUERY_PARAMS: [&str; 13] = [
    "key",
    "sig",
    "code",
    "*auth*",
    "*token*",
    "*secret*",
    "*password*",
    "*passwd*",
    "*credential*",
    "*signature*",
    "*apikey*",
    "*api_key*",
    "*api-key*",
];

/// Headers stored in `allow` mode whatever `keep_headers` says: export and open-loop replay
/// need the content type, and a replay of a Messages or Responses request must send the API
/// version and beta features it was made under (`anthropic-version`, `anthropic-beta`,
/// `openai-beta`) for a server to read it alike. None of them ever holds a secret.
const ALWAYS_KEPT: [&str; 4] = [
    "content-type",
    "anthropic-version",
    "anthropic-beta",
    "openai-beta",
];

/// Which headers a capture stores.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum HeaderMode {
    /// Every header, those matching `redact_headers` as a hash.
    #[default]
    Deny,
    /// Only `content-type`, the API version headers (`anthropic-version`, `anthropic-beta`,
    /// `openai-beta`) and the headers matching `keep_headers` (those also matching
    /// `redact_headers` as a hash); the rest are left out.
    Allow,
}

/// One name pattern: exact, or with `*` at the start and/or end.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Pattern {
    Exact(String),
    Prefix(String),
    Suffix(String),
    Contains(String),
}

impl Pattern {
    /// Parses `text` (lower-cased); the core must be non-empty and satisfy `valid`.
    fn parse(text: &str, valid: impl Fn(&str) -> bool) -> Result<Pattern, String> {
        let lower = text.to_ascii_lowercase();
        let (start, end) = (
            lower.starts_with('*'),
            lower.len() > 1 && lower.ends_with('*'),
        );
        let core = lower
            .get(usize::from(start)..lower.len() - usize::from(end))
            .unwrap_or("");
        if core.is_empty() || core.contains('*') || !valid(core) {
            return Err(format!(
                "not a name, or a name with `*` at its start or end: {text:?}"
            ));
        }
        let core = core.to_owned();
        Ok(match (start, end) {
            (false, false) => Pattern::Exact(core),
            (false, true) => Pattern::Prefix(core),
            (true, false) => Pattern::Suffix(core),
            (true, true) => Pattern::Contains(core),
        })
    }

    /// `name` must be lower-case already.
    fn matches(&self, name: &str) -> bool {
        match self {
            Pattern::Exact(p) => name == p,
            Pattern::Prefix(p) => name.starts_with(p.as_str()),
            Pattern::Suffix(p) => name.ends_with(p.as_str()),
            Pattern::Contains(p) => name.contains(p.as_str()),
        }
    }
}

fn valid_header_name(core: &str) -> bool {
    http::HeaderName::from_bytes(core.as_bytes()).is_ok()
}

fn valid_query_name(core: &str) -> bool {
    !core.contains(['&', '=', '?', '#', ' '])
}

fn parse_all(
    field: &str,
    texts: &[String],
    valid: fn(&str) -> bool,
) -> Result<Vec<Pattern>, String> {
    texts
        .iter()
        .map(|t| Pattern::parse(t, valid).map_err(|e| format!("capture.{field}: {e}")))
        .collect()
}

/// The compiled redaction settings of one recorder.
#[derive(Debug, Clone)]
pub(crate) struct Redactor {
    mode: HeaderMode,
    redact: Vec<Pattern>,
    keep: Vec<Pattern>,
    query: Vec<Pattern>,
}

impl Redactor {
    /// Compiles the patterns; the error names the field and the bad entry.
    pub(crate) fn new(
        mode: HeaderMode,
        redact_headers: &[String],
        keep_headers: &[String],
        redact_query_params: &[String],
    ) -> Result<Redactor, String> {
        Ok(Redactor {
            mode,
            redact: parse_all("redact_headers", redact_headers, valid_header_name)?,
            keep: parse_all("keep_headers", keep_headers, valid_header_name)?,
            query: parse_all("redact_query_params", redact_query_params, valid_query_name)?,
        })
    }

    /// The headers as stored: `[name, value]` pairs in arrival order.
    pub(crate) fn headers(&self, map: &http::HeaderMap) -> Vec<(String, String)> {
        map.iter()
            .filter(|(name, _)| {
                let name = name.as_str();
                self.mode == HeaderMode::Deny
                    || ALWAYS_KEPT.contains(&name)
                    || self.keep.iter().any(|p| p.matches(name))
            })
            .map(|(name, value)| {
                let v = if self.redact.iter().any(|p| p.matches(name.as_str())) {
                    format::redacted(value.as_bytes())
                } else {
                    String::from_utf8_lossy(value.as_bytes()).into_owned()
                };
                (name.as_str().to_owned(), v)
            })
            .collect()
    }

    /// The path and query as stored: the value of every query parameter whose (decoded,
    /// lower-cased) name matches `redact_query_params` becomes `REDACTED-<hash>`.
    pub(crate) fn path(&self, path_and_query: &str) -> String {
        let Some((path, query)) = path_and_query.split_once('?') else {
            return path_and_query.to_owned();
        };
        let mut out = String::with_capacity(path_and_query.len() + 16);
        out.push_str(path);
        out.push('?');
        for (i, pair) in query.split('&').enumerate() {
            if i > 0 {
                out.push('&');
            }
            match pair.split_once('=') {
                Some((name, value)) if self.secret_param(name) => {
                    out.push_str(name);
                    out.push('=');
                    out.push_str(&format::redacted(value.as_bytes()));
                }
                _ => out.push_str(pair),
            }
        }
        out
    }

    fn secret_param(&self, raw_name: &str) -> bool {
        let name = percent_decoded_lower(raw_name);
        self.query.iter().any(|p| p.matches(&name))
    }
}

/// `%XX` escapes decoded and ASCII lower-cased, so `API%5FKEY` is `api_key`; anything that is
/// not a valid escape is kept as it is.
fn percent_decoded_lower(raw: &str) -> String {
    let bytes = raw.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        let hex = |b: u8| (b as char).to_digit(16);
        match (bytes[i], bytes.get(i + 1), bytes.get(i + 2)) {
            (b'%', Some(&h), Some(&l)) if hex(h).is_some() && hex(l).is_some() => {
                out.push((hex(h).unwrap_or(0) * 16 + hex(l).unwrap_or(0)) as u8);
                i += 3;
            }
            (b'+', _, _) => {
                out.push(b' ');
                i += 1;
            }
            (b, _, _) => {
                out.push(b);
                i += 1;
            }
        }
    }
    String::from_utf8_lossy(&out).to_ascii_lowercase()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn strings(list: &[&str]) -> Vec<String> {
        list.iter().map(|s| s.to_string()).collect()
    }

    fn default_redactor(mode: HeaderMode, keep: &[&str]) -> Redactor {
        Redactor::new(
            mode,
            &strings(&DEFAULT_REDACTED_HEADERS),
            &strings(keep),
            &strings(&DEFAULT_REDACTED_QUERY_PARAMS),
        )
        .unwrap()
    }

    #[test]
    fn vendor_credential_headers_are_redacted_and_session_headers_kept() {
        let r = default_redactor(HeaderMode::Deny, &[]);
        let mut map = http::HeaderMap::new();
        let secrets = [
            "authorization",
            "proxy-authorization",
            "api-key",
            "x-api-key",
            "cookie",
            "set-cookie",
            "x-auth-token",
            "x-goog-api-key",
            "ocp-apim-subscription-key",
            "x-amz-security-token",
            "x-client-secret",
        ];
        for name in secrets {
            map.insert(
                http::HeaderName::from_static(name),
                http::HeaderValue::from_static("s3cr3t"),
            );
        }
        for name in [
            "x-session-id",
            "x-routing-key",
            "content-type",
            "keep-alive",
        ] {
            map.insert(
                http::HeaderName::from_static(name),
                http::HeaderValue::from_static("plain"),
            );
        }
        for (name, value) in r.headers(&map) {
            let secret = secrets.contains(&name.as_str());
            assert_eq!(value.starts_with("REDACTED-"), secret, "{name}: {value}");
        }
    }

    #[test]
    fn allow_mode_keeps_only_named_headers_and_still_hashes_secrets() {
        let r = default_redactor(HeaderMode::Allow, &["x-session-id"]);
        let mut map = http::HeaderMap::new();
        for name in ["x-session-id", "content-type", "user-agent", "x-team-token"] {
            map.insert(
                http::HeaderName::from_static(name),
                http::HeaderValue::from_static("v"),
            );
        }
        let stored = r.headers(&map);
        let names: Vec<&str> = stored.iter().map(|(n, _)| n.as_str()).collect();
        assert_eq!(names, ["x-session-id", "content-type"]);
        assert!(Redactor::new(HeaderMode::Allow, &[], &strings(&["a*b"]), &[]).is_err());
        let r = default_redactor(HeaderMode::Allow, &["x-team-*"]);
        let stored = r.headers(&map);
        assert_eq!(stored[1].0, "x-team-token");
        assert!(stored[1].1.starts_with("REDACTED-"));
    }

    #[test]
    fn allow_mode_keeps_the_api_version_headers_and_hashes_x_api_key() {
        let r = default_redactor(HeaderMode::Allow, &["x-api-key"]);
        let mut map = http::HeaderMap::new();
        for (name, value) in [
            ("x-api-key", "sk-ant-secret"),
            ("anthropic-version", "2023-06-01"),
            ("anthropic-beta", "interleaved-thinking-2025-05-14"),
            ("openai-beta", "responses=v1"),
            ("user-agent", "claude-cli/2.0"),
        ] {
            map.insert(
                http::HeaderName::from_static(name),
                http::HeaderValue::from_static(value),
            );
        }
        let stored = r.headers(&map);
        let names: Vec<&str> = stored.iter().map(|(n, _)| n.as_str()).collect();
        assert_eq!(
            names,
            [
                "x-api-key",
                "anthropic-version",
                "anthropic-beta",
                "openai-beta"
            ]
        );
        assert!(stored[0].1.starts_with("REDACTED-"), "{:?}", stored[0]);
        assert_eq!(stored[1].1, "2023-06-01");
    }

    #[test]
    fn credential_query_parameters_are_redacted_wherever_they_stand() {
        let r = default_redactor(HeaderMode::Deny, &[]);
        let stored =
            r.path("/v1/chat?key=AIzaSECRET&model=m&API%5FKEY=k2&access_token=t&x=1&sig=abc&flag");
        for secret in ["AIzaSECRET", "k2", "=t&", "abc"] {
            assert!(!stored.contains(secret), "{stored}");
        }
        assert!(stored.starts_with("/v1/chat?key=REDACTED-"), "{stored}");
        assert!(stored.contains("&model=m&"), "{stored}");
        assert!(stored.contains("&x=1&sig=REDACTED-"), "{stored}");
        assert!(stored.ends_with("&flag"), "{stored}");
        assert_eq!(r.path("/v1/chat/completions"), "/v1/chat/completions");
        assert_eq!(r.path("/p?"), "/p?");
    }
}

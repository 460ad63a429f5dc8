//! How a message body is delimited (RFC 9112 §6): told from a head's `Content-Length` and
//! `Transfer-Encoding`, refusing every combination two parsers could read differently.

use http::{StatusCode, Version};

use super::fields::Fields;
use super::H1Error;

/// How a message body is delimited on the wire.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Framing {
    /// No body.
    Empty,
    /// Exactly this many bytes.
    Length(u64),
    /// `Transfer-Encoding: chunked`.
    Chunked,
    /// Until the connection closes (responses only).
    UntilClose,
}

/// Which of the fields that frame a message a head carries, told by one pass over its names,
/// so the rules below look up only the fields that are there.
#[derive(Debug, Clone, Copy, Default)]
pub(super) struct Seen {
    pub(super) hosts: usize,
    pub(super) content_length: bool,
    pub(super) transfer_encoding: bool,
    pub(super) connection: bool,
}

impl Seen {
    pub(super) fn of(headers: &impl Fields) -> Self {
        let mut seen = Seen::default();
        for (name, _) in headers.pairs() {
            let is = |known: &str| super::fields::same_name(name, known.as_bytes());
            match name.len() {
                4 if is("host") => seen.hosts += 1,
                10 if is("connection") => seen.connection = true,
                14 if is("content-length") => seen.content_length = true,
                17 if is("transfer-encoding") => seen.transfer_encoding = true,
                _ => {}
            }
        }
        seen
    }
}

/// The declared length: every `Content-Length` value must agree (RFC 9112 §6.3).
fn content_length(headers: &impl Fields) -> Result<Option<u64>, H1Error> {
    let mut length = None;
    for value in headers.values_of("content-length") {
        for part in value.split(|&b| b == b',') {
            let part = part.trim_ascii();
            if part.is_empty() || !part.iter().all(u8::is_ascii_digit) {
                return Err(H1Error::Framing("content-length is not a number"));
            }
            let n = part
                .iter()
                .try_fold(0u64, |n, &d| {
                    n.checked_mul(10)?.checked_add(u64::from(d - b'0'))
                })
                .ok_or(H1Error::Framing("content-length is too large"))?;
            if length.is_some_and(|l| l != n) {
                return Err(H1Error::Framing("conflicting content-length values"));
            }
            length = Some(n);
        }
    }
    Ok(length)
}

/// The transfer codings, in order; empty without the header.
fn codings(headers: &impl Fields) -> impl Iterator<Item = &[u8]> {
    headers
        .values_of("transfer-encoding")
        .flat_map(|v| v.split(|&b| b == b','))
        .map(<[u8]>::trim_ascii)
        .filter(|c| !c.is_empty())
}

/// What `Transfer-Encoding` says of a body whose framing the proxy can tell.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Codings {
    /// `chunked` alone.
    Chunked,
    /// `chunked` over other codings (gzip, …), which the proxy does not decode.
    ChunkedOverOthers,
    /// No `chunked` (RFC 9112 §6.3: a request's length cannot be told; a response's runs to
    /// the close).
    NotChunked,
}

/// Reads `Transfer-Encoding` (present in the head). An empty list, or `chunked` anywhere but
/// last (RFC 9112 §7: it is applied once, as the final coding), is faulty framing.
fn transfer_codings(headers: &impl Fields) -> Result<Codings, H1Error> {
    let (mut count, mut chunked, mut last_chunked) = (0, 0, false);
    for coding in codings(headers) {
        count += 1;
        last_chunked = coding.eq_ignore_ascii_case(b"chunked");
        chunked += usize::from(last_chunked);
    }
    match (count, chunked, last_chunked) {
        (0, ..) => Err(H1Error::Framing("an empty transfer-encoding")),
        (1, 1, true) => Ok(Codings::Chunked),
        (_, 1, true) => Ok(Codings::ChunkedOverOthers),
        (_, 0, _) => Ok(Codings::NotChunked),
        _ => Err(H1Error::Framing(
            "chunked is not the final transfer coding, or is applied twice",
        )),
    }
}

pub(super) fn request_framing(
    version: Version,
    headers: &impl Fields,
    seen: Seen,
) -> Result<Framing, H1Error> {
    if seen.transfer_encoding {
        // RFC 9112 §6.1: HTTP/1.0 has no transfer codings, so the framing is faulty.
        if version == Version::HTTP_10 {
            return Err(H1Error::Framing("transfer-encoding in an HTTP/1.0 message"));
        }
        // Both headers is how requests are smuggled past a proxy: refuse it.
        if seen.content_length {
            return Err(H1Error::Framing(
                "both transfer-encoding and content-length",
            ));
        }
        return match transfer_codings(headers)? {
            Codings::Chunked => Ok(Framing::Chunked),
            // Valid framing, but the coding under the chunks would be lost in the
            // length-framed copy sent on: RFC 9110 §6.1's 501 for a coding not understood.
            Codings::ChunkedOverOthers => Err(H1Error::UnsupportedCoding),
            // RFC 9112 §6.3: the length cannot be told; 400 and close.
            Codings::NotChunked => {
                Err(H1Error::Framing("the final transfer coding is not chunked"))
            }
        };
    }
    if !seen.content_length {
        return Ok(Framing::Empty);
    }
    Ok(match content_length(headers)? {
        Some(0) | None => Framing::Empty,
        Some(n) => Framing::Length(n),
    })
}

pub(super) fn response_framing(
    status: StatusCode,
    version: Version,
    headers: &impl Fields,
    seen: Seen,
    head_request: bool,
) -> Result<Framing, H1Error> {
    // RFC 9112 §6.1, as for requests; a proxy answers such a response with 502 (§6.3).
    if seen.transfer_encoding && version == Version::HTTP_10 {
        return Err(H1Error::Framing("transfer-encoding in an HTTP/1.0 message"));
    }
    if head_request
        || status.is_informational()
        || status == StatusCode::NO_CONTENT
        || status == StatusCode::NOT_MODIFIED
    {
        return Ok(Framing::Empty);
    }
    if seen.transfer_encoding {
        return match transfer_codings(headers)? {
            Codings::Chunked => Ok(Framing::Chunked),
            // Under the chunks (gzip, …) or alone: the coding is hop-by-hop and would be lost,
            // passing coded bytes off as the content.
            Codings::ChunkedOverOthers | Codings::NotChunked => Err(H1Error::UnsupportedCoding),
        };
    }
    if !seen.content_length {
        return Ok(Framing::UntilClose);
    }
    Ok(match content_length(headers)? {
        Some(0) => Framing::Empty,
        Some(n) => Framing::Length(n),
        None => Framing::UntilClose,
    })
}

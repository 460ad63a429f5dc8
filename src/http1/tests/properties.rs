//! Properties of the HTTP/1 codec (`h1::parse_request`, `h1::parse_response`,
//! `h1::BodyDecoder`) over generated input.
//!
//! Invariants: the codec reads a socket, so a message arrives in reads cut anywhere. Any split
//! of a valid request head, response head or chunked body into reads gives the same result as
//! one read: the same head (fields, framing, keep-alive), the same body bytes, the same bytes
//! left for the next message. Any split of arbitrary bytes gives the same outcome too (the
//! same head or the same error), so a fault is never found or missed depending on where a read
//! ended. And no input, valid, mutated or arbitrary, makes any of them panic.

use crate::http1::{self as h1, BodyDecoder, Decoded, Framing, H1Error};
use bytes::BytesMut;
use proptest::collection::vec;
use proptest::prelude::*;
use proptest::sample::{select, Index};

/// Enough cases to cover the shapes, few enough for a debug build to run in a second or two.
/// A failure prints its shrunk input; nothing is written next to the sources.
fn config() -> ProptestConfig {
    ProptestConfig {
        cases: 1024,
        failure_persistence: None,
        ..ProptestConfig::default()
    }
}

const TCHARS: &[u8] =
    b"abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789!#$%&'*+-.^_`|~";

fn token(max: usize) -> impl Strategy<Value = String> {
    vec(select(TCHARS), 1..max).prop_map(|b| String::from_utf8(b).unwrap())
}

/// Field content: visible ASCII with inner spaces and tabs.
fn value() -> impl Strategy<Value = String> {
    let chars: Vec<u8> = (b' '..=b'~').chain([b'\t']).collect();
    vec(select(chars), 0..40).prop_map(|b| {
        String::from_utf8(b)
            .unwrap()
            .trim_matches([' ', '\t'])
            .to_string()
    })
}

/// Extra fields, named so that none is one the framing rules look at.
fn extra_fields() -> impl Strategy<Value = String> {
    vec((token(12), value()), 0..10).prop_map(|fields| {
        fields
            .iter()
            .map(|(name, value)| format!("x-{name}: {value}\r\n"))
            .collect()
    })
}

/// Cut points into a message of `len` bytes, sorted.
fn cuts(picks: &[Index], len: usize) -> Vec<usize> {
    let mut cuts: Vec<usize> = picks.iter().map(|i| i.index(len + 1)).collect();
    cuts.sort_unstable();
    cuts.dedup();
    cuts
}

/// What parsing a head gave: the head as its `Debug` text, or the error's message; and for a
/// head, the bytes left after it.
#[derive(Debug, PartialEq, Eq)]
enum Parsed {
    Head(String, Vec<u8>),
    Error(String),
    Incomplete,
}

/// Parses `wire` as it arrives in pieces cut at `cuts`: after each piece, as a server would
/// after each read; once the head is there, what follows arrives too.
fn parse_in_pieces<T: std::fmt::Debug>(
    wire: &[u8],
    cuts: &[usize],
    parse: impl Fn(&mut BytesMut) -> Result<Option<T>, H1Error>,
) -> Parsed {
    let mut buf = BytesMut::new();
    let mut start = 0;
    for &end in cuts.iter().chain([&wire.len()]) {
        buf.extend_from_slice(&wire[start..end]);
        start = end;
        match parse(&mut buf) {
            Ok(None) => {}
            Ok(Some(head)) => {
                buf.extend_from_slice(&wire[start..]);
                return Parsed::Head(format!("{head:?}"), buf.to_vec());
            }
            Err(e) => return Parsed::Error(e.to_string()),
        }
    }
    Parsed::Incomplete
}

fn request_head() -> impl Strategy<Value = String> {
    let method = select(vec![
        "GET", "POST", "PUT", "DELETE", "PATCH", "OPTIONS", "HEAD",
    ]);
    let pchars: Vec<u8> = b"abcdefghijklmnopqrstuvwxyz0123456789-._~!$&'()*+,;=:@/%?".to_vec();
    let path =
        vec(select(pchars), 0..30).prop_map(|b| format!("/{}", String::from_utf8(b).unwrap()));
    let host = select(vec![
        "a",
        "example.com:8080",
        "192.0.2.1",
        "[2001:db8::1]:80",
    ]);
    let framing = prop_oneof![
        Just(String::new()),
        any::<u32>().prop_map(|n| format!("Content-Length: {n}\r\n")),
        Just("transfer-encoding: chunked\r\n".to_string()),
    ];
    let connection = select(vec![
        "",
        "Connection: close\r\n",
        "connection: keep-alive\r\n",
    ]);
    let http10 = any::<bool>();
    (method, path, host, framing, connection, extra_fields(), http10).prop_map(
        |(method, path, host, framing, connection, fields, http10)| {
            // HTTP/1.0 has no transfer codings.
            let version = if http10 && !framing.contains("chunked") {
                "1.0"
            } else {
                "1.1"
            };
            format!(
                "{method} {path} HTTP/{version}\r\nHost: {host}\r\n{fields}{framing}{connection}\r\n"
            )
        },
    )
}

fn response_head() -> impl Strategy<Value = (String, bool)> {
    let status = select(vec![
        "100 Continue",
        "103 Early Hints",
        "200 OK",
        "204 No Content",
        "304 Not Modified",
        "404 Not Found",
        "502 Bad Gateway",
        "200 ",
    ]);
    let framing = prop_oneof![
        Just(String::new()),
        any::<u32>().prop_map(|n| format!("content-length: {n}\r\n")),
        Just("Transfer-Encoding: chunked\r\n".to_string()),
    ];
    let connection = select(vec![
        "",
        "connection: close\r\n",
        "Connection: keep-alive\r\n",
    ]);
    (
        status,
        framing,
        connection,
        extra_fields(),
        any::<bool>(),
        any::<bool>(),
    )
        .prop_map(
            |(status, framing, connection, fields, http10, head_request)| {
                let version = if http10 && !framing.contains("hunked") {
                    "1.0"
                } else {
                    "1.1"
                };
                let wire = format!("HTTP/{version} {status}\r\n{fields}{framing}{connection}\r\n");
                (wire, head_request)
            },
        )
}

/// A valid chunked body: its wire form and its data.
fn chunked_body() -> impl Strategy<Value = (Vec<u8>, Vec<u8>)> {
    let ext = select(vec![
        "",
        "",
        ";a",
        ";a=b",
        " ; name = \"q \\\" v\"",
        ";x=1;y",
    ]);
    let chunk = (vec(any::<u8>(), 1..64), ext, any::<bool>());
    let trailers = vec((token(10), value()), 0..4);
    (vec(chunk, 0..8), select(vec!["", ";last"]), trailers).prop_map(
        |(chunks, last_ext, trailers)| {
            let (mut wire, mut data) = (Vec::new(), Vec::new());
            for (bytes, ext, upper) in chunks {
                let size = if upper {
                    format!("{:X}", bytes.len())
                } else {
                    format!("{:x}", bytes.len())
                };
                wire.extend_from_slice(format!("{size}{ext}\r\n").as_bytes());
                wire.extend_from_slice(&bytes);
                wire.extend_from_slice(b"\r\n");
                data.extend_from_slice(&bytes);
            }
            wire.extend_from_slice(format!("0{last_ext}\r\n").as_bytes());
            for (name, value) in trailers {
                wire.extend_from_slice(format!("{name}: {value}\r\n").as_bytes());
            }
            wire.extend_from_slice(b"\r\n");
            (wire, data)
        },
    )
}

/// What decoding a body gave: its data, then how it ended and the bytes left after it.
#[derive(Debug, PartialEq, Eq)]
struct DecodedBody {
    data: Vec<u8>,
    end: Result<(), String>,
    rest: Vec<u8>,
}

/// Decodes a body framed as `framing` from `wire` arriving in pieces cut at `cuts`, then the
/// end of the stream.
fn decode_in_pieces(framing: Framing, wire: &[u8], cuts: &[usize]) -> DecodedBody {
    let mut decoder = BodyDecoder::new(framing);
    let mut buf = BytesMut::new();
    let mut data = Vec::new();
    let mut bounds: Vec<usize> = vec![0];
    bounds.extend_from_slice(cuts);
    bounds.push(wire.len());
    let mut step = |buf: &mut BytesMut, eof: bool| -> Option<Result<(), String>> {
        loop {
            match decoder.decode(buf, eof) {
                Ok(Decoded::Data(d)) => data.extend_from_slice(&d),
                Ok(Decoded::NeedMore) => return None,
                Ok(Decoded::Done) => return Some(Ok(())),
                Err(e) => return Some(Err(e.to_string())),
            }
        }
    };
    let mut end = None;
    for piece in bounds.windows(2) {
        buf.extend_from_slice(&wire[piece[0]..piece[1]]);
        if end.is_none() {
            end = step(&mut buf, false);
        }
    }
    let end = end
        .or_else(|| step(&mut buf, true))
        .unwrap_or_else(|| Err("no end at the end of the stream".into()));
    DecodedBody {
        data,
        end,
        rest: buf.to_vec(),
    }
}

/// Valid wire with bytes replaced or inserted at random places.
fn mutated(wire: Vec<u8>, edits: &[(Index, u8, bool)]) -> Vec<u8> {
    let mut wire = wire;
    for (at, byte, insert) in edits {
        let i = at.index(wire.len() + 1);
        if *insert || i == wire.len() {
            wire.insert(i, *byte);
        } else {
            wire[i] = *byte;
        }
    }
    wire
}

/// Bytes that favour the ones HTTP/1 framing turns on.
fn wire_byte() -> impl Strategy<Value = u8> {
    prop_oneof![
        any::<u8>(),
        select(b"\r\n\r\n:; \t0123456789abcdefABCDEF\"\\".to_vec()),
    ]
}

fn edits() -> impl Strategy<Value = Vec<(Index, u8, bool)>> {
    vec((any::<Index>(), wire_byte(), any::<bool>()), 1..6)
}

fn splits() -> impl Strategy<Value = Vec<Index>> {
    vec(any::<Index>(), 0..10)
}

proptest! {
    #![proptest_config(config())]

    #[test]
    fn a_valid_request_head_parses_the_same_however_it_is_split(
        head in request_head(),
        tail in vec(any::<u8>(), 0..16),
        picks in splits(),
    ) {
        let wire = [head.as_bytes(), &tail].concat();
        let whole = parse_in_pieces(&wire, &[], h1::parse_request);
        let Parsed::Head(_, rest) = &whole else {
            panic!("valid head refused: {whole:?}\n{head}");
        };
        prop_assert_eq!(rest, &tail);
        let split = parse_in_pieces(&wire, &cuts(&picks, wire.len()), h1::parse_request);
        prop_assert_eq!(whole, split);
    }

    #[test]
    fn a_valid_response_head_parses_the_same_however_it_is_split(
        (head, head_request) in response_head(),
        tail in vec(any::<u8>(), 0..16),
        picks in splits(),
    ) {
        let wire = [head.as_bytes(), &tail].concat();
        let parse = |b: &mut BytesMut| h1::parse_response(b, head_request);
        let whole = parse_in_pieces(&wire, &[], parse);
        let Parsed::Head(_, rest) = &whole else {
            panic!("valid head refused: {whole:?}\n{head}");
        };
        prop_assert_eq!(rest, &tail);
        prop_assert_eq!(whole, parse_in_pieces(&wire, &cuts(&picks, wire.len()), parse));
    }

    #[test]
    fn a_valid_chunked_body_decodes_the_same_however_it_is_split(
        (body, data) in chunked_body(),
        tail in vec(any::<u8>(), 0..16),
        picks in splits(),
    ) {
        let wire = [&body[..], &tail].concat();
        let whole = decode_in_pieces(Framing::Chunked, &wire, &[]);
        prop_assert_eq!(&whole, &DecodedBody { data, end: Ok(()), rest: tail });
        let split = decode_in_pieces(Framing::Chunked, &wire, &cuts(&picks, wire.len()));
        prop_assert_eq!(whole, split);
    }

    #[test]
    fn mutated_heads_give_the_same_outcome_however_they_are_split(
        head in request_head(),
        (response, head_request) in response_head(),
        edits in edits(),
        picks in splits(),
    ) {
        let wire = mutated(head.into_bytes(), &edits);
        let cut = cuts(&picks, wire.len());
        prop_assert_eq!(
            parse_in_pieces(&wire, &[], h1::parse_request),
            parse_in_pieces(&wire, &cut, h1::parse_request)
        );
        let wire = mutated(response.into_bytes(), &edits);
        let cut = cuts(&picks, wire.len());
        let parse = |b: &mut BytesMut| h1::parse_response(b, head_request);
        prop_assert_eq!(parse_in_pieces(&wire, &[], parse), parse_in_pieces(&wire, &cut, parse));
    }

    #[test]
    fn mutated_chunked_bodies_give_the_same_outcome_however_they_are_split(
        (body, _) in chunked_body(),
        edits in edits(),
        picks in splits(),
    ) {
        let wire = mutated(body, &edits);
        let cut = cuts(&picks, wire.len());
        prop_assert_eq!(
            decode_in_pieces(Framing::Chunked, &wire, &[]),
            decode_in_pieces(Framing::Chunked, &wire, &cut)
        );
    }

    #[test]
    fn arbitrary_bytes_never_panic_and_split_reads_agree(
        wire in vec(wire_byte(), 0..512),
        picks in splits(),
        length in 0u64..600,
    ) {
        let cut = cuts(&picks, wire.len());
        prop_assert_eq!(
            parse_in_pieces(&wire, &[], h1::parse_request),
            parse_in_pieces(&wire, &cut, h1::parse_request)
        );
        for head_request in [false, true] {
            let parse = |b: &mut BytesMut| h1::parse_response(b, head_request);
            prop_assert_eq!(parse_in_pieces(&wire, &[], parse), parse_in_pieces(&wire, &cut, parse));
        }
        for framing in [Framing::Chunked, Framing::Length(length), Framing::UntilClose, Framing::Empty] {
            prop_assert_eq!(
                decode_in_pieces(framing, &wire, &[]),
                decode_in_pieces(framing, &wire, &cut)
            );
        }
    }

    /// Requests and responses that start well and go wrong anywhere after.
    #[test]
    fn arbitrary_bytes_after_a_valid_start_never_panic(
        head in request_head(),
        (response, head_request) in response_head(),
        garbage in vec(wire_byte(), 0..256),
    ) {
        for start in [head.as_bytes(), response.as_bytes()] {
            for keep in [start.len() / 3, start.len() / 2, start.len()] {
                let wire = [&start[..keep], &garbage].concat();
                let _ = h1::parse_request(&mut BytesMut::from(&wire[..]));
                let _ = h1::parse_response(&mut BytesMut::from(&wire[..]), head_request);
                let _ = decode_in_pieces(Framing::Chunked, &wire, &[]);
            }
        }
    }
}

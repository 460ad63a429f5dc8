//! Bodies decoded incrementally from the front of a read buffer (by length, chunked, or until
//! the close), so a streamed body passes through piece by piece as it arrives and whatever
//! follows it (the next pipelined message) stays in the buffer.

use bytes::{Bytes, BytesMut};

use super::fields;
use super::framing::Framing;
use super::limits::{MAX_CHUNK_EXTENSIONS, MAX_LINE, MAX_TRAILERS};
use super::H1Error;

/// What one decoding step produced.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Decoded {
    /// A piece of body data, split off the buffer.
    Data(Bytes),
    /// The buffer holds no more of the body yet: read more.
    NeedMore,
    /// The body is complete.
    Done,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Chunk {
    Size,
    Data(u64),
    DataEnd,
    Trailers,
}

/// Decodes a body of a given framing from the front of a read buffer, leaving whatever
/// follows it (the next pipelined message) in place.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct BodyDecoder {
    state: State,
    /// Chunk-extension bytes seen so far, against [`MAX_CHUNK_EXTENSIONS`].
    extensions: usize,
    /// Trailer-section bytes seen so far, against [`MAX_TRAILERS`].
    trailers: usize,
}

#[derive(Debug, Clone, PartialEq, Eq)]
enum State {
    Length(u64),
    Chunked(Chunk),
    UntilClose,
    Done,
}

impl BodyDecoder {
    /// A decoder for a body framed as `framing`.
    pub(crate) fn new(framing: Framing) -> Self {
        let state = match framing {
            Framing::Empty | Framing::Length(0) => State::Done,
            Framing::Length(n) => State::Length(n),
            Framing::Chunked => State::Chunked(Chunk::Size),
            Framing::UntilClose => State::UntilClose,
        };
        Self {
            state,
            extensions: 0,
            trailers: 0,
        }
    }

    /// True once the whole body has been decoded.
    pub(crate) fn is_done(&self) -> bool {
        self.state == State::Done
    }

    /// The body bytes still expected, when the framing says.
    pub(crate) fn remaining(&self) -> Option<u64> {
        match self.state {
            State::Length(n) => Some(n),
            State::Done => Some(0),
            _ => None,
        }
    }

    /// Decodes the next piece from `buf`; `eof` says the peer has closed (so `buf` is all
    /// there will be).
    pub(crate) fn decode(&mut self, buf: &mut BytesMut, eof: bool) -> Result<Decoded, H1Error> {
        match self.state {
            State::Done => Ok(Decoded::Done),
            State::Length(_) | State::Chunked(_) if buf.is_empty() && eof => {
                Err(H1Error::Incomplete)
            }
            State::Length(n) => {
                if buf.is_empty() {
                    return Ok(Decoded::NeedMore);
                }
                let take = n.min(buf.len() as u64);
                self.state = match n - take {
                    0 => State::Done,
                    rest => State::Length(rest),
                };
                Ok(Decoded::Data(buf.split_to(take as usize).freeze()))
            }
            State::UntilClose if !buf.is_empty() => Ok(Decoded::Data(buf.split().freeze())),
            State::UntilClose if eof => {
                self.state = State::Done;
                Ok(Decoded::Done)
            }
            State::UntilClose => Ok(Decoded::NeedMore),
            State::Chunked(chunk) => match self.chunked_step(chunk, buf)? {
                Some(decoded) => Ok(decoded),
                None if self.is_done() => Ok(Decoded::Done),
                None if eof => Err(H1Error::Incomplete),
                None => Ok(Decoded::NeedMore),
            },
        }
    }

    /// Advances the chunked state as far as `buf` allows; `Some` when data is produced.
    /// Every line must end in CRLF, and so must every chunk's data (RFC 9112 §7.1): a bare
    /// LF or CR is where two parsers would disagree on where a chunk ends.
    fn chunked_step(
        &mut self,
        mut chunk: Chunk,
        buf: &mut BytesMut,
    ) -> Result<Option<Decoded>, H1Error> {
        loop {
            match chunk {
                Chunk::Size => {
                    let Some(line) = take_line(buf, MAX_LINE, "a chunk-size line over 4 KiB")?
                    else {
                        break;
                    };
                    let (size, extensions) = chunk_size(&line)?;
                    self.extensions += extensions;
                    if self.extensions > MAX_CHUNK_EXTENSIONS {
                        return Err(H1Error::Chunked("chunk extensions over 16 KiB in all"));
                    }
                    chunk = match size {
                        0 => Chunk::Trailers,
                        n => Chunk::Data(n),
                    };
                }
                Chunk::Data(n) => {
                    if buf.is_empty() {
                        break;
                    }
                    let take = n.min(buf.len() as u64);
                    let data = buf.split_to(take as usize).freeze();
                    self.state = State::Chunked(if take == n {
                        Chunk::DataEnd
                    } else {
                        Chunk::Data(n - take)
                    });
                    return Ok(Some(Decoded::Data(data)));
                }
                Chunk::DataEnd => {
                    // Refused at the first wrong byte, without waiting for a line end.
                    if buf.first().is_some_and(|&b| b != b'\r')
                        || buf.get(1).is_some_and(|&b| b != b'\n')
                    {
                        return Err(H1Error::Chunked("chunk data not followed by CRLF"));
                    }
                    if buf.len() < 2 {
                        break;
                    }
                    bytes::Buf::advance(buf, 2);
                    chunk = Chunk::Size;
                }
                Chunk::Trailers => {
                    // Each line with its CRLF, and the final CRLF, within the limit.
                    let Some(room) = (MAX_TRAILERS - self.trailers).checked_sub(2) else {
                        return Err(H1Error::Chunked("trailers over 16 KiB"));
                    };
                    let Some(line) = take_line(buf, room, "trailers over 16 KiB")? else {
                        break;
                    };
                    self.trailers += line.len() + 2;
                    if line.is_empty() {
                        self.state = State::Done;
                        return Ok(None);
                    }
                    if !is_field_line(&line) {
                        return Err(H1Error::Chunked("a trailer that is not a field line"));
                    }
                }
            }
        }
        self.state = State::Chunked(chunk);
        Ok(None)
    }
}

/// Takes one line, without its CRLF, off the front of `buf`; `None` until a whole line is
/// there. A line longer than `max` bytes (`too_long` says which), one ended by a bare LF, or
/// one holding a CR is an error, found without reading past `max`.
fn take_line(
    buf: &mut BytesMut,
    max: usize,
    too_long: &'static str,
) -> Result<Option<Bytes>, H1Error> {
    // Judged by the first CR or LF, whichever comes first, so that the verdict does not depend
    // on how much of the line has arrived.
    let window = &buf[..buf.len().min(max + 2)];
    let cr = memchr::memchr(b'\r', window);
    if let Some(lf) = memchr::memchr(b'\n', window) {
        if cr.is_none_or(|cr| lf < cr) {
            return Err(H1Error::Chunked("a line ended by a bare LF"));
        }
    }
    match cr {
        Some(cr) if cr + 1 < window.len() => {
            if window[cr + 1] != b'\n' {
                return Err(H1Error::Chunked("a CR not followed by LF"));
            }
            let mut line = buf.split_to(cr + 2);
            line.truncate(cr);
            Ok(Some(line.freeze()))
        }
        _ if window.len() == max + 2 => Err(H1Error::Chunked(too_long)),
        _ => Ok(None),
    }
}

/// Reads a chunk-size line (RFC 9112 §7.1.1): the size, and how many bytes of chunk
/// extensions follow it. At most 15 hex digits (as httparse allows), so no size overflows;
/// whitespace after the size is taken as the BWS before an extension, as hyper, httparse and
/// h11 do.
fn chunk_size(line: &[u8]) -> Result<(u64, usize), H1Error> {
    let digits = line.iter().take_while(|b| b.is_ascii_hexdigit()).count();
    if digits == 0 {
        return Err(H1Error::Chunked("a chunk size that is not hex digits"));
    }
    if digits > 15 {
        return Err(H1Error::Chunked("a chunk size over 15 hex digits"));
    }
    let size = line[..digits].iter().fold(0u64, |n, &b| {
        n << 4 | u64::from((b as char).to_digit(16).unwrap_or_default())
    });
    let extensions = &line[digits..];
    if !is_chunk_ext(extensions) {
        return Err(H1Error::Chunked("a malformed chunk extension"));
    }
    Ok((size, extensions.len()))
}

/// Whether `s` is `*( BWS ";" BWS name [ BWS "=" BWS ( token / quoted-string ) ] ) BWS`.
fn is_chunk_ext(mut s: &[u8]) -> bool {
    let skip_ws =
        |s: &[u8]| -> usize { s.iter().take_while(|&&b| b == b' ' || b == b'\t').count() };
    let token_len = |s: &[u8]| -> usize { s.iter().take_while(|&&b| fields::is_tchar(b)).count() };
    loop {
        s = &s[skip_ws(s)..];
        let Some(rest) = s.strip_prefix(b";") else {
            return s.is_empty();
        };
        let rest = &rest[skip_ws(rest)..];
        let name = token_len(rest);
        if name == 0 {
            return false;
        }
        s = &rest[name..];
        let after = &s[skip_ws(s)..];
        if let Some(value) = after.strip_prefix(b"=") {
            let value = &value[skip_ws(value)..];
            let len = match fields::quoted_len(value) {
                Some(len) => len,
                None => token_len(value),
            };
            if len == 0 {
                return false;
            }
            s = &value[len..];
        }
    }
}

/// Whether a trailer line is `name ":" value` with a token name and a value of field content
/// (no obs-fold, no control other than HTAB).
fn is_field_line(line: &[u8]) -> bool {
    let Some(colon) = memchr::memchr(b':', line) else {
        return false;
    };
    fields::is_token(&line[..colon])
        && line[colon + 1..]
            .iter()
            .all(|&b| b == b'\t' || (b >= b' ' && b != 0x7f))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn buf(s: &str) -> BytesMut {
        BytesMut::from(s.as_bytes())
    }

    #[test]
    fn chunked_bodies_decode_piece_by_piece_across_reads() {
        let wire = "5;ext=1\r\nhello\r\n7\r\n, world\r\n0\r\ntrailer: x\r\n\r\nNEXT";
        // Feed the body one byte at a time: the data must come out whole and in order.
        let mut decoder = BodyDecoder::new(Framing::Chunked);
        let mut b = BytesMut::new();
        let mut out = Vec::new();
        let mut done = false;
        for (i, byte) in wire.bytes().enumerate() {
            if done {
                b.extend_from_slice(&wire.as_bytes()[i..]);
                break;
            }
            b.extend_from_slice(&[byte]);
            loop {
                match decoder.decode(&mut b, false).unwrap() {
                    Decoded::Data(d) => out.extend_from_slice(&d),
                    Decoded::NeedMore => break,
                    Decoded::Done => {
                        done = true;
                        break;
                    }
                }
            }
        }
        assert!(done && decoder.is_done());
        assert_eq!(out, b"hello, world");
        assert_eq!(&b[..], b"NEXT", "the next message stays in the buffer");
    }

    #[test]
    fn truncated_and_malformed_bodies_are_errors() {
        let mut d = BodyDecoder::new(Framing::Length(10));
        let mut b = buf("12345");
        assert_eq!(
            d.decode(&mut b, false).unwrap(),
            Decoded::Data(Bytes::from_static(b"12345"))
        );
        assert!(matches!(d.decode(&mut b, true), Err(H1Error::Incomplete)));
        let mut c = BodyDecoder::new(Framing::Chunked);
        assert!(matches!(
            c.decode(&mut buf("zz\r\n"), false),
            Err(H1Error::Chunked(_))
        ));
        let mut c = BodyDecoder::new(Framing::Chunked);
        assert!(matches!(
            c.decode(&mut buf("3\r\nabcX\r\n"), false),
            Ok(Decoded::Data(_))
        ));
        assert!(matches!(
            c.decode(&mut buf("X\r\n"), false),
            Err(H1Error::Chunked(_))
        ));
        let mut c = BodyDecoder::new(Framing::Chunked);
        assert!(matches!(
            c.decode(&mut buf("3\r\nab"), true),
            Ok(Decoded::Data(_))
        ));
        assert!(matches!(
            c.decode(&mut BytesMut::new(), true),
            Err(H1Error::Incomplete)
        ));
        let mut u = BodyDecoder::new(Framing::UntilClose);
        assert!(matches!(
            u.decode(&mut buf("abc"), false),
            Ok(Decoded::Data(_))
        ));
        assert_eq!(u.decode(&mut BytesMut::new(), true).unwrap(), Decoded::Done);
    }
}

//! The one line reader of dataset files (loading, validation, snapshot conversion): a line
//! longer than the limit stops the read at once, naming the line, instead of being gathered
//! whole; a file without a newline must not take the process's memory with it.

use std::io::BufRead;

/// Default line-length limit: thousands of times the longest row of the public sample
/// (15.7 KB), and room for a snapshot line holding a whole long-context conversation.
pub const DEFAULT_MAX_LINE_BYTES: usize = 64 * 1024 * 1024;

/// Why the next line could not be read.
#[derive(Debug, thiserror::Error)]
pub(crate) enum LineError {
    /// Reading failed.
    #[error("line {line}: {source}")]
    Io {
        /// 1-based line being read.
        line: usize,
        /// The cause.
        source: std::io::Error,
    },
    /// The line is longer than the limit; nothing past the limit was read.
    #[error("line {line} is longer than {limit} bytes, the line-length limit (--max-line-bytes, or dataset_max_line_bytes in a replay config)")]
    TooLong {
        /// 1-based line number.
        line: usize,
        /// The limit in bytes.
        limit: usize,
    },
}

/// Reads `\n`-terminated lines of at most `max` bytes (the terminator not counted).
pub(crate) struct Lines<R> {
    inner: R,
    max: usize,
    line_no: usize,
    buf: Vec<u8>,
}

impl<R: BufRead> Lines<R> {
    /// Lines of `inner`, each at most `max` bytes.
    pub(crate) fn new(inner: R, max: usize) -> Self {
        Self {
            inner,
            max,
            line_no: 0,
            buf: Vec::new(),
        }
    }

    /// The next line's 1-based number and bytes (without its `\n`), or `None` at the end.
    pub(crate) fn next_line(&mut self) -> Result<Option<(usize, &[u8])>, LineError> {
        self.buf.clear();
        let line = self.line_no + 1;
        loop {
            let available = match self.inner.fill_buf() {
                Ok(a) => a,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                Err(source) => return Err(LineError::Io { line, source }),
            };
            if available.is_empty() {
                if self.buf.is_empty() {
                    return Ok(None);
                }
                break;
            }
            let (take, end) = match memchr::memchr(b'\n', available) {
                Some(at) => (at, true),
                None => (available.len(), false),
            };
            if self.buf.len() + take > self.max {
                return Err(LineError::TooLong {
                    line,
                    limit: self.max,
                });
            }
            let need = self.buf.len() + take;
            if need > self.buf.capacity() {
                // Grow by doubling, but never past the limit: a line at the limit holds no
                // more than the limit.
                let grown = (self.buf.capacity() * 2).clamp(need, self.max);
                self.buf.reserve_exact(grown - self.buf.len());
            }
            self.buf.extend_from_slice(&available[..take]);
            self.inner.consume(take + usize::from(end));
            if end {
                break;
            }
        }
        self.line_no = line;
        Ok(Some((line, &self.buf)))
    }

    /// The reader, positioned after the last line read.
    #[cfg(test)]
    pub(crate) fn into_inner(self) -> R {
        self.inner
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lines_up_to_the_limit_pass_and_a_longer_one_is_named_at_once() {
        let text = b"ab\n\nabcd\nabcde\nnever read\n";
        let mut lines = Lines::new(std::io::BufReader::with_capacity(2, &text[..]), 4);
        assert_eq!(lines.next_line().unwrap(), Some((1, &b"ab"[..])));
        assert_eq!(lines.next_line().unwrap(), Some((2, &b""[..])));
        assert_eq!(lines.next_line().unwrap(), Some((3, &b"abcd"[..])));
        match lines.next_line() {
            Err(LineError::TooLong { line: 4, limit: 4 }) => {}
            other => panic!("{other:?}"),
        }
        let mut rest = Vec::new();
        std::io::Read::read_to_end(&mut lines.into_inner(), &mut rest).unwrap();
        assert!(
            rest.ends_with(b"never read\n") && rest.len() > 11,
            "{rest:?}"
        );
    }

    #[test]
    fn a_last_line_without_newline_is_a_line() {
        let mut lines = Lines::new(&b"x\ny"[..], 10);
        assert_eq!(lines.next_line().unwrap(), Some((1, &b"x"[..])));
        assert_eq!(lines.next_line().unwrap(), Some((2, &b"y"[..])));
        assert_eq!(lines.next_line().unwrap(), None);
    }
}

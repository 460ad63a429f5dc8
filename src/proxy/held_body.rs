//! A request body held until it has been forwarded, as parts of bounded size.
//!
//! One growing buffer doubles its capacity and copies itself as a body arrives, so a 60 MiB
//! body briefly takes 96 MiB and ends in a 64 MiB allocation: memory that the body budget,
//! which counts bytes, never sees. Parts never move once written: the memory a body holds
//! is the bytes it has received plus at most one part being filled, and the parts are
//! written upstream as they are (vectored on HTTP/1.1, one frame each on HTTP/2).

use std::borrow::Cow;
use std::collections::VecDeque;
use std::convert::Infallible;
use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::{Bytes, BytesMut};
use http_body::{Body, Frame, SizeHint};

use super::budget::BodyCharge;
use super::routing::{Turn, TurnScan};

/// The first part's capacity: a whole ordinary chat request.
const FIRST_PART: usize = 64 * 1024;
/// The largest part: parts double up to this, so a large body takes few parts.
const LARGEST_PART: usize = 1024 * 1024;
/// Bodies from this size are freed on a blocking thread: handing tens of MiB back to the
/// system takes milliseconds that every other connection on the worker would wait.
const FREE_ASIDE: usize = 4 * 1024 * 1024;

/// Frees `body` of `len` bytes, on a blocking thread when it is large; the handle of that
/// thread's task, if any, ends once the memory is freed.
fn free<T: Send + 'static>(body: T, len: usize) -> Option<tokio::task::JoinHandle<()>> {
    match tokio::runtime::Handle::try_current() {
        Ok(runtime) if len >= FREE_ASIDE => Some(runtime.spawn_blocking(move || drop(body))),
        _ => None,
    }
}

/// A whole request body as the parts it was received in.
#[derive(Clone, Debug, Default)]
pub(crate) struct HeldBody {
    parts: VecDeque<Bytes>,
    len: usize,
    /// The turn, when it was read as the body arrived.
    turn: Option<Turn>,
}

impl HeldBody {
    /// Bytes in the body.
    pub(crate) fn len(&self) -> usize {
        self.len
    }

    /// Whether the body has no bytes.
    pub(crate) fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The parts, in order.
    pub(crate) fn parts(&self) -> impl ExactSizeIterator<Item = &Bytes> {
        self.parts.iter()
    }

    /// What the body says about its turn: read as it arrived when it came in parts, so a
    /// large body costs no long pass on the worker once it is whole.
    pub(crate) fn turn(&self) -> Turn {
        self.turn
            .unwrap_or_else(|| Turn::of_parts(self.parts.iter().map(|p| &p[..])))
    }

    /// Lets the body go (freed on a blocking thread when large) and returns once its memory
    /// is freed, so the budget charge that covers it is let go only after the memory.
    pub(crate) async fn release(self) {
        let len = self.len;
        if let Some(freed) = free(self, len) {
            let _ = freed.await;
        }
    }

    /// The body in one piece when it arrived in one part (the usual case: no copy).
    pub(crate) fn single(&self) -> Option<&Bytes> {
        match self.parts.len() {
            0 => Some(&EMPTY),
            1 => self.parts.front(),
            _ => None,
        }
    }

    /// The body as one slice: borrowed when it is one part, else a copy counted against
    /// `charge` (None when the budget has no room for the copy).
    pub(crate) fn contiguous(&self, charge: &mut BodyCharge<'_>) -> Option<Cow<'_, [u8]>> {
        if let Some(one) = self.single() {
            return Some(Cow::Borrowed(one));
        }
        if !charge.try_add(self.len as u64) {
            return None;
        }
        let mut joined = Vec::with_capacity(self.len);
        for part in &self.parts {
            joined.extend_from_slice(part);
        }
        Some(Cow::Owned(joined))
    }
}

impl From<Bytes> for HeldBody {
    fn from(bytes: Bytes) -> Self {
        let len = bytes.len();
        let parts = if len == 0 {
            VecDeque::new()
        } else {
            VecDeque::from([bytes])
        };
        Self {
            parts,
            len,
            turn: None,
        }
    }
}

static EMPTY: Bytes = Bytes::new();

/// Sent upstream over HTTP/2 as one data frame per part.
impl Body for HeldBody {
    type Data = Bytes;
    type Error = Infallible;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        _cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Infallible>>> {
        let part = self.parts.pop_front();
        if let Some(p) = &part {
            self.len -= p.len();
        }
        Poll::Ready(part.map(|p| Ok(Frame::data(p))))
    }

    fn is_end_stream(&self) -> bool {
        self.parts.is_empty()
    }

    fn size_hint(&self) -> SizeHint {
        SizeHint::with_exact(self.len as u64)
    }
}

/// Gathers a body from reads of any size into parts, counting every byte as it arrives.
#[derive(Debug, Default)]
pub(crate) struct BodyParts {
    body: HeldBody,
    filling: BytesMut,
    /// The most bytes the body may have (its declared length, or else the body limit): no
    /// part is made larger than what may still come, so a body never allocates past it.
    most: usize,
    /// The turn of the sealed parts' bytes.
    scan: TurnScan,
}

impl BodyParts {
    /// An empty body of at most `most` bytes: its `Content-Length`, or else the body limit.
    pub(crate) fn new(most: usize) -> Self {
        Self {
            most,
            ..Self::default()
        }
    }

    /// Bytes gathered so far.
    pub(crate) fn gathered(&self) -> usize {
        self.body.len + self.filling.len()
    }

    /// Copies `data` in, counting each part's whole capacity in `charge` when the part is
    /// made (the memory it takes, not only the bytes in it); false when the body budget
    /// refuses the next part.
    pub(crate) fn push(&mut self, mut data: &[u8], charge: &mut BodyCharge<'_>) -> bool {
        while !data.is_empty() {
            if self.filling.len() == self.filling.capacity() && !self.start_part(charge) {
                return false;
            }
            let take = (self.filling.capacity() - self.filling.len()).min(data.len());
            self.filling.extend_from_slice(&data[..take]);
            data = &data[take..];
        }
        true
    }

    /// Room to read the next bytes of the body into: the part being filled, or a new one
    /// counted in `charge` (None when the budget refuses it). Never more room than the
    /// body's most length leaves, so a read into it cannot take the next request's bytes.
    pub(crate) fn room(&mut self, charge: &mut BodyCharge<'_>) -> Option<&mut BytesMut> {
        if self.filling.len() == self.filling.capacity() && !self.start_part(charge) {
            return None;
        }
        Some(&mut self.filling)
    }

    /// Takes `bytes` as a part of its own, without a copy (bytes already held elsewhere,
    /// such as the part of a read buffer that follows a request head).
    pub(crate) fn push_bytes(&mut self, bytes: Bytes, charge: &mut BodyCharge<'_>) -> bool {
        if !charge.try_add(bytes.len() as u64) {
            return false;
        }
        self.seal();
        self.scan.feed(&bytes);
        self.add_part(bytes);
        true
    }

    /// The body once `read` has gathered it all, or `read`'s error with the bytes gathered
    /// so far let go (freed on a blocking thread when large).
    pub(crate) fn finish_after<E>(self, read: Result<(), E>) -> Result<HeldBody, E> {
        match read {
            Ok(()) => Ok(self.finish()),
            Err(e) => {
                // Not awaited: a refused upload's room must reach the uploads still arriving
                // before they too ask for a part, or one refusal leads to the next.
                let len = self.gathered();
                drop(free(self, len));
                Err(e)
            }
        }
    }

    /// The body, whole.
    pub(crate) fn finish(mut self) -> HeldBody {
        self.seal();
        self.body.turn = Some(self.scan.turn());
        self.body
    }

    fn start_part(&mut self, charge: &mut BodyCharge<'_>) -> bool {
        self.seal();
        let size = FIRST_PART
            .checked_shl(self.body.parts.len() as u32)
            .unwrap_or(LARGEST_PART)
            .min(LARGEST_PART);
        let size = size.min(self.most.saturating_sub(self.body.len)).max(1);
        if !charge.try_add(size as u64) {
            return false;
        }
        self.filling = BytesMut::with_capacity(size);
        true
    }

    fn seal(&mut self) {
        self.scan.feed(&self.filling);
        if !self.filling.is_empty() {
            let part = std::mem::take(&mut self.filling).freeze();
            self.add_part(part);
        }
    }

    fn add_part(&mut self, part: Bytes) {
        if !part.is_empty() {
            self.body.len += part.len();
            self.body.parts.push_back(part);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::budget::BodyBudget;
    use super::*;

    #[test]
    fn a_body_holds_its_bytes_in_parts_that_never_grow_past_the_declared_length() {
        let budget = BodyBudget::new(u64::MAX);
        let mut charge = budget.charge();
        let declared = 3 * 1024 * 1024 + 17;
        let mut parts = BodyParts::new(declared);
        let data: Vec<u8> = (0..declared).map(|i| (i % 251) as u8).collect();
        // Reads of an awkward size, as a socket gives them.
        for read in data.chunks(7_001) {
            assert!(parts.push(read, &mut charge));
        }
        let body = parts.finish();
        assert_eq!(body.len(), declared);
        assert_eq!(charge.bytes(), declared as u64);
        // 64 KiB, doubling to 1 MiB, the last cut to what was declared.
        let sizes: Vec<usize> = body.parts().map(|p| p.len()).collect();
        let k = 1024;
        assert_eq!(
            sizes,
            [
                64 * k,
                128 * k,
                256 * k,
                512 * k,
                1024 * k,
                1024 * k,
                64 * k + 17
            ]
        );
        let joined: Vec<u8> = body.parts().flat_map(|p| p.iter().copied()).collect();
        assert_eq!(joined, data);
    }

    #[test]
    fn a_body_of_unknown_length_is_charged_for_the_parts_it_allocates() {
        let budget = BodyBudget::new(u64::MAX);
        let mut charge = budget.charge();
        let mut parts = BodyParts::new(usize::MAX);
        let sent = 2 * LARGEST_PART + 5;
        for read in vec![7u8; sent].chunks(4_096) {
            assert!(parts.push(read, &mut charge));
        }
        // 64 KiB doubling to 1 MiB, then 1 MiB parts: the last is mostly empty but allocated.
        let allocated: usize = (0..5).map(|i| FIRST_PART << i).sum::<usize>() + LARGEST_PART;
        assert!(allocated >= sent);
        assert_eq!(charge.bytes(), allocated as u64);
        assert_eq!(parts.finish().len(), sent);
    }

    #[test]
    fn a_joined_copy_is_counted_and_refused_without_room() {
        let budget = BodyBudget::new(4 * LARGEST_PART as u64);
        let mut charge = budget.charge();
        let mut parts = BodyParts::new(usize::MAX);
        assert!(parts.push(&vec![1; 3 * LARGEST_PART], &mut charge));
        let body = parts.finish();
        assert!(body.single().is_none(), "{} parts", body.parts().len());
        let mut copy = budget.charge();
        assert!(body.contiguous(&mut copy).is_none(), "no room for a copy");
        drop(copy);

        let small = HeldBody::from(Bytes::from_static(b"{}"));
        let mut none = budget.charge();
        assert_eq!(small.contiguous(&mut none).as_deref(), Some(&b"{}"[..]));
        assert_eq!(none.bytes(), 0, "one part is borrowed, not copied");
    }

    #[test]
    fn the_turn_read_while_a_body_arrives_equals_the_turn_of_the_whole_body() {
        let budget = BodyBudget::new(u64::MAX);
        let mut pad = vec![b' '; 3 * LARGEST_PART];
        let at = 2 * LARGEST_PART - 4;
        let later = br#""role":"assistant""#;
        pad[at..at + later.len()].copy_from_slice(later);
        for body in [&pad[..], &pad[..at]] {
            let whole = Turn::of_body(body);
            for read in [1_000, 65_536, 700_001] {
                let mut charge = budget.charge();
                let mut parts = BodyParts::new(body.len());
                let (head, rest) = body.split_at(read.min(body.len()));
                assert!(parts.push_bytes(Bytes::copy_from_slice(head), &mut charge));
                for piece in rest.chunks(read) {
                    assert!(parts.push(piece, &mut charge));
                }
                let held = parts.finish();
                assert_eq!(held.turn, Some(whole), "reads of {read}");
                assert_eq!(held.turn(), whole);
            }
        }
        assert!(Turn::of_body(&pad).continues && !Turn::of_body(&pad[..at]).continues);
    }
}

//! The read buffer a connection keeps between messages.

use bytes::BytesMut;

use crate::http1::reserve_read;

#[test]
fn an_emptied_buffer_reads_its_next_message_at_its_start() {
    let mut buf = BytesMut::new();
    reserve_read(&mut buf);
    let start = buf.as_ptr();
    buf.extend_from_slice(b"GET / HTTP/1.1\r\nHost: a\r\n\r\n");
    let head = buf.split_to(buf.len()).freeze();
    drop(head);
    reserve_read(&mut buf);
    assert_eq!(
        buf.as_ptr(),
        start,
        "the next read lands at the buffer's start"
    );
}

#[test]
fn a_message_still_held_keeps_its_bytes_when_the_buffer_reads_on() {
    let mut buf = BytesMut::new();
    reserve_read(&mut buf);
    buf.extend_from_slice(b"first message");
    let held = buf.split_to(buf.len()).freeze();
    for _ in 0..4 {
        reserve_read(&mut buf);
        let room = buf.capacity() - buf.len();
        buf.extend_from_slice(&vec![b'x'; room]);
        buf.clear();
    }
    assert_eq!(&held[..], b"first message");
}

//! The codec's own tests: RFC 9112 / 9110 cases row by row, properties over generated input,
//! and the read buffer's reuse.

mod properties;
mod read_buffer;
mod rfc_vectors;

//! The codec's own tests: RFC 9112 / 9110 cases row by row, and properties over generated input.

mod properties;
mod rfc_vectors;

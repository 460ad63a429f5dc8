//! What one HTTP/1.1 message may make its reader hold or scan: every quantity a peer controls
//! is bounded here, so the proxy and the replay client refuse the same things at the same size.

/// The largest request or response head accepted (larger: 431, or an upstream error).
pub(crate) const MAX_HEAD: usize = 64 * 1024;
/// The most header fields in one head.
pub(crate) const MAX_HEADERS: usize = 128;
/// The longest chunk-size line.
pub(crate) const MAX_LINE: usize = 4096;
/// Chunk-extension bytes one chunked body may carry in all (hyper's limit). Extensions are
/// not passed on, so past this they are only work for the reader.
pub(crate) const MAX_CHUNK_EXTENSIONS: usize = 16 * 1024;
/// Trailer-section bytes one chunked body may carry, line ends included (hyper's limit).
/// Trailers are not passed on either.
pub(crate) const MAX_TRAILERS: usize = 16 * 1024;
/// Bytes a read buffer is grown by when it runs low.
pub(crate) const READ_CHUNK: usize = 16 * 1024;

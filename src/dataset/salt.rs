//! Salting exactly as the reference: 2-byte BLAKE2b digests of the repeat number and the
//! source conversation id around the first system message.

use blake2::digest::{Update, VariableOutput};
use blake2::Blake2bVar;

/// The two salts of one trajectory instance.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Salt {
    /// 4 hex chars from the repeat number.
    pub repeat: String,
    /// 4 hex chars from the source conversation id.
    pub conversation: String,
}

/// Lowercase hex of BLAKE2b with a 2-byte output. The output length is a BLAKE2b
/// parameter (it changes every byte of the digest), not a truncation of a longer digest.
pub(crate) fn blake2b_2(input: &[u8]) -> String {
    let mut hasher = Blake2bVar::new(2).expect("2 is a valid BLAKE2b output size");
    hasher.update(input);
    let mut digest = [0u8; 2];
    hasher
        .finalize_variable(&mut digest)
        .expect("the buffer has the output size");
    hex::encode(digest)
}

impl Salt {
    /// Salts for repeat `repeat_id` (1-based) of source conversation `source_id`.
    pub fn new(repeat_id: u64, source_id: &str) -> Salt {
        Salt {
            repeat: blake2b_2(repeat_id.to_string().as_bytes()),
            conversation: blake2b_2(source_id.as_bytes()),
        }
    }

    /// The salted system prompt content.
    pub fn apply(&self, content: &str) -> String {
        format!(
            "[salt: {}]\n\n{content}\n\n[salt: {}]",
            self.repeat, self.conversation
        )
    }
}

//! Salting exactly as the reference: 2-byte BLAKE2b digests of the repeat number and the
//! source conversation id around the first system message.

/// The two salts of one trajectory instance.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Salt {
    /// 4 hex chars from the repeat number.
    pub repeat: String,
    /// 4 hex chars from the source conversation id.
    pub conversation: String,
}

impl Salt {
    /// Salts for repeat `repeat_id` (1-based) of source conversation `source_id`.
    pub fn new(_repeat_id: u64, _source_id: &str) -> Salt {
        Salt {
            repeat: String::new(),
            conversation: String::new(),
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

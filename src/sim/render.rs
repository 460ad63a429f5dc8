//! Chat template and pseudo-tokenizer: messages → ChatML bytes → 4-byte pseudo-tokens →
//! chained block hashes. The same prefix always yields the same blocks.

use serde_json::Value;

use super::api::{content_text, Message};
use crate::random::splitmix64;

/// Seed of the block-hash chain: fixed so hashes are reproducible run to run.
const NONE_HASH: u64 = 0x9E37_79B9_7F4A_7C15;
const FNV32_OFFSET: u32 = 0x811c_9dc5;
const FNV32_PRIME: u32 = 0x0100_0193;
const FNV64_OFFSET: u64 = 0xcbf2_9ce4_8422_2325;
const FNV64_PRIME: u64 = 0x0000_0100_0000_01b3;

/// Bytes per pseudo-token ("4 characters ≈ 1 token").
pub(crate) const BYTES_PER_TOKEN: usize = 4;

/// A prompt as the KV cache sees it.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct Prompt {
    /// Pseudo-token count.
    pub tokens: usize,
    /// Chained hash of every *full* block of the prompt, block 0 first.
    pub block_hashes: Vec<u64>,
}

impl Prompt {
    /// Tokenizes `text` and hashes its full blocks of `block_size` tokens.
    pub(crate) fn from_bytes(text: &[u8], block_size: usize) -> Prompt {
        let block_bytes = block_size * BYTES_PER_TOKEN;
        let full_blocks = text.len() / block_bytes;
        let mut block_hashes = Vec::with_capacity(full_blocks);
        let mut parent = NONE_HASH;
        for block in text.chunks_exact(block_bytes) {
            let mut h = parent;
            for chunk in block.chunks_exact(BYTES_PER_TOKEN) {
                h = (h ^ u64::from(token_id(chunk))).wrapping_mul(FNV64_PRIME);
            }
            parent = splitmix64(h);
            block_hashes.push(parent);
        }
        Prompt {
            tokens: text.len().div_ceil(BYTES_PER_TOKEN),
            block_hashes,
        }
    }
}

/// The pseudo-token id of one chunk of up to 4 bytes (FNV-1a).
pub(crate) fn token_id(chunk: &[u8]) -> u32 {
    chunk.iter().fold(FNV32_OFFSET, |h, b| {
        (h ^ u32::from(*b)).wrapping_mul(FNV32_PRIME)
    })
}

/// Renders a chat as ChatML with the tools JSON in the system block and the generation
/// prompt at the end. Each message renders on its own, so a history that extends another
/// renders to an extension of its bytes.
pub(crate) fn render_chat(messages: &[Message], tools: Option<&[Value]>) -> Vec<u8> {
    let mut out = String::with_capacity(4096);
    let tools_json = tools
        .filter(|t| !t.is_empty())
        .map(|t| serde_json::to_string(t).unwrap_or_default());
    let first_is_system = messages.first().is_some_and(|m| m.role == "system");
    if let (Some(tools_json), false) = (&tools_json, first_is_system) {
        out.push_str("<|im_start|>system\n# Tools\n");
        out.push_str(tools_json);
        out.push_str("<|im_end|>\n");
    }
    for (i, m) in messages.iter().enumerate() {
        out.push_str("<|im_start|>");
        out.push_str(&m.role);
        out.push('\n');
        if let Some(reasoning) = m.reasoning_text() {
            out.push_str("<think>\n");
            out.push_str(reasoning);
            out.push_str("\n</think>\n\n");
        }
        if let Some(c) = &m.content {
            content_text(c, &mut out);
        }
        if let Some(Value::Array(calls)) = &m.tool_calls {
            for call in calls {
                let f = call.get("function");
                let name = f
                    .and_then(|f| f.get("name"))
                    .and_then(Value::as_str)
                    .unwrap_or("");
                out.push_str("\n<tool_call>\n{\"name\":\"");
                out.push_str(name);
                out.push_str("\",\"arguments\":");
                match f.and_then(|f| f.get("arguments")) {
                    Some(Value::String(s)) => out.push_str(s),
                    Some(v) => out.push_str(&v.to_string()),
                    None => out.push_str("{}"),
                }
                out.push_str("}\n</tool_call>");
            }
        }
        if i == 0 && first_is_system {
            if let Some(tools_json) = &tools_json {
                out.push_str("\n\n# Tools\n");
                out.push_str(tools_json);
            }
        }
        out.push_str("<|im_end|>\n");
    }
    out.push_str("<|im_start|>assistant\n");
    out.into_bytes()
}

/// 64-bit FNV-1a, used to seed per-request randomness from a request body.
pub(crate) fn fnv64(bytes: &[u8]) -> u64 {
    bytes.iter().fold(FNV64_OFFSET, |h, b| {
        (h ^ u64::from(*b)).wrapping_mul(FNV64_PRIME)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn msg(role: &str, content: &str) -> Message {
        serde_json::from_value(serde_json::json!({"role": role, "content": content})).unwrap()
    }

    #[test]
    fn extended_history_keeps_every_block_of_the_shorter_one() {
        let a = vec![
            msg("system", "you are helpful"),
            msg("user", &"hello world ".repeat(40)),
        ];
        let mut b = a.clone();
        b.push(msg("assistant", "sure"));
        b.push(msg("user", &"more ".repeat(50)));
        let pa = Prompt::from_bytes(&render_chat(&a, None), 16);
        let pb = Prompt::from_bytes(&render_chat(&b, None), 16);
        assert!(pa.block_hashes.len() >= 2);
        // The generation prompt at the end of `a` is not part of `b`'s bytes, so only the
        // blocks before it must match.
        let shared = (render_chat(&a, None).len() - "<|im_start|>assistant\n".len()) / 64;
        assert_eq!(pa.block_hashes[..shared], pb.block_hashes[..shared]);
        assert!(pb.tokens > pa.tokens);
    }

    #[test]
    fn different_first_byte_changes_every_block() {
        let a = Prompt::from_bytes(&[b'a'; 640], 16);
        let mut other = vec![b'a'; 640];
        other[0] = b'b';
        let b = Prompt::from_bytes(&other, 16);
        assert!(a
            .block_hashes
            .iter()
            .zip(&b.block_hashes)
            .all(|(x, y)| x != y));
        assert_eq!(a.tokens, 160);
        assert_eq!(a.block_hashes.len(), 10);
    }
}

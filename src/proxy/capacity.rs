//! How many tokens a backend's KV cache holds, read once from its Prometheus `/metrics`: vLLM
//! and the simulator publish `vllm:cache_config_info` with `num_gpu_blocks` and `block_size`
//! labels, SGLang a `sglang:max_total_num_tokens` gauge. Bounded load uses it to tell a
//! backend that queues but holds its sessions (a spill would only cost a cache) from one whose
//! sessions outgrew its memory.

/// The most of a `/metrics` answer read: vLLM's is a few hundred KiB.
pub(crate) const MAX_METRICS_BYTES: usize = 4 << 20;

/// The KV cache size in tokens that a Prometheus text exposition states, if it states one.
pub(crate) fn kv_cache_tokens(text: &str) -> Option<u64> {
    for line in text.lines() {
        if let Some(labels) = line.strip_prefix("vllm:cache_config_info{") {
            let blocks = label(labels, "num_gpu_blocks")?;
            let size = label(labels, "block_size")?;
            return blocks.checked_mul(size).filter(|&t| t > 0);
        }
        if let Some(rest) = line.strip_prefix("sglang:max_total_num_tokens") {
            let value = rest.rsplit(' ').next()?.parse::<f64>().ok()?;
            return (value >= 1.0 && value < u64::MAX as f64).then_some(value as u64);
        }
    }
    None
}

/// The whole-number value of label `name` in a sample's label set (`a="1",b="2"} 1`).
fn label(labels: &str, name: &str) -> Option<u64> {
    let at = labels.find(&format!("{name}=\""))? + name.len() + 2;
    let value = &labels[at..];
    value[..value.find('"')?].parse().ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn vllm_states_its_cache_as_blocks_of_a_size() {
        let text = "# HELP vllm:cache_config_info KV cache configuration.\n\
            # TYPE vllm:cache_config_info gauge\n\
            vllm:cache_config_info{block_size=\"16\",cache_dtype=\"auto\",enable_prefix_caching=\"True\",gpu_memory_utilization=\"0.9\",num_gpu_blocks=\"5000\"} 1.0\n";
        assert_eq!(kv_cache_tokens(text), Some(80_000));
    }

    #[test]
    fn sglang_states_its_cache_in_tokens() {
        let text = "sglang:max_total_num_tokens{model_name=\"m\"} 123456.0\n";
        assert_eq!(kv_cache_tokens(text), Some(123_456));
    }

    #[test]
    fn a_missing_or_malformed_figure_states_nothing() {
        for text in [
            "",
            "llamacpp:kv_cache_tokens 12\n",
            "vllm:cache_config_info{block_size=\"16\"} 1\n",
            "vllm:cache_config_info{block_size=\"16\",num_gpu_blocks=\"-3\"} 1\n",
            "vllm:cache_config_info{block_size=\"0\",num_gpu_blocks=\"5000\"} 1\n",
            "vllm:cache_config_info{block_size=\"4294967296\",num_gpu_blocks=\"4294967296\"} 1\n",
            "sglang:max_total_num_tokens{} NaN\n",
            "sglang:max_total_num_tokens{} 0\n",
        ] {
            assert_eq!(kv_cache_tokens(text), None, "{text:?}");
        }
    }
}

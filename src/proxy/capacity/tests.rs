//! Each engine's parser against an answer in that engine's own shape: llama-server's recorded
//! from the build `scripts/real-engine.sh` makes (b1-0c1e570, `--ctx-size 16384 --parallel 2`,
//! sampling parameters and chat template trimmed); the others as their documentation and
//! sources print them.

use super::*;

fn path(p: &str) -> usize {
    KV_PATHS.iter().position(|k| *k == p).unwrap()
}

fn read_at(p: &str, body: &str) -> Reading {
    read(path(p), body.as_bytes())
}

/// vLLM's `/metrics`: `cache_config_info` carries the cache configuration as labels.
const VLLM_METRICS: &str = "# HELP vllm:cache_config_info KV cache configuration.\n\
# TYPE vllm:cache_config_info gauge\n\
vllm:cache_config_info{block_size=\"16\",cache_dtype=\"auto\",enable_prefix_caching=\"True\",gpu_memory_utilization=\"0.9\",num_gpu_blocks=\"5000\"} 1.0\n";

/// SGLang's `/metrics` with `--enable-metrics`: its gauge carries the scheduler's labels and
/// Python's client prints large values in exponent form.
const SGLANG_METRICS: &str = "# HELP sglang:token_usage The token usage\n\
# TYPE sglang:token_usage gauge\n\
sglang:token_usage{engine_type=\"unified\",model_name=\"meta-llama/Llama-3.1-8B-Instruct\",moe_ep_rank=\"0\",pp_rank=\"0\",tp_rank=\"0\"} 0.28\n\
# HELP sglang:max_total_num_tokens Maximum total number of tokens in the KV cache pool.\n\
# TYPE sglang:max_total_num_tokens gauge\n\
sglang:max_total_num_tokens{engine_type=\"unified\",model_name=\"meta-llama/Llama-3.1-8B-Instruct\",moe_ep_rank=\"0\",pp_rank=\"0\",tp_rank=\"0\"} 1.020726e+06\n\
sglang:max_total_num_tokens{engine_type=\"unified\",model_name=\"meta-llama/Llama-3.1-8B-Instruct\",moe_ep_rank=\"0\",pp_rank=\"0\",tp_rank=\"1\"} 1.020726e+06\n";

/// SGLang's `/get_server_info`: its server arguments (a few of some hundred), the scheduler's
/// figures, its internal states and version.
const SGLANG_SERVER_INFO: &str = r#"{"model_path":"qwen/qwen2.5-0.5b-instruct","tokenizer_path":"qwen/qwen2.5-0.5b-instruct","host":"0.0.0.0","port":30000,"mem_fraction_static":0.88,"max_running_requests":null,"max_total_tokens":null,"chunked_prefill_size":8192,"tp_size":1,"dp_size":1,"enable_metrics":false,"status":"ready","max_total_num_tokens":1345066,"max_req_input_len":32762,"internal_states":[{"attention_backend":"fa3","last_gen_throughput":0.0,"memory_usage":{"weight":1.04,"kvcache":15.39,"token_capacity":1345066,"graph":0.24}}],"version":"0.5.4"}"#;

/// llama-server's `/props`, recorded.
const LLAMA_PROPS: &str = r#"{"default_generation_settings":{"params":{"seed":4294967295,"temperature":0.800000011920929,"top_k":40,"top_p":0.949999988079071,"min_p":0.05000000074505806,"max_tokens":-1,"n_predict":-1,"n_keep":0,"stream":false,"chat_format":"Content-only","samplers":["penalties","dry","top_n_sigma","top_k","typ_p","top_p","min_p","xtc","temperature"],"lora":[]},"n_ctx":8192},"total_slots":2,"model_alias":"tiny","model_ftype":"all F32","model_path":"/root/.cache/agentrace/real-engine/tiny.gguf","modalities":{"vision":false,"video":false,"audio":false},"endpoint_slots":true,"endpoint_props":false,"endpoint_metrics":true,"ui":true,"ui_settings":{},"chat_template":"{% for message in messages %}…{% endfor %}","bos_token":"<s>","eos_token":"<|im_end|>","build_info":"b1-0c1e570","is_sleeping":false,"cors_proxy_enabled":false}"#;

/// llama-server's `/slots`, recorded.
const LLAMA_SLOTS: &str = r#"[{"id":0,"n_ctx":8192,"speculative":false,"is_processing":false},{"id":1,"n_ctx":8192,"speculative":false,"is_processing":false}]"#;

/// llama-server's `/metrics` (with `--metrics`), recorded: it states no cache size.
const LLAMA_METRICS: &str = "# HELP llamacpp:prompt_tokens_total Number of prompt tokens processed, excluding cached tokens\n\
# TYPE llamacpp:prompt_tokens_total counter\n\
llamacpp:prompt_tokens_total 0\n\
# HELP llamacpp:n_tokens_max Largest observed sequence length (prompt + generation)\n\
# TYPE llamacpp:n_tokens_max counter\n\
llamacpp:n_tokens_max 0\n";

/// llama-server's answer to a path it does not serve, recorded (with status 404).
const LLAMA_NOT_FOUND: &str =
    r#"{"error":{"message":"File Not Found","type":"not_found_error","code":404}}"#;

/// trtllm-serve's `/metrics`, as its documentation prints one iteration.
const TRTLLM_METRICS: &str = r#"[{"gpuMemUsage":76665782272,"iter":154,"iterLatencyMS":7.00688362121582,"kvCacheStats":{"allocNewBlocks":3126,"allocTotalBlocks":3126,"cacheHitRate":0.00128,"freeNumBlocks":101253,"maxNumBlocks":101256,"missedBlocks":3121,"reusedBlocks":4,"tokensPerBlock":32,"usedNumBlocks":3},"numActiveRequests":1}]"#;

#[test]
fn each_engine_states_its_cache_where_it_publishes_it() {
    let cases = [
        ("/metrics", VLLM_METRICS, 80_000, KvSource::VllmCacheConfig),
        (
            "/metrics",
            SGLANG_METRICS,
            1_020_726,
            KvSource::SglangMetrics,
        ),
        (
            "/get_server_info",
            SGLANG_SERVER_INFO,
            1_345_066,
            KvSource::SglangServerInfo,
        ),
        ("/props", LLAMA_PROPS, 16_384, KvSource::LlamaProps),
        ("/slots", LLAMA_SLOTS, 16_384, KvSource::LlamaSlots),
        (
            "/metrics",
            TRTLLM_METRICS,
            101_256 * 32,
            KvSource::TrtllmStats,
        ),
    ];
    for (p, body, tokens, source) in cases {
        assert_eq!(
            read_at(p, body),
            Reading::Size(tokens, source),
            "{p}: {body}"
        );
    }
}

#[test]
fn a_data_parallel_server_holds_a_pool_per_rank() {
    // Two data-parallel ranks of two tensor-parallel ranks each: each pool counted once.
    let labels = |dp: u32, tp: u32| {
        format!("{{dp_rank=\"{dp}\",engine_type=\"unified\",model_name=\"m\",moe_ep_rank=\"0\",pp_rank=\"0\",tp_rank=\"{tp}\"}}")
    };
    let text: String = [(0, 0), (0, 1), (1, 0), (1, 1)]
        .iter()
        .map(|&(dp, tp)| format!("sglang:max_total_num_tokens{} 262144.0\n", labels(dp, tp)))
        .collect();
    assert_eq!(
        read_at("/metrics", &text),
        Reading::Size(524_288, KvSource::SglangMetrics)
    );
    let info = SGLANG_SERVER_INFO.replace("\"dp_size\":1", "\"dp_size\":4");
    assert_eq!(
        read_at("/get_server_info", &info),
        Reading::Size(4 * 1_345_066, KvSource::SglangServerInfo)
    );
}

#[test]
fn an_answer_in_another_engines_shape_states_nothing() {
    let cases = [
        ("/metrics", LLAMA_METRICS),
        ("/metrics", "not metrics at all"),
        ("/get_server_info", LLAMA_NOT_FOUND),
        ("/props", LLAMA_NOT_FOUND),
        ("/props", SGLANG_SERVER_INFO),
        ("/slots", LLAMA_NOT_FOUND),
        ("/slots", "[]"),
        ("/props", "<html>llama.cpp</html>"),
        // trtllm-serve iterations without cache statistics.
        ("/metrics", r#"[{"iter":1,"gpuMemUsage":1}]"#),
    ];
    for (p, body) in cases {
        assert_eq!(read_at(p, body), Reading::Silent, "{p}: {body}");
    }
}

#[test]
fn trtllm_with_no_iteration_since_its_last_read_is_asked_again() {
    assert_eq!(read_at("/metrics", " []"), Reading::NotYet);
}

#[test]
fn a_missing_malformed_or_overflowing_figure_states_nothing() {
    let cases = [
        ("/metrics", ""),
        ("/metrics", "vllm:cache_config_info{block_size=\"16\"} 1\n"),
        (
            "/metrics",
            "vllm:cache_config_info{block_size=\"16\",num_gpu_blocks=\"-3\"} 1\n",
        ),
        (
            "/metrics",
            "vllm:cache_config_info{block_size=\"0\",num_gpu_blocks=\"5000\"} 1\n",
        ),
        (
            "/metrics",
            "vllm:cache_config_info{block_size=\"4294967296\",num_gpu_blocks=\"4294967296\"} 1\n",
        ),
        // A label whose name ends like the one looked for is not it.
        (
            "/metrics",
            "vllm:cache_config_info{xblock_size=\"16\",num_gpu_blocks=\"5\"} 1\n",
        ),
        ("/metrics", "sglang:max_total_num_tokens{} NaN\n"),
        ("/metrics", "sglang:max_total_num_tokens{} 0\n"),
        ("/metrics", "sglang:max_total_num_tokens{tp_rank=\"0\" 5\n"),
        ("/metrics", "sglang:max_total_num_tokens 1e30\n"),
        ("/get_server_info", r#"{"max_total_num_tokens":-5}"#),
        ("/get_server_info", r#"{"max_total_num_tokens":0}"#),
        (
            "/get_server_info",
            r#"{"max_total_num_tokens":18446744073709551615,"dp_size":2}"#,
        ),
        (
            "/props",
            r#"{"default_generation_settings":{"n_ctx":8192}}"#,
        ),
        (
            "/props",
            r#"{"default_generation_settings":{"n_ctx":8192},"total_slots":0}"#,
        ),
        (
            "/props",
            r#"{"default_generation_settings":{"n_ctx":4294967296},"total_slots":4294967296}"#,
        ),
        ("/slots", r#"[{"id":0}]"#),
        ("/slots", r#"[{"n_ctx":18446744073709551615},{"n_ctx":1}]"#),
        ("/metrics", r#"[{"kvCacheStats":{"maxNumBlocks":5}}]"#),
    ];
    for (p, body) in cases {
        assert_eq!(read_at(p, body), Reading::Silent, "{p}: {body}");
    }
}

#[test]
fn ranks_beyond_any_real_server_state_nothing() {
    let text: String = (0..2000)
        .map(|r| format!("sglang:max_total_num_tokens{{dp_rank=\"{r}\"}} 1\n"))
        .collect();
    assert_eq!(read_at("/metrics", &text), Reading::Silent);
}

#[test]
fn a_backend_is_asked_until_a_path_states_it_or_none_can() {
    let state = KvSizeState::default();
    assert_eq!(state.source(), "pending");
    // A trtllm-serve that has run nothing yet: asked again, with no end.
    for _ in 0..100 {
        assert!(!state.round_ended(false, true));
    }
    assert!(state.asking());
    // Failing paths: asked for a bounded number of rounds, then unknown, said once.
    let said: Vec<bool> = (0..MAX_FAILED_ROUNDS + 2)
        .map(|_| state.round_ended(true, false))
        .collect();
    assert_eq!(said.iter().filter(|s| **s).count(), 1, "{said:?}");
    assert_eq!(state.source(), "unknown");
    assert!(!state.asking());

    let state = KvSizeState::default();
    state.silent(path("/metrics"));
    assert!(!state.ask(path("/metrics")) && state.ask(path("/props")));
    state.stated(KvSource::LlamaProps);
    assert_eq!(state.source(), "llama.cpp /props");
    assert!(!state.asking());
}

//! Latency model of one engine step: a memory-bound, MoE-aware decode term and a
//! compute-bound prefill term whose per-token cost grows with context (doc §6).

use super::config::EngineConfig;

/// The cost model of one replica, in milliseconds.
#[derive(Debug, Clone)]
pub(crate) struct CostModel {
    t_fixed_ms: f64,
    t_tok_ms: f64,
    l_eq: f64,
    dense_ms: f64,
    experts_ms: f64,
    expert_miss: f64,
    kv_ms_per_token: f64,
    seq_ms: f64,
}

impl CostModel {
    /// The model of an engine configuration.
    pub(crate) fn new(e: &EngineConfig) -> CostModel {
        let ms_per_byte = 1e3 / e.bandwidth_bytes_per_s;
        CostModel {
            t_fixed_ms: e.t_fixed_ms,
            t_tok_ms: e.prefill_us_per_token / 1e3,
            l_eq: e.attention_equal_context,
            dense_ms: e.dense_weight_bytes * ms_per_byte,
            experts_ms: e.expert_weight_bytes * ms_per_byte,
            expert_miss: 1.0 - f64::from(e.experts_per_token) / f64::from(e.experts_total),
            kv_ms_per_token: e.kv_bytes_per_token * ms_per_byte,
            seq_ms: e.decode_us_per_seq / 1e3,
        }
    }

    /// Prefilling `u` new tokens on top of `c` tokens already in KV.
    pub(crate) fn prefill_chunk_ms(&self, u: usize, c: usize) -> f64 {
        let (u, c) = (u as f64, c as f64);
        u * self.t_tok_ms * (1.0 + (c + u / 2.0) / self.l_eq)
    }

    /// One decode step for `batch` sequences holding `context` tokens in total (without the
    /// fixed step cost).
    pub(crate) fn decode_ms(&self, batch: usize, context: usize) -> f64 {
        if batch == 0 {
            return 0.0;
        }
        let activated = 1.0 - self.expert_miss.powi(batch.min(i32::MAX as usize) as i32);
        self.dense_ms
            + self.experts_ms * activated
            + context as f64 * self.kv_ms_per_token
            + batch as f64 * self.seq_ms
    }

    /// A whole step: the fixed cost, the decode term and every prefill chunk `(u, c)`.
    pub(crate) fn step_ms(
        &self,
        batch: usize,
        context: usize,
        chunks: impl Iterator<Item = (usize, usize)>,
    ) -> f64 {
        self.t_fixed_ms
            + self.decode_ms(batch, context)
            + chunks
                .map(|(u, c)| self.prefill_chunk_ms(u, c))
                .sum::<f64>()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sim::SimConfig;

    /// The curves the simulated-backend doc §7.1 derives for the H100 profile.
    #[test]
    fn h100_profile_reproduces_the_documented_curves() {
        let cfg = SimConfig::default();
        let m = CostModel::new(&cfg.engine);
        let close = |got: f64, want: f64, tol: f64| {
            assert!((got - want).abs() <= tol, "got {got}, want {want}")
        };
        close(m.step_ms(1, 6_600, std::iter::empty()), 5.7, 0.1);
        close(m.step_ms(16, 105_000, std::iter::empty()), 22.0, 1.0);
        close(m.step_ms(64, 80_000, std::iter::empty()), 28.0, 1.0);
        let ttft =
            |n: usize| cfg.engine.request_overhead_ms + m.step_ms(0, 0, std::iter::once((n, 0)));
        close(ttft(1_000), 39.0, 1.0);
        close(ttft(8_192), 224.0, 2.0);
        close(ttft(32_768), 1_340.0, 10.0);
        let warm =
            cfg.engine.request_overhead_ms + m.step_ms(0, 0, std::iter::once((2_000, 30_000)));
        assert!(ttft(32_000) / warm > 8.0);
    }
}

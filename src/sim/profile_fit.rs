//! Fits the cost model's parameters to what `sim calibrate` measured: ordinary least squares
//! over the prefill and decode samples, with a term dropped (and the rest refitted) when the
//! data give it a negative value, which no engine has.

use super::config::EngineConfig;

/// One TTFT sample: `uncached` prompt tokens computed on top of `cached` ones.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize)]
pub(crate) struct PrefillSample {
    /// Tokens the engine computed.
    pub uncached: f64,
    /// Tokens it served from its prefix cache.
    pub cached: f64,
    /// Time to first token, ms.
    pub ttft_ms: f64,
}

/// One inter-token-time sample: `batch` streams decoding together over `context` tokens.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize)]
pub(crate) struct DecodeSample {
    /// Streams decoding at once.
    pub batch: f64,
    /// KV tokens of all of them together while they decode.
    pub context: f64,
    /// Median time between two tokens of one stream, ms.
    pub itl_ms: f64,
}

/// The fitted model, in the terms the samples were measured in.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct Fit {
    /// TTFT of an empty prompt: request overhead plus one step's fixed cost, ms.
    pub ttft_base_ms: f64,
    /// Prefill time per token on a short context, ms.
    pub prefill_ms_per_token: f64,
    /// Context at which attention doubles the per-token prefill cost, tokens.
    pub attention_equal_context: f64,
    /// A decode step's cost with no sequence: the fixed part, ms.
    pub step_base_ms: f64,
    /// Added per running sequence, ms.
    pub step_ms_per_seq: f64,
    /// Added per KV token read, ms.
    pub step_ms_per_context_token: f64,
}

/// How far the fit is from the samples.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub(crate) struct Residuals {
    /// Root mean square of (fitted − measured), ms.
    pub rms_ms: f64,
    /// Largest |fitted − measured| / measured, percent.
    pub max_error_pct: f64,
}

/// Why no fit could be made.
#[derive(Debug, thiserror::Error, PartialEq)]
pub(crate) enum FitError {
    /// Too few distinct samples for the terms.
    #[error("{what}: {got} samples cannot fit the model (need at least {need} distinct ones)")]
    TooFewSamples {
        /// Which curve.
        what: &'static str,
        /// Samples given.
        got: usize,
        /// Samples needed.
        need: usize,
    },
}

/// "Unbounded" context for attention when the data show no growth with context.
const NO_ATTENTION_GROWTH: f64 = 1e12;

impl Fit {
    /// Fits both curves.
    pub(crate) fn new(prefill: &[PrefillSample], decode: &[DecodeSample]) -> Result<Fit, FitError> {
        // TTFT = base + t·u + (t/L)·u·(c + u/2)
        let rows: Vec<(Vec<f64>, f64)> = prefill
            .iter()
            .map(|s| {
                let quad = s.uncached * (s.cached + s.uncached / 2.0);
                (vec![1.0, s.uncached, quad], s.ttft_ms)
            })
            .collect();
        let p = nonnegative_fit(&rows, "prefill")?;
        let t = p[1];
        let attention_equal_context = if p[2] > 0.0 && t > 0.0 {
            t / p[2]
        } else {
            NO_ATTENTION_GROWTH
        };
        // ITL = fixed + per-seq·b + per-token·context
        let rows: Vec<(Vec<f64>, f64)> = decode
            .iter()
            .map(|s| (vec![1.0, s.batch, s.context], s.itl_ms))
            .collect();
        let d = nonnegative_fit(&rows, "decode")?;
        Ok(Fit {
            ttft_base_ms: p[0],
            prefill_ms_per_token: t,
            attention_equal_context,
            step_base_ms: d[0],
            step_ms_per_seq: d[1],
            step_ms_per_context_token: d[2],
        })
    }

    /// The fitted TTFT of a sample.
    pub(crate) fn ttft_ms(&self, s: &PrefillSample) -> f64 {
        self.ttft_base_ms
            + self.prefill_ms_per_token
                * s.uncached
                * (1.0 + (s.cached + s.uncached / 2.0) / self.attention_equal_context)
    }

    /// The fitted inter-token time of a sample.
    pub(crate) fn itl_ms(&self, s: &DecodeSample) -> f64 {
        self.step_base_ms
            + self.step_ms_per_seq * s.batch
            + self.step_ms_per_context_token * s.context
    }

    /// Writes the fit into an engine configuration. The simulator's step has one fixed cost
    /// for prefill and decode alike; the rest of the TTFT base becomes request overhead.
    /// Decode cost is expressed through a nominal 1 TB/s bandwidth: only the products
    /// (bytes ÷ bandwidth) matter to the model.
    pub(crate) fn apply(&self, e: &mut EngineConfig) {
        const BANDWIDTH: f64 = 1e12;
        let ms_to_bytes = BANDWIDTH / 1e3;
        e.t_fixed_ms = self.step_base_ms;
        e.request_overhead_ms = (self.ttft_base_ms - self.step_base_ms).max(0.0);
        e.prefill_us_per_token = self.prefill_ms_per_token * 1e3;
        e.attention_equal_context = self.attention_equal_context;
        e.bandwidth_bytes_per_s = BANDWIDTH;
        e.dense_weight_bytes = 0.0;
        e.expert_weight_bytes = 0.0;
        e.experts_per_token = 1;
        e.experts_total = 1;
        e.kv_bytes_per_token = self.step_ms_per_context_token * ms_to_bytes;
        e.decode_us_per_seq = self.step_ms_per_seq * 1e3;
    }

    /// Residuals of the prefill curve.
    pub(crate) fn prefill_residuals(&self, samples: &[PrefillSample]) -> Residuals {
        residuals(samples.iter().map(|s| (self.ttft_ms(s), s.ttft_ms)))
    }

    /// Residuals of the decode curve.
    pub(crate) fn decode_residuals(&self, samples: &[DecodeSample]) -> Residuals {
        residuals(samples.iter().map(|s| (self.itl_ms(s), s.itl_ms)))
    }
}

fn residuals(pairs: impl Iterator<Item = (f64, f64)>) -> Residuals {
    let (mut sq, mut n, mut max) = (0.0, 0usize, 0.0f64);
    for (fitted, measured) in pairs {
        sq += (fitted - measured).powi(2);
        n += 1;
        if measured > 0.0 {
            max = max.max(100.0 * (fitted - measured).abs() / measured);
        }
    }
    Residuals {
        rms_ms: if n == 0 { 0.0 } else { (sq / n as f64).sqrt() },
        max_error_pct: max,
    }
}

/// Least squares on relative errors (each row weighted by 1/measured, so a 5 ms TTFT counts
/// as much as a 500 ms one) with every coefficient ≥ 0: a term that comes out negative is
/// dropped and the others refitted (the intercept is kept but clamped), until none is.
fn nonnegative_fit(rows: &[(Vec<f64>, f64)], what: &'static str) -> Result<Vec<f64>, FitError> {
    let rows: Vec<(Vec<f64>, f64)> = rows
        .iter()
        .map(|(x, y)| {
            let w = 1.0 / y.abs().max(1e-3);
            (x.iter().map(|v| v * w).collect(), y * w)
        })
        .collect();
    let terms = rows.first().map_or(0, |r| r.0.len());
    let mut active: Vec<bool> = vec![true; terms];
    loop {
        let cols: Vec<usize> = (0..terms).filter(|&j| active[j]).collect();
        let reduced: Vec<(Vec<f64>, f64)> = rows
            .iter()
            .map(|(x, y)| (cols.iter().map(|&j| x[j]).collect(), *y))
            .collect();
        let Some(coef) = least_squares(&reduced) else {
            // Samples that cannot tell two terms apart (collinear, or too few): the last
            // term goes, the simplest model that the data determine is kept.
            match cols.last() {
                Some(&j) if cols.len() > 1 && !rows.is_empty() => {
                    active[j] = false;
                    continue;
                }
                _ => {
                    return Err(FitError::TooFewSamples {
                        what,
                        got: rows.len(),
                        need: cols.len(),
                    })
                }
            }
        };
        let mut full = vec![0.0; terms];
        for (k, &j) in cols.iter().enumerate() {
            full[j] = coef[k];
        }
        let worst = cols
            .iter()
            .copied()
            .filter(|&j| j > 0 && full[j] < 0.0)
            .min_by(|&a, &b| full[a].total_cmp(&full[b]));
        match worst {
            Some(j) => active[j] = false,
            None => {
                full[0] = full[0].max(0.0);
                return Ok(full);
            }
        }
    }
}

/// Ordinary least squares by the normal equations (a handful of terms, well scaled by
/// column normalisation); `None` when the samples do not determine the coefficients.
#[allow(clippy::needless_range_loop)] // Gauss-Jordan reads rows by index while writing others.
fn least_squares(rows: &[(Vec<f64>, f64)]) -> Option<Vec<f64>> {
    let k = rows.first()?.0.len();
    if rows.len() < k {
        return None;
    }
    let scale: Vec<f64> = (0..k)
        .map(|j| {
            let m = rows.iter().map(|r| r.0[j].abs()).fold(0.0, f64::max);
            if m > 0.0 {
                m
            } else {
                1.0
            }
        })
        .collect();
    // [XᵀX | Xᵀy] on normalised columns.
    let mut a = vec![vec![0.0; k + 1]; k];
    for (x, y) in rows {
        for i in 0..k {
            let xi = x[i] / scale[i];
            for j in 0..k {
                a[i][j] += xi * x[j] / scale[j];
            }
            a[i][k] += xi * y;
        }
    }
    for col in 0..k {
        let pivot = (col..k).max_by(|&p, &q| a[p][col].abs().total_cmp(&a[q][col].abs()))?;
        if a[pivot][col].abs() < 1e-9 {
            return None;
        }
        a.swap(col, pivot);
        for row in 0..k {
            if row != col {
                let f = a[row][col] / a[col][col];
                for j in col..=k {
                    a[row][j] -= f * a[col][j];
                }
            }
        }
    }
    Some((0..k).map(|i| a[i][k] / a[i][i] / scale[i]).collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exact_samples_give_back_the_parameters_that_made_them() {
        let truth = Fit {
            ttft_base_ms: 12.0,
            prefill_ms_per_token: 0.2,
            attention_equal_context: 3_000.0,
            step_base_ms: 4.0,
            step_ms_per_seq: 1.5,
            step_ms_per_context_token: 0.001,
        };
        let prefill: Vec<_> = [(64.0, 0.0), (512.0, 0.0), (2048.0, 0.0), (256.0, 1024.0)]
            .iter()
            .map(|&(u, c)| {
                let mut s = PrefillSample {
                    uncached: u,
                    cached: c,
                    ttft_ms: 0.0,
                };
                s.ttft_ms = truth.ttft_ms(&s);
                s
            })
            .collect();
        let decode: Vec<_> = [(1.0, 100.0), (2.0, 200.0), (4.0, 4000.0), (1.0, 2000.0)]
            .iter()
            .map(|&(b, c)| {
                let mut s = DecodeSample {
                    batch: b,
                    context: c,
                    itl_ms: 0.0,
                };
                s.itl_ms = truth.itl_ms(&s);
                s
            })
            .collect();
        let fit = Fit::new(&prefill, &decode).unwrap();
        let close = |a: f64, b: f64| (a - b).abs() <= 1e-6 * b.abs().max(1.0);
        assert!(close(fit.ttft_base_ms, 12.0), "{fit:?}");
        assert!(close(fit.prefill_ms_per_token, 0.2), "{fit:?}");
        assert!(
            (fit.attention_equal_context - 3_000.0).abs() < 1.0,
            "{fit:?}"
        );
        assert!(close(fit.step_ms_per_seq, 1.5), "{fit:?}");
        assert!(close(fit.step_ms_per_context_token, 0.001), "{fit:?}");
        assert!(fit.prefill_residuals(&prefill).rms_ms < 1e-6);
    }

    #[test]
    fn a_term_the_data_make_negative_is_dropped_not_kept() {
        // ITL falls slightly with batch: noise, not physics.
        let decode = [
            DecodeSample {
                batch: 1.0,
                context: 100.0,
                itl_ms: 5.0,
            },
            DecodeSample {
                batch: 2.0,
                context: 200.0,
                itl_ms: 4.9,
            },
            DecodeSample {
                batch: 4.0,
                context: 400.0,
                itl_ms: 4.8,
            },
        ];
        let prefill = [
            PrefillSample {
                uncached: 10.0,
                cached: 0.0,
                ttft_ms: 2.0,
            },
            PrefillSample {
                uncached: 100.0,
                cached: 0.0,
                ttft_ms: 11.0,
            },
            PrefillSample {
                uncached: 1000.0,
                cached: 0.0,
                ttft_ms: 101.0,
            },
        ];
        let fit = Fit::new(&prefill, &decode).unwrap();
        assert!(fit.step_ms_per_seq >= 0.0 && fit.step_ms_per_context_token >= 0.0);
        assert!((fit.step_base_ms - 4.9).abs() < 0.2, "{fit:?}");
    }

    #[test]
    fn too_few_samples_is_an_error_naming_the_curve() {
        let err = Fit::new(&[], &[]).unwrap_err();
        assert!(err.to_string().starts_with("prefill:"), "{err}");
    }
}

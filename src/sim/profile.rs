//! A measured simulator profile: the `[calibration]` record `agentrace sim calibrate` writes
//! beside the fitted `[engine]` fields, and `--profile NAME|FILE` resolution. A profile file
//! is an ordinary `--config` file; there is one format.

use std::path::Path;

use serde::{Deserialize, Serialize};

use super::config::{ConfigError, SimConfig, PROFILES};

/// Where and how a profile was measured, and how well the fit matches the measurements: the
/// planner reads it to say where its predictions cannot be trusted.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Calibration {
    /// The engine measured (its URL).
    pub target: String,
    /// Requests sent while measuring.
    pub requests: u64,
    /// Shortest prompt measured, tokens.
    pub prompt_tokens_min: u64,
    /// Longest prompt measured, tokens: beyond it prefill is extrapolated.
    pub prompt_tokens_max: u64,
    /// Largest batch measured: beyond it decode is extrapolated.
    pub batch_max: u64,
    /// Where the KV capacity came from (the engine's own statement, or "not stated").
    pub kv_source: String,
    /// Root mean square of the TTFT fit's residuals, ms.
    pub prefill_rms_ms: f64,
    /// Largest relative TTFT error of the fit over the samples, percent.
    pub prefill_max_error_pct: f64,
    /// Root mean square of the inter-token-time fit's residuals, ms.
    pub decode_rms_ms: f64,
    /// Largest relative inter-token-time error of the fit over the samples, percent.
    pub decode_max_error_pct: f64,
}

/// Whether `--profile` names a file rather than a built-in profile.
fn is_path(name_or_path: &str) -> bool {
    !PROFILES.contains(&name_or_path)
        && (name_or_path.contains('/')
            || name_or_path.ends_with(".toml")
            || Path::new(name_or_path).is_file())
}

/// `--profile NAME|FILE`: a built-in profile, or a profile file `sim calibrate` wrote (or
/// any `--config` file).
pub fn resolve(name_or_path: &str) -> Result<SimConfig, ConfigError> {
    if is_path(name_or_path) {
        SimConfig::from_file(Path::new(name_or_path))
    } else {
        SimConfig::from_profile(name_or_path)
    }
}

/// The profile file's text: a header of comments saying what was measured and how well the
/// fit holds, then the configuration itself.
pub(crate) fn render(config: &SimConfig, header: &[String]) -> Result<String, toml::ser::Error> {
    let mut out = String::new();
    for line in header {
        out.push_str("# ");
        out.push_str(line);
        out.push('\n');
    }
    out.push('\n');
    out.push_str(&toml::to_string_pretty(config)?);
    Ok(out)
}

/// A profile measured on a real engine: the fitted configuration and its file header.
#[derive(Debug, Clone)]
pub(crate) struct Calibrated {
    /// The configuration, its `calibration` record filled.
    pub config: SimConfig,
    /// Comment lines for the file: the samples and the fit against them.
    pub header: Vec<String>,
}

/// Describes the engine, states the request count (through `announce`), measures, fits.
pub(crate) async fn calibrate(
    opts: super::profile_probe::ProbeOptions,
    announce: &dyn Fn(&str),
) -> anyhow::Result<Calibrated> {
    use super::profile_fit::Fit;
    use super::profile_probe::{ProbePlan, Prober};
    let target = opts.target.clone();
    let mut prober = Prober::new(opts.clone())?;
    let described = prober.describe().await;
    let plan = ProbePlan::new(&opts, described.slots);
    announce(&format!(
        "calibrate: {target}: model {:?}, KV {}, slots {}; sending {} chat requests (bound --max-requests {}): prompts {:?} tokens uncached and extended ×{}, decode batches {:?} at {:?}-token prompts, {} tokens each",
        described.model,
        described
            .kv_tokens
            .map_or("not stated".to_string(), |(t, src)| format!("{t} tokens ({src})")),
        described
            .slots
            .map_or(format!("not stated (measuring up to {})", opts.max_batch), |s| s.to_string()),
        plan.requests,
        opts.max_requests,
        plan.lengths,
        opts.repeats,
        plan.batches,
        plan.decode_prompts,
        opts.decode_tokens,
    ));
    let m = prober
        .measure(&plan, &|step| announce(&format!("calibrate: {step} done")))
        .await?;
    let fit = Fit::new(&m.prefill, &m.decode)?;
    let pre = fit.prefill_residuals(&m.prefill);
    let dec = fit.decode_residuals(&m.decode);
    let mut config = SimConfig {
        model: described.model.clone(),
        ..SimConfig::default()
    };
    fit.apply(&mut config.engine);
    if let Some(slots) = described.slots {
        config.engine.max_num_seqs = slots;
    }
    config.engine.max_num_batched_tokens = config
        .engine
        .max_num_batched_tokens
        .max(config.engine.max_num_seqs + 1);
    if let Some((tokens, _)) = described.kv_tokens {
        let blocks = (tokens as usize) / config.engine.block_size;
        config.engine.num_gpu_blocks = blocks.max(1);
    }
    let range = |f: fn(&super::profile_fit::PrefillSample) -> f64| {
        m.prefill
            .iter()
            .map(f)
            .fold((f64::MAX, 0.0f64), |(lo, hi), v| (lo.min(v), hi.max(v)))
    };
    let (lo, hi) = range(|s| s.uncached + s.cached);
    config.calibration = Some(Calibration {
        target: target.clone(),
        requests: m.requests,
        prompt_tokens_min: lo as u64,
        prompt_tokens_max: hi as u64,
        batch_max: plan.batches.last().copied().unwrap_or(1) as u64,
        kv_source: described
            .kv_tokens
            .map_or("not stated".to_string(), |(_, s)| s.to_string()),
        prefill_rms_ms: pre.rms_ms,
        prefill_max_error_pct: pre.max_error_pct,
        decode_rms_ms: dec.rms_ms,
        decode_max_error_pct: dec.max_error_pct,
    });
    config.validate()?;
    let mut header = vec![
        format!("Simulator profile measured by `agentrace sim calibrate` on {target}."),
        "Read by `agentrace sim --profile FILE` and `agentrace plan --profile FILE`.".to_string(),
        format!(
            "Fit: TTFT = {:.3} ms + {:.4} ms/token x u x (1 + (c + u/2) / {:.0}); residual rms {:.2} ms, worst {:.1}%",
            fit.ttft_base_ms, fit.prefill_ms_per_token, fit.attention_equal_context, pre.rms_ms, pre.max_error_pct
        ),
        format!(
            "Fit: ITL = {:.3} ms + {:.4} ms x batch + {:.6} ms x context tokens; residual rms {:.3} ms, worst {:.1}%",
            fit.step_base_ms, fit.step_ms_per_seq, fit.step_ms_per_context_token, dec.rms_ms, dec.max_error_pct
        ),
        "prefill samples (uncached u, cached c, measured TTFT ms, fitted TTFT ms):".to_string(),
    ];
    for s in &m.prefill {
        header.push(format!(
            "  u={:>6} c={:>6} measured={:>9.3} fitted={:>9.3}",
            s.uncached,
            s.cached,
            s.ttft_ms,
            fit.ttft_ms(s)
        ));
    }
    header.push(
        "decode samples (batch, context tokens, measured ITL ms, fitted ITL ms):".to_string(),
    );
    for s in &m.decode {
        header.push(format!(
            "  batch={:>3} context={:>7} measured={:>8.3} fitted={:>8.3}",
            s.batch,
            s.context,
            s.itl_ms,
            fit.itl_ms(s)
        ));
    }
    Ok(Calibrated { config, header })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_rendered_profile_reads_back_as_the_same_config() {
        let mut cfg = SimConfig {
            calibration: Some(Calibration {
                target: "http://127.0.0.1:1".into(),
                requests: 40,
                prompt_tokens_min: 60,
                prompt_tokens_max: 2000,
                batch_max: 4,
                kv_source: "llama.cpp /props".into(),
                prefill_rms_ms: 1.5,
                prefill_max_error_pct: 7.0,
                decode_rms_ms: 0.2,
                decode_max_error_pct: 4.0,
            }),
            ..SimConfig::default()
        };
        cfg.engine.decode_us_per_seq = 1234.5;
        let text = render(&cfg, &["measured".into()]).unwrap();
        let back = SimConfig::from_toml_str(&text, "profile.toml").unwrap();
        assert_eq!(back, cfg);
    }

    #[test]
    fn built_in_names_stay_names_and_paths_are_read_as_files() {
        assert_eq!(
            resolve("h200-qwen3-30b-a3b-fp8").unwrap().profile,
            "h200-qwen3-30b-a3b-fp8"
        );
        let err = resolve("/nonexistent/profile.toml").unwrap_err();
        assert!(
            err.to_string().contains("/nonexistent/profile.toml"),
            "{err}"
        );
        assert!(matches!(
            resolve("no-such-profile"),
            Err(ConfigError::UnknownProfile(_))
        ));
    }
}

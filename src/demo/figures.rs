//! The figures' data, read back from what each replay wrote (`events.jsonl`,
//! `result_summary.json`) and converted to the page's one time base, simulated time.

use std::collections::HashMap;
use std::io::BufRead as _;
use std::path::Path;

use anyhow::Context as _;

/// Per-user output tokens over time, from `result_summary.json`.
#[derive(Debug, Clone, Default)]
pub struct UserTokens {
    /// Bucket width, simulated seconds.
    pub bucket_s: f64,
    /// Per user (slot), output tokens completed in each bucket.
    pub users: Vec<Vec<u64>>,
}

/// Client-side TTFT of every answered turn in simulated ms: `sample.issued` to
/// `sample.recv_first` of the same sample, wall-clock ns divided by `time_scale`.
pub(super) fn client_ttfts_ms(events: &Path, time_scale: f64) -> anyhow::Result<Vec<f64>> {
    #[derive(serde::Deserialize)]
    struct Line<'a> {
        event_type: &'a str,
        timestamp_ns: u64,
        sample_uuid: &'a str,
    }
    let file =
        std::fs::File::open(events).with_context(|| format!("cannot open {}", events.display()))?;
    let mut issued: HashMap<String, u64> = HashMap::new();
    let mut ttfts = Vec::new();
    for (i, line) in std::io::BufReader::new(file).lines().enumerate() {
        let line = line.with_context(|| format!("cannot read {}", events.display()))?;
        let rec: Line<'_> = serde_json::from_str(&line)
            .with_context(|| format!("{} line {}: not an event", events.display(), i + 1))?;
        match rec.event_type {
            "sample.issued" => {
                issued.insert(rec.sample_uuid.to_string(), rec.timestamp_ns);
            }
            "sample.recv_first" => {
                if let Some(at) = issued.remove(rec.sample_uuid) {
                    ttfts.push(rec.timestamp_ns.saturating_sub(at) as f64 / 1e6 / time_scale);
                }
            }
            _ => {}
        }
    }
    Ok(ttfts)
}

/// `metrics.per_user` of a `result_summary.json`, its bucket width in simulated seconds.
pub(super) fn user_tokens(summary: &Path, time_scale: f64) -> anyhow::Result<UserTokens> {
    let text = std::fs::read_to_string(summary)
        .with_context(|| format!("cannot read {}", summary.display()))?;
    let doc: serde_json::Value =
        serde_json::from_str(&text).with_context(|| format!("{}: not JSON", summary.display()))?;
    let per_user = &doc["metrics"]["per_user"];
    let bucket_s = per_user["tokens_bucket_s"]
        .as_f64()
        .with_context(|| format!("{}: no metrics.per_user.tokens_bucket_s", summary.display()))?;
    let users = per_user["users"]
        .as_array()
        .with_context(|| format!("{}: no metrics.per_user.users", summary.display()))?
        .iter()
        .map(|u| {
            u["output_tokens_over_time"]
                .as_array()
                .map(|b| b.iter().filter_map(serde_json::Value::as_u64).collect())
                .unwrap_or_default()
        })
        .collect();
    Ok(UserTokens {
        bucket_s: bucket_s / time_scale,
        users,
    })
}

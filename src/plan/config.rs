//! `agentrace plan` settings: the flags, the choices they expand to, and validation whose
//! messages name the flag.

use std::path::PathBuf;

use serde::{Deserialize, Serialize};

use crate::proxy::Policy;
use crate::replay::slo::Slo;

/// Flags of `agentrace plan`.
#[derive(Debug, Clone, clap::Args)]
pub struct PlanArgs {
    /// Capture directories of recorded traffic (exported in-process to a dataset).
    #[arg(long, num_args = 1.., conflicts_with = "dataset")]
    pub captures: Vec<PathBuf>,
    /// MLPerf agentic dataset (JSONL) instead of captures.
    #[arg(long)]
    pub dataset: Option<PathBuf>,
    /// Simulator profile: a built-in name or a file written by `agentrace sim calibrate`.
    #[arg(long, default_value = crate::sim::DEFAULT_PROFILE)]
    pub profile: String,
    /// Replica counts to try: a range `1..8` or a list `1,2,4`.
    #[arg(long, default_value = "1..4")]
    pub replicas: String,
    /// Placement policies to try (the proxy's names): session, round_robin, least_loaded;
    /// `affinity` is accepted for session.
    #[arg(long, default_value = "session,round_robin")]
    pub policies: String,
    /// KV capacities per replica to try, in blocks (comma-separated) [default: the profile's].
    #[arg(long)]
    pub kv_blocks: Option<String>,
    /// Real seconds per simulated second of every run.
    #[arg(long, default_value_t = 0.05)]
    pub time_scale: f64,
    /// Service level: `ttft_p90=2s,interactivity=30`.
    #[arg(long, default_value = "ttft_p90=2s,interactivity=20")]
    pub slo: String,
    /// Fixed concurrency, turns back to back (no recorded delays) instead of one user per
    /// recorded conversation at its recorded think and tool times.
    #[arg(long)]
    pub closed_loop: bool,
    /// Users of `--closed-loop`.
    #[arg(long, default_value_t = 8)]
    pub concurrency: usize,
    /// Output directory (reused: finished combinations with unchanged inputs are skipped).
    #[arg(long, default_value = "plan")]
    pub out: PathBuf,
    /// No progress bar.
    #[arg(long)]
    pub no_progress: bool,
}

/// The settings after parsing and validation.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PlanConfig {
    /// Replica counts.
    pub replicas: Vec<usize>,
    /// Policies.
    pub policies: Vec<Policy>,
    /// KV capacities in blocks (`None`: the profile's).
    pub kv_blocks: Vec<Option<usize>>,
    /// Real seconds per simulated second.
    pub time_scale: f64,
    /// The SLO as given.
    pub slo: String,
    /// Closed loop at `concurrency`, else paced at recorded timing.
    pub closed_loop: bool,
    /// Users of the closed loop.
    pub concurrency: usize,
}

/// A setting that cannot run.
#[derive(Debug, thiserror::Error)]
pub enum PlanConfigError {
    /// A flag's value is wrong.
    #[error("{flag}: {reason}, got {value:?}")]
    Invalid {
        /// The flag.
        flag: &'static str,
        /// What is required.
        reason: &'static str,
        /// The value.
        value: String,
    },
    /// The SLO does not parse.
    #[error("--slo: {0}")]
    Slo(#[from] crate::replay::slo::SloError),
}

fn invalid(flag: &'static str, reason: &'static str, value: &str) -> PlanConfigError {
    PlanConfigError::Invalid {
        flag,
        reason,
        value: value.to_string(),
    }
}

/// `1..8` (inclusive) or `1,2,4`.
pub(crate) fn parse_counts(s: &str) -> Result<Vec<usize>, PlanConfigError> {
    let bad = || {
        invalid(
            "--replicas",
            "must be a range a..b or a list of counts >= 1",
            s,
        )
    };
    let v: Vec<usize> = match s.split_once("..") {
        Some((a, b)) => {
            let (a, b) = (
                a.trim().parse::<usize>(),
                b.trim_start_matches('=').trim().parse(),
            );
            let (a, b) = (a.map_err(|_| bad())?, b.map_err(|_| bad())?);
            (a..=b).collect()
        }
        None => s
            .split(',')
            .map(|x| x.trim().parse::<usize>().map_err(|_| bad()))
            .collect::<Result<_, _>>()?,
    };
    if v.is_empty() || v.contains(&0) {
        return Err(bad());
    }
    Ok(v)
}

/// The proxy's policy names; `affinity` and `round-robin` spellings too.
pub(crate) fn parse_policies(s: &str) -> Result<Vec<Policy>, PlanConfigError> {
    s.split(',')
        .map(|p| match p.trim().replace('-', "_").as_str() {
            "session" | "affinity" => Ok(Policy::Session),
            "round_robin" => Ok(Policy::RoundRobin),
            "least_loaded" => Ok(Policy::LeastLoaded),
            _ => Err(invalid(
                "--policies",
                "each must be session (affinity), round_robin or least_loaded",
                p,
            )),
        })
        .collect()
}

/// The name a policy goes by in the outputs.
pub(crate) fn policy_name(p: Policy) -> &'static str {
    match p {
        Policy::Session => "affinity",
        Policy::RoundRobin => "round_robin",
        Policy::LeastLoaded => "least_loaded",
    }
}

impl PlanConfig {
    /// Parses the flags' lists.
    pub fn from_args(a: &PlanArgs) -> Result<PlanConfig, PlanConfigError> {
        let kv_blocks = match &a.kv_blocks {
            None => vec![None],
            Some(s) => s
                .split(',')
                .map(|x| {
                    x.trim()
                        .parse::<usize>()
                        .ok()
                        .filter(|n| *n > 0)
                        .map(Some)
                        .ok_or_else(|| invalid("--kv-blocks", "must be block counts >= 1", s))
                })
                .collect::<Result<_, _>>()?,
        };
        let cfg = PlanConfig {
            replicas: parse_counts(&a.replicas)?,
            policies: parse_policies(&a.policies)?,
            kv_blocks,
            time_scale: a.time_scale,
            slo: a.slo.clone(),
            closed_loop: a.closed_loop,
            concurrency: a.concurrency,
        };
        cfg.validate()?;
        Ok(cfg)
    }

    /// Checks every setting; the message names the flag.
    pub fn validate(&self) -> Result<(), PlanConfigError> {
        if self.replicas.iter().any(|r| *r == 0 || *r > 64) {
            return Err(invalid(
                "--replicas",
                "each must be in 1..=64",
                &format!("{:?}", self.replicas),
            ));
        }
        if !(self.time_scale.is_finite() && self.time_scale > 0.0 && self.time_scale <= 10.0) {
            return Err(invalid(
                "--time-scale",
                "must be in (0, 10]",
                &self.time_scale.to_string(),
            ));
        }
        if self.closed_loop && self.concurrency == 0 {
            return Err(invalid("--concurrency", "must be >= 1", "0"));
        }
        Slo::parse(&self.slo)?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn replica_ranges_and_lists_parse_and_zero_is_refused() {
        assert_eq!(parse_counts("1..4").unwrap(), vec![1, 2, 3, 4]);
        assert_eq!(parse_counts("1,2, 8").unwrap(), vec![1, 2, 8]);
        assert!(parse_counts("0..2")
            .unwrap_err()
            .to_string()
            .starts_with("--replicas:"));
        assert!(parse_counts("x").is_err());
    }

    #[test]
    fn policies_take_the_proxy_names_and_name_the_flag_when_wrong() {
        assert_eq!(
            parse_policies("affinity,round-robin,least_loaded").unwrap(),
            vec![Policy::Session, Policy::RoundRobin, Policy::LeastLoaded]
        );
        let e = parse_policies("random").unwrap_err().to_string();
        assert!(e.starts_with("--policies:"), "{e}");
    }
}

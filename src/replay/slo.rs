//! A service-level objective tier, e.g. `ttft_p90=2s,interactivity=30`: parsed and validated
//! once, then asked of each turn and of each agent (a trajectory's turns together). Goodput is
//! the share of agents, and of turns, that meet every term.
//!
//! Kept free of the replayer's records so that capacity planning can ask the same question of
//! predicted turns.

use std::fmt;

/// Why an SLO spec cannot be used; each message quotes the term at fault.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SloError {
    /// Nothing to check.
    #[error("the SLO is empty: give terms like ttft_p90=2s,interactivity=30")]
    Empty,
    /// A term without `=`.
    #[error("SLO term {term:?} is not NAME=VALUE")]
    NotAssignment {
        /// The term as given.
        term: String,
    },
    /// A metric name this module does not know.
    #[error(
        "SLO term {term:?}: unknown metric {name:?} (known: ttft_pNN, tpot_pNN, latency_pNN \
         with NN in 1..=99.9, and interactivity)"
    )]
    UnknownMetric {
        /// The term as given.
        term: String,
        /// The name before `=`.
        name: String,
    },
    /// A value that is not a positive finite number with the unit the metric needs.
    #[error("SLO term {term:?}: {message}")]
    BadValue {
        /// The term as given.
        term: String,
        /// What is wrong with it.
        message: String,
    },
    /// The same metric named twice.
    #[error("SLO term {term:?}: {name} is already set by an earlier term")]
    Repeated {
        /// The term as given.
        term: String,
        /// The metric's name.
        name: String,
    },
}

/// The turn figure a term bounds.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum SloMetric {
    /// Time to first token, at a percentile of the agent's turns; at most the bound.
    Ttft(f64),
    /// Time per output token after the first, at a percentile; at most the bound.
    Tpot(f64),
    /// Turn latency (request sent → last byte), at a percentile; at most the bound.
    Latency(f64),
    /// Output tokens per second of turn time (tool time excluded); at least the bound.
    Interactivity,
}

impl SloMetric {
    fn key(&self) -> String {
        let p = |name: &str, p: f64| format!("{name}_p{}", fmt_number(p));
        match *self {
            SloMetric::Ttft(q) => p("ttft", q),
            SloMetric::Tpot(q) => p("tpot", q),
            SloMetric::Latency(q) => p("latency", q),
            SloMetric::Interactivity => "interactivity".into(),
        }
    }

    fn same_kind(&self, other: &SloMetric) -> bool {
        std::mem::discriminant(self) == std::mem::discriminant(other)
    }
}

/// One bound: `metric <= bound` for times (seconds), `metric >= bound` for interactivity
/// (tokens per second).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SloTerm {
    /// What is bounded.
    pub metric: SloMetric,
    /// Seconds for the times, tokens per second for interactivity.
    pub bound: f64,
}

/// A tier: every term must hold.
#[derive(Debug, Clone, PartialEq)]
pub struct Slo {
    terms: Vec<SloTerm>,
}

/// What the SLO needs to know of one successful turn.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct TurnSample {
    /// Seconds from send to the first non-empty fragment; `None` if none came.
    pub ttft_s: Option<f64>,
    /// Seconds per output token after the first; `None` with fewer than two tokens.
    pub tpot_s: Option<f64>,
    /// Seconds from send to the last byte.
    pub latency_s: f64,
    /// Output tokens.
    pub output_tokens: u64,
}

impl Slo {
    /// Parses `NAME=VALUE[,NAME=VALUE…]`. Times take a unit (`ms`, `s`, `us`), interactivity
    /// is tokens per second per user.
    pub fn parse(spec: &str) -> Result<Slo, SloError> {
        let mut terms: Vec<SloTerm> = Vec::new();
        for raw in spec.split(',').map(str::trim).filter(|t| !t.is_empty()) {
            let term = || raw.to_string();
            let (name, value) = raw
                .split_once('=')
                .ok_or_else(|| SloError::NotAssignment { term: term() })?;
            let (name, value) = (name.trim(), value.trim());
            let metric = parse_metric(name).ok_or_else(|| SloError::UnknownMetric {
                term: term(),
                name: name.to_string(),
            })?;
            let bound = match metric {
                SloMetric::Interactivity => parse_rate(value),
                _ => parse_seconds(value),
            }
            .map_err(|message| SloError::BadValue {
                term: term(),
                message,
            })?;
            if let Some(prev) = terms.iter().find(|t| t.metric.same_kind(&metric)) {
                return Err(SloError::Repeated {
                    term: term(),
                    name: prev.metric.key(),
                });
            }
            terms.push(SloTerm { metric, bound });
        }
        if terms.is_empty() {
            return Err(SloError::Empty);
        }
        Ok(Slo { terms })
    }

    /// The terms, in the order given.
    pub fn terms(&self) -> &[SloTerm] {
        &self.terms
    }

    /// Whether one turn meets every term: percentiles of a single turn are its own value.
    /// A turn without a first token or a TPOT fails a term on that figure.
    pub fn turn_meets(&self, t: &TurnSample) -> bool {
        self.terms.iter().all(|term| match term.metric {
            SloMetric::Ttft(_) => t.ttft_s.is_some_and(|v| v <= term.bound),
            SloMetric::Tpot(_) => t.tpot_s.is_some_and(|v| v <= term.bound),
            SloMetric::Latency(_) => t.latency_s <= term.bound,
            SloMetric::Interactivity => {
                t.latency_s > 0.0 && t.output_tokens as f64 / t.latency_s >= term.bound
            }
        })
    }

    /// Whether an agent (the successful turns of one trajectory) meets every term: the
    /// percentile terms over its turns by the lower method (the element at
    /// `floor(p/100 · (n − 1))`, as MLPerf's client), interactivity as Σ output tokens /
    /// Σ turn time. An agent with no turns meets nothing.
    pub fn agent_meets(&self, turns: &[TurnSample]) -> bool {
        if turns.is_empty() {
            return false;
        }
        self.terms.iter().all(|term| match term.metric {
            SloMetric::Ttft(p) => at_most(turns.iter().map(|t| t.ttft_s), p, term.bound),
            SloMetric::Tpot(p) => at_most(turns.iter().map(|t| t.tpot_s), p, term.bound),
            SloMetric::Latency(p) => {
                at_most(turns.iter().map(|t| Some(t.latency_s)), p, term.bound)
            }
            SloMetric::Interactivity => {
                let tokens: u64 = turns.iter().map(|t| t.output_tokens).sum();
                let secs: f64 = turns.iter().map(|t| t.latency_s).sum();
                secs > 0.0 && tokens as f64 / secs >= term.bound
            }
        })
    }
}

impl fmt::Display for Slo {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, t) in self.terms.iter().enumerate() {
            if i > 0 {
                f.write_str(",")?;
            }
            match t.metric {
                SloMetric::Interactivity => {
                    write!(f, "{}={}", t.metric.key(), fmt_number(t.bound))?
                }
                _ => write!(f, "{}={}ms", t.metric.key(), fmt_number(t.bound * 1e3))?,
            }
        }
        Ok(())
    }
}

impl std::str::FromStr for Slo {
    type Err = SloError;
    fn from_str(s: &str) -> Result<Slo, SloError> {
        Slo::parse(s)
    }
}

impl serde::Serialize for Slo {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

impl<'de> serde::Deserialize<'de> for Slo {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Slo, D::Error> {
        let s = String::deserialize(d)?;
        Slo::parse(&s).map_err(serde::de::Error::custom)
    }
}

/// Lower-method percentile `p` of the values ≤ `bound`; a missing value counts as failing
/// (infinitely late), so a turn that never sent a token cannot help its agent pass.
fn at_most(values: impl Iterator<Item = Option<f64>>, p: f64, bound: f64) -> bool {
    let mut v: Vec<f64> = values.map(|v| v.unwrap_or(f64::INFINITY)).collect();
    if v.is_empty() {
        return false;
    }
    v.sort_by(|a, b| a.total_cmp(b));
    let idx = ((p / 100.0) * (v.len() - 1) as f64).floor() as usize;
    v[idx.min(v.len() - 1)] <= bound
}

fn parse_metric(name: &str) -> Option<SloMetric> {
    if name == "interactivity" {
        return Some(SloMetric::Interactivity);
    }
    let (kind, p) = name.split_once("_p")?;
    let p: f64 = p.parse().ok()?;
    if !(p > 0.0 && p < 100.0) {
        return None;
    }
    match kind {
        "ttft" => Some(SloMetric::Ttft(p)),
        "tpot" => Some(SloMetric::Tpot(p)),
        "latency" => Some(SloMetric::Latency(p)),
        _ => None,
    }
}

fn parse_seconds(value: &str) -> Result<f64, String> {
    let split = value
        .find(|c: char| c.is_ascii_alphabetic())
        .ok_or_else(|| format!("{value:?} needs a unit: ms, s or us (e.g. 2s, 250ms)"))?;
    let (number, unit) = value.split_at(split);
    let scale = match unit {
        "s" => 1.0,
        "ms" => 1e-3,
        "us" => 1e-6,
        _ => return Err(format!("unknown unit {unit:?}: use ms, s or us")),
    };
    positive(number).map(|n| n * scale)
}

fn parse_rate(value: &str) -> Result<f64, String> {
    let number = value.strip_suffix("tok/s").unwrap_or(value).trim();
    positive(number)
}

fn positive(number: &str) -> Result<f64, String> {
    let n: f64 = number
        .trim()
        .parse()
        .map_err(|_| format!("{number:?} is not a number"))?;
    if n.is_finite() && n > 0.0 {
        Ok(n)
    } else {
        Err(format!("{number:?} must be a positive finite number"))
    }
}

/// `90` not `90.0`; `99.9` as is.
fn fmt_number(v: f64) -> String {
    if v.fract() == 0.0 {
        format!("{v:.0}")
    } else {
        format!("{v}")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn turn(ttft_s: f64, latency_s: f64, output_tokens: u64) -> TurnSample {
        TurnSample {
            ttft_s: Some(ttft_s),
            tpot_s: None,
            latency_s,
            output_tokens,
        }
    }

    #[test]
    fn spec_round_trips_with_units_normalised() {
        let slo = Slo::parse("ttft_p90=2s, interactivity=30,latency_p99.9=1500ms").unwrap();
        assert_eq!(
            slo.terms(),
            &[
                SloTerm {
                    metric: SloMetric::Ttft(90.0),
                    bound: 2.0
                },
                SloTerm {
                    metric: SloMetric::Interactivity,
                    bound: 30.0
                },
                SloTerm {
                    metric: SloMetric::Latency(99.9),
                    bound: 1.5
                },
            ]
        );
        assert_eq!(
            slo.to_string(),
            "ttft_p90=2000ms,interactivity=30,latency_p99.9=1500ms"
        );
        assert_eq!(Slo::parse(&slo.to_string()).unwrap(), slo);
    }

    #[test]
    fn each_bad_term_is_refused_with_the_term_named() {
        let cases = [
            ("", "empty"),
            ("ttft_p90", "\"ttft_p90\" is not NAME=VALUE"),
            ("ttfb_p90=2s", "unknown metric \"ttfb_p90\""),
            ("ttft_p100=2s", "unknown metric \"ttft_p100\""),
            ("ttft_p90=2", "\"2\" needs a unit"),
            ("ttft_p90=2h", "unknown unit \"h\""),
            ("interactivity=-3", "\"-3\" must be a positive"),
            ("interactivity=fast", "\"fast\" is not a number"),
            (
                "ttft_p90=1s,ttft_p99=3s",
                "ttft_p99=3s\": ttft_p90 is already set",
            ),
        ];
        for (spec, want) in cases {
            let err = Slo::parse(spec).expect_err(spec).to_string();
            assert!(err.contains(want), "{spec:?}: {err}");
        }
    }

    #[test]
    fn a_turn_meets_the_tier_only_if_every_term_holds() {
        let slo = Slo::parse("ttft_p90=2s,interactivity=30").unwrap();
        // 300 tokens in 5 s = 60 tok/s, TTFT 1 s: meets both.
        assert!(slo.turn_meets(&turn(1.0, 5.0, 300)));
        // 100 tokens in 5 s = 20 tok/s < 30: fails interactivity.
        assert!(!slo.turn_meets(&turn(1.0, 5.0, 100)));
        // TTFT 2.5 s > 2 s: fails.
        assert!(!slo.turn_meets(&turn(2.5, 5.0, 300)));
        // No first token at all: fails the TTFT term.
        let none = TurnSample {
            ttft_s: None,
            ..turn(0.0, 5.0, 300)
        };
        assert!(!slo.turn_meets(&none));
    }

    #[test]
    fn an_agent_is_judged_on_its_percentile_and_pooled_rate() {
        let slo = Slo::parse("ttft_p50=1s,interactivity=30").unwrap();
        // TTFTs sorted 0.5, 0.8, 3.0: lower p50 = index floor(0.5·2) = 1 → 0.8 s ≤ 1 s.
        // Tokens 100 + 100 + 400 = 600 over 4 + 4 + 4 = 12 s → 50 tok/s ≥ 30, though two
        // of the three turns alone (25 tok/s) would fail.
        let agent = [
            turn(0.5, 4.0, 100),
            turn(3.0, 4.0, 400),
            turn(0.8, 4.0, 100),
        ];
        assert!(slo.agent_meets(&agent));
        assert!(!slo.turn_meets(&agent[0]));
        // Same rate, TTFTs 0.5, 1.5, 3.0: p50 = 1.5 s > 1 s.
        let slow = [
            turn(0.5, 4.0, 100),
            turn(3.0, 4.0, 400),
            turn(1.5, 4.0, 100),
        ];
        assert!(!slo.agent_meets(&slow));
        assert!(!slo.agent_meets(&[]));
    }

    #[test]
    fn slo_deserialises_from_a_string_and_refuses_a_bad_one_by_term() {
        #[derive(serde::Deserialize)]
        struct C {
            slo: Slo,
        }
        let c: C = toml::from_str("slo = \"tpot_p90=50ms\"").unwrap();
        assert_eq!(c.slo.terms()[0].bound, 0.05);
        let err = toml::from_str::<C>("slo = \"tpot_p90=50\"")
            .err()
            .unwrap()
            .to_string();
        assert!(err.contains("tpot_p90=50"), "{err}");
    }
}

//! Dataset statistics: conversations and client turns per domain, delays, prompt sizes in
//! bytes and estimated tokens, replay volume and shared-prefix ratio.
//!
//! Tokens are estimated as prompt bytes / 4 ([`BYTES_PER_TOKEN`]); percentiles use the lower
//! nearest-rank method (`sorted[floor(p·(n−1))]`).

use std::collections::HashMap;
use std::fmt::Write as _;
use std::hash::{Hash, Hasher};

use serde::Serialize;

use super::synth::BYTES_PER_TOKEN;
use super::{ClientTurn, Conversation, Dataset, Domain, ModelParams, RequestBuilder};

/// Statistics of one dataset, per domain and overall.
#[derive(Debug, Clone, Serialize)]
pub struct DatasetStats {
    /// The file's SHA-256.
    pub sha256: String,
    /// Coding conversations (every id that is not `sim_NNN`).
    pub coding: DomainStats,
    /// Workflow conversations (`sim_NNN`).
    pub workflow: DomainStats,
    /// Both together.
    pub all: DomainStats,
}

/// Statistics of one domain.
#[derive(Debug, Clone, Default, Serialize)]
pub struct DomainStats {
    /// Conversations (trajectories).
    pub conversations: usize,
    /// Client turns: requests in one pass.
    pub client_turns: usize,
    /// Rows (turns `1..N`) per conversation.
    pub turns_per_conversation: Summary,
    /// Client turns per conversation.
    pub client_turns_per_conversation: Summary,
    /// Client turns that carry a delay (> 0).
    pub delayed_turns: usize,
    /// Delays of those turns, seconds.
    pub delay_seconds: Summary,
    /// Sum of all delays of one pass, seconds.
    pub delay_seconds_total: f64,
    /// Prompt bytes per client turn: the messages' wire JSON plus `tools`.
    pub prompt_bytes: Summary,
    /// Estimated prompt tokens per client turn (bytes / 4).
    pub prompt_tokens_est: Summary,
    /// Estimated tokens of each conversation's last (largest) prompt.
    pub final_context_tokens_est: Summary,
    /// Conversations whose last prompt reaches 100 K estimated tokens.
    pub conversations_over_100k_tokens: usize,
    /// Bytes of every request body of one pass (default model parameters, unsalted).
    pub replay_request_bytes: u64,
    /// Share of prompt bytes, over all client turns, that is a prefix shared with another
    /// conversation (identical leading messages, and identical tools).
    pub shared_prefix_ratio: f64,
}

/// Distribution summary.
#[derive(Debug, Clone, Default, Serialize)]
pub struct Summary {
    /// Smallest value.
    pub min: f64,
    /// Median (lower).
    pub median: f64,
    /// Mean.
    pub mean: f64,
    /// 90th percentile (lower).
    pub p90: f64,
    /// 99th percentile (lower).
    pub p99: f64,
    /// Largest value.
    pub max: f64,
}

impl Summary {
    fn of(mut values: Vec<f64>) -> Summary {
        if values.is_empty() {
            return Summary::default();
        }
        values.sort_by(f64::total_cmp);
        let at = |p: f64| values[(p * (values.len() - 1) as f64).floor() as usize];
        Summary {
            min: values[0],
            median: at(0.5),
            mean: values.iter().sum::<f64>() / values.len() as f64,
            p90: at(0.9),
            p99: at(0.99),
            max: values[values.len() - 1],
        }
    }
}

impl DatasetStats {
    /// Computes every statistic in one pass over the loaded dataset (no body is built).
    pub fn compute(ds: &Dataset) -> DatasetStats {
        let shared = SharedPrefixes::new(&ds.conversations);
        let builder = RequestBuilder::new(ModelParams::default(), false);
        let mut parts: HashMap<Domain, Vec<&Conversation>> = HashMap::new();
        for c in &ds.conversations {
            parts.entry(c.domain()).or_default().push(c);
        }
        let all: Vec<&Conversation> = ds.conversations.iter().map(|c| &**c).collect();
        let domain = |d: Domain| {
            DomainStats::compute(
                parts.get(&d).map(Vec::as_slice).unwrap_or(&[]),
                &shared,
                &builder,
            )
        };
        DatasetStats {
            sha256: ds.sha256.clone(),
            coding: domain(Domain::Coding),
            workflow: domain(Domain::Workflow),
            all: DomainStats::compute(&all, &shared, &builder),
        }
    }

    /// A plain-text table, one row per statistic, one column per domain.
    pub fn table(&self) -> String {
        let cols = [&self.coding, &self.workflow, &self.all];
        let mut out = String::new();
        let _ = writeln!(out, "sha256 {}", self.sha256);
        let _ = writeln!(
            out,
            "{:<40} {:>22} {:>22} {:>22}",
            "", "coding", "workflow", "all"
        );
        let mut row = |name: &str, f: &dyn Fn(&DomainStats) -> String| {
            let _ = writeln!(
                out,
                "{:<40} {:>22} {:>22} {:>22}",
                name,
                f(cols[0]),
                f(cols[1]),
                f(cols[2])
            );
        };
        let mmm = |s: &Summary| format!("{}/{}/{}", s.min, s.median, s.max);
        let k = |x: f64| format!("{:.1}K", x / 1000.0);
        row("conversations", &|d| d.conversations.to_string());
        row("client turns", &|d| d.client_turns.to_string());
        row("turns/conversation min/med/max", &|d| {
            mmm(&d.turns_per_conversation)
        });
        row("client turns/conv min/med/max", &|d| {
            mmm(&d.client_turns_per_conversation)
        });
        row("client turns/conv mean/p90", &|d| {
            let s = &d.client_turns_per_conversation;
            format!("{:.1}/{}", s.mean, s.p90)
        });
        row("delayed turns", &|d| d.delayed_turns.to_string());
        row("delay s min/median/p90", &|d| {
            let s = &d.delay_seconds;
            format!("{:.3}/{:.3}/{:.3}", s.min, s.median, s.p90)
        });
        row("delay s p99/max", &|d| {
            let s = &d.delay_seconds;
            format!("{:.2}/{:.1}", s.p99, s.max)
        });
        row("delay s total (one pass)", &|d| {
            format!("{:.0}", d.delay_seconds_total)
        });
        row("prompt bytes/turn median/p90", &|d| {
            format!("{}/{}", k(d.prompt_bytes.median), k(d.prompt_bytes.p90))
        });
        row("prompt bytes/turn mean/max", &|d| {
            format!("{}/{}", k(d.prompt_bytes.mean), k(d.prompt_bytes.max))
        });
        row("est. tokens/turn median/p90/max", &|d| {
            let s = &d.prompt_tokens_est;
            format!("{}/{}/{}", k(s.median), k(s.p90), k(s.max))
        });
        row("final context est. tokens med/p90/max", &|d| {
            let s = &d.final_context_tokens_est;
            format!("{}/{}/{}", k(s.median), k(s.p90), k(s.max))
        });
        row("conversations >= 100K est. tokens", &|d| {
            d.conversations_over_100k_tokens.to_string()
        });
        row("replay request bytes (one pass)", &|d| {
            format!("{:.1} MB", d.replay_request_bytes as f64 / 1e6)
        });
        row("shared-prefix ratio", &|d| {
            format!("{:.1}%", d.shared_prefix_ratio * 100.0)
        });
        out
    }
}

impl DomainStats {
    fn compute(
        convs: &[&Conversation],
        shared: &SharedPrefixes,
        builder: &RequestBuilder,
    ) -> DomainStats {
        let mut s = DomainStats {
            conversations: convs.len(),
            ..DomainStats::default()
        };
        let (mut turns, mut client, mut delays, mut prompts, mut finals) =
            (vec![], vec![], vec![], vec![], vec![]);
        let (mut shared_bytes, mut prompt_total) = (0u64, 0u64);
        for conv in convs {
            client.push(conv.client_turns.len() as f64);
            let last_row = conv
                .client_turns
                .iter()
                .map(|t| t.turn.max(t.expected.as_ref().map_or(0, |e| e.turn)))
                .max()
                .unwrap_or(0);
            turns.push(last_row as f64);
            // Prefix sums of wire bytes: a prompt's size without building it.
            let mut prefix = Vec::with_capacity(conv.messages.len() + 1);
            prefix.push(0u64);
            for m in &conv.messages {
                prefix.push(prefix.last().copied().unwrap_or(0) + m.wire.get().len() as u64);
            }
            let depth = shared.depth(conv);
            let mut largest = 0u64;
            for t in &conv.client_turns {
                s.client_turns += 1;
                if t.delay_seconds > 0.0 {
                    delays.push(t.delay_seconds);
                    s.delay_seconds_total += t.delay_seconds;
                }
                let n = t.history_len.min(conv.messages.len());
                let tools = tools_bytes(conv, t);
                let prompt = prefix[n] + tools;
                prompts.push(prompt as f64);
                largest = largest.max(prompt);
                prompt_total += prompt;
                shared_bytes +=
                    prefix[depth.min(n)] + if shared.tools(conv, t) { tools } else { 0 };
                s.replay_request_bytes += body_bytes(builder, conv, t, prefix[n]);
            }
            finals.push((largest / BYTES_PER_TOKEN as u64) as f64);
            if largest >= 100_000 * BYTES_PER_TOKEN as u64 {
                s.conversations_over_100k_tokens += 1;
            }
        }
        s.delayed_turns = delays.len();
        s.turns_per_conversation = Summary::of(turns);
        s.client_turns_per_conversation = Summary::of(client);
        s.delay_seconds = Summary::of(delays);
        s.prompt_tokens_est = Summary::of(
            prompts
                .iter()
                .map(|b| (*b as usize / BYTES_PER_TOKEN) as f64)
                .collect(),
        );
        s.prompt_bytes = Summary::of(prompts);
        s.final_context_tokens_est = Summary::of(finals);
        s.shared_prefix_ratio = if prompt_total == 0 {
            0.0
        } else {
            shared_bytes as f64 / prompt_total as f64
        };
        s
    }
}

fn tools_bytes(conv: &Conversation, t: &ClientTurn) -> u64 {
    conv.request_field(t, "tools").map_or(0, |v| {
        let mut counter = ByteCounter(0);
        let _ = serde_json::to_writer(&mut counter, v);
        counter.0
    })
}

/// The exact body size: everything but the messages (built once with no history) plus the
/// messages' bytes and the commas between them.
fn body_bytes(builder: &RequestBuilder, conv: &Conversation, t: &ClientTurn, wire: u64) -> u64 {
    let frame = ClientTurn {
        history_len: 0,
        ..t.clone()
    };
    let empty = builder.body(conv, &frame, None).len() as u64;
    let n = t.history_len.min(conv.messages.len()) as u64;
    empty + wire + n.saturating_sub(1)
}

struct ByteCounter(u64);

impl std::io::Write for ByteCounter {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0 += buf.len() as u64;
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// Which leading messages and which tool sets occur in more than one conversation.
struct SharedPrefixes {
    /// (depth, hash of the first `depth` messages) → conversations with that prefix.
    prefixes: HashMap<(usize, u64), usize>,
    /// Hash of a tools value → conversations using it.
    tools: HashMap<u64, usize>,
}

impl SharedPrefixes {
    fn new(convs: &[std::sync::Arc<Conversation>]) -> Self {
        let mut prefixes = HashMap::new();
        let mut tools = HashMap::new();
        for c in convs {
            let mut h = std::collections::hash_map::DefaultHasher::new();
            // Leading messages up to the first user message's reply are enough: deeper
            // messages are conversation-specific in any real set.
            for (depth, m) in c.messages.iter().take(8).enumerate() {
                m.wire.get().hash(&mut h);
                *prefixes.entry((depth + 1, h.finish())).or_insert(0) += 1;
            }
            let mut seen = std::collections::HashSet::new();
            for t in &c.client_turns {
                if let Some(key) = tools_hash(c, t) {
                    if seen.insert(key) {
                        *tools.entry(key).or_insert(0) += 1;
                    }
                }
            }
        }
        Self { prefixes, tools }
    }

    /// How many leading messages of `c` another conversation also starts with.
    fn depth(&self, c: &Conversation) -> usize {
        let mut h = std::collections::hash_map::DefaultHasher::new();
        let mut depth = 0;
        for (i, m) in c.messages.iter().take(8).enumerate() {
            m.wire.get().hash(&mut h);
            if self
                .prefixes
                .get(&(i + 1, h.finish()))
                .copied()
                .unwrap_or(0)
                < 2
            {
                break;
            }
            depth = i + 1;
        }
        depth
    }

    /// Whether this turn's tools are used by another conversation too.
    fn tools(&self, conv: &Conversation, t: &ClientTurn) -> bool {
        tools_hash(conv, t).is_some_and(|k| self.tools.get(&k).copied().unwrap_or(0) >= 2)
    }
}

fn tools_hash(conv: &Conversation, t: &ClientTurn) -> Option<u64> {
    let v = conv.request_field(t, "tools")?;
    let mut h = std::collections::hash_map::DefaultHasher::new();
    v.to_string().hash(&mut h);
    Some(h.finish())
}

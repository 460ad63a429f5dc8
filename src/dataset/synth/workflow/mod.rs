//! Workflow traces: customer-service conversations over one shared catalogue and tool set.

pub(super) mod catalogue;

use std::fmt::Write as _;

use serde_json::value::RawValue;

use crate::dataset::synth::rows::{call, round5, Row, ToolCall, ToolResult};
use crate::dataset::synth::workflow::catalogue::{
    intent_name, FIRST_NAMES, INTENTS, LAST_NAMES, WORKFLOW_NOUNS, WORKFLOW_TOOLS,
};
use crate::random::Rng;

/// The tools a request of intent `code` typically needs.
pub(super) fn tools_for(code: usize, rng: &mut Rng) -> Vec<usize> {
    let primary = match code {
        0 => 0,
        57 | 58 => 4,
        c => [1, 2, 3, 4, 7, 8, 9, 12][c % 8],
    };
    let mut tools = vec![primary];
    if code == 57 || code == 58 || rng.chance(0.4) {
        let second = match code {
            57 => 6,
            58 => 3,
            _ => *rng.pick(&[2, 3, 5, 6, 9, 10, 11, 12]),
        };
        if second != primary {
            tools.push(second);
        }
    }
    tools
}

pub(super) fn tool_arguments(rng: &mut Rng, tool: usize, ctx: &WorkflowCtx) -> String {
    let (_, _, params) = WORKFLOW_TOOLS[tool];
    let mut args = serde_json::Map::new();
    for (i, (name, ty)) in params.iter().enumerate() {
        if i > 0 && rng.chance(0.5) {
            continue;
        }
        let v = match (*name, *ty) {
            ("account_id", _) => ctx.account.clone().into(),
            ("email", _) => ctx.email.clone().into(),
            ("order_id", _) => ctx.order.clone().into(),
            ("shipment_id", _) => ctx.shipment.clone().into(),
            ("driver_id", _) => format!("DRV-{}", rng.int(1000, 9999)).into(),
            ("limit", _) => serde_json::Value::from(rng.int(5, 20)),
            ("amount", _) => serde_json::Value::from((rng.int(500, 25_000) as f64) / 100.0),
            ("window_start", _) => {
                format!("2026-08-{:02}T{:02}:00:00", rng.int(1, 28), rng.int(8, 14)).into()
            }
            ("window_end", _) => {
                format!("2026-08-{:02}T{:02}:00:00", rng.int(1, 28), rng.int(15, 19)).into()
            }
            ("address", _) => format!(
                "{} {} Street, {}",
                rng.int(1, 200),
                rng.pick(LAST_NAMES),
                rng.pick(&["Lyon", "Leeds", "Porto", "Graz"])
            )
            .into(),
            ("priority", _) => (*rng.pick(&["normal", "high"])).into(),
            ("channel", _) => (*rng.pick(&["sms", "email"])).into(),
            (_, _) => ctx.topic.clone().into(),
        };
        args.insert((*name).to_string(), v);
    }
    serde_json::Value::Object(args).to_string()
}

pub(super) fn tool_result(rng: &mut Rng, tool: usize, ctx: &WorkflowCtx) -> String {
    let (name, _, _) = WORKFLOW_TOOLS[tool];
    let mut v = serde_json::json!({"ok": true, "tool": name, "order_id": ctx.order});
    let obj = v.as_object_mut().expect("an object");
    let statuses = [
        "booked",
        "in_transit",
        "out_for_delivery",
        "delivered",
        "exception",
        "picked_up",
    ];
    match name {
        "get_customer_profile" => {
            obj.insert("account_id".into(), ctx.account.clone().into());
            obj.insert("name".into(), ctx.name.clone().into());
            obj.insert(
                "tier".into(),
                (*rng.pick(&["standard", "business", "premium"])).into(),
            );
            obj.insert("open_orders".into(), rng.int(0, 6).into());
        }
        "get_tracking_events" => {
            let events: Vec<serde_json::Value> = (0..rng.int(2, 9))
                .map(|i| {
                    serde_json::json!({"time": format!("2026-08-{:02}T{:02}:{:02}:00Z", 10 + i, rng.int(6, 21), rng.int(0, 59)),
                        "location": rng.pick(&["Lyon hub", "Leeds depot", "Porto sort center", "Graz van 14"]),
                        "status": rng.pick(&statuses)})
                })
                .collect();
            obj.insert("events".into(), events.into());
        }
        _ => {
            obj.insert("status".into(), (*rng.pick(&statuses)).into());
            obj.insert(
                "updated_at".into(),
                format!(
                    "2026-08-{:02}T{:02}:{:02}:00Z",
                    rng.int(1, 28),
                    rng.int(6, 21),
                    rng.int(0, 59)
                )
                .into(),
            );
            if rng.chance(0.5) {
                obj.insert(
                    "note".into(),
                    format!(
                        "{} reported at {}",
                        rng.pick(WORKFLOW_NOUNS),
                        rng.pick(&["pickup", "the hub", "delivery", "billing"])
                    )
                    .into(),
                );
            }
            if rng.chance(0.3) {
                obj.insert(
                    "amount_eur".into(),
                    ((rng.int(500, 30_000) as f64) / 100.0).into(),
                );
            }
        }
    }
    v.to_string()
}

pub(super) struct WorkflowCtx {
    pub(super) name: String,
    pub(super) account: String,
    pub(super) email: String,
    pub(super) order: String,
    pub(super) shipment: String,
    pub(super) topic: String,
}

/// Think time before a user turn: log-normal, median 6 s, capped at 90 s (an assumption:
/// no public workflow trace gives it).
pub(super) fn think_time(rng: &mut Rng) -> f64 {
    round5(rng.lognormal(6.0, 0.8).clamp(0.5, 90.0))
}

/// Tool latency before a tool turn: log-normal, median 0.25 s.
pub(super) fn tool_latency(rng: &mut Rng) -> f64 {
    round5(rng.lognormal(0.25, 0.7).clamp(0.02, 10.0))
}

pub(super) fn workflow_conversation(
    rng: &mut Rng,
    id: &str,
    system: &str,
    tools: &RawValue,
    mut emit: impl FnMut(&Row<'_>) -> std::io::Result<()>,
) -> std::io::Result<()> {
    let first = rng.pick(FIRST_NAMES);
    let last = rng.pick(LAST_NAMES);
    let ctx = WorkflowCtx {
        name: format!("{first} {last}"),
        account: format!("ACC-{}", rng.int(100_000, 999_999)),
        email: format!(
            "{}.{}@example.com",
            first.to_lowercase(),
            last.to_lowercase()
        ),
        order: format!("ORD-{}", rng.int(10_000_000, 99_999_999)),
        shipment: format!("SHP-{}", rng.hex(10).to_uppercase()),
        topic: rng.pick(WORKFLOW_NOUNS).to_string(),
    };
    // The requests of this conversation: most open with identification (I000), then 1–5
    // problems; I057 → I058 is a common follow-up pair.
    let mut intents = Vec::new();
    if rng.chance(0.75) {
        intents.push(0);
    }
    let problems = rng.int(1, 5);
    while intents.iter().filter(|c| **c != 0).count() < problems {
        let code = if rng.chance(0.12) {
            57
        } else {
            rng.int(1, INTENTS - 1)
        };
        if !intents.contains(&code) {
            intents.push(code);
            if code == 57 && rng.chance(0.6) && !intents.contains(&58) {
                intents.push(58);
            }
        }
    }

    let mut turn = 1;
    let mut cumulative: Vec<String> = Vec::new();
    let mut call_no = 0;
    for (k, &code) in intents.iter().enumerate() {
        let message = customer_message(rng, code, &ctx, k == 0);
        emit(&Row {
            conversation_id: id,
            turn,
            role: "user",
            content: Some(&message),
            system: (turn == 1).then_some(system),
            tools: (turn == 1).then_some(tools),
            delay_seconds: (turn > 1).then(|| think_time(rng)),
            ..Row::default()
        })?;
        turn += 1;
        // Tool rounds before the reply: 0–2, each with 1–2 calls.
        let planned = tools_for(code, rng);
        let rounds = if code == 0 && rng.chance(0.5) {
            0
        } else {
            planned.len().min(rng.int(1, 2))
        };
        for round in 0..rounds {
            let parallel = round + 1 == rounds && planned.len() > rounds && rng.chance(0.5);
            let picked: Vec<usize> = if parallel {
                planned[round..].to_vec()
            } else {
                vec![planned[round]]
            };
            let calls: Vec<ToolCall> = picked
                .iter()
                .map(|&t| {
                    call_no += 1;
                    call(
                        format!("call_{}", rng.hex(24)),
                        WORKFLOW_TOOLS[t].0,
                        tool_arguments(rng, t, &ctx),
                    )
                })
                .collect();
            let reasoning = rng.chance(0.6).then(|| {
                format!(
                    "The customer asks about {}; I need {} first.",
                    intent_name(code).to_lowercase(),
                    picked
                        .iter()
                        .map(|&t| WORKFLOW_TOOLS[t].0)
                        .collect::<Vec<_>>()
                        .join(" and ")
                )
            });
            emit(&Row {
                conversation_id: id,
                turn,
                role: "assistant",
                reasoning_content: reasoning.as_deref(),
                tool_calls: Some(&calls),
                ..Row::default()
            })?;
            turn += 1;
            let results: Vec<ToolResult> = calls
                .iter()
                .zip(&picked)
                .map(|(c, &t)| ToolResult {
                    tool_call_id: c.id.clone(),
                    content: tool_result(rng, t, &ctx),
                })
                .collect();
            emit(&Row {
                conversation_id: id,
                turn,
                role: "tool",
                tool_results: Some(&results),
                delay_seconds: Some(tool_latency(rng)),
                ..Row::default()
            })?;
            turn += 1;
        }
        cumulative.push(format!("I{code:03}"));
        let reply = agent_reply(rng, code, &ctx);
        let reasoning = rng.chance(0.5).then(|| {
            format!(
                "This matches the catalogue entry {} for the latest request.",
                intent_name(code)
            )
        });
        emit(&Row {
            conversation_id: id,
            turn,
            role: "assistant",
            content: Some(&reply),
            reasoning_content: reasoning.as_deref(),
            intent_codes: Some(&cumulative),
            ..Row::default()
        })?;
        turn += 1;
    }
    Ok(())
}

pub(super) fn customer_message(
    rng: &mut Rng,
    code: usize,
    ctx: &WorkflowCtx,
    first: bool,
) -> String {
    let mut s = String::new();
    if first {
        let _ = write!(
            s,
            "{} ",
            rng.pick(&["Hi,", "Hello,", "Good morning,", "Hey there,"])
        );
    }
    match code {
        0 => {
            let _ = write!(
                s,
                "this is {}, account {} ({}). I have a question about order {}.",
                ctx.name, ctx.account, ctx.email, ctx.order
            );
        }
        57 => {
            let _ = write!(
                s,
                "my pickup for order {} was booked for this morning between {} and {}, and nobody came. The parcel is still here.",
                ctx.order,
                rng.int(8, 10),
                rng.int(11, 13)
            );
        }
        58 => {
            s.push_str("Also, the tracking page now says the parcel was picked up, but it is sitting right here on my desk. How can it be picked up?");
        }
        c => {
            let _ = write!(
                s,
                "{} it's about {}: {} on order {}. {}",
                rng.pick(&[
                    "Another thing,",
                    "Next,",
                    "One more question:",
                    "Can you help,"
                ]),
                intent_name(c).to_lowercase(),
                rng.pick(WORKFLOW_NOUNS),
                ctx.order,
                rng.pick(&[
                    "What can you do about it?",
                    "This is the second time this happens.",
                    "I need this sorted today.",
                    "Please check and tell me what happened.",
                ])
            );
        }
    }
    s
}

pub(super) fn agent_reply(rng: &mut Rng, code: usize, ctx: &WorkflowCtx) -> String {
    let mut s = format!("intent: I{code:03}\n");
    let body = match code {
        0 => format!("Thank you, {}. I found your account {}. How can I help with order {}?", ctx.name, ctx.account, ctx.order),
        57 => format!(
            "I'm sorry the driver did not come. The pickup for {} was still open in our system; I have booked a new window tomorrow between {}:00 and {}:00 and you will get an SMS when the driver is on the way.",
            ctx.order,
            rng.int(8, 11),
            rng.int(12, 16)
        ),
        58 => format!(
            "You are right, the scan was recorded by mistake. I have opened ticket TCK-{} so the status of {} is corrected, and the new pickup stays booked.",
            rng.int(100_000, 999_999),
            ctx.shipment
        ),
        c => format!(
            "I checked {} for {}. {} I have noted this on your account{}.",
            ctx.order,
            intent_name(c).to_lowercase(),
            rng.pick(&[
                "The records show the issue on our side.",
                "The latest scan is consistent with what you describe.",
                "Our policy covers this case.",
                "The carrier confirmed the details.",
            ]),
            rng.pick(&["", " and sent you a confirmation e-mail", " and opened a ticket for the hub team"])
        ),
    };
    s.push_str(&body);
    s
}

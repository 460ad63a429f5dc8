//! The workflow catalogue: intents, tools, the shared system prompt and names.

use std::fmt::Write as _;

use crate::random::Rng;

/// Intent catalogue size: codes I000..I119.
pub(super) const INTENTS: usize = 120;

pub(super) const INTENT_AREAS: &[&str] = &[
    "Pickup",
    "Delivery",
    "Tracking",
    "Billing",
    "Returns",
    "Account",
    "Damage",
    "Customs",
    "Address",
    "Scheduling",
    "Driver",
    "Warehouse",
];

pub(super) const INTENT_ISSUES: &[&str] = &[
    "Delay",
    "Missed Window",
    "Wrong Status",
    "Charge Dispute",
    "Cancellation",
    "Change Request",
    "Lost Item",
    "Partial Shipment",
    "Proof Request",
    "Escalation",
];

/// The catalogue's names; I000, I057 and I058 carry the names the reference scorer's
/// comments give them.
pub(super) fn intent_name(code: usize) -> String {
    match code {
        0 => "Greeting and Identification".to_string(),
        57 => "Pickup Delay".to_string(),
        58 => "Marked Picked Up But Not Collected".to_string(),
        c => format!(
            "{} {}",
            INTENT_AREAS[c % INTENT_AREAS.len()],
            INTENT_ISSUES[(c / INTENT_AREAS.len()) % INTENT_ISSUES.len()]
        ),
    }
}

/// A function tool: name, description, `(parameter, JSON type)` pairs.
pub(super) type ToolSpec = (
    &'static str,
    &'static str,
    &'static [(&'static str, &'static str)],
);

pub(super) const WORKFLOW_TOOLS: &[ToolSpec] = &[
    (
        "get_customer_profile",
        "Look up a customer by account id or email.",
        &[("account_id", "string"), ("email", "string")],
    ),
    (
        "lookup_order",
        "Fetch an order with its items, addresses and payment state.",
        &[("order_id", "string")],
    ),
    (
        "get_shipment_status",
        "Current status and carrier of a shipment.",
        &[("shipment_id", "string")],
    ),
    (
        "get_tracking_events",
        "Scan events of a shipment, newest first.",
        &[("shipment_id", "string"), ("limit", "integer")],
    ),
    (
        "get_pickup_booking",
        "The pickup booking of an order: window, driver, state.",
        &[("order_id", "string")],
    ),
    (
        "reschedule_pickup",
        "Book a new pickup window for an order.",
        &[
            ("order_id", "string"),
            ("window_start", "string"),
            ("window_end", "string"),
        ],
    ),
    (
        "check_driver_location",
        "Last known position and ETA of a driver.",
        &[("driver_id", "string")],
    ),
    (
        "update_delivery_address",
        "Change the delivery address of an undelivered shipment.",
        &[("shipment_id", "string"), ("address", "string")],
    ),
    (
        "issue_refund",
        "Refund all or part of an order.",
        &[
            ("order_id", "string"),
            ("amount", "number"),
            ("reason", "string"),
        ],
    ),
    (
        "create_support_ticket",
        "Open a ticket for a team that must act later.",
        &[
            ("order_id", "string"),
            ("category", "string"),
            ("summary", "string"),
        ],
    ),
    (
        "escalate_to_human",
        "Hand the conversation to a human agent.",
        &[("reason", "string"), ("priority", "string")],
    ),
    (
        "send_customer_notification",
        "Send an SMS or e-mail to the customer.",
        &[
            ("account_id", "string"),
            ("channel", "string"),
            ("message", "string"),
        ],
    ),
    (
        "search_knowledge_base",
        "Search internal policy articles.",
        &[("query", "string")],
    ),
];

pub(in crate::dataset::synth) fn workflow_tools() -> serde_json::Value {
    let tools: Vec<serde_json::Value> = WORKFLOW_TOOLS
        .iter()
        .map(|(name, description, params)| {
            let properties: serde_json::Map<String, serde_json::Value> = params
                .iter()
                .map(|(p, ty)| ((*p).to_string(), serde_json::json!({"type": ty})))
                .collect();
            let required: Vec<&str> = params.iter().take(1).map(|(p, _)| *p).collect();
            serde_json::json!({"type": "function", "function": {"name": name,
                "description": description,
                "parameters": {"type": "object", "properties": properties, "required": required}}})
        })
        .collect();
    serde_json::Value::Array(tools)
}

/// The shared system prompt: role, policies, and the intent catalogue with handling notes.
pub(in crate::dataset::synth) fn workflow_system_prompt() -> String {
    let mut rng = Rng::from_state(0x005E_ED0F_1A7E);
    let mut s = String::with_capacity(48 * 1024);
    s.push_str(
        "You are the customer-support agent of Parcelway, a regional parcel and freight carrier. \
You help senders and recipients with pickups, deliveries, tracking, billing, returns and \
account questions, using the tools you are given. Be accurate, brief and polite.\n\n\
# Rules\n\
1. Identify the customer before you disclose or change anything: an account id, or the \
e-mail plus the order id.\n\
2. Look facts up with the tools; never guess a status, a date or an amount.\n\
3. Every reply to the customer starts with one line `intent: IXXX`, the catalogue code that \
best describes the customer's latest request, followed by your message.\n\
4. Refunds above 200.00 EUR, legal threats and safety issues go to a human \
(escalate_to_human).\n\
5. Confirm any change (address, window, refund) back to the customer with its new value.\n\
6. Do not promise delivery times the tracking data does not support.\n\n\
# Intent catalogue\n\
Classify the customer's latest request with exactly one code. Handling notes say which \
tools to use and what to tell the customer.\n\n",
    );
    let handling = [
        "Check the booking with get_pickup_booking and the driver with check_driver_location.",
        "Read the tracking events and compare them with the promised window.",
        "Open the order with lookup_order and confirm the items and the amounts.",
        "Search the knowledge base for the policy before you answer.",
        "If the customer asks for money back, apply the refund policy and use issue_refund.",
        "When the carrier must act later, open a ticket with create_support_ticket.",
        "Offer a new window with reschedule_pickup and confirm it back to the customer.",
        "Verify the new address format before update_delivery_address.",
    ];
    let outcomes = [
        "Tell the customer the next concrete step and when it happens.",
        "Quote the scan time and location exactly as the tool returns them.",
        "Never blame the driver; state facts and the remedy.",
        "Send a notification with the ticket number when one is created.",
        "If data is missing or contradictory, escalate to a human agent.",
    ];
    for code in 0..INTENTS {
        let name = intent_name(code);
        let _ = write!(
            s,
            "I{code:03} — {name}: the customer's request is about {} ({}). ",
            name.to_lowercase(),
            match code {
                0 => "a greeting, or the customer gives their name, account or order so you can identify them".to_string(),
                57 => "the booked pickup window has passed and the parcel is still with the sender".to_string(),
                58 => "tracking says the parcel was picked up, but the sender still has it".to_string(),
                _ => format!(
                    "{} {} reported by the {}",
                    rng.pick(&["a", "an unexpected", "a repeated", "a disputed"]),
                    rng.pick(WORKFLOW_NOUNS),
                    rng.pick(&["sender", "recipient", "business account", "marketplace seller"])
                ),
            }
        );
        let _ = writeln!(s, "{} {}", rng.pick(&handling), rng.pick(&outcomes));
    }
    s.push_str(
        "\n# Style\nWrite plain sentences. Give order ids, dates and amounts exactly. When you \
call a tool, do not write to the customer in the same message. End every reply with a \
question only when you need information from the customer.\n",
    );
    s
}

pub(super) const WORKFLOW_NOUNS: &[&str] = &[
    "status mismatch",
    "missing scan",
    "late driver",
    "double charge",
    "damaged box",
    "wrong address",
    "customs hold",
    "failed delivery attempt",
    "label error",
    "lost parcel",
    "duplicate pickup",
    "missing refund",
    "password reset",
    "invoice copy",
    "weight surcharge",
];

pub(super) const FIRST_NAMES: &[&str] = &[
    "Dana", "Lee", "Amira", "Jonas", "Priya", "Marco", "Sofia", "Tomasz", "Keiko", "Olu", "Ines",
    "Mateo", "Hana", "Erik", "Zanele", "Ravi",
];

pub(super) const LAST_NAMES: &[&str] = &[
    "Ortiz",
    "Nguyen",
    "Haddad",
    "Becker",
    "Rao",
    "Rossi",
    "Silva",
    "Nowak",
    "Sato",
    "Adeyemi",
    "Moreau",
    "Fernandez",
    "Kim",
    "Larsen",
    "Dlamini",
    "Iyer",
];

//! The export's reading of Anthropic Messages and OpenAI Responses exchanges: each turn is put
//! into the chat form the dataset rows are built from (see [`crate::wire`]), with its source
//! API kept, and a Responses conversation continued by `previous_response_id`, whose requests
//! carry only their new items, is put back together from the recorded turns before it.

use std::collections::{HashMap, VecDeque};

use serde_json::{Map, Value};

use super::export::{response_message, Turn};
use super::reader::Exchange;
use crate::wire::{messages, responses, Api};

/// The row field naming the API a conversation was recorded in: `chat`, `messages` or
/// `responses`. The dataset loader reads rows by the fields it knows and ignores this one.
pub(crate) const SOURCE_API: &str = "source_api";

/// The request body of a turn of `api` in chat form (`messages`, the rest of its fields, and
/// [`SOURCE_API`]), or why it has none. A chat body is returned as it is.
pub(crate) fn chat_body(api: Api, body: Vec<u8>) -> Result<Vec<u8>, &'static str> {
    if api == Api::Chat {
        return Ok(body);
    }
    let Ok(Value::Object(request)) = serde_json::from_slice::<Value>(&body) else {
        return Err("request body is not a JSON object");
    };
    let converted = match api {
        Api::Messages => messages::to_chat(request),
        _ => responses::to_chat(request),
    };
    let Some((mut rest, chat)) = converted else {
        return Err(match api {
            Api::Messages => "request is not a Messages request",
            _ => "request is not a Responses request",
        });
    };
    rest.insert("messages".into(), Value::Array(chat));
    rest.insert(SOURCE_API.into(), Value::from(api.as_str()));
    Ok(serde_json::to_vec(&Value::Object(rest)).expect("a JSON value serialises"))
}

/// The assistant message an exchange's response holds, whatever its API; a Responses reply
/// keeps its response `id`.
pub(crate) fn reply(e: &Exchange) -> Option<Value> {
    let api = Api::of_path(&e.record.path)?;
    if api == Api::Chat {
        return response_message(e);
    }
    let resp = e.record.response.as_ref()?;
    if !(200..300).contains(&resp.status) || !e.record.complete {
        return None;
    }
    let body = e.response_body.as_deref()?;
    let sse = resp.headers.iter().any(|(k, v)| {
        k.eq_ignore_ascii_case("content-type") && v.trim_start().starts_with("text/event-stream")
    });
    match (api, sse) {
        (Api::Messages, true) => messages::reply_sse(body),
        (Api::Messages, false) => messages::reply_json(&serde_json::from_slice(body).ok()?),
        (_, true) => responses::reply_sse(body),
        (_, false) => responses::reply_json(&serde_json::from_slice(body).ok()?),
    }
}

/// Histories of the conversations whose last response may still be continued.
const MAX_CHAINS: usize = 4096;

/// Puts Responses turns continued by `previous_response_id` back together: each recorded
/// response's whole history is kept under its id until a turn continues it (or
/// [`MAX_CHAINS`] newer ones push it out), and that turn's messages become the history, the
/// reply and its own new items.
#[derive(Default)]
pub(crate) struct Chains {
    by_id: HashMap<String, Vec<Value>>,
    order: VecDeque<String>,
    /// Turns whose `previous_response_id` named no recorded response.
    pub unknown: u64,
}

impl Chains {
    /// `turn` with its whole conversation, in turn order of its session.
    pub(crate) fn stitch(&mut self, turn: &mut Turn) {
        let previous = turn
            .request
            .get("previous_response_id")
            .and_then(Value::as_str)
            .map(str::to_owned);
        if let Some(prev) = previous {
            match self.by_id.remove(&prev) {
                Some(mut history) => {
                    let own = std::mem::take(&mut turn.messages);
                    // The instructions are sent again with each request; the history has them.
                    let skip = usize::from(
                        history.first().is_some_and(is_system)
                            && own.first().is_some_and(is_system),
                    );
                    history.extend(own.into_iter().skip(skip));
                    turn.messages = history;
                }
                None => self.unknown += 1,
            }
        }
        let id = turn
            .reply
            .as_ref()
            .and_then(|r| r.get("id"))
            .and_then(Value::as_str);
        if let (Some(id), Some(reply)) = (id, &turn.reply) {
            let mut whole = turn.messages.clone();
            whole.push(reply.clone());
            self.by_id.insert(id.to_owned(), whole);
            self.order.push_back(id.to_owned());
            while self.order.len() > MAX_CHAINS {
                if let Some(old) = self.order.pop_front() {
                    self.by_id.remove(&old);
                }
            }
        }
    }
}

fn is_system(m: &Value) -> bool {
    m.get("role").and_then(Value::as_str) == Some("system")
}

/// Copies the request's [`SOURCE_API`] onto a client row.
pub(crate) fn mark_row(row: &mut Map<String, Value>, request: &Map<String, Value>) {
    if let Some(api) = request.get(SOURCE_API) {
        row.insert(SOURCE_API.into(), api.clone());
    }
}

//! The request APIs agents speak, read the same way by the proxy and the recorder: Chat
//! Completions (most frameworks), Anthropic Messages (Claude Code) and OpenAI Responses
//! (Codex). Each API's parsing lives in its own module; this one says which API a request
//! speaks and what the three have in common.
//!
//! Everything here reads untrusted bytes: a body that does not parse is "not this API", never
//! an error that stops forwarding or recording.

pub(crate) mod chat;
pub(crate) mod messages;
pub(crate) mod messages_request;
pub(crate) mod responses;
pub(crate) mod responses_request;
pub(crate) mod sse;

/// Which API a request speaks: told by its path for the proxy and recorder, chosen by
/// `replay --api` for the replayer (which then writes every turn in that API's shape).
#[derive(
    Debug,
    Clone,
    Copy,
    PartialEq,
    Eq,
    Default,
    serde::Serialize,
    serde::Deserialize,
    clap::ValueEnum,
)]
#[serde(rename_all = "lowercase")]
pub enum Api {
    /// `POST …/chat/completions`.
    #[default]
    Chat,
    /// `POST …/messages` (Anthropic Messages; `?beta=true` and other queries allowed).
    Messages,
    /// `POST …/responses` (OpenAI Responses).
    Responses,
}

impl Api {
    /// The API of a request to `path` (its query, if any, is ignored). `…/messages/count_tokens`
    /// and `GET …/responses/{id}` are not turns of a conversation, so they have none.
    pub(crate) fn of_path(path: &str) -> Option<Api> {
        let path = path.split('?').next().unwrap_or("");
        if path.ends_with("/chat/completions") {
            Some(Api::Chat)
        } else if path.ends_with("/messages") {
            Some(Api::Messages)
        } else if path.ends_with("/responses") {
            Some(Api::Responses)
        } else {
            None
        }
    }

    /// The request path under a base URL's path prefix.
    pub(crate) fn path(self) -> &'static str {
        match self {
            Api::Chat => "/v1/chat/completions",
            Api::Messages => "/v1/messages",
            Api::Responses => "/v1/responses",
        }
    }

    /// The name a dataset row keeps as `source_api`.
    pub(crate) fn as_str(self) -> &'static str {
        match self {
            Api::Chat => "chat",
            Api::Messages => "messages",
            Api::Responses => "responses",
        }
    }
}

/// The parts of a first request that every later turn of its conversation repeats: what the
/// header-less session key hashes. Text is taken out of its JSON so that markers a client
/// moves from turn to turn (Anthropic's `cache_control`) do not change the key.
#[derive(Debug, Default, PartialEq, Eq)]
pub(crate) struct Head {
    /// The model, as raw JSON.
    pub model: Option<String>,
    /// The system prompt (Messages' `system`, Responses' `instructions`).
    pub system: Option<String>,
    /// The first user message's text.
    pub user: Option<String>,
}

/// The text of a content value: a string, or the `text` of each part of an array that has one
/// (parts without text are left out). `None` when it is neither.
pub(crate) fn text_of(content: &serde_json::Value) -> Option<String> {
    use serde_json::Value;
    match content {
        Value::String(s) => Some(s.clone()),
        Value::Array(parts) => Some(
            parts
                .iter()
                .filter_map(|p| p.get("text").and_then(Value::as_str))
                .collect::<Vec<_>>()
                .join("\n\n"),
        ),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_api_is_told_by_its_path_and_side_endpoints_have_none() {
        assert_eq!(Api::of_path("/v1/chat/completions"), Some(Api::Chat));
        assert_eq!(Api::of_path("/v1/messages?beta=true"), Some(Api::Messages));
        assert_eq!(Api::of_path("/v1/responses"), Some(Api::Responses));
        assert_eq!(Api::of_path("/v1/messages/count_tokens"), None);
        assert_eq!(Api::of_path("/v1/responses/resp_1"), None);
        assert_eq!(Api::of_path("/v1/completions"), None);
    }
}

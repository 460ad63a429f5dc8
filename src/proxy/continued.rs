//! Responses API requests that continue a response held on one backend
//! (`previous_response_id`): where they must go, the error when that backend is gone, and
//! the learning of each response's origin as it streams back.

use std::sync::Arc;

use bytes::Bytes;
use http::StatusCode;
use http_body_util::{Either, Full};
use tokio::time::Instant;

use super::fields::OutboundFields;
use super::held_body::HeldBody;
use super::routing::{
    previous_response_id, Backend, IdLearner, Origin, Pool, ResponseIds, SessionKey, Turn,
};
use super::upstream::Answer;
use crate::http1::WireFields;
use crate::wire::Api;

/// A request naming a response a backend of this proxy created.
pub(crate) struct Continued {
    /// The response id it names.
    pub id: String,
    /// Where that response was created.
    pub origin: Origin,
}

impl Continued {
    /// The response a Responses request continues, when the table knows where it was
    /// created. An id the table does not know (learnt before a restart, or forgotten) leaves
    /// the request to the ordinary routing: nothing better is known.
    pub(crate) fn of(api: Option<Api>, body: &HeldBody, ids: &ResponseIds) -> Option<Self> {
        if api != Some(Api::Responses) {
            return None;
        }
        let id = previous_response_id(body.parts().map(|b| &b[..]))?;
        let origin = ids.origin(&id, Instant::now())?;
        Some(Self { id, origin })
    }

    /// The session key the continued response was made under, for a request without one.
    pub(crate) fn session_key(&self, turn: Turn) -> Option<SessionKey> {
        let (text, source) = self.origin.session.clone()?;
        Some(SessionKey::new(text, source).with_turn(turn))
    }

    /// The index of the creating backend in `pool`, if it is still there.
    pub(crate) fn backend(&self, pool: &Pool) -> Option<usize> {
        pool.backends
            .iter()
            .position(|b| b.name == self.origin.backend)
    }

    /// The answer for a client whose response lives on a backend no longer in the pool: 400,
    /// with the code the OpenAI API gives an unknown `previous_response_id`, as the state is
    /// gone for good, so sending the same request again cannot succeed, and a client that
    /// recovers by resending the whole conversation knows this code.
    pub(crate) fn gone(&self) -> Answer {
        error(
            StatusCode::BAD_REQUEST,
            "invalid_request_error",
            "previous_response_not_found",
            &format!(
                "previous response {} was created on backend {}, which is no longer in the pool; send the whole conversation instead",
                self.id, self.origin.backend
            ),
        )
    }

    /// The answer when the creating backend failed before answering: 503, as it may come
    /// back with the state, and no other backend has it.
    pub(crate) fn unavailable(&self, cause: &str) -> Answer {
        error(
            StatusCode::SERVICE_UNAVAILABLE,
            "server_error",
            "previous_response_unavailable",
            &format!(
                "previous response {} is held only by backend {}, which failed: {cause}",
                self.id, self.origin.backend
            ),
        )
    }
}

/// A learner of the id of a successful Responses API response from `backend`.
pub(crate) fn learner(
    api: Option<Api>,
    status: StatusCode,
    ids: &Arc<ResponseIds>,
    backend: &Backend,
    key: Option<&SessionKey>,
) -> Option<IdLearner> {
    (api == Some(Api::Responses) && status.is_success()).then(|| {
        let origin = Origin {
            backend: backend.name.clone(),
            session: key.map(|k| (k.text.clone(), k.source)),
        };
        IdLearner::new(ids.clone(), origin)
    })
}

/// An error in the Responses API's own shape, naming `previous_response_id` as its param.
fn error(status: StatusCode, kind: &str, code: &str, message: &str) -> Answer {
    let body = serde_json::json!({"error": {
        "message": message, "type": kind, "param": "previous_response_id", "code": code}});
    let headers = WireFields::from_pairs([
        (&b"content-type"[..], &b"application/json"[..]),
        (b"x-agentrace-error", code.as_bytes()),
    ]);
    Answer {
        status,
        headers: OutboundFields::new(headers, &[], Vec::new()),
        body: Either::Right(Full::new(Bytes::from(body.to_string()))),
    }
}

//! The session key of a request, and what its body says about the turn it carries.

use std::borrow::Cow;
use std::sync::LazyLock;

use http::{HeaderName, Method};

use super::hash::{avalanche, hash64};
use crate::http1::Fields;
use crate::tap::KeySource;
use crate::wire::{Api, Head};

/// A request's session key with its precomputed hash.
#[derive(Debug, Clone)]
pub(crate) struct SessionKey {
    /// The key as shown in the admin API (a header value, or `fp:` + 16 hex digits).
    pub text: String,
    /// `hash64(0, text)`: the input of every rendezvous score.
    pub hash: u64,
    /// Where the key came from.
    pub source: KeySource,
    /// What the request's body says about the turn; not part of the key's identity.
    pub turn: Turn,
}

/// What a request tells the router about its place in the conversation.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct Turn {
    /// Body bytes: the context the backend will hold for the session after this turn, in the
    /// unit the router balances (about four bytes a token for chat JSON).
    pub context_bytes: u64,
    /// The conversation already has an assistant message: an earlier turn went somewhere, so
    /// its cache is there and the turn must not be placed afresh.
    pub continues: bool,
}

impl Turn {
    /// The turn a request body carries.
    pub(crate) fn of_body(body: &[u8]) -> Self {
        Self::of_parts([body])
    }

    /// The turn a body held in parts carries, read without joining the parts.
    pub(crate) fn of_parts<'p>(parts: impl IntoIterator<Item = &'p [u8]>) -> Self {
        let mut scan = TurnScan::default();
        parts.into_iter().for_each(|part| scan.feed(part));
        scan.turn()
    }
}

/// Reads the turn of a body from its bytes in pieces of any size, as they arrive: a large
/// body is read once while it is received rather than in one long pass once it is whole.
#[derive(Debug, Clone, Default)]
pub(crate) struct TurnScan {
    turn: Turn,
    /// The last bytes before the next piece, so a needle cut across pieces is found.
    seam: Vec<u8>,
}

/// Built once: building a searcher costs more than scanning a small body with it.
static CONTINUES: LazyLock<[memchr::memmem::Finder<'static>; 3]> =
    LazyLock::new(|| TurnScan::NEEDLES.map(memchr::memmem::Finder::new));

impl TurnScan {
    /// Strings only a continuing conversation has, each with both quotes unescaped, so only
    /// a JSON string that is exactly one of them: an assistant message (all three APIs), a
    /// function call's output (Responses, whose calls carry no role), a response continued
    /// on the server (Responses' `previous_response_id`).
    const NEEDLES: [&'static [u8]; 3] = [
        b"\"assistant\"",
        b"\"function_call_output\"",
        b"\"previous_response_id\"",
    ];
    const KEEP: usize = 22 - 1;

    /// Reads the next bytes of the body.
    pub(crate) fn feed(&mut self, part: &[u8]) {
        self.turn.context_bytes += part.len() as u64;
        if self.turn.continues {
            return;
        }
        let keep = Self::KEEP;
        self.seam.extend_from_slice(&part[..part.len().min(keep)]);
        let found = |text: &[u8]| CONTINUES.iter().any(|f| f.find(text).is_some());
        if found(&self.seam) || found(part) {
            self.turn.continues = true;
            self.seam = Vec::new();
            return;
        }
        if part.len() >= keep {
            self.seam.clear();
            self.seam.extend_from_slice(&part[part.len() - keep..]);
        } else {
            self.seam.drain(..self.seam.len().saturating_sub(keep));
        }
    }

    /// The turn of the bytes read so far.
    pub(crate) fn turn(&self) -> Turn {
        self.turn
    }
}

/// Two keys are the same session when their text and source agree, whatever turn they carry.
impl PartialEq for SessionKey {
    fn eq(&self, other: &Self) -> bool {
        self.text == other.text && self.source == other.source
    }
}

impl Eq for SessionKey {}

impl SessionKey {
    /// A key from its text (hash computed here), for a first turn of unknown size.
    pub(crate) fn new(text: String, source: KeySource) -> Self {
        let hash = hash64(0, text.as_bytes());
        Self {
            text,
            hash,
            source,
            turn: Turn::default(),
        }
    }

    /// The same key carrying `turn`.
    pub(crate) fn with_turn(mut self, turn: Turn) -> Self {
        self.turn = turn;
        self
    }
}

#[derive(serde::Deserialize)]
struct ChatHead<'a> {
    #[serde(borrow, default)]
    model: Option<&'a serde_json::value::RawValue>,
    #[serde(borrow, default)]
    messages: Vec<ChatMessage<'a>>,
}

#[derive(serde::Deserialize)]
struct ChatMessage<'a> {
    #[serde(borrow, default)]
    role: Option<Cow<'a, str>>,
    #[serde(borrow, default)]
    content: Option<&'a serde_json::value::RawValue>,
}

/// The session key of a request: the first configured header present and non-empty, else
/// (when enabled) the conversation fingerprint of a `POST` body of one of the [`Api`]s.
pub(crate) fn session_key(
    headers: &impl Fields,
    names: &[HeaderName],
    fingerprint: bool,
    method: &Method,
    path: &str,
    body: &[u8],
) -> Option<SessionKey> {
    let turn = Turn::of_body(body);
    header_key(headers, names, turn).or_else(|| {
        fingerprint_applies(fingerprint, method, path)
            .and_then(|api| fingerprint_key(api, body, turn))
    })
}

/// The key from the first of `names` present and non-empty in `headers`.
pub(crate) fn header_key(
    headers: &impl Fields,
    names: &[HeaderName],
    turn: Turn,
) -> Option<SessionKey> {
    names.iter().find_map(|name| {
        let bytes = headers.first(name.as_str()).filter(|b| !b.is_empty())?;
        let text = String::from_utf8_lossy(bytes).into_owned();
        Some(SessionKey::new(text, KeySource::Header).with_turn(turn))
    })
}

/// The API whose body keys a request without a header key by its conversation fingerprint.
pub(crate) fn fingerprint_applies(fingerprint: bool, method: &Method, path: &str) -> Option<Api> {
    (fingerprint && method == Method::POST)
        .then(|| Api::of_path(path))
        .flatten()
}

/// The key from a body's conversation fingerprint, if it has one.
pub(crate) fn fingerprint_key(api: Api, body: &[u8], turn: Turn) -> Option<SessionKey> {
    let fp = match api {
        Api::Chat => conversation_fingerprint(body),
        Api::Messages => crate::wire::messages::head(body).map(|h| head_fingerprint(&h)),
        Api::Responses => crate::wire::responses::head(body).map(|h| head_fingerprint(&h)),
    };
    fp.map(|fp| SessionKey::new(format!("fp:{fp:016x}"), KeySource::Fingerprint).with_turn(turn))
}

/// Hash of a Messages or Responses request's head, mixed as a chat body's is.
fn head_fingerprint(head: &Head) -> u64 {
    let part = |i: u64, text: &Option<String>| text.as_ref().map_or(0, |t| hash64(i, t.as_bytes()));
    let mut h = part(1, &head.model);
    h = avalanche(h ^ part(2, &head.system));
    avalanche(h.wrapping_add(part(3, &head.user)))
}

/// Hash of the model, the first system message and the first user message of a chat body:
/// the part of a conversation that every later turn repeats verbatim. Contents are hashed as
/// raw JSON text, so a client must serialise them the same way on every turn (they do).
pub(crate) fn conversation_fingerprint(body: &[u8]) -> Option<u64> {
    let head: ChatHead<'_> = serde_json::from_slice(body).ok()?;
    let mut system = None;
    let mut user = None;
    for m in &head.messages {
        match m.role.as_deref() {
            Some("system") | Some("developer") if system.is_none() => system = m.content,
            Some("user") if user.is_none() => user = m.content,
            _ => {}
        }
        if system.is_some() && user.is_some() {
            break;
        }
    }
    if system.is_none() && user.is_none() {
        return None;
    }
    let part = |i: u64, raw: Option<&serde_json::value::RawValue>| {
        raw.map_or(0, |r| hash64(i, r.get().as_bytes()))
    };
    let mut h = part(1, head.model);
    h = avalanche(h ^ part(2, system));
    h = avalanche(h.wrapping_add(part(3, user)));
    Some(h)
}

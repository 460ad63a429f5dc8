//! The response body the proxy forwards: the backend's body frame by frame, with nothing
//! buffered, while the backend's metrics and the tap's observer watch it go by; and the SSE
//! event that ends a stream the backend cut. Apart from the trip upstream because it runs
//! after [`super::upstream::forward`] has returned, for as long as the client reads.

use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http_body::{Body as HttpBody, Frame, SizeHint};
use pin_project_lite::pin_project;
use tokio::time::Instant;

use super::metrics::ErrorKind;
use super::pool::UpstreamBody;
use super::routing::{Backend, IdLearner, InFlight, SessionId, UsageScan};
use super::view::WorkerView;
use crate::http_body::BoxError;
use crate::tap::{ExchangeEnd, ExchangeObserver};

/// What an in-progress response carries besides its bytes; dropping it ends the exchange.
pub(crate) struct Exchange {
    /// Counts the request in flight, and holds its backend.
    in_flight: InFlight,
    turn: Option<SessionTurn>,
    observer: Option<Box<dyn ExchangeObserver>>,
    sent_at: Instant,
    /// When the first body byte came (none yet).
    first_byte_at: Option<Instant>,
    sse: bool,
    at_event_boundary: bool,
    /// Learns the id of a Responses API response, for the requests that continue it.
    response_id: Option<IdLearner>,
}

/// A turn of a session the table placed, in flight until it ends: the session counts in its
/// backend's active context meanwhile, and its idle time starts when the turn ends. When lost
/// caches are judged, the turn also reads its response for the usage the backend reports, and
/// tells the session table, as the turn ends, whether that backend still held the session's
/// cache: one lock of the table for both.
pub(crate) struct SessionTurn {
    session: SessionId,
    /// The worker's view, for its session table: a count only this worker's requests touch.
    view: Arc<WorkerView>,
    /// The usage scan and `affinity.lost_cache_share`, when that is above 0.
    cache: Option<(UsageScan, f64)>,
    ended: bool,
}

impl SessionTurn {
    /// The turn the router started for `session` ([`Commit::Turn`]), when it placed one.
    ///
    /// [`Commit::Turn`]: super::routing::Commit::Turn
    pub(crate) fn start(
        view: &Arc<WorkerView>,
        session: Option<SessionId>,
        api: Option<crate::wire::Api>,
    ) -> Option<Self> {
        let session = session?;
        let api = api.unwrap_or(crate::wire::Api::Chat);
        let lost_share = view.pool.affinity.lost_cache_share;
        Some(Self {
            session,
            view: view.clone(),
            cache: (lost_share > 0.0).then(|| (UsageScan::new(api), lost_share)),
            ended: false,
        })
    }

    fn feed(&mut self, data: &[u8]) {
        if let Some((scan, _)) = self.cache.as_mut() {
            scan.feed(data);
        }
    }

    /// The turn ends now (the table's marks go in the order they are made); its response
    /// came complete from `complete_on`, if it did, its first byte `ttfb` after the request
    /// went out, and the usage that reported goes to the table.
    fn end(&mut self, complete_on: Option<&Arc<Backend>>, ttfb: Option<Duration>) {
        if std::mem::replace(&mut self.ended, true) {
            return;
        }
        let mut slot = self.view.sessions.slot(self.session, Instant::now());
        if let (Some(backend), Some((scan, lost_share))) = (complete_on, &self.cache) {
            if let Some(usage) = scan.usage() {
                slot.report_cache(backend, usage, *lost_share, ttfb);
            }
        }
        slot.end_turn();
    }
}

impl Drop for SessionTurn {
    fn drop(&mut self) {
        self.end(None, None);
    }
}

/// An exchange whose last bytes were handed to the client connection (no longer counted in
/// flight): it ends when the connection has written them ([`delivered`]), as the agent's wait
/// before its next request starts there, not when this thread, which may then wait for a
/// core, handed them on; dropped undelivered (a failed write, or the HTTP/2 path, which has no
/// such hook), it ends as they were handed on.
struct Ending {
    exchange: Option<Exchange>,
    end: Option<ExchangeEnd>,
    handed_on: Instant,
}

impl Ending {
    fn finish_at(&mut self, at: Instant) {
        if let (Some(exchange), Some(end)) = (self.exchange.take(), self.end.take()) {
            exchange.finish_at(end, at);
        }
    }
}

impl Drop for Ending {
    fn drop(&mut self) {
        self.finish_at(self.handed_on);
    }
}

/// The connection has written the last bytes of `body` at `at`: its exchange ends then.
pub(crate) fn delivered(body: &mut super::upstream::ProxyBody, at: Instant) {
    if let http_body_util::Either::Left(observed) = body {
        if let Some(mut ending) = observed.ending.take() {
            ending.finish_at(at);
        }
    }
}

impl Exchange {
    /// The exchange with `in_flight`'s backend whose request went out at `sent_at`, counted in
    /// flight (and as `turn` of its session) until it ends; `sse` when an error event may be
    /// appended to its body.
    pub(crate) fn new(
        in_flight: InFlight,
        turn: Option<SessionTurn>,
        observer: Option<Box<dyn ExchangeObserver>>,
        sent_at: Instant,
        sse: bool,
    ) -> Self {
        Self {
            in_flight,
            turn,
            observer,
            sent_at,
            first_byte_at: None,
            sse,
            at_event_boundary: true,
            response_id: None,
        }
    }

    /// The exchange, reading its response for the id `learner` remembers.
    pub(crate) fn learning_response_id(mut self, learner: Option<IdLearner>) -> Self {
        self.response_id = learner;
        self
    }

    /// The last item went to the connection at `at`. The request stops counting in flight
    /// here, before the connection writes it: once written, the client may have sent its next
    /// request, and must not find this one still counted.
    fn handed_on(mut self, end: ExchangeEnd, at: Instant) -> Ending {
        self.in_flight.release();
        Ending {
            exchange: Some(self),
            end: Some(end),
            handed_on: at,
        }
    }

    fn finish(self, end: ExchangeEnd) {
        self.finish_at(end, Instant::now());
    }

    fn finish_at(mut self, end: ExchangeEnd, now: Instant) {
        self.in_flight
            .backend()
            .metrics
            .latency(now.duration_since(self.sent_at));
        if let Some(turn) = self.turn.as_mut() {
            let complete = matches!(end, ExchangeEnd::Complete);
            let ttfb = self.first_byte_at.map(|t| t.duration_since(self.sent_at));
            turn.end(complete.then_some(self.in_flight.backend()), ttfb);
        }
        if let Some(observer) = self.observer.take() {
            observer.end(end, now);
        }
    }
}

impl Drop for Exchange {
    fn drop(&mut self) {
        // Reached only when the body is dropped before its end: the client went away.
        if let Some(observer) = self.observer.take() {
            observer.end(ExchangeEnd::ClientGone, Instant::now());
        }
    }
}

pin_project! {
    /// The upstream body, forwarded frame by frame as it arrives: nothing is buffered, and it
    /// polls upstream only when the client connection polls it, so backpressure holds. Dropping
    /// it (client gone) drops the upstream body, which closes that upstream connection and so
    /// cancels the request on the backend.
    pub struct ObservedBody {
        // First, so that dropped early they end the exchange before the connection closes.
        ending: Option<Ending>,
        exchange: Option<Exchange>,
        // A frame read ahead of the head (bodies of known length), forwarded first; also the
        // last frame while the observer is not ready for the end.
        pending: Option<Result<Frame<Bytes>, BoxError>>,
        // The inner body ended while the observer was not ready for the end.
        ended: bool,
        #[pin]
        inner: UpstreamBody,
    }
}

impl ObservedBody {
    /// `inner` observed for `exchange`; `pending` is a frame read ahead of the head.
    pub(crate) fn new(
        inner: UpstreamBody,
        pending: Option<Result<Frame<Bytes>, BoxError>>,
        exchange: Exchange,
    ) -> Self {
        Self {
            ending: None,
            exchange: Some(exchange),
            pending,
            ended: false,
            inner,
        }
    }

    /// Ends the exchange of a response with no body to poll, complete at its head.
    pub(crate) async fn complete_at_head(&mut self, head_at: Instant) {
        if let Some(observer) = self.exchange.as_mut().and_then(|e| e.observer.as_mut()) {
            std::future::poll_fn(|cx| observer.poll_ready(cx)).await;
        }
        if let Some(exchange) = self.exchange.take() {
            exchange
                .in_flight
                .backend()
                .metrics
                .ttfb(head_at.duration_since(exchange.sent_at));
            exchange.finish(ExchangeEnd::Complete);
        }
    }
}

impl HttpBody for ObservedBody {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        let mut this = self.project();
        let Some(exchange) = this.exchange.as_mut() else {
            return Poll::Ready(None);
        };
        let item = match this.pending.take() {
            Some(item) => Some(item),
            None if *this.ended => None,
            None => std::task::ready!(this.inner.as_mut().poll_frame(cx)),
        };
        // The exchange ends with this item: a recorder that waits for room (`full_policy =
        // "block"`) holds it back here, slowing this response only, never the thread.
        let last = match &item {
            Some(Ok(_)) => this.inner.is_end_stream(),
            _ => true,
        };
        if last {
            if let Some(observer) = exchange.observer.as_mut() {
                if observer.poll_ready(cx).is_pending() {
                    match item {
                        Some(item) => *this.pending = Some(item),
                        None => *this.ended = true,
                    }
                    return Poll::Pending;
                }
            }
        }
        match item {
            Some(Ok(frame)) => {
                // One reading of the clock serves every use below.
                let mut read = None;
                let mut now = || *read.get_or_insert_with(Instant::now);
                if let Some(data) = frame.data_ref() {
                    if exchange.first_byte_at.is_none() && !data.is_empty() {
                        exchange.first_byte_at = Some(now());
                        exchange
                            .in_flight
                            .backend()
                            .metrics
                            .ttfb(now().duration_since(exchange.sent_at));
                    }
                    if exchange.sse && !data.is_empty() {
                        exchange.at_event_boundary = data.ends_with(b"\n\n");
                    }
                    if let Some(turn) = exchange.turn.as_mut() {
                        turn.feed(data);
                    }
                    if let Some(learner) = exchange.response_id.as_mut() {
                        learner.feed(data);
                    }
                    if let Some(observer) = exchange.observer.as_mut() {
                        observer.response_frame(data, now());
                    }
                }
                // A body of known length ends with its last byte: hyper stops polling there
                // (it never asks for the `None`), so the exchange ends here.
                if this.inner.is_end_stream() {
                    if let Some(exchange) = this.exchange.take() {
                        *this.ending = Some(exchange.handed_on(ExchangeEnd::Complete, now()));
                    }
                }
                Poll::Ready(Some(Ok(frame)))
            }
            None => {
                let exchange = this.exchange.take().expect("checked above");
                let now = Instant::now();
                if exchange.first_byte_at.is_none() {
                    exchange
                        .in_flight
                        .backend()
                        .metrics
                        .ttfb(now.duration_since(exchange.sent_at));
                }
                *this.ending = Some(exchange.handed_on(ExchangeEnd::Complete, now));
                Poll::Ready(None)
            }
            Some(Err(e)) => {
                let mut exchange = this.exchange.take().expect("checked above");
                let cause = crate::telemetry::error_chain(&*e);
                exchange
                    .in_flight
                    .backend()
                    .metrics
                    .error(ErrorKind::Stream);
                tracing::warn!(backend = %exchange.in_flight.backend().name, error = %cause, sse = exchange.sse, "upstream failed mid-response; ending the response");
                let sse = exchange.sse;
                let boundary = exchange.at_event_boundary;
                let message = format!(
                    "backend {} failed mid-stream: {cause}",
                    exchange.in_flight.backend().name
                );
                if sse {
                    let event = sse_error_event(&message, boundary);
                    let now = Instant::now();
                    if let Some(observer) = exchange.observer.as_mut() {
                        observer.response_frame(&event, now);
                    }
                    *this.ending = Some(exchange.handed_on(ExchangeEnd::UpstreamError(cause), now));
                    Poll::Ready(Some(Ok(Frame::data(event))))
                } else {
                    exchange.finish(ExchangeEnd::UpstreamError(cause));
                    Poll::Ready(Some(Err(message.into())))
                }
            }
        }
    }

    /// Ends only after the inner body said so through `poll_frame`, so the exchange is always
    /// finished there (and never mistaken for a client that went away).
    fn is_end_stream(&self) -> bool {
        self.exchange.is_none() && self.pending.is_none()
    }

    fn size_hint(&self) -> SizeHint {
        let ahead = match &self.pending {
            Some(Ok(frame)) => frame.data_ref().map_or(0, |d| d.len() as u64),
            _ => 0,
        };
        let inner = self.inner.size_hint();
        let mut hint = SizeHint::new();
        hint.set_lower(inner.lower() + ahead);
        if let Some(upper) = inner.upper() {
            hint.set_upper(upper + ahead);
        }
        hint
    }
}

/// The SSE event that ends a stream cut by the backend; starts with a blank line when the cut
/// fell inside an event, so the error is never glued onto a partial one.
fn sse_error_event(message: &str, at_boundary: bool) -> Bytes {
    let payload = serde_json::json!({"error": {"message": message, "type": "upstream_error"}});
    let prefix = if at_boundary { "" } else { "\n\n" };
    Bytes::from(format!("{prefix}data: {payload}\n\n"))
}

#[cfg(test)]
mod tests {
    use http::uri::PathAndQuery;
    use http::Method;
    use http_body_util::BodyExt;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio::net::TcpListener;

    use super::*;
    use crate::http1::WireFields;
    use crate::proxy::config::{BackendUrl, UpstreamConfig};
    use crate::proxy::fields::OutboundFields;
    use crate::proxy::held_body::HeldBody;
    use crate::proxy::pool::{connection_pool, UpstreamRequest};
    use crate::proxy::routing::pool_of;

    /// A backend that answers one request with `head` and `first`, then, once told, `rest`.
    async fn two_part_backend(
        head: &'static str,
        first: &'static str,
        rest: &'static str,
    ) -> (BackendUrl, tokio::sync::oneshot::Sender<()>) {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = BackendUrl::parse(&format!("http://{}", listener.local_addr().unwrap())).unwrap();
        let (go, gone) = tokio::sync::oneshot::channel::<()>();
        tokio::spawn(async move {
            let (mut conn, _) = listener.accept().await.unwrap();
            let mut buf = vec![0u8; 4096];
            let mut read = Vec::new();
            while !read.windows(4).any(|w| w == b"\r\n\r\n") {
                let n = conn.read(&mut buf).await.unwrap();
                assert!(n > 0, "the request came whole");
                read.extend_from_slice(&buf[..n]);
            }
            conn.write_all(format!("{head}{first}").as_bytes())
                .await
                .unwrap();
            let _ = gone.await;
            conn.write_all(rest.as_bytes()).await.unwrap();
            let _ = conn.read(&mut buf).await;
        });
        (url, go)
    }

    /// A request stops counting in flight when its last bytes are handed to the client
    /// connection, before that connection writes them: a client that reads its answer and
    /// sends its next request at once never finds the previous one still counted. Until
    /// then it counts, with a length and streamed alike.
    #[tokio::test]
    async fn a_request_stops_counting_as_its_last_bytes_go_to_the_client() {
        let answers = [
            (
                "HTTP/1.1 200 OK\r\ncontent-length: 10\r\n\r\n",
                "hello",
                "world",
            ),
            (
                "HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n",
                "5\r\nhello\r\n",
                "5\r\nworld\r\n0\r\n\r\n",
            ),
        ];
        for (head, first, rest) in answers {
            let (url, go) = two_part_backend(head, first, rest).await;
            let pool = pool_of(&["a"], 0.0);
            let backend = pool.backends[0].clone();
            let connections = Arc::new(connection_pool(&UpstreamConfig::default(), false).unwrap());
            let headers = OutboundFields::new(WireFields::default(), &[], Vec::new());
            let request = UpstreamRequest {
                method: &Method::GET,
                path_and_query: &PathAndQuery::from_static("/"),
                headers: &headers,
                body: &HeldBody::default(),
                declare_length: false,
                sent_at: Instant::now(),
            };
            let in_flight = InFlight::new(backend.clone());
            let response = connections.send(&url, request).await.unwrap();
            let exchange = Exchange::new(in_flight, None, None, Instant::now(), false);
            let mut body = ObservedBody::new(response.body, None, exchange);
            let frame = body.frame().await.unwrap().unwrap();
            assert_eq!(frame.into_data().unwrap(), "hello");
            assert_eq!(
                backend.in_flight.load(std::sync::atomic::Ordering::Relaxed),
                1,
                "counted while the answer is under way ({head:?})"
            );
            go.send(()).unwrap();
            let mut rest = Vec::new();
            while !body.is_end_stream() {
                match body.frame().await {
                    Some(frame) => rest.extend_from_slice(&frame.unwrap().into_data().unwrap()),
                    None => break,
                }
            }
            assert_eq!(rest, b"world");
            assert_eq!(
                backend.in_flight.load(std::sync::atomic::Ordering::Relaxed),
                0,
                "handed on whole: no longer counted ({head:?})"
            );
            drop(body);
            assert_eq!(
                backend.in_flight.load(std::sync::atomic::Ordering::Relaxed),
                0
            );
        }
    }

    #[test]
    fn sse_error_event_is_a_complete_event() {
        let e = sse_error_event("boom \"x\"", true);
        let text = std::str::from_utf8(&e).unwrap();
        assert!(text.starts_with("data: {"));
        assert!(text.ends_with("\n\n"));
        let json: serde_json::Value =
            serde_json::from_str(text.trim_start_matches("data: ").trim()).unwrap();
        assert_eq!(json["error"]["type"], "upstream_error");
        assert!(sse_error_event("x", false).starts_with(b"\n\ndata: "));
    }
}

//! A black-box conformance suite for endpoint pickers, written from the Gateway API Inference
//! Extension's *Endpoint Picker Protocol* (`docs/proposals/004-endpoint-picker-protocol/
//! README.md` in `kubernetes-sigs/gateway-api-inference-extension`, v1.0.0). It speaks only
//! ext_proc gRPC, as a gateway would; each case names the section it checks.
//!
//! By default every case starts the real `agentrace epp` binary on `127.0.0.1:0` with a config
//! file over test endpoints. To run it against another picker:
//!
//! ```sh
//! EPP_CONFORMANCE_TARGET=10.0.0.5:9002 \
//! EPP_CONFORMANCE_ENDPOINTS=10.0.1.1:8000,10.0.1.2:8000 \
//! EPP_CONFORMANCE_SELECTION=1 \
//!     cargo test --test epp_conformance
//! ```
//!
//! `EPP_CONFORMANCE_ENDPOINTS` lists the picker's ready endpoints (at least two);
//! `EPP_CONFORMANCE_SELECTION=1` says it honours `test-epp-endpoint-selection`. Cases that need
//! a set-up only a started picker allows (no ready endpoint, shedding, the selection header
//! off, session placement) print a skip line against an external picker.

mod support;

use std::collections::BTreeSet;
use std::net::SocketAddr;
use std::time::Duration;

use envoy_types::pb::envoy::config::core::v3::Metadata;
use envoy_types::pb::envoy::service::ext_proc::v3::{
    body_mutation::Mutation, processing_request::Request, processing_response::Response, HttpBody,
    ImmediateResponse, ProcessingRequest,
};
use support::backends::TestBackend;
use support::epp::{self as fixture, Stream};
use support::epp_process::{config_toml, EppProcess};

/// The header GIE's conformance suite steers requests with.
const SELECTION: &str = "test-epp-endpoint-selection";
/// `ProcessingMode.BodySendMode`.
const BUFFERED: i32 = 1;
const FULL_DUPLEX_STREAMED: i32 = 4;

/// How a started picker is set up; an external picker is taken as it is.
#[derive(Default, Clone, Copy)]
struct Setup {
    /// Endpoints that refuse connections, so none is ever ready.
    none_ready: bool,
    /// `epp.shed_in_flight`.
    shed_in_flight: u64,
    /// `epp.selection_header = "test-epp-endpoint-selection"`.
    selection: bool,
}

impl Setup {
    /// Whether an external picker can stand for this set-up.
    fn external_fits(&self) -> bool {
        !self.none_ready && self.shed_in_flight == 0
    }
}

/// The picker under test and its endpoints.
struct Picker {
    addr: SocketAddr,
    endpoints: Vec<String>,
    /// Whether this is the `agentrace epp` the suite started.
    started: bool,
    _process: Option<EppProcess>,
    _backends: Vec<TestBackend>,
    _refusing: Vec<socket2::Socket>,
}

/// The picker for `setup`, or None (with a skip line) when an external one cannot stand for it.
async fn picker(test: &str, setup: Setup) -> Option<Picker> {
    if let Ok(target) = std::env::var("EPP_CONFORMANCE_TARGET") {
        if !setup.external_fits() {
            support::skip(test, "needs a picker this suite starts");
            return None;
        }
        let selection = std::env::var("EPP_CONFORMANCE_SELECTION").is_ok_and(|v| v == "1");
        if setup.selection && !selection {
            support::skip(test, "EPP_CONFORMANCE_SELECTION=1 not set");
            return None;
        }
        if !setup.selection && selection && test.contains("_off_") {
            support::skip(test, "the external picker honours the selection header");
            return None;
        }
        let endpoints: Vec<String> = std::env::var("EPP_CONFORMANCE_ENDPOINTS")
            .expect("EPP_CONFORMANCE_ENDPOINTS=ip:port,ip:port with EPP_CONFORMANCE_TARGET")
            .split(',')
            .map(|s| s.trim().to_string())
            .collect();
        assert!(
            endpoints.len() >= 2,
            "EPP_CONFORMANCE_ENDPOINTS: at least two"
        );
        return Some(Picker {
            addr: target.parse().expect("EPP_CONFORMANCE_TARGET is host:port"),
            endpoints,
            started: false,
            _process: None,
            _backends: Vec::new(),
            _refusing: Vec::new(),
        });
    }
    Some(start(setup).await)
}

/// Starts `agentrace epp` over three endpoints as `setup` says.
async fn start(setup: Setup) -> Picker {
    let mut backends = Vec::new();
    let mut refusing = Vec::new();
    let mut endpoints = Vec::new();
    for i in 0..3 {
        let addr = if setup.none_ready {
            let (socket, addr) = support::refusing_socket_addr();
            refusing.push(socket);
            addr
        } else {
            let b = TestBackend::spawn(&format!("e{i}")).await;
            let addr = b.addr;
            backends.push(b);
            addr
        };
        endpoints.push((format!("e{i}"), addr));
    }
    let mut epp = format!("shed_in_flight = {}\n", setup.shed_in_flight);
    if setup.selection {
        epp.push_str(&format!("selection_header = \"{SELECTION}\"\n"));
    }
    let process = EppProcess::spawn(&config_toml(&endpoints, &epp)).await;
    Picker {
        addr: process.addr,
        endpoints: endpoints.iter().map(|(_, a)| a.to_string()).collect(),
        started: true,
        _process: Some(process),
        _backends: backends,
        _refusing: refusing,
    }
}

/// A request's headers as the gateway sends them, announcing `body_mode`.
fn headers(extra: &[(&str, &str)], end_of_stream: bool, body_mode: i32) -> ProcessingRequest {
    let mut all = vec![
        (":authority", "gateway"),
        ("content-type", "application/json"),
    ];
    all.extend_from_slice(extra);
    let mut msg = fixture::headers_msg(&all, end_of_stream, None);
    if let Some(config) = msg.protocol_config.as_mut() {
        config.request_body_mode = body_mode;
    }
    msg
}

fn body(chunk: &[u8], end_of_stream: bool) -> ProcessingRequest {
    ProcessingRequest {
        request: Some(Request::RequestBody(HttpBody {
            body: chunk.to_vec(),
            end_of_stream,
            ..HttpBody::default()
        })),
        ..ProcessingRequest::default()
    }
}

fn chat_body(session: &str) -> Vec<u8> {
    serde_json::to_vec(&serde_json::json!({
        "model": "m",
        "messages": [{"role": "user", "content": format!("conversation {session}")}],
    }))
    .unwrap()
}

/// The endpoints a headers reply names in `x-gateway-destination-endpoint` (§Destination
/// Endpoint: one or more `ip:port`, comma-separated; the first is the primary).
fn destination(r: &Response) -> Vec<String> {
    let Response::RequestHeaders(h) = r else {
        panic!("expected a request headers reply, got {r:?}")
    };
    let set = &h
        .response
        .as_ref()
        .and_then(|c| c.header_mutation.as_ref())
        .expect("a header mutation")
        .set_headers;
    let value = set
        .iter()
        .filter_map(|o| o.header.as_ref())
        .find(|h| h.key.eq_ignore_ascii_case("x-gateway-destination-endpoint"))
        .map(|h| {
            if h.raw_value.is_empty() {
                h.value.clone()
            } else {
                String::from_utf8(h.raw_value.clone()).unwrap()
            }
        })
        .expect("x-gateway-destination-endpoint is set");
    value.split(',').map(|s| s.trim().to_string()).collect()
}

/// Headers-only request: the primary endpoint picked, or the immediate response.
async fn pick(picker: &Picker, extra: &[(&str, &str)], metadata: Option<Metadata>) -> Picked {
    let mut stream = Stream::open(picker.addr).await;
    let mut msg = headers(extra, true, FULL_DUPLEX_STREAMED);
    msg.metadata_context = metadata;
    stream.send(msg).await;
    match stream.recv().await {
        r @ Response::RequestHeaders(_) => {
            let endpoints = destination(&r);
            for e in &endpoints {
                assert!(
                    e.parse::<SocketAddr>().is_ok(),
                    "{e:?} is not <ip:port> (§Destination Endpoint)"
                );
            }
            Picked::Endpoint(endpoints[0].clone())
        }
        Response::ImmediateResponse(i) => Picked::Refused(i),
        other => panic!("unexpected reply to request headers: {other:?}"),
    }
}

#[derive(Debug)]
enum Picked {
    Endpoint(String),
    Refused(ImmediateResponse),
}

impl Picked {
    fn endpoint(self) -> String {
        match self {
            Picked::Endpoint(e) => e,
            Picked::Refused(i) => panic!("refused: {i:?}"),
        }
    }

    fn status(&self) -> Option<i32> {
        match self {
            Picked::Refused(i) => i.status.as_ref().map(|s| s.code),
            Picked::Endpoint(_) => None,
        }
    }
}

/// Polls until a headers-only request is placed (the picker has seen its endpoints ready).
async fn ready(picker: &Picker) {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    loop {
        if let Picked::Endpoint(_) = pick(picker, &[], None).await {
            return;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "the picker placed nothing within 10 s"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// §Destination Endpoint: the header and the `envoy.lb` dynamic metadata name the same
/// endpoint (the fixture's `recv` compares them on every headers reply), one of the pool's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_destination_header_and_the_envoy_lb_metadata_name_the_same_pool_endpoint() {
    let Some(p) = picker(
        "the_destination_header_and_the_envoy_lb_metadata_name_the_same_pool_endpoint",
        Setup::default(),
    )
    .await
    else {
        return;
    };
    ready(&p).await;
    let mut seen = BTreeSet::new();
    for s in 0..24 {
        let session = format!("dest-{s}");
        let e = pick(&p, &[("x-session-id", &session)], None)
            .await
            .endpoint();
        assert!(
            p.endpoints.contains(&e),
            "{e} is not in the pool {:?}",
            p.endpoints
        );
        seen.insert(e);
    }
    assert!(!seen.is_empty());
}

/// §Endpoint Subset: with `x-gateway-destination-endpoint-subset` in the
/// `envoy.lb.subset_hint` filter metadata, only endpoints of the list are picked.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn only_endpoints_of_the_subset_hint_are_picked() {
    let Some(p) = picker(
        "only_endpoints_of_the_subset_hint_are_picked",
        Setup::default(),
    )
    .await
    else {
        return;
    };
    ready(&p).await;
    for subset in [
        vec![p.endpoints[0].clone()],
        vec![p.endpoints[1].clone()],
        vec![p.endpoints[0].clone(), p.endpoints[1].clone()],
    ] {
        for s in 0..12 {
            let session = format!("subset-{s}");
            let e = pick(
                &p,
                &[("x-session-id", &session)],
                Some(fixture::subset(&subset)),
            )
            .await
            .endpoint();
            assert!(
                subset.contains(&e),
                "{e} picked outside the subset {subset:?}"
            );
        }
    }
}

/// §Endpoint Subset: an empty list, or one naming no endpoint of the pool, is answered with
/// an `ImmediateResponse` of 503.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_empty_subset_or_one_naming_no_pool_endpoint_gets_503() {
    let Some(p) = picker(
        "an_empty_subset_or_one_naming_no_pool_endpoint_gets_503",
        Setup::default(),
    )
    .await
    else {
        return;
    };
    ready(&p).await;
    let (_unused, elsewhere) = support::refusing_socket_addr();
    for subset in [vec![], vec![elsewhere.to_string()]] {
        let picked = pick(&p, &[], Some(fixture::subset(&subset))).await;
        assert_eq!(picked.status(), Some(503), "subset {subset:?}: {picked:?}");
    }
}

/// §Destination Endpoint, constraints: no ready endpoint is an `ImmediateResponse` of 503,
/// and the stream carries nothing after it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_ready_endpoint_gets_an_immediate_503() {
    let Some(p) = picker(
        "no_ready_endpoint_gets_an_immediate_503",
        Setup {
            none_ready: true,
            ..Setup::default()
        },
    )
    .await
    else {
        return;
    };
    // Until its health checks have failed, an endpoint may count as ready.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    let refused = loop {
        match pick(&p, &[("x-session-id", "none")], None).await {
            Picked::Refused(i) => break i,
            Picked::Endpoint(_) => {
                assert!(
                    tokio::time::Instant::now() < deadline,
                    "still placing on endpoints that refuse connections after 10 s"
                );
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }
    };
    assert_eq!(refused.status.map(|s| s.code), Some(503));
}

/// §Destination Endpoint, constraints: a request the picker drops under load is an
/// `ImmediateResponse` of 429 (`agentrace epp` drops when every endpoint has
/// `epp.shed_in_flight` requests in flight).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_shed_under_load_gets_an_immediate_429() {
    let Some(p) = picker(
        "a_request_shed_under_load_gets_an_immediate_429",
        Setup {
            shed_in_flight: 1,
            ..Setup::default()
        },
    )
    .await
    else {
        return;
    };
    // Requests left in flight (streams open, no response yet) until every endpoint has one:
    // the next is shed.
    let mut open = Vec::new();
    let refused = loop {
        assert!(open.len() < 64, "64 requests in flight and none shed");
        let mut stream = Stream::open(p.addr).await;
        let session = format!("load-{}", open.len());
        stream
            .send(headers(&[("x-session-id", &session)], true, 0))
            .await;
        match stream.recv().await {
            Response::RequestHeaders(_) => open.push(stream),
            Response::ImmediateResponse(i) => break i,
            other => panic!("unexpected reply {other:?}"),
        }
    };
    assert!(
        open.len() >= p.endpoints.len(),
        "shed with {} in flight over {} endpoints",
        open.len(),
        p.endpoints.len()
    );
    assert_eq!(
        refused.status.as_ref().map(|s| s.code),
        Some(429),
        "{refused:?}"
    );
    assert!(!refused.body.is_empty(), "the 429 says why");
    drop(open);
}

/// GIE's conformance picker: with the selection header enabled, a request goes to an
/// endpoint it names (`ip:port`, or `ip` for any port), whatever its session would pick; one
/// naming no endpoint of the pool is dropped with 429, as GIE's `GatewayFollowingEPPRouting`
/// expects for `256.256.256.256`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_the_selection_header_on_the_named_endpoint_is_picked() {
    let Some(p) = picker(
        "with_the_selection_header_on_the_named_endpoint_is_picked",
        Setup {
            selection: true,
            ..Setup::default()
        },
    )
    .await
    else {
        return;
    };
    ready(&p).await;
    for (s, named) in p.endpoints.iter().enumerate() {
        for turn in 0..3 {
            let session = format!("steer-{s}-{turn}");
            let e = pick(&p, &[("x-session-id", &session), (SELECTION, named)], None)
                .await
                .endpoint();
            assert_eq!(&e, named, "the selection header names {named}");
        }
    }
    let two = format!("{}, {}", p.endpoints[2], p.endpoints[1]);
    for s in 0..8 {
        let e = pick(
            &p,
            &[("x-session-id", &format!("two-{s}")), (SELECTION, &two)],
            None,
        )
        .await
        .endpoint();
        assert!(
            e == p.endpoints[1] || e == p.endpoints[2],
            "{e} not in {two}"
        );
    }
    // Within a subset hint too: the header narrows the subset, never widens it.
    let subset = fixture::subset(&[p.endpoints[0].clone(), p.endpoints[1].clone()]);
    let e = pick(&p, &[(SELECTION, &two)], Some(subset))
        .await
        .endpoint();
    assert_eq!(e, p.endpoints[1]);
    let invalid = pick(&p, &[(SELECTION, "256.256.256.256")], None).await;
    assert_eq!(invalid.status(), Some(429), "{invalid:?}");
}

/// The selection header is a test hook: off unless configured, when it steers nothing and
/// drops nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_the_selection_header_off_it_is_ignored() {
    let Some(p) = picker(
        "with_the_selection_header_off_it_is_ignored",
        Setup::default(),
    )
    .await
    else {
        return;
    };
    if !p.started {
        support::skip(
            "with_the_selection_header_off_it_is_ignored",
            "needs a picker this suite starts",
        );
        return;
    }
    ready(&p).await;
    for s in 0..12 {
        let session = format!("ignored-{s}");
        let own = pick(&p, &[("x-session-id", &session)], None)
            .await
            .endpoint();
        let other = p.endpoints.iter().find(|e| **e != own).unwrap();
        let steered = pick(&p, &[("x-session-id", &session), (SELECTION, other)], None)
            .await
            .endpoint();
        assert_eq!(
            steered, own,
            "{session}: the header moved it with the hook off"
        );
    }
    let invalid = pick(&p, &[(SELECTION, "256.256.256.256")], None).await;
    assert!(
        matches!(invalid, Picked::Endpoint(_)),
        "dropped by a hook that is off: {invalid:?}"
    );
}

/// §Destination Endpoint Served: the gateway reports in the response's `envoy.lb` metadata
/// which endpoint served; the picker answers the response headers and, for `agentrace epp`,
/// the session continues where it was served, and a report naming an endpoint the picker did
/// not offer for that stream moves nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_served_endpoint_report_is_answered_and_keeps_the_session_where_it_was_served() {
    let Some(p) = picker(
        "the_served_endpoint_report_is_answered_and_keeps_the_session_where_it_was_served",
        Setup::default(),
    )
    .await
    else {
        return;
    };
    ready(&p).await;
    let session = [("x-session-id", "served")];
    let mut stream = Stream::open(p.addr).await;
    stream.send(headers(&session, true, 0)).await;
    let first = destination(&stream.recv().await)[0].clone();
    stream
        .send(fixture::response_headers_msg(Some(fixture::served(&first))))
        .await;
    assert!(
        matches!(stream.recv().await, Response::ResponseHeaders(_)),
        "the response headers are answered with a response headers reply"
    );
    if !p.started {
        return;
    }
    let other = p.endpoints.iter().find(|e| **e != first).unwrap().clone();
    for _ in 0..3 {
        let mut stream = Stream::open(p.addr).await;
        stream.send(headers(&session, true, 0)).await;
        let e = destination(&stream.recv().await)[0].clone();
        assert_eq!(e, first, "the session continues where it was served");
        stream
            .send(fixture::response_headers_msg(Some(fixture::served(&other))))
            .await;
        assert!(matches!(stream.recv().await, Response::ResponseHeaders(_)));
    }
    let again = pick(&p, &session, None).await.endpoint();
    assert_eq!(
        again, first,
        "a served report for an endpoint not offered moved the session"
    );
}

/// The replies to a request sent in `body_mode` as `chunks`: they must be one headers reply
/// naming an endpoint, then (full-duplex) streamed body mutations that give back the body
/// unchanged and end it, or (buffered) one body reply.
async fn body_sequence(p: &Picker, body_mode: i32, chunks: &[&[u8]]) {
    let mut stream = Stream::open(p.addr).await;
    stream
        .send(headers(&[], chunks.is_empty(), body_mode))
        .await;
    for (i, chunk) in chunks.iter().enumerate() {
        stream.send(body(chunk, i + 1 == chunks.len())).await;
    }
    let first = stream.recv().await;
    let endpoint = destination(&first)[0].clone();
    assert!(p.endpoints.contains(&endpoint), "{endpoint}");
    if chunks.is_empty() {
        return;
    }
    let sent: Vec<u8> = chunks.concat();
    if body_mode == BUFFERED {
        let Response::RequestBody(_) = stream.recv().await else {
            panic!("a buffered body is answered with one body reply")
        };
        return;
    }
    let mut passed = Vec::new();
    loop {
        let Response::RequestBody(b) = stream.recv().await else {
            panic!("after the headers reply, only body replies until the body ends")
        };
        let mutation = b
            .response
            .and_then(|c| c.body_mutation)
            .and_then(|m| m.mutation);
        let Some(Mutation::StreamedResponse(s)) = mutation else {
            panic!("full-duplex: the body comes back as streamed body responses, got {mutation:?}")
        };
        passed.extend_from_slice(&s.body);
        if s.end_of_stream {
            break;
        }
    }
    assert_eq!(passed, sent, "the body passes through unchanged");
}

/// §Proposal: the picker handles streaming mode (`FULL_DUPLEX_STREAMED`), as well as
/// header-only requests and buffered bodies, with a reply sequence valid for each.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_body_mode_gets_a_valid_reply_sequence() {
    let Some(p) = picker(
        "each_body_mode_gets_a_valid_reply_sequence",
        Setup::default(),
    )
    .await
    else {
        return;
    };
    ready(&p).await;
    body_sequence(&p, FULL_DUPLEX_STREAMED, &[]).await;
    let whole = chat_body("modes");
    body_sequence(&p, BUFFERED, &[&whole]).await;
    let (a, rest) = whole.split_at(7);
    let (b, c) = rest.split_at(rest.len() / 2);
    body_sequence(&p, FULL_DUPLEX_STREAMED, &[a, b, c]).await;
    body_sequence(&p, FULL_DUPLEX_STREAMED, &[&whole]).await;
    // A header-less conversation placed by its body lands where the same body did before.
    let by_body = |p: &Picker| {
        let addr = p.addr;
        let whole = whole.clone();
        async move {
            let mut stream = Stream::open(addr).await;
            stream.send(headers(&[], false, FULL_DUPLEX_STREAMED)).await;
            let (x, y) = whole.split_at(whole.len() / 3);
            stream.send(body(x, false)).await;
            stream.send(body(y, true)).await;
            destination(&stream.recv().await)[0].clone()
        }
    };
    let first = by_body(&p).await;
    if p.started {
        assert_eq!(
            by_body(&p).await,
            first,
            "the same conversation, another endpoint"
        );
    }
}

//! Fixtures for the picker tests: a picker on `127.0.0.1:0` over given endpoints, and a real
//! gRPC ext_proc client that speaks to it as a gateway would.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::time::Duration;

use agentrace::epp::{self, EppHandle};
use agentrace::proxy::config::{BackendConfig, HealthConfig};
use agentrace::proxy::ProxyConfig;
use agentrace::shutdown::{self, Trigger};
use envoy_types::pb::envoy::config::core::v3::{HeaderMap, HeaderValue, Metadata};
use envoy_types::pb::envoy::service::ext_proc::v3::external_processor_client::ExternalProcessorClient;
use envoy_types::pb::envoy::service::ext_proc::v3::{
    processing_request::Request, processing_response::Response, HttpBody, HttpHeaders,
    ProcessingRequest, ProcessingResponse, ProtocolConfiguration,
};
use envoy_types::pb::google::protobuf::{value::Kind, ListValue, Struct, Value};

/// A running picker and the trigger that stops it.
pub struct TestEpp {
    pub handle: EppHandle,
    pub trigger: Trigger,
}

impl TestEpp {
    pub fn addr(&self) -> SocketAddr {
        self.handle.addr
    }

    /// Stops the picker and waits for it.
    pub async fn stop(self) {
        self.trigger.fire();
        self.handle.join().await;
    }

    /// `/metrics` of the admin port.
    pub async fn metrics(&self) -> String {
        String::from_utf8(
            super::sim::get(self.handle.admin_addr, "/metrics")
                .await
                .body(),
        )
        .unwrap()
    }

    /// Waits until the admin API shows `name`'s health as `healthy`.
    pub async fn wait_health(&self, name: &str, healthy: bool) {
        let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
        loop {
            let reply = super::sim::get(self.handle.admin_addr, "/admin/backends").await;
            let json: serde_json::Value = serde_json::from_slice(&reply.body()).unwrap();
            let list = json
                .as_array()
                .cloned()
                .unwrap_or_else(|| json["backends"].as_array().cloned().unwrap_or_default());
            if list
                .iter()
                .any(|b| b["name"] == name && b["healthy"] == healthy)
            {
                return;
            }
            assert!(
                tokio::time::Instant::now() < deadline,
                "{name} never became healthy={healthy}: {json}"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
}

/// A picker config over `endpoints` (`name`, address), probing every 50 ms.
pub fn config(endpoints: &[(String, SocketAddr)]) -> ProxyConfig {
    let mut config = ProxyConfig::default();
    config.admin.listen = "127.0.0.1:0".parse().unwrap();
    config.health = HealthConfig {
        interval_ms: 50,
        timeout_ms: 50,
        unhealthy_threshold: 1,
        healthy_threshold: 1,
        ..HealthConfig::default()
    };
    config.backends = endpoints
        .iter()
        .map(|(name, addr)| BackendConfig {
            name: name.clone(),
            url: format!("http://{addr}"),
            weight: 1.0,
        })
        .collect();
    config
}

/// Starts a picker on `127.0.0.1:0`.
pub async fn start(config: ProxyConfig) -> TestEpp {
    let (trigger, shutdown) = shutdown::channel();
    let handle = epp::start("127.0.0.1:0".parse().unwrap(), config, shutdown)
        .await
        .expect("epp starts");
    TestEpp { handle, trigger }
}

/// One ext_proc stream, as a gateway drives it.
pub struct Stream {
    tx: tokio::sync::mpsc::Sender<ProcessingRequest>,
    rx: tonic::Streaming<ProcessingResponse>,
}

impl Stream {
    pub async fn open(addr: SocketAddr) -> Stream {
        Self::open_with_token(addr, None).await.expect("process")
    }

    /// Opens a stream presenting `token` as `authorization: Bearer TOKEN`; the picker's
    /// refusal, if it refuses.
    pub async fn open_with_token(
        addr: SocketAddr,
        token: Option<&str>,
    ) -> Result<Stream, tonic::Status> {
        let mut client = ExternalProcessorClient::connect(format!("http://{addr}"))
            .await
            .expect("connect");
        let (tx, rx) = tokio::sync::mpsc::channel(16);
        let outbound = futures_util::stream::unfold(
            rx,
            |mut rx: tokio::sync::mpsc::Receiver<ProcessingRequest>| async move {
                rx.recv().await.map(|m| (m, rx))
            },
        );
        let mut request = tonic::Request::new(outbound);
        if let Some(token) = token {
            request
                .metadata_mut()
                .insert("authorization", format!("Bearer {token}").parse().unwrap());
        }
        let rx = client.process(request).await?.into_inner();
        Ok(Stream { tx, rx })
    }

    /// Waits for the picker to end the stream with an error, and returns it.
    pub async fn ended_with(&mut self) -> tonic::Status {
        let next = tokio::time::timeout(Duration::from_secs(10), self.rx.message())
            .await
            .expect("an answer within 10 s");
        match next {
            Err(status) => status,
            Ok(other) => panic!("expected the stream to end with an error, got {other:?}"),
        }
    }

    pub async fn send(&self, msg: ProcessingRequest) {
        self.tx.send(msg).await.expect("send");
    }

    pub async fn recv(&mut self) -> Response {
        let msg = tokio::time::timeout(Duration::from_secs(10), self.rx.message())
            .await
            .expect("a reply within 10 s")
            .expect("a reply")
            .expect("the stream is open");
        msg.response
            .clone()
            .map(|r| {
                if let Response::RequestHeaders(_) = r {
                    // The metadata must name what the header names.
                    let header = destination_header(&r);
                    assert_eq!(
                        header,
                        destination_metadata(&msg),
                        "header and metadata differ"
                    );
                }
                r
            })
            .expect("a response")
    }

    /// Sends a whole request (headers, then the body in one chunk) and returns the picked
    /// endpoint, or the immediate status.
    pub async fn request(
        &mut self,
        headers: &[(&str, &str)],
        body: &[u8],
        metadata: Option<Metadata>,
    ) -> Result<String, u16> {
        self.send(headers_msg(headers, body.is_empty(), metadata))
            .await;
        if !body.is_empty() {
            self.send(body_msg(body, true)).await;
        }
        match self.recv().await {
            r @ Response::RequestHeaders(_) => {
                let endpoint = destination_header(&r);
                if !body.is_empty() {
                    match self.recv().await {
                        Response::RequestBody(b) => {
                            let m = b.response.unwrap().body_mutation.unwrap().mutation.unwrap();
                            match m {
                                envoy_types::pb::envoy::service::ext_proc::v3::body_mutation::Mutation::StreamedResponse(s) => {
                                    assert_eq!(s.body, body, "the body passes through unchanged");
                                    assert!(s.end_of_stream);
                                }
                                other => panic!("unexpected body mutation {other:?}"),
                            }
                        }
                        other => panic!("expected the body back, got {other:?}"),
                    }
                }
                Ok(endpoint)
            }
            Response::ImmediateResponse(i) => Err(i.status.unwrap().code as u16),
            other => panic!("unexpected reply {other:?}"),
        }
    }
}

fn destination_header(r: &Response) -> String {
    let Response::RequestHeaders(h) = r else {
        panic!("not a headers reply")
    };
    let set = &h
        .response
        .as_ref()
        .unwrap()
        .header_mutation
        .as_ref()
        .unwrap()
        .set_headers;
    let hv = set
        .iter()
        .find(|o| o.header.as_ref().unwrap().key == "x-gateway-destination-endpoint")
        .unwrap();
    String::from_utf8(hv.header.as_ref().unwrap().raw_value.clone()).unwrap()
}

fn destination_metadata(msg: &ProcessingResponse) -> String {
    let lb = &msg.dynamic_metadata.as_ref().unwrap().fields["envoy.lb"];
    let Some(Kind::StructValue(s)) = &lb.kind else {
        panic!("envoy.lb is not a struct")
    };
    match &s.fields["x-gateway-destination-endpoint"].kind {
        Some(Kind::StringValue(v)) => v.clone(),
        other => panic!("not a string: {other:?}"),
    }
}

pub fn headers_msg(
    headers: &[(&str, &str)],
    end_of_stream: bool,
    metadata: Option<Metadata>,
) -> ProcessingRequest {
    let mut all = vec![(":method", "POST"), (":path", "/v1/chat/completions")];
    all.extend_from_slice(headers);
    ProcessingRequest {
        request: Some(Request::RequestHeaders(HttpHeaders {
            headers: Some(HeaderMap {
                headers: all
                    .iter()
                    .map(|(k, v)| HeaderValue {
                        key: k.to_string(),
                        raw_value: v.as_bytes().to_vec(),
                        ..HeaderValue::default()
                    })
                    .collect(),
            }),
            end_of_stream,
            ..HttpHeaders::default()
        })),
        protocol_config: Some(ProtocolConfiguration {
            request_body_mode: 4,
            response_body_mode: 0,
            ..ProtocolConfiguration::default()
        }),
        metadata_context: metadata,
        ..ProcessingRequest::default()
    }
}

pub fn body_msg(body: &[u8], end_of_stream: bool) -> ProcessingRequest {
    ProcessingRequest {
        request: Some(Request::RequestBody(HttpBody {
            body: body.to_vec(),
            end_of_stream,
            ..HttpBody::default()
        })),
        ..ProcessingRequest::default()
    }
}

pub fn response_headers_msg(metadata: Option<Metadata>) -> ProcessingRequest {
    ProcessingRequest {
        request: Some(Request::ResponseHeaders(HttpHeaders::default())),
        metadata_context: metadata,
        ..ProcessingRequest::default()
    }
}

fn string(s: &str) -> Value {
    Value {
        kind: Some(Kind::StringValue(s.to_string())),
    }
}

/// Filter metadata `{namespace: {key: value}}`.
pub fn metadata(namespace: &str, key: &str, value: Value) -> Metadata {
    let inner = Struct {
        fields: [(key.to_string(), value)].into_iter().collect(),
    };
    Metadata {
        filter_metadata: HashMap::from([(namespace.to_string(), inner)])
            .into_iter()
            .collect(),
        ..Metadata::default()
    }
}

/// The gateway's subset hint naming `endpoints`.
pub fn subset(endpoints: &[String]) -> Metadata {
    let list = ListValue {
        values: endpoints.iter().map(|e| string(e)).collect(),
    };
    metadata(
        "envoy.lb.subset_hint",
        "x-gateway-destination-endpoint-subset",
        Value {
            kind: Some(Kind::ListValue(list)),
        },
    )
}

/// The gateway saying `endpoint` served the request.
pub fn served(endpoint: &str) -> Metadata {
    metadata(
        "envoy.lb",
        "x-gateway-destination-endpoint-served",
        string(endpoint),
    )
}

//! The ext_proc messages the picker sends back to the gateway, and the metadata it reads.

use std::collections::BTreeMap;

use envoy_types::pb::envoy::config::core::v3::{
    header_value_option::HeaderAppendAction, HeaderValue, HeaderValueOption, Metadata,
};
use envoy_types::pb::envoy::r#type::v3::HttpStatus;
use envoy_types::pb::envoy::service::ext_proc::v3::{
    body_mutation::Mutation, processing_response::Response, BodyMutation, BodyResponse,
    CommonResponse, HeaderMutation, HeadersResponse, ImmediateResponse, ProcessingResponse,
    StreamedBodyResponse, TrailersResponse,
};
use envoy_types::pb::google::protobuf::{value::Kind, Struct, Value};

/// The header and the `envoy.lb` metadata key naming the picked endpoint (always equal).
pub(crate) const DESTINATION: &str = "x-gateway-destination-endpoint";
/// The metadata namespace the destination goes in, and the served endpoint comes back in.
pub(crate) const LB_NAMESPACE: &str = "envoy.lb";
/// The filter-metadata namespace of the gateway's subset hint.
pub(crate) const SUBSET_NAMESPACE: &str = "envoy.lb.subset_hint";
/// The key of the subset hint: the endpoints this request may go to.
pub(crate) const SUBSET_KEY: &str = "x-gateway-destination-endpoint-subset";
/// The key of the endpoint that served the request, in the response's metadata.
pub(crate) const SERVED_KEY: &str = "x-gateway-destination-endpoint-served";

fn string_value(s: &str) -> Value {
    Value {
        kind: Some(Kind::StringValue(s.to_string())),
    }
}

/// The answer to a request's headers: the endpoint in the header and in `envoy.lb` metadata.
pub(crate) fn destination(endpoint: &str) -> ProcessingResponse {
    let header = HeaderValueOption {
        header: Some(HeaderValue {
            key: DESTINATION.to_string(),
            raw_value: endpoint.as_bytes().to_vec(),
            ..HeaderValue::default()
        }),
        append_action: HeaderAppendAction::OverwriteIfExistsOrAdd as i32,
        ..HeaderValueOption::default()
    };
    let lb = Struct {
        fields: BTreeMap::from([(DESTINATION.to_string(), string_value(endpoint))])
            .into_iter()
            .collect(),
    };
    let metadata = Struct {
        fields: [(
            LB_NAMESPACE.to_string(),
            Value {
                kind: Some(Kind::StructValue(lb)),
            },
        )]
        .into_iter()
        .collect(),
    };
    ProcessingResponse {
        response: Some(Response::RequestHeaders(HeadersResponse {
            response: Some(CommonResponse {
                header_mutation: Some(HeaderMutation {
                    set_headers: vec![header],
                    ..HeaderMutation::default()
                }),
                // Routes may match on the header just set.
                clear_route_cache: true,
                ..CommonResponse::default()
            }),
        })),
        dynamic_metadata: Some(metadata),
        ..ProcessingResponse::default()
    }
}

/// Passes request body bytes on unchanged (full-duplex mode: the gateway forwards only what
/// the processor sends back).
pub(crate) fn request_body(body: Vec<u8>, end_of_stream: bool) -> ProcessingResponse {
    body_reply(Some(body), end_of_stream, true)
}

/// Acknowledges a request body chunk the picker does not hold (streamed or buffered mode).
pub(crate) fn request_body_ack() -> ProcessingResponse {
    ProcessingResponse {
        response: Some(Response::RequestBody(BodyResponse::default())),
        ..ProcessingResponse::default()
    }
}

/// Passes response body bytes on unchanged (full-duplex), or acknowledges them (other modes).
pub(crate) fn response_body(body: Option<Vec<u8>>, end_of_stream: bool) -> ProcessingResponse {
    body_reply(body, end_of_stream, false)
}

fn body_reply(body: Option<Vec<u8>>, end_of_stream: bool, request: bool) -> ProcessingResponse {
    let common = body.map(|body| CommonResponse {
        body_mutation: Some(BodyMutation {
            mutation: Some(Mutation::StreamedResponse(StreamedBodyResponse {
                body,
                end_of_stream,
                ..StreamedBodyResponse::default()
            })),
        }),
        ..CommonResponse::default()
    });
    let reply = BodyResponse {
        response: Some(common.unwrap_or_default()),
    };
    ProcessingResponse {
        response: Some(if request {
            Response::RequestBody(reply)
        } else {
            Response::ResponseBody(reply)
        }),
        ..ProcessingResponse::default()
    }
}

/// Acknowledges request trailers unchanged.
pub(crate) fn request_trailers() -> ProcessingResponse {
    ProcessingResponse {
        response: Some(Response::RequestTrailers(TrailersResponse::default())),
        ..ProcessingResponse::default()
    }
}

/// Acknowledges response trailers unchanged.
pub(crate) fn response_trailers() -> ProcessingResponse {
    ProcessingResponse {
        response: Some(Response::ResponseTrailers(TrailersResponse::default())),
        ..ProcessingResponse::default()
    }
}

/// Acknowledges response headers unchanged.
pub(crate) fn response_headers() -> ProcessingResponse {
    ProcessingResponse {
        response: Some(Response::ResponseHeaders(HeadersResponse::default())),
        ..ProcessingResponse::default()
    }
}

/// The gateway answers the client itself with `status` and a JSON error body, as the proxy's
/// own refusals look.
pub(crate) fn immediate(status: u16, kind: &str, message: &str) -> ProcessingResponse {
    let body = serde_json::json!({"error": {"type": kind, "message": message}}).to_string();
    let content_type = HeaderValueOption {
        header: Some(HeaderValue {
            key: "content-type".to_string(),
            raw_value: b"application/json".to_vec(),
            ..HeaderValue::default()
        }),
        append_action: HeaderAppendAction::OverwriteIfExistsOrAdd as i32,
        ..HeaderValueOption::default()
    };
    ProcessingResponse {
        response: Some(Response::ImmediateResponse(ImmediateResponse {
            status: Some(HttpStatus {
                code: i32::from(status),
            }),
            headers: Some(HeaderMutation {
                set_headers: vec![content_type],
                ..HeaderMutation::default()
            }),
            body: body.into_bytes(),
            details: format!("agentrace_epp_{kind}"),
            ..ImmediateResponse::default()
        })),
        ..ProcessingResponse::default()
    }
}

/// Adds `retry-after: secs` to an immediate response (a refusal the client may retry).
pub(crate) fn add_retry_after(reply: &mut ProcessingResponse, secs: u64) {
    if let Some(Response::ImmediateResponse(i)) = reply.response.as_mut() {
        i.headers
            .get_or_insert_with(HeaderMutation::default)
            .set_headers
            .push(HeaderValueOption {
                header: Some(HeaderValue {
                    key: "retry-after".to_string(),
                    raw_value: secs.to_string().into_bytes(),
                    ..HeaderValue::default()
                }),
                append_action: HeaderAppendAction::OverwriteIfExistsOrAdd as i32,
                ..HeaderValueOption::default()
            });
    }
}

/// The string under `namespace.key` of `metadata`, if it is one.
pub(crate) fn metadata_string<'a>(
    metadata: Option<&'a Metadata>,
    namespace: &str,
    key: &str,
) -> Option<&'a str> {
    match metadata_value(metadata, namespace, key)?.kind.as_ref()? {
        Kind::StringValue(s) => Some(s),
        _ => None,
    }
}

/// The endpoints under `namespace.key`: a list of strings, or one comma-separated string.
pub(crate) fn metadata_list(
    metadata: Option<&Metadata>,
    namespace: &str,
    key: &str,
) -> Option<Vec<String>> {
    let split = |s: &str| -> Vec<String> {
        s.split(',')
            .map(str::trim)
            .filter(|p| !p.is_empty())
            .map(String::from)
            .collect()
    };
    match metadata_value(metadata, namespace, key)?.kind.as_ref()? {
        Kind::StringValue(s) => Some(split(s)),
        Kind::ListValue(list) => Some(
            list.values
                .iter()
                .filter_map(|v| match &v.kind {
                    Some(Kind::StringValue(s)) => Some(split(s)),
                    _ => None,
                })
                .flatten()
                .collect(),
        ),
        _ => None,
    }
}

fn metadata_value<'a>(
    metadata: Option<&'a Metadata>,
    namespace: &str,
    key: &str,
) -> Option<&'a Value> {
    metadata?.filter_metadata.get(namespace)?.fields.get(key)
}

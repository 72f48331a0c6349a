//! Reads the `type` of an RFC 9457 problem body without taking the body from the caller: a 409 is
//! retried only when its type is `key-in-flight`, and that is in the body, not the head.

use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::{Bytes, BytesMut};
use http::header::{CONTENT_LENGTH, CONTENT_TYPE};
use http_body::{Body as HttpBody, Frame, SizeHint};
use http_body_util::BodyExt;
use reqwest::{Response, ResponseBuilderExt};

/// Problem documents are a few hundred bytes; a body larger than this is not read for its type.
const PEEK_LIMIT: usize = 64 * 1024;

fn is_problem_json(response: &Response) -> bool {
    response
        .headers()
        .get(CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.split(';').next())
        .is_some_and(|essence| essence.trim().eq_ignore_ascii_case("application/problem+json"))
}

fn declared_length(response: &Response) -> Option<u64> {
    response
        .headers()
        .get(CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.trim().parse().ok())
}

#[derive(serde::Deserialize)]
struct ProblemType {
    #[serde(rename = "type")]
    type_uri: Option<String>,
}

/// For an error answer with a problem+json body: buffers the body (up to [`PEEK_LIMIT`]), reads its
/// `type`, and hands back an equivalent response whose body the caller can still read whole.
/// Any other answer passes through untouched.
pub(crate) async fn read_problem_type(response: Response) -> Result<(Response, Option<String>), reqwest::Error> {
    let status = response.status();
    if !(status.is_client_error() || status.is_server_error())
        || !is_problem_json(&response)
        || declared_length(&response).is_some_and(|n| n > PEEK_LIMIT as u64)
    {
        return Ok((response, None));
    }
    let url = response.url().clone();
    let (parts, mut body) = http::Response::<reqwest::Body>::from(response).into_parts();
    let mut read = BytesMut::new();
    let mut complete = false;
    while read.len() <= PEEK_LIMIT {
        match body.frame().await {
            Some(frame) => {
                if let Ok(data) = frame?.into_data() {
                    read.extend_from_slice(&data);
                }
            }
            None => {
                complete = true;
                break;
            }
        }
    }
    let read = read.freeze();
    let problem_type = if complete {
        serde_json::from_slice::<ProblemType>(&read)
            .ok()
            .and_then(|p| p.type_uri)
    } else {
        None
    };
    let body = if complete {
        reqwest::Body::from(read)
    } else {
        reqwest::Body::wrap(Prefixed {
            prefix: Some(read),
            rest: body,
        })
    };
    let mut builder = http::Response::builder()
        .status(parts.status)
        .version(parts.version)
        .url(url);
    if let Some(headers) = builder.headers_mut() {
        *headers = parts.headers;
    }
    let mut rebuilt = builder.body(body).expect("the parts of a valid response");
    rebuilt.extensions_mut().extend(parts.extensions);
    Ok((Response::from(rebuilt), problem_type))
}

/// The bytes already read, then the rest of the body.
struct Prefixed {
    prefix: Option<Bytes>,
    rest: reqwest::Body,
}

impl HttpBody for Prefixed {
    type Data = Bytes;
    type Error = reqwest::Error;

    fn poll_frame(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
        if let Some(prefix) = self.prefix.take() {
            return Poll::Ready(Some(Ok(Frame::data(prefix))));
        }
        Pin::new(&mut self.rest).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.prefix.is_none() && self.rest.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        let rest = self.rest.size_hint();
        let extra = self.prefix.as_ref().map_or(0, |p| p.len() as u64);
        let mut hint = SizeHint::new();
        hint.set_lower(rest.lower() + extra);
        if let Some(upper) = rest.upper() {
            hint.set_upper(upper + extra);
        }
        hint
    }
}

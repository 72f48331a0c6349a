//! The gateway's inner service: forwards a request to the upstream and streams the answer back.
//! It tells the idempotency layer, through [`NoAnswer`], when its response is not the upstream's.

use std::convert::Infallible;
use std::future::Future;
use std::net::SocketAddr;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use axum::extract::ConnectInfo;
use http::header::{self, HeaderMap, HeaderName, HeaderValue};
use http::uri::{PathAndQuery, Scheme};
use http::{Request, Response, Uri};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use idem_core::{HOP_BY_HOP, Problem, ProblemKind};
use idem_tower::{Body, IdempotencyInfo, NoAnswer};

use crate::serve::ClientBodyFailed;

const RECOVERED: HeaderName = HeaderName::from_static("idempotency-recovered");

/// Forwards requests to one upstream over a pooled connection.
#[derive(Clone, Debug)]
pub(crate) struct Proxy {
    client: Client<HttpConnector, Body>,
    upstream: Uri,
    timeout: Duration,
}

impl Proxy {
    /// A proxy to `upstream` (`http://host:port[/prefix]`). `timeout` bounds requests that are not
    /// keyed; keyed ones are bounded by the idempotency layer, which keeps waiting in the background.
    pub(crate) fn new(upstream: Uri, timeout: Duration) -> anyhow::Result<Self> {
        if upstream.scheme() != Some(&Scheme::HTTP) || upstream.authority().is_none() {
            anyhow::bail!("--upstream must be an absolute http:// URL such as http://127.0.0.1:3000, not {upstream}");
        }
        let mut connector = HttpConnector::new();
        connector.set_nodelay(true);
        connector.set_connect_timeout(Some(Duration::from_secs(5)));
        let client = Client::builder(TokioExecutor::new())
            // Below the usual upstream keep-alive, so the pool does not reuse connections the
            // upstream has already closed.
            .pool_idle_timeout(Duration::from_secs(4))
            .build(connector);
        Ok(Self {
            client,
            upstream,
            timeout,
        })
    }

    fn target(&self, uri: &Uri) -> Uri {
        let prefix = self.upstream.path().trim_end_matches('/');
        let path_and_query = uri.path_and_query().map_or("/", PathAndQuery::as_str);
        let mut parts = self.upstream.clone().into_parts();
        parts.path_and_query = format!("{prefix}{path_and_query}").parse().ok();
        Uri::from_parts(parts).unwrap_or_else(|_| self.upstream.clone())
    }

    async fn forward(self, request: Request<Body>) -> Response<Body> {
        let (mut parts, body) = request.into_parts();
        let keyed = parts.extensions.get::<IdempotencyInfo>().cloned();
        let client_addr = parts.extensions.get::<ConnectInfo<SocketAddr>>().map(|c| c.0);
        let original_host = parts.headers.get(header::HOST).cloned();
        strip_hop_by_hop(&mut parts.headers);
        parts.headers.remove(header::HOST);
        parts.headers.remove(RECOVERED);
        if keyed.as_ref().is_some_and(|info| info.recovered) {
            parts.headers.insert(RECOVERED, HeaderValue::from_static("true"));
        }
        if let Some(addr) = client_addr {
            let forwarded_for = match parts.headers.get("x-forwarded-for").and_then(|v| v.to_str().ok()) {
                Some(earlier) => format!("{earlier}, {}", addr.ip()),
                None => addr.ip().to_string(),
            };
            if let Ok(value) = HeaderValue::from_str(&forwarded_for) {
                parts.headers.insert("x-forwarded-for", value);
            }
        }
        if let Some(host) = original_host {
            parts.headers.insert("x-forwarded-host", host);
        }
        parts
            .headers
            .insert("x-forwarded-proto", HeaderValue::from_static("http"));
        parts.uri = self.target(&parts.uri);
        parts.version = http::Version::HTTP_11;
        let sent = self.client.request(Request::from_parts(parts, body));

        let result = if keyed.is_some() {
            Ok(sent.await)
        } else {
            tokio::time::timeout(self.timeout, sent).await
        };
        match result {
            Ok(Ok(response)) => {
                let (mut head, body) = response.into_parts();
                strip_hop_by_hop(&mut head.headers);
                // The gateway speaks its own protocol version to its client.
                head.version = http::Version::default();
                Response::from_parts(head, Body::new(body))
            }
            Ok(Err(err)) if err.is_connect() => {
                tracing::warn!(upstream = %self.upstream, error = %err, "upstream unreachable");
                let detail =
                    format!("the upstream could not be reached ({err}); nothing was sent, retry with the same key");
                no_answer(
                    Problem::new(ProblemKind::UpstreamUnavailable, detail),
                    NoAnswer::NotSent,
                )
            }
            Ok(Err(err)) => match client_body_failed(&err) {
                Some(failed) => {
                    // The client's fault, not the upstream's: no 5xx that would page someone about
                    // the upstream. Only a request passed through gets here (a keyed body is read
                    // whole before anything is sent), so nothing is said of what the upstream did.
                    tracing::info!(upstream = %self.upstream, error = %failed, "a request body broke off; the forwarded request was cut off");
                    let detail =
                        format!("the request body broke off before it was complete ({failed}); send the request again");
                    no_answer(
                        Problem::new(ProblemKind::BodyIncomplete, detail),
                        NoAnswer::OutcomeUnknown,
                    )
                }
                None => {
                    tracing::warn!(upstream = %self.upstream, error = %err, "connection to the upstream lost after sending");
                    let detail = "the connection to the upstream was lost after the request was sent, so whether it took effect is unknown; retry with the same key (the upstream is told the retry is a recovery)";
                    no_answer(
                        Problem::new(ProblemKind::UpstreamFailed, detail),
                        NoAnswer::OutcomeUnknown,
                    )
                }
            },
            Err(_) => {
                let detail = format!(
                    "the upstream did not answer within {}",
                    humantime::format_duration(self.timeout)
                );
                let problem = Problem::new(ProblemKind::UpstreamTimeout, detail).retry_after(Duration::from_secs(1));
                no_answer(problem, NoAnswer::OutcomeUnknown)
            }
        }
    }
}

/// The client's body, if that is why sending the request failed: its client kept the gateway
/// waiting too long for it, or it broke off.
fn client_body_failed<'a>(err: &'a (dyn std::error::Error + 'static)) -> Option<&'a ClientBodyFailed> {
    std::iter::successors(Some(err), |err| err.source()).find_map(|err| err.downcast_ref::<ClientBodyFailed>())
}

fn no_answer(problem: Problem, why: NoAnswer) -> Response<Body> {
    let mut response = problem.to_response().map(Body::full);
    response.extensions_mut().insert(why);
    response
}

/// Removes the headers that belong to one connection (RFC 9110 §7.6.1), including any the
/// `Connection` header names.
fn strip_hop_by_hop(headers: &mut HeaderMap) {
    let named: Vec<HeaderName> = headers
        .get_all(header::CONNECTION)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .filter_map(|name| HeaderName::from_bytes(name.trim().as_bytes()).ok())
        .collect();
    for name in named {
        headers.remove(name);
    }
    for name in HOP_BY_HOP {
        headers.remove(name);
    }
}

impl tower::Service<Request<Body>> for Proxy {
    type Response = Response<Body>;
    type Error = Infallible;
    type Future = Pin<Box<dyn Future<Output = Result<Response<Body>, Infallible>> + Send>>;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, request: Request<Body>) -> Self::Future {
        let proxy = self.clone();
        Box::pin(async move { Ok(proxy.forward(request).await) })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn joins_the_upstream_prefix() {
        let proxy = Proxy::new("http://127.0.0.1:3000/api/".parse().unwrap(), Duration::from_secs(1)).unwrap();
        assert_eq!(
            proxy.target(&"/pay?x=1".parse().unwrap()),
            "http://127.0.0.1:3000/api/pay?x=1"
        );
        let bare = Proxy::new("http://127.0.0.1:3000".parse().unwrap(), Duration::from_secs(1)).unwrap();
        assert_eq!(bare.target(&"/pay".parse().unwrap()), "http://127.0.0.1:3000/pay");
    }

    #[test]
    fn refuses_upstreams_it_cannot_reach() {
        assert!(Proxy::new("https://example.invalid".parse().unwrap(), Duration::from_secs(1)).is_err());
        assert!(Proxy::new("/relative".parse().unwrap(), Duration::from_secs(1)).is_err());
    }

    #[test]
    fn strips_connection_headers() {
        let mut headers = HeaderMap::new();
        headers.insert(header::CONNECTION, HeaderValue::from_static("close, x-private"));
        headers.insert("x-private", HeaderValue::from_static("1"));
        headers.insert(header::TRANSFER_ENCODING, HeaderValue::from_static("chunked"));
        headers.insert("idempotency-key", HeaderValue::from_static("\"k\""));
        strip_hop_by_hop(&mut headers);
        assert_eq!(headers.len(), 1);
        assert!(headers.contains_key("idempotency-key"), "the key is forwarded");
    }
}

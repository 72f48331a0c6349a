//! The gateway's inner service: forwards a request to the upstream and streams the answer back.
//! It tells the idempotency layer, through [`NoAnswer`], when its response is not the upstream's;
//! what the client then gets, and what becomes of the record, is the protocol's to decide.
//! An upstream is `http://` (HTTP/1.1, or h2c by prior knowledge when asked) or `https://`
//! (HTTP/2 or HTTP/1.1, as ALPN decides).

use std::convert::Infallible;
use std::future::Future;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use axum::extract::ConnectInfo;
use http::header::{self, HeaderMap, HeaderName, HeaderValue};
use http::uri::{PathAndQuery, Scheme};
use http::{Request, Response, Uri};
use hyper_rustls::{HttpsConnector, HttpsConnectorBuilder};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use idem_core::{
    HOP_BY_HOP, IDEMPOTENCY_RECOVERED as RECOVERED, IDEMPOTENCY_TOKEN, metric_names,
    protocol::{IdempotencyInfo, InTransaction, NoAnswer},
};
use idem_tower::Body;

use crate::config::UpstreamOptions;
use crate::listener::ClientBodyFailed;
use crate::misconfigured::Misconfigured;
use crate::tls::{self, OverTls};

/// Forwards requests to one upstream over a pooled connection. Cloned for every request, so a
/// clone is one reference count.
#[derive(Clone, Debug)]
pub(crate) struct Proxy {
    inner: Arc<Upstream>,
}

#[derive(Debug)]
struct Upstream {
    client: Client<HttpsConnector<HttpConnector>, Body>,
    upstream: Uri,
    /// The upstream as logs show it: any password in it masked.
    shown: Arc<str>,
    timeout: Duration,
    /// Whether keyed runs carry their `Idempotency-Token` (a PostgreSQL store).
    completion_tokens: bool,
}

impl Proxy {
    /// A proxy to `upstream` (`http://host:port[/prefix]`, or `https://…` checked against the
    /// system's roots) with the default options. `timeout` bounds requests that are not keyed;
    /// keyed ones are bounded by the idempotency layer, which keeps waiting in the background.
    pub(crate) fn new(upstream: Uri, timeout: Duration) -> Result<Self, Misconfigured> {
        Self::with_options(upstream, timeout, &UpstreamOptions::default())
    }

    /// A proxy to `upstream`, `http://` or `https://`, as `options` say.
    pub(crate) fn with_options(
        upstream: Uri,
        timeout: Duration,
        options: &UpstreamOptions,
    ) -> Result<Self, Misconfigured> {
        let refuse = |flag, reason: &str| Misconfigured {
            flag,
            reason: reason.to_owned(),
        };
        let https = match upstream.scheme() {
            Some(scheme) if *scheme == Scheme::HTTPS => true,
            Some(scheme) if *scheme == Scheme::HTTP => false,
            _ => {
                return Err(Misconfigured {
                    flag: "upstream",
                    reason: format!(
                        "must be an absolute http:// or https:// URL such as http://127.0.0.1:3000, not {}",
                        idem_core::redact_url(&upstream.to_string())
                    ),
                });
            }
        };
        if upstream.authority().is_none() {
            return Err(Misconfigured {
                flag: "upstream",
                reason: format!(
                    "must name a host, such as http://127.0.0.1:3000, not {}",
                    idem_core::redact_url(&upstream.to_string())
                ),
            });
        }
        if !https && options.ca.is_some() {
            return Err(refuse(
                "upstream-ca",
                "the upstream is http://, so there is no certificate to check: use an https:// upstream or drop --upstream-ca",
            ));
        }
        if https && options.http2 {
            return Err(refuse(
                "upstream-http2",
                "asks for h2c, HTTP/2 by prior knowledge over plain http://; over https:// HTTP/2 is negotiated by ALPN and used whenever the upstream offers it, so drop --upstream-http2",
            ));
        }
        let mut http = HttpConnector::new();
        http.set_nodelay(true);
        http.set_connect_timeout(Some(Duration::from_secs(5)));
        // The TLS connector below hands it https:// addresses too.
        http.enforce_http(false);
        let connector = if https {
            HttpsConnectorBuilder::new()
                .with_tls_config(tls::upstream(options.ca.as_deref())?)
                .https_only()
                // ALPN offers h2 and http/1.1; the pool speaks whichever the upstream picks.
                .enable_all_versions()
                .wrap_connector(http)
        } else {
            // Plain TCP: the TLS side is never used (this client only ever sees the upstream's
            // http:// URL), so it needs no roots. HTTP/2 here is `http2_only`, below.
            HttpsConnectorBuilder::new()
                .with_tls_config(tls::unused())
                .https_or_http()
                .enable_http1()
                .wrap_connector(http)
        };
        let client = Client::builder(TokioExecutor::new())
            // Below the usual upstream keep-alive, so the pool does not reuse connections the
            // upstream has already closed.
            .pool_idle_timeout(Duration::from_secs(4))
            .http2_only(options.http2)
            .build(connector);
        Ok(Self {
            inner: Arc::new(Upstream {
                client,
                shown: idem_core::redact_url(&upstream.to_string()).into(),
                upstream,
                timeout,
                completion_tokens: options.completion_tokens,
            }),
        })
    }

    /// How long a client waits for the upstream's answer (`--upstream-timeout`).
    pub(crate) fn timeout(&self) -> Duration {
        self.inner.timeout
    }

    /// The upstream's path prefix (`/api` of `http://host/api/`), empty if it has none: every
    /// path is passed on under it, so the idempotency layer is told it
    /// ([`IdempotencyLayer::with_path_prefix`](idem_tower::IdempotencyLayer::with_path_prefix))
    /// and refuses a path that would climb out of it.
    pub(crate) fn prefix(&self) -> &str {
        self.inner.upstream.path().trim_end_matches('/')
    }

    fn target(&self, uri: &Uri) -> Uri {
        let prefix = self.prefix();
        let path_and_query = uri.path_and_query().map_or("/", PathAndQuery::as_str);
        let mut parts = self.inner.upstream.clone().into_parts();
        parts.path_and_query = format!("{prefix}{path_and_query}").parse().ok();
        Uri::from_parts(parts).unwrap_or_else(|_| self.inner.upstream.clone())
    }

    async fn forward(self, request: Request<Body>) -> Response<Body> {
        let (mut parts, body) = request.into_parts();
        let keyed = parts.extensions.get::<IdempotencyInfo>().cloned();
        let client_addr = parts.extensions.get::<ConnectInfo<SocketAddr>>().map(|c| c.0);
        let over_tls = parts.extensions.get::<OverTls>().is_some();
        // An HTTP/2 request names its host in the `:authority` pseudo-header, not in `Host`.
        let original_host = parts.headers.get(header::HOST).cloned().or_else(|| {
            parts
                .uri
                .authority()
                .and_then(|authority| HeaderValue::from_str(authority.as_str()).ok())
        });
        strip_hop_by_hop(&mut parts.headers);
        parts.headers.remove(header::HOST);
        parts.headers.remove(RECOVERED);
        if keyed.as_ref().is_some_and(|info| info.recovered) {
            parts.headers.insert(RECOVERED, HeaderValue::from_static("true"));
        }
        // Only the gateway says which run may complete which record: a client's is never passed on.
        parts.headers.remove(IDEMPOTENCY_TOKEN);
        if self.inner.completion_tokens
            && let Some(run) = parts.extensions.get::<InTransaction>()
            && let Ok(token) = HeaderValue::from_str(&run.completion_token())
        {
            parts.headers.insert(IDEMPOTENCY_TOKEN, token);
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
        parts.headers.insert(
            "x-forwarded-proto",
            HeaderValue::from_static(if over_tls { "https" } else { "http" }),
        );
        crate::telemetry::inject(&mut parts.headers);
        parts.uri = self.target(&parts.uri);
        // Not the client's version: the connection to the upstream decides (HTTP/1.1, or HTTP/2 by
        // ALPN or by prior knowledge), and the client refuses an HTTP/2 request on HTTP/1.1.
        parts.version = http::Version::HTTP_11;
        let sent = self.inner.client.request(Request::from_parts(parts, body));

        let started = std::time::Instant::now();
        let result = if keyed.is_some() {
            Ok(sent.await)
        } else {
            tokio::time::timeout(self.inner.timeout, sent).await
        };
        let result_label = match &result {
            Ok(Ok(_)) => "answered",
            Ok(Err(err)) if err.is_connect() => "unreachable",
            Ok(Err(_)) => "failed",
            Err(_) => "timeout",
        };
        // Until the answer's head: its body streams on, so a slow body does not count.
        metrics::histogram!(metric_names::UPSTREAM_SECONDS, "result" => result_label)
            .record(started.elapsed().as_secs_f64());
        match result {
            Ok(Ok(response)) => {
                let (mut head, body) = response.into_parts();
                strip_hop_by_hop(&mut head.headers);
                // The gateway speaks its own protocol version to its client.
                head.version = http::Version::default();
                Response::from_parts(head, Body::new(body))
            }
            Ok(Err(err)) if err.is_connect() => {
                // The causes say why (refused, a certificate not trusted, …): for the operator.
                tracing::warn!(upstream = %self.inner.shown, error = %causes(&err), "upstream unreachable");
                let cause = match tls_failure(&err) {
                    Some(tls @ rustls::Error::InvalidCertificate(_)) => format!(
                        "its TLS certificate was rejected: {tls}; put the upstream's certificate or --upstream-ca right"
                    ),
                    Some(tls) => format!("the TLS handshake failed: {tls}"),
                    None => err.to_string(),
                };
                no_answer(NoAnswer::NotSent { cause })
            }
            Ok(Err(err)) => match client_body_failed(&err) {
                Some(failed) => {
                    // Only a request passed through gets here (a keyed body is read whole before
                    // anything is sent).
                    tracing::info!(upstream = %self.inner.shown, error = %failed, "a request body broke off; the forwarded request was cut off");
                    no_answer(NoAnswer::ClientBodyBroke {
                        cause: failed.to_string(),
                    })
                }
                None => {
                    tracing::warn!(upstream = %self.inner.shown, error = %causes(&err), "connection to the upstream lost after sending");
                    no_answer(NoAnswer::OutcomeUnknown { cause: err.to_string() })
                }
            },
            Err(_) => no_answer(NoAnswer::TimedOut {
                after: self.inner.timeout,
            }),
        }
    }
}

/// The client's body, if that is why sending the request failed: its client kept the gateway
/// waiting too long for it, or it broke off.
fn client_body_failed<'a>(err: &'a (dyn std::error::Error + 'static)) -> Option<&'a ClientBodyFailed> {
    std::iter::successors(Some(err), |err| err.source()).find_map(|err| err.downcast_ref::<ClientBodyFailed>())
}

/// The TLS error that stopped a connection to the upstream, if that is why it failed: a client
/// should learn that the upstream's certificate was refused, and why, not just "Connect".
fn tls_failure<'a>(err: &'a (dyn std::error::Error + 'static)) -> Option<&'a rustls::Error> {
    // tokio-rustls wraps it in an `io::Error`, and hyper-rustls that in another: an `io::Error`'s
    // `source` skips what it wraps, so each is opened by `get_ref`.
    let unwrapped = |err: &'a (dyn std::error::Error + 'static)| {
        std::iter::successors(Some(err), |err| {
            err.downcast_ref::<std::io::Error>()
                .and_then(std::io::Error::get_ref)
                .map(|inner| inner as &(dyn std::error::Error + 'static))
        })
    };
    std::iter::successors(Some(err), |err| err.source())
        .flat_map(unwrapped)
        .find_map(|err| err.downcast_ref::<rustls::Error>())
}

/// An error and its causes, `: `-separated.
fn causes(err: &(dyn std::error::Error + 'static)) -> String {
    std::iter::successors(Some(err), |err| err.source())
        .map(ToString::to_string)
        .collect::<Vec<_>>()
        .join(": ")
}

/// An empty response that says why it is not the upstream's answer; the layer answers it.
fn no_answer(why: NoAnswer) -> Response<Body> {
    let mut response = Response::new(Body::full(bytes::Bytes::new()));
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
        assert_eq!(proxy.prefix(), "/api", "the prefix the idempotency layer is told");
        let bare = Proxy::new("http://127.0.0.1:3000".parse().unwrap(), Duration::from_secs(1)).unwrap();
        assert_eq!(bare.target(&"/pay".parse().unwrap()), "http://127.0.0.1:3000/pay");
        assert_eq!(bare.prefix(), "", "nothing to climb out of");
    }

    #[test]
    fn refuses_upstreams_it_cannot_reach() {
        let second = Duration::from_secs(1);
        assert_eq!(
            Proxy::new("/relative".parse().unwrap(), second).unwrap_err().flag,
            "upstream"
        );
        assert_eq!(
            Proxy::new("ftp://host".parse().unwrap(), second).unwrap_err().flag,
            "upstream"
        );
        let ca = UpstreamOptions {
            ca: Some("ca.pem".into()),
            ..UpstreamOptions::default()
        };
        let err = Proxy::with_options("http://127.0.0.1:3000".parse().unwrap(), second, &ca).unwrap_err();
        assert_eq!(err.flag, "upstream-ca");
        let h2c = UpstreamOptions {
            http2: true,
            ..UpstreamOptions::default()
        };
        let err = Proxy::with_options("https://127.0.0.1:3000".parse().unwrap(), second, &h2c).unwrap_err();
        assert_eq!(err.flag, "upstream-http2");
        assert!(Proxy::with_options("http://127.0.0.1:3000".parse().unwrap(), second, &h2c).is_ok());
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

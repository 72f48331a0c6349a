//! How a listener holds its clients: at most `--max-connections` open (the others wait in the
//! kernel's listen queue); a client that takes longer than `--read-timeout` to send a request's
//! head is disconnected, one that keeps the gateway waiting longer for a body has it cut off; a
//! shutdown closes whatever is left when the grace is over. It speaks HTTP/1.1 and HTTP/2 (h2c by
//! prior knowledge on plain TCP; over TLS, whichever ALPN settled), and TLS when given a certificate.
//! A request's body is handed on with its read timeout ([`request_body`]).

use std::convert::Infallible;
use std::future::Future;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::task::{Context, Poll};
use std::time::Duration;

use idem_core::metric_names;

use axum::extract::ConnectInfo;
use http::Request;
use hyper::body::{Body as HttpBody, Frame, Incoming, SizeHint};
use hyper_util::rt::{TokioExecutor, TokioIo};
use hyper_util::server::conn::auto;
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{Notify, OwnedSemaphorePermit, Semaphore};
use tokio::time::Instant;
use tokio_rustls::TlsAcceptor;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tower::ServiceExt as _;

use crate::config::Limits;
use crate::head_limit;
use crate::tls::OverTls;

mod request_body;

pub(crate) use request_body::ClientBodyFailed;
use request_body::ReadTimeout;

/// How often at most a listener says that it is full.
const FULL_WARNING_EVERY: Duration = Duration::from_secs(60);

/// Serves `app` on `listener` (over TLS with `tls`) within `limits` until `shutdown` resolves;
/// then stops accepting, lets the open connections finish their requests and `background` its
/// work, and returns once all of that is done or `limits.shutdown_grace` has passed, having closed
/// what was left. `name` labels the `idem_connections_open` gauge.
pub(crate) async fn serve(
    name: &'static str,
    listener: TcpListener,
    tls: Option<TlsAcceptor>,
    app: axum::Router,
    limits: &Limits,
    background: &TaskTracker,
    shutdown: impl Future<Output = ()>,
) {
    let mut shutdown = std::pin::pin!(shutdown);
    let slots = Arc::new(Semaphore::new(limits.max_connections));
    let connections = TaskTracker::new();
    let graceful = CancellationToken::new();
    let cut = CancellationToken::new();
    let mut builder = auto::Builder::new(TokioExecutor::new());
    // The head is timed by `Connection::serve`, for both protocols and for the wait before the
    // first byte too (when hyper has not yet been told which protocol it speaks).
    builder.http1().header_read_timeout(None);
    let mut warned: Option<Instant> = None;
    loop {
        // Waiting for a slot before accepting leaves the connections beyond the limit in the
        // kernel's listen queue, served in turn as slots free up (as HAProxy's maxconn does): a
        // burst is served late instead of failed, a client never accepted hits its own connect
        // or request timeout and retries as after any network fault, and no accept-then-close
        // loop spends, under a flood of retrying clients, the CPU the limit is there to save.
        let slot = match slots.clone().try_acquire_owned() {
            Ok(slot) => slot,
            Err(_) => {
                if warned.is_none_or(|at| at.elapsed() >= FULL_WARNING_EVERY) {
                    warned = Some(Instant::now());
                    tracing::warn!(
                        listener = name,
                        max_connections = limits.max_connections,
                        "connection limit reached: new connections wait in the listen queue until one closes"
                    );
                }
                tokio::select! {
                    slot = slots.clone().acquire_owned() => slot.expect("the semaphore is never closed"),
                    () = &mut shutdown => break,
                }
            }
        };
        let (stream, remote) = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok(accepted) => accepted,
                Err(err) => {
                    accept_failed(name, err).await;
                    continue;
                }
            },
            () = &mut shutdown => break,
        };
        let _ = stream.set_nodelay(true);
        let gauge = metrics::gauge!(metric_names::CONNECTIONS_OPEN, "listener" => name);
        gauge.increment(1.0);
        let connection = Connection {
            builder: builder.clone(),
            tls: tls.clone(),
            app: app.clone(),
            read_timeout: limits.read_timeout,
            graceful: graceful.clone(),
            cut: cut.clone(),
            _slot: slot,
        };
        connections.spawn(async move {
            connection.serve(stream, remote).await;
            gauge.decrement(1.0);
        });
    }

    // Stop accepting: connections still in the listen queue are refused.
    drop(listener);
    let deadline = Instant::now() + limits.shutdown_grace;
    graceful.cancel();
    connections.close();
    background.close();
    // Connections first: while one is open it may still start background work.
    let drained = tokio::time::timeout_at(deadline, async {
        connections.wait().await;
        background.wait().await;
    })
    .await;
    if drained.is_err() {
        tracing::warn!(
            listener = name,
            grace = ?limits.shutdown_grace,
            connections = connections.len(),
            requests = background.len(),
            "shutdown grace over: closing the connections left; requests still running have their keys taken over when their leases end"
        );
    }
    cut.cancel();
    connections.wait().await;
}

/// Accepting fails for a connection that is already gone (nothing to do) or because the process
/// is out of file descriptors: then wait a little for some to close rather than spin.
async fn accept_failed(name: &'static str, err: std::io::Error) {
    use std::io::ErrorKind;
    if matches!(
        err.kind(),
        ErrorKind::ConnectionAborted | ErrorKind::ConnectionReset | ErrorKind::ConnectionRefused
    ) {
        return;
    }
    tracing::error!(listener = name, error = %err, "cannot accept a connection; retrying in 1 s");
    tokio::time::sleep(Duration::from_secs(1)).await;
}

/// One accepted connection and what it needs to be served.
struct Connection {
    builder: auto::Builder<TokioExecutor>,
    /// The TLS handshake to make first, if any.
    tls: Option<TlsAcceptor>,
    app: axum::Router,
    read_timeout: Duration,
    /// Asks the connection to finish its requests and close.
    graceful: CancellationToken,
    /// Closes the connection at once.
    cut: CancellationToken,
    /// Holds one of the listener's connection slots until the connection ends.
    _slot: OwnedSemaphorePermit,
}

impl Connection {
    /// Makes the TLS handshake, if the listener has TLS, then serves the connection. A client
    /// gets the read timeout to finish the handshake, as it does to send its first head.
    async fn serve(mut self, stream: TcpStream, remote: SocketAddr) {
        let Some(acceptor) = self.tls.take() else {
            return self.serve_http(stream, remote, false).await;
        };
        let handshake = tokio::time::timeout(self.read_timeout, acceptor.accept(stream));
        let stream = tokio::select! {
            done = handshake => match done {
                Ok(Ok(stream)) => stream,
                Ok(Err(err)) => {
                    tracing::debug!(%remote, error = %err, "TLS handshake failed");
                    return;
                }
                Err(_) => {
                    tracing::debug!(%remote, read_timeout = ?self.read_timeout, "closing a connection that did not finish its TLS handshake in time");
                    return;
                }
            },
            // No request has come yet: nothing to finish.
            () = self.graceful.cancelled() => return,
            () = self.cut.cancelled() => return,
        };
        self.serve_http(stream, remote, true).await;
    }

    /// Serves HTTP/1.1 or HTTP/2 on `stream` until the client closes it, it stays without a
    /// request for the read timeout, or the listener shuts down. `over_tls` marks its requests.
    async fn serve_http<S>(self, stream: S, remote: SocketAddr, over_tls: bool)
    where
        S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
    {
        let activity = Arc::new(Activity::new());
        let service = {
            let (app, activity, read_timeout) = (self.app, activity.clone(), self.read_timeout);
            hyper::service::service_fn(move |request: Request<Incoming>| {
                let in_flight = InFlight::start(&activity);
                let mut request = request.map(|body| ReadTimeout::new(body, read_timeout));
                request.extensions_mut().insert(ConnectInfo(remote));
                if over_tls {
                    request.extensions_mut().insert(OverTls);
                }
                // A head over the limit is answered here, before any layer sees it.
                let call = match head_limit::refusal(&request) {
                    Some(refused) => Err(refused),
                    None => Ok(app.clone().oneshot(request)),
                };
                async move {
                    let response = match call {
                        Ok(call) => call.await?,
                        Err(refused) => refused,
                    };
                    Ok::<_, Infallible>(response.map(|body| Answering {
                        body,
                        _in_flight: in_flight,
                    }))
                }
            })
        };
        let connection = self.builder.serve_connection(TokioIo::new(stream), service);
        let mut connection = std::pin::pin!(connection);
        let mut closing = false;
        loop {
            // While a request is being answered its body has a timeout of its own; between
            // requests (and before the first), the next head must come within the read timeout.
            let idle_until = activity.idle_since().map(|since| since + self.read_timeout);
            tokio::select! {
                served = connection.as_mut() => {
                    if let Err(err) = served {
                        tracing::debug!(%remote, error = %err, "connection ended with an error");
                    }
                    return;
                }
                () = self.cut.cancelled() => return,
                () = self.graceful.cancelled(), if !closing => {
                    closing = true;
                    connection.as_mut().graceful_shutdown();
                }
                () = activity.changed.notified() => {}
                () = tokio::time::sleep_until(idle_until.unwrap_or_else(Instant::now)), if idle_until.is_some() => {
                    // Checked again: a request may have started since the deadline was computed.
                    if activity.idle_since().is_some_and(|since| since.elapsed() >= self.read_timeout) {
                        tracing::debug!(%remote, read_timeout = ?self.read_timeout, "closing a connection that sent no request head in time");
                        return;
                    }
                }
            }
        }
    }
}

/// Whether a connection is answering requests, and since when it has not been.
#[derive(Debug)]
struct Activity {
    in_flight: AtomicUsize,
    idle_since: Mutex<Instant>,
    /// Woken when the last request in flight ends, so that the idle deadline is set again.
    changed: Notify,
}

impl Activity {
    fn new() -> Self {
        Self {
            in_flight: AtomicUsize::new(0),
            idle_since: Mutex::new(Instant::now()),
            changed: Notify::new(),
        }
    }

    /// When the connection went idle, or `None` while it answers a request.
    fn idle_since(&self) -> Option<Instant> {
        let since = *self.idle_since.lock().unwrap_or_else(PoisonError::into_inner);
        (self.in_flight.load(Ordering::SeqCst) == 0).then_some(since)
    }
}

/// One request being answered: from its head until its answer's body is done or dropped.
#[derive(Debug)]
struct InFlight(Arc<Activity>);

impl InFlight {
    fn start(activity: &Arc<Activity>) -> Self {
        activity.in_flight.fetch_add(1, Ordering::SeqCst);
        Self(activity.clone())
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        *self.0.idle_since.lock().unwrap_or_else(PoisonError::into_inner) = Instant::now();
        if self.0.in_flight.fetch_sub(1, Ordering::SeqCst) == 1 {
            self.0.changed.notify_one();
        }
    }
}

/// An answer's body that keeps its request counted as in flight until it is done.
#[derive(Debug)]
struct Answering<B> {
    body: B,
    _in_flight: InFlight,
}

impl<B: HttpBody + Unpin> HttpBody for Answering<B> {
    type Data = B::Data;
    type Error = B::Error;

    fn poll_frame(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<B::Data>, B::Error>>> {
        Pin::new(&mut self.body).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.body.size_hint()
    }
}

//! What the three servers share: the handler, the port, and serving with `axum::serve`.

use std::net::SocketAddr;

use axum::Router;
use axum::http::{StatusCode, header};
use axum::response::IntoResponse;
use axum::routing::post;

/// The answer of `POST /pay`: a small JSON body, as a payment API would return.
pub const ANSWER: &str = r#"{"id":"pay_0001","status":"created","amount":100,"currency":"EUR"}"#;

/// `POST /pay` → `201` with [`ANSWER`]. It reads nothing of the request: the cost measured is
/// the server's and the idempotency layer's, not the handler's.
pub async fn pay() -> impl IntoResponse {
    (
        StatusCode::CREATED,
        [(header::CONTENT_TYPE, "application/json")],
        ANSWER,
    )
}

/// The router every server starts from.
pub fn router() -> Router {
    Router::new().route("/pay", post(pay))
}

/// The address to listen on: the first argument, else `PORT`, as a port on 127.0.0.1 (or a
/// whole `host:port`).
pub fn listen_addr() -> SocketAddr {
    let value = std::env::args()
        .nth(1)
        .or_else(|| std::env::var("PORT").ok())
        .unwrap_or_else(|| die("give the port as the first argument or in PORT"));
    if let Ok(port) = value.parse::<u16>() {
        return SocketAddr::from(([127, 0, 0, 1], port));
    }
    value
        .parse()
        .unwrap_or_else(|_| die(&format!("not a port or host:port: {value:?}")))
}

/// The Redis URL of the stores: `REDIS_URL`, else redis://127.0.0.1:6379.
pub fn redis_url() -> String {
    std::env::var("REDIS_URL").unwrap_or_else(|_| "redis://127.0.0.1:6379".to_owned())
}

/// A key prefix unique to this run: `BENCH_PREFIX`, else `bench-<pid>-<nanos>`.
pub fn run_prefix() -> String {
    std::env::var("BENCH_PREFIX").unwrap_or_else(|_| {
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap_or_default()
            .as_nanos();
        format!("bench-{}-{nanos}", std::process::id())
    })
}

/// Serves `app` on `addr` until SIGTERM or Ctrl-C. The router is built once by the caller.
pub async fn serve(name: &str, addr: SocketAddr, app: Router) {
    let listener = tokio::net::TcpListener::bind(addr)
        .await
        .unwrap_or_else(|err| die(&format!("cannot listen on {addr}: {err}")));
    eprintln!("{name}: listening on http://{addr}");
    axum::serve(listener, app)
        .with_graceful_shutdown(async {
            let mut term =
                tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()).expect("a SIGTERM handler");
            tokio::select! {
                _ = term.recv() => {}
                _ = tokio::signal::ctrl_c() => {}
            }
        })
        .await
        .unwrap_or_else(|err| die(&format!("serving failed: {err}")));
}

/// Prints `message` and exits with status 2.
pub fn die(message: &str) -> ! {
    eprintln!("error: {message}");
    std::process::exit(2)
}

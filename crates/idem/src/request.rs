//! `idem request`: a curl-like client built on idem-client. It sends one logical request with
//! retries and one idempotency key, writes the final body to stdout and one summary line
//! (status, attempts, key, replayed) to stderr, and turns the outcome into the exit status.

use std::io::Read;
use std::process::ExitCode;
use std::time::Duration;

use clap::Args;
use http::{HeaderName, HeaderValue, Method};
use idem_client::reqwest_middleware::{self, ClientBuilder};
use idem_client::{ErrorExt, IdempotencyKey, IdempotencyMiddleware, ResponseExt, RetryReport};
use idem_core::IDEMPOTENCY_KEY;
use tokio::io::AsyncWriteExt;

use crate::units::parse_duration;

/// The exit statuses of `idem request`.
mod exit {
    /// The final answer is a 2xx.
    pub(super) const SUCCESS: u8 = 0;
    /// No final answer: the client gave up (no answer after the retries, the deadline, a
    /// `Retry-After` beyond the deadline) or the answer's body broke off.
    pub(super) const NO_ANSWER: u8 = 1;
    /// The command line or its inputs are wrong (clap uses 2 for its own usage errors too).
    pub(super) const USAGE: u8 = 2;
    /// The final answer is a 1xx or 3xx (a redirect that was not followed).
    pub(super) const OTHER: u8 = 3;
    /// The final answer is a 4xx: the request itself is refused; sending it again will not help.
    pub(super) const CLIENT_ERROR: u8 = 4;
    /// The final answer is a 5xx, after the retries allowed.
    pub(super) const SERVER_ERROR: u8 = 5;
}

/// `idem request` flags. `--retries`, `--timeout` and `--deadline` also read `IDEM_RETRIES`,
/// `IDEM_TIMEOUT` and `IDEM_DEADLINE`; the per-request flags (`-X`, `-H`, `-d`, `--key`) do not, so
/// that a variable left in a shell cannot silently give every request the same key.
#[derive(Debug, Args)]
#[command(after_help = "\
Exit status: 0 for a 2xx final answer; 1 when there is no final answer (the client gave up, or the
body broke off); 2 for a usage error; 3 for a 1xx or 3xx; 4 for a 4xx; 5 for a 5xx after the retries.")]
pub(crate) struct RequestArgs {
    /// The method; GET by default, POST when a body is given.
    #[arg(short = 'X', long = "request", value_name = "METHOD")]
    method: Option<Method>,
    /// A request header, `Name: value`; repeat for more.
    #[arg(short = 'H', long = "header", value_name = "NAME: VALUE", value_parser = parse_header)]
    headers: Vec<(HeaderName, HeaderValue)>,
    /// The body, `@FILE` to read it from a file, or `@-` to read standard input.
    #[arg(short = 'd', long = "data", value_name = "BODY|@FILE")]
    data: Option<String>,
    /// The idempotency key; by default a fresh UUIDv7 is stamped on POST and PATCH.
    #[arg(long, value_parser = parse_key)]
    key: Option<IdempotencyKey>,
    /// Retries after the first attempt.
    #[arg(long, env = "IDEM_RETRIES", default_value_t = 3)]
    retries: u32,
    /// The time limit of each attempt.
    #[arg(long, env = "IDEM_TIMEOUT", default_value = "30s", value_parser = parse_duration)]
    timeout: Duration,
    /// The time limit of the whole request, every attempt and wait included.
    #[arg(long, env = "IDEM_DEADLINE", default_value = "60s", value_parser = parse_duration)]
    deadline: Duration,
    /// The URL (http://; https:// needs idem-client's `rustls` feature in the build).
    url: reqwest::Url,
}

fn parse_header(text: &str) -> Result<(HeaderName, HeaderValue), String> {
    let (name, value) = text
        .split_once(':')
        .ok_or_else(|| format!("{text:?} is not a header such as 'Content-Type: application/json'"))?;
    let name = HeaderName::from_bytes(name.trim().as_bytes()).map_err(|e| format!("bad header name {name:?}: {e}"))?;
    let value = HeaderValue::from_str(value.trim()).map_err(|e| format!("bad value for {name}: {e}"))?;
    Ok((name, value))
}

fn parse_key(text: &str) -> Result<IdempotencyKey, String> {
    IdempotencyKey::new(text).map_err(|e| e.to_string())
}

/// Reads `-d`: the text itself, or the file (`@FILE`) or standard input (`@-`) it names.
fn read_body(data: &str) -> Result<Vec<u8>, String> {
    match data.strip_prefix('@') {
        Some("-") => {
            let mut body = Vec::new();
            std::io::stdin()
                .read_to_end(&mut body)
                .map_err(|e| format!("cannot read the body from standard input: {e}"))?;
            Ok(body)
        }
        Some(path) => std::fs::read(path).map_err(|e| format!("cannot read the body from {path}: {e}")),
        None => Ok(data.as_bytes().to_vec()),
    }
}

/// Runs `idem request`; the exit status follows [`exit`].
pub(crate) async fn run(args: RequestArgs) -> ExitCode {
    let request = match prepare(args) {
        Ok(request) => request,
        Err(message) => {
            eprintln!("idem: {message}");
            return ExitCode::from(exit::USAGE);
        }
    };
    ExitCode::from(send(request).await)
}

/// A request ready to send, its inputs checked.
struct Prepared {
    client: reqwest_middleware::ClientWithMiddleware,
    builder: reqwest_middleware::RequestBuilder,
    https: bool,
}

fn prepare(args: RequestArgs) -> Result<Prepared, String> {
    let body = args.data.as_deref().map(read_body).transpose()?;
    let method = args
        .method
        .unwrap_or(if body.is_some() { Method::POST } else { Method::GET });
    if args.key.is_some() && args.headers.iter().any(|(name, _)| *name == IDEMPOTENCY_KEY) {
        return Err("give the key either with --key or as an Idempotency-Key header, not both".to_owned());
    }
    // Proxies from the environment are never used: the answer must come from the URL given.
    let http = reqwest::Client::builder()
        .no_proxy()
        .timeout(args.timeout)
        .build()
        .map_err(|e| format!("cannot build the HTTP client: {e}"))?;
    let middleware = IdempotencyMiddleware::new()
        .with_max_retries(args.retries)
        .with_deadline(args.deadline);
    let client = ClientBuilder::new(http).with(middleware).build();
    let https = args.url.scheme() == "https";
    let mut builder = client.request(method, args.url);
    for (name, value) in args.headers {
        builder = builder.header(name, value);
    }
    if let Some(key) = &args.key {
        builder = builder.header(IDEMPOTENCY_KEY, key.to_header_value());
    }
    if let Some(body) = body {
        builder = builder.body(body);
    }
    Ok(Prepared { client, builder, https })
}

async fn send(request: Prepared) -> u8 {
    let Prepared { client, builder, https } = request;
    let result = builder.send().await;
    drop(client);
    let mut response = match result {
        Ok(response) => response,
        Err(err) => {
            let chain = error_chain(&err);
            eprintln!("idem: {chain}");
            if https && chain.contains("scheme is not http") {
                eprintln!("idem: this build has no TLS: https:// needs idem-client's `rustls` feature");
            }
            eprintln!("{}", summary(None, err.retry_report()));
            return exit::NO_ANSWER;
        }
    };
    let status = response.status();
    let report = response.retry_report().cloned();
    let mut stdout = tokio::io::stdout();
    let copied = async {
        while let Some(chunk) = response.chunk().await.map_err(|e| error_chain(&e))? {
            stdout
                .write_all(&chunk)
                .await
                .map_err(|e| format!("cannot write the body: {e}"))?;
        }
        stdout.flush().await.map_err(|e| format!("cannot write the body: {e}"))
    }
    .await;
    let line = summary(Some(status), report.as_ref());
    if let Err(message) = copied {
        eprintln!("idem: the answer's body broke off: {message}");
        eprintln!("{line}");
        return exit::NO_ANSWER;
    }
    eprintln!("{line}");
    match status.as_u16() {
        200..=299 => exit::SUCCESS,
        400..=499 => exit::CLIENT_ERROR,
        500..=599 => exit::SERVER_ERROR,
        _ => exit::OTHER,
    }
}

/// `idem: status=201 attempts=2 key=… replayed=true waited=1.023s`, with why the client stopped
/// early when it did.
fn summary(status: Option<http::StatusCode>, report: Option<&RetryReport>) -> String {
    let status = status.map_or_else(|| "none".to_owned(), |s| s.as_u16().to_string());
    match report {
        Some(report) => {
            let mut line = format!("idem: status={status} {report}");
            if let Some(stopped) = report.stopped {
                line.push_str(&format!(" (stopped: {stopped})"));
            }
            line
        }
        None => format!("idem: status={status} attempts=0"),
    }
}

/// An error and its causes on one line, each cause once.
fn error_chain(err: &(dyn std::error::Error + 'static)) -> String {
    let mut parts: Vec<String> = Vec::new();
    let mut next = Some(err);
    while let Some(err) = next {
        let text = err.to_string();
        if !parts.iter().any(|seen| seen.contains(&text)) {
            parts.push(text);
        }
        next = err.source();
    }
    parts.join(": ")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn headers_parse_like_curl() {
        let (name, value) = parse_header("Content-Type: application/json").unwrap();
        assert_eq!(name, http::header::CONTENT_TYPE);
        assert_eq!(value, "application/json");
        let (_, value) = parse_header("X-Empty:").unwrap();
        assert_eq!(value, "");
        assert!(parse_header("no colon").is_err());
        assert!(parse_header("bad name: x").is_err());
    }

    #[test]
    fn keys_are_checked_before_sending() {
        assert!(parse_key("order-42").is_ok());
        assert!(parse_key("has space").is_err());
        assert!(parse_key("").is_err());
    }

    #[test]
    fn bodies_come_from_text_or_files() {
        assert_eq!(read_body("a=1").unwrap(), b"a=1");
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("body.json");
        std::fs::write(&path, br#"{"amount":1}"#).unwrap();
        assert_eq!(read_body(&format!("@{}", path.display())).unwrap(), br#"{"amount":1}"#);
        let missing = read_body("@/nonexistent/body").unwrap_err();
        assert!(missing.contains("/nonexistent/body"), "{missing}");
    }
}

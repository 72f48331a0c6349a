//! The test's requests go on raw TCP ([`idem_test_support::wire`]): a method and a request target
//! exactly as spelt (`Post`, `//payments/1`, `/payments%2F1`, `*`), which an HTTP library would
//! correct. What this file adds is how the test reads an answer: the upstream's run id, the problem.

use std::net::SocketAddr;
use std::time::Duration;

pub(crate) use idem_test_support::wire::Answer;
use idem_test_support::wire::{self, Raw};

/// The longest a request may take (a waiting copy waits `--wait`, a hung run `--upstream-timeout`).
const LIMIT: Duration = Duration::from_secs(30);

/// How the test reads an answer.
pub(crate) trait Reading {
    /// The upstream's run id in the body, if the body is an upstream's answer.
    fn run(&self) -> Option<u64>;
    /// The last segment of a problem's `type` (`key-expired`), if the body is a problem.
    fn problem(&self) -> Option<String>;
    /// One line for the step log.
    fn summary(&self) -> String;
}

impl Reading for Answer {
    fn run(&self) -> Option<u64> {
        let body: serde_json::Value = serde_json::from_slice(&self.body).ok()?;
        body.get("run")?.as_u64()
    }

    fn problem(&self) -> Option<String> {
        if !self.is_problem() {
            return None;
        }
        let body: serde_json::Value = serde_json::from_slice(&self.body).ok()?;
        let kind = body.get("type")?.as_str()?;
        Some(kind.rsplit([':', '/']).next().unwrap_or(kind).to_owned())
    }

    fn summary(&self) -> String {
        let mut out = self.status.to_string();
        if let Some(problem) = self.problem() {
            out.push(' ');
            out.push_str(&problem);
        }
        if let Some(run) = self.run() {
            out.push_str(&format!(" run {run}"));
        }
        if self.replayed() {
            out.push_str(" (replayed)");
        }
        out
    }
}

/// How a request failed to get an answer.
pub(crate) type Failure = String;

/// Sends one JSON request on a new connection and reads the answer to its end.
pub(crate) async fn exchange(
    addr: SocketAddr,
    method: &str,
    target: &str,
    headers: &[(&str, String)],
    body: &str,
) -> Result<Answer, Failure> {
    let request = headers
        .iter()
        .fold(Raw::new(method, target).json(), |raw, (name, value)| raw.h(name, value));
    wire::send(addr, &request.sized(body.as_bytes()), LIMIT).await
}

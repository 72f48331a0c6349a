//! The test's HTTP/1.1 client, on raw TCP: it sends a method and a request target exactly as
//! spelt (`Post`, `//payments/1`, `/payments%2F1`, `*`), which an HTTP library would correct.

use std::net::SocketAddr;
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// The longest a request may take (a waiting copy waits `--wait`, a hung run `--upstream-timeout`).
const LIMIT: Duration = Duration::from_secs(30);

/// What came back.
#[derive(Debug, Clone)]
pub(crate) struct Answer {
    pub(crate) status: u16,
    pub(crate) headers: Vec<(String, String)>,
    pub(crate) body: String,
}

impl Answer {
    /// A header's value (names compared without case).
    pub(crate) fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(n, _)| n.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }

    /// `Idempotency-Replayed: true`.
    pub(crate) fn replayed(&self) -> bool {
        self.header("idempotency-replayed")
            .is_some_and(|v| v.trim().eq_ignore_ascii_case("true") || v.trim() == "?1")
    }

    /// The upstream's run id in the body, if the body is an upstream's answer.
    pub(crate) fn run(&self) -> Option<u64> {
        number_after(&self.body, "\"run\":")
    }

    /// The last segment of a problem's `type` (`key-expired`), if the body is a problem.
    pub(crate) fn problem(&self) -> Option<String> {
        let content_type = self.header("content-type").unwrap_or("");
        if !content_type.starts_with("application/problem+json") {
            return None;
        }
        let at = self.body.find("\"type\"")?;
        let rest = &self.body[at + 6..];
        let start = rest.find('"')? + 1;
        let end = start + rest[start..].find('"')?;
        let kind = &rest[start..end];
        Some(kind.rsplit([':', '/']).next().unwrap_or(kind).to_owned())
    }

    /// One line for the step log.
    pub(crate) fn summary(&self) -> String {
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

/// Sends one request on a new connection and reads the answer to its end.
pub(crate) async fn exchange(
    addr: SocketAddr,
    method: &str,
    target: &str,
    headers: &[(&str, String)],
    body: &str,
) -> Result<Answer, Failure> {
    let mut bytes = format!("{method} {target} HTTP/1.1\r\nhost: {addr}\r\nconnection: close\r\n");
    bytes.push_str("content-type: application/json\r\n");
    bytes.push_str(&format!("content-length: {}\r\n", body.len()));
    for (name, value) in headers {
        bytes.push_str(&format!("{name}: {value}\r\n"));
    }
    bytes.push_str("\r\n");
    bytes.push_str(body);
    let talk = async {
        let mut stream = TcpStream::connect(addr).await.map_err(|e| format!("connect: {e}"))?;
        stream
            .write_all(bytes.as_bytes())
            .await
            .map_err(|e| format!("write: {e}"))?;
        let mut buf = Vec::new();
        stream
            .read_to_end(&mut buf)
            .await
            .map_err(|e| format!("read: {e} after {} bytes", buf.len()))?;
        parse_answer(&buf).ok_or_else(|| format!("not an HTTP answer: {:?}", String::from_utf8_lossy(&buf)))
    };
    match tokio::time::timeout(LIMIT, talk).await {
        Ok(result) => result,
        Err(_) => Err(format!("no answer within {LIMIT:?}")),
    }
}

fn parse_answer(buf: &[u8]) -> Option<Answer> {
    let at = buf.windows(4).position(|w| w == b"\r\n\r\n")?;
    let head = String::from_utf8_lossy(&buf[..at]).into_owned();
    let rest = &buf[at + 4..];
    let mut lines = head.split("\r\n");
    let status: u16 = lines.next()?.split(' ').nth(1)?.parse().ok()?;
    let headers: Vec<(String, String)> = lines
        .filter_map(|line| line.split_once(':'))
        .map(|(n, v)| (n.trim().to_ascii_lowercase(), v.trim().to_owned()))
        .collect();
    let chunked = headers
        .iter()
        .any(|(n, v)| n == "transfer-encoding" && v.to_ascii_lowercase().contains("chunked"));
    let body = if chunked { dechunk(rest)?.0 } else { rest.to_vec() };
    Some(Answer {
        status,
        headers,
        body: String::from_utf8_lossy(&body).into_owned(),
    })
}

/// Decodes a whole chunked body at the start of `buf`: the body and the bytes it took, or `None`
/// if it is not complete yet.
pub(crate) fn dechunk(buf: &[u8]) -> Option<(Vec<u8>, usize)> {
    let mut body = Vec::new();
    let mut pos = 0;
    loop {
        let line_end = pos + buf[pos..].windows(2).position(|w| w == b"\r\n")?;
        let size_text = String::from_utf8_lossy(&buf[pos..line_end]);
        let size = usize::from_str_radix(size_text.split(';').next()?.trim(), 16).ok()?;
        pos = line_end + 2;
        if size == 0 {
            // Trailers, if any, end with an empty line.
            let end = pos + buf[pos..].windows(2).position(|w| w == b"\r\n")?;
            return Some((body, end + 2));
        }
        if buf.len() < pos + size + 2 {
            return None;
        }
        body.extend_from_slice(&buf[pos..pos + size]);
        pos += size + 2;
    }
}

fn number_after(text: &str, needle: &str) -> Option<u64> {
    let at = text.find(needle)? + needle.len();
    let digits: String = text[at..]
        .trim_start()
        .chars()
        .take_while(char::is_ascii_digit)
        .collect();
    digits.parse().ok()
}

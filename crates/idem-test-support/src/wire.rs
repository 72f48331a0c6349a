//! HTTP/1.1 on raw TCP, written once for every test that needs it: a client that sends bytes
//! exactly as given (a method in another case, `//payments/1`, a header with a control byte, a
//! body that breaks off — what an HTTP library would tidy up or refuse to send), the parser of
//! what comes back, and the reading half of an upstream that must misbehave on purpose (read a
//! request, then hang or hang up — what a framework will not do).

use std::net::SocketAddr;
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// One answer read off the wire.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Answer {
    /// The status code.
    pub status: u16,
    /// The header fields in order, names in lower case, values as sent (trimmed).
    pub headers: Vec<(String, Vec<u8>)>,
    /// The body, de-chunked.
    pub body: Vec<u8>,
    /// False if the connection ended before the whole body came.
    pub complete: bool,
}

impl Answer {
    /// A header's value as text (names compared without case).
    pub fn header(&self, name: &str) -> Option<String> {
        self.headers
            .iter()
            .find(|(n, _)| n.eq_ignore_ascii_case(name))
            .map(|(_, v)| String::from_utf8_lossy(v).into_owned())
    }

    /// The body as text.
    pub fn text(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }

    /// Whether the answer is a problem (`application/problem+json`).
    pub fn is_problem(&self) -> bool {
        self.header("content-type")
            .is_some_and(|ct| ct.trim().to_ascii_lowercase().starts_with("application/problem+json"))
    }

    /// Whether the gateway marked the answer as a replay (`Idempotency-Replayed: true`).
    pub fn replayed(&self) -> bool {
        self.header("idempotency-replayed")
            .is_some_and(|v| v.trim().eq_ignore_ascii_case("true") || v.trim() == "?1")
    }

    /// Asserts that this is a `status` answer carrying the problem `name` (`urn:idem:problem:NAME`).
    #[track_caller]
    pub fn assert_problem(&self, status: u16, name: &str) {
        assert_eq!(self.status, status, "{self}");
        assert!(
            self.text().contains(&format!("urn:idem:problem:{name}")),
            "a {name} problem: {self}"
        );
    }

    /// The answer on one line, control bytes escaped, for an assertion message.
    pub fn describe(&self) -> String {
        let headers: Vec<String> = self
            .headers
            .iter()
            .map(|(n, v)| format!("{n}: {}", escape(v, 80)))
            .collect();
        format!(
            "{}{} [{}] body={}",
            self.status,
            if self.complete { "" } else { " (body broke off)" },
            headers.join("; "),
            escape(&self.body, 300)
        )
    }
}

impl std::fmt::Display for Answer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.describe())
    }
}

/// How an exchange ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Ending {
    /// All the answers wanted came.
    Answered,
    /// The server closed the connection.
    Closed,
    /// The connection broke (reset).
    Broken(String),
    /// Neither the answers wanted nor a close within the time limit: a hang.
    TimedOut,
    /// The bytes that came back are not HTTP/1.x.
    NotHttp(String),
    /// Could not connect at all.
    ConnectFailed(String),
}

/// What [`parse_answers`] found.
#[derive(Debug, Default)]
pub struct Parsed {
    /// The answers, in order.
    pub answers: Vec<Answer>,
    /// Whether bytes that are not an HTTP/1.x answer came.
    pub not_http: bool,
}

/// Where `needle` first occurs in `haystack`.
fn find(haystack: &[u8], needle: &[u8]) -> Option<usize> {
    haystack.windows(needle.len()).position(|w| w == needle)
}

/// Parses as many answers as `buf` holds (1xx answers skipped). At `eof`, a last answer whose body
/// is incomplete is returned too, marked incomplete, and an answer framed by the end of the
/// connection ends there.
pub fn parse_answers(buf: &[u8], eof: bool) -> Parsed {
    let mut parsed = Parsed::default();
    let mut pos = 0;
    while pos < buf.len() {
        let rest = &buf[pos..];
        let prefix = &rest[..rest.len().min(7)];
        if !b"HTTP/1.".starts_with(prefix) {
            parsed.not_http = true;
            return parsed;
        }
        let Some(end) = find(rest, b"\r\n\r\n") else {
            return parsed;
        };
        let mut lines = rest[..end]
            .split(|&b| b == b'\n')
            .map(|l| l.strip_suffix(b"\r").unwrap_or(l));
        let status_line = String::from_utf8_lossy(lines.next().unwrap_or_default()).into_owned();
        let Some(status) = status_line.split(' ').nth(1).and_then(|s| s.parse::<u16>().ok()) else {
            parsed.not_http = true;
            return parsed;
        };
        let headers: Vec<(String, Vec<u8>)> = lines
            .filter_map(|line| {
                let colon = line.iter().position(|&b| b == b':')?;
                let name = String::from_utf8_lossy(&line[..colon]).trim().to_ascii_lowercase();
                Some((name, line[colon + 1..].trim_ascii().to_vec()))
            })
            .collect();
        let body_start = pos + end + 4;
        let header = |name: &str| {
            headers
                .iter()
                .find(|(n, _)| n == name)
                .map(|(_, v)| String::from_utf8_lossy(v).into_owned())
        };
        if (100..200).contains(&status) {
            pos = body_start;
            continue;
        }
        let (body, consumed, complete) = if status == 204 || status == 304 {
            (Vec::new(), 0, true)
        } else if header("transfer-encoding").is_some_and(|te| te.to_ascii_lowercase().contains("chunked")) {
            match dechunk(&buf[body_start..]) {
                Some((body, consumed)) => (body, consumed, true),
                None if eof => (buf[body_start..].to_vec(), buf.len() - body_start, false),
                None => return parsed,
            }
        } else if let Some(len) = header("content-length").and_then(|l| l.trim().parse::<usize>().ok()) {
            if buf.len() - body_start >= len {
                (buf[body_start..body_start + len].to_vec(), len, true)
            } else if eof {
                (buf[body_start..].to_vec(), buf.len() - body_start, false)
            } else {
                return parsed;
            }
        } else if eof {
            (buf[body_start..].to_vec(), buf.len() - body_start, true)
        } else {
            return parsed;
        };
        parsed.answers.push(Answer {
            status,
            headers,
            body,
            complete,
        });
        pos = body_start + consumed;
    }
    parsed
}

/// Decodes a whole chunked body at the start of `buf`: its data and how many bytes it took (the
/// trailers included), or `None` if it is not all there yet.
pub fn dechunk(buf: &[u8]) -> Option<(Vec<u8>, usize)> {
    let mut body = Vec::new();
    let mut pos = 0;
    loop {
        let line_end = pos + find(&buf[pos..], b"\r\n")?;
        let size_text = String::from_utf8_lossy(&buf[pos..line_end]);
        let size = usize::from_str_radix(size_text.split(';').next()?.trim(), 16).ok()?;
        pos = line_end + 2;
        if size == 0 {
            let end = pos + find(&buf[pos..], b"\r\n")?;
            // Trailers, if any, end with an empty line.
            let end = if end == pos {
                end
            } else {
                pos + find(&buf[pos..], b"\r\n\r\n")? + 2
            };
            return Some((body, end + 2));
        }
        if buf.len() < pos + size + 2 {
            return None;
        }
        body.extend_from_slice(&buf[pos..pos + size]);
        pos += size + 2;
    }
}

/// `bytes` as text for a message: printable ASCII as is, the rest escaped, cut after `limit` bytes.
pub fn escape(bytes: &[u8], limit: usize) -> String {
    let shown = &bytes[..bytes.len().min(limit)];
    let mut text = shown.escape_ascii().to_string();
    if bytes.len() > limit {
        text.push_str(&format!("… ({} bytes)", bytes.len()));
    }
    text
}

/// A request written by hand: the request line and the header fields exactly as given, in order.
#[derive(Debug, Clone)]
pub struct Raw {
    line: Vec<u8>,
    headers: Vec<(Vec<u8>, Vec<u8>)>,
}

impl Raw {
    /// `METHOD TARGET HTTP/1.1` with `Host` and `Connection: close`.
    pub fn new(method: &str, target: &str) -> Self {
        Self::line(format!("{method} {target} HTTP/1.1"))
    }

    /// Any request line, with `Host` and `Connection: close`.
    pub fn line(line: impl Into<Vec<u8>>) -> Self {
        Self {
            line: line.into(),
            headers: vec![
                (b"Host".to_vec(), b"127.0.0.1".to_vec()),
                (b"Connection".to_vec(), b"close".to_vec()),
            ],
        }
    }

    /// With one more header field.
    pub fn h(mut self, name: impl AsRef<[u8]>, value: impl AsRef<[u8]>) -> Self {
        self.headers.push((name.as_ref().to_vec(), value.as_ref().to_vec()));
        self
    }

    /// With `Content-Type: application/json`.
    pub fn json(self) -> Self {
        self.h("Content-Type", "application/json")
    }

    /// Without the header fields named `name` (compared without case).
    pub fn without(mut self, name: &str) -> Self {
        self.headers.retain(|(n, _)| !n.eq_ignore_ascii_case(name.as_bytes()));
        self
    }

    /// The head, ending with the empty line.
    pub fn head(&self) -> Vec<u8> {
        let mut out = self.line.clone();
        out.extend_from_slice(b"\r\n");
        for (name, value) in &self.headers {
            out.extend_from_slice(name);
            out.extend_from_slice(b": ");
            out.extend_from_slice(value);
            out.extend_from_slice(b"\r\n");
        }
        out.extend_from_slice(b"\r\n");
        out
    }

    /// With `Content-Length` and `body`.
    pub fn sized(&self, body: &[u8]) -> Vec<u8> {
        let mut out = self.clone().h("Content-Length", body.len().to_string()).head();
        out.extend_from_slice(body);
        out
    }

    /// The head, then `rest` as is.
    pub fn then_raw(&self, rest: &[u8]) -> Vec<u8> {
        let mut out = self.head();
        out.extend_from_slice(rest);
        out
    }
}

/// Writes `bytes` on a new connection (half-closing after them if asked) while reading, until
/// `want` answers came, the server closed, or `limit` passed.
pub async fn exchange(
    addr: SocketAddr,
    bytes: &[u8],
    half_close: bool,
    want: usize,
    limit: Duration,
) -> (Vec<Answer>, Ending) {
    let mut stream = match tokio::time::timeout(Duration::from_secs(10), TcpStream::connect(addr)).await {
        Ok(Ok(stream)) => stream,
        Ok(Err(err)) => return (Vec::new(), Ending::ConnectFailed(err.to_string())),
        Err(_) => return (Vec::new(), Ending::ConnectFailed("timed out".into())),
    };
    let _ = stream.set_nodelay(true);
    // Borrowed halves: dropping them does not shut the write side down.
    let (mut reader, mut writer) = stream.split();
    let write = async {
        let written = writer.write_all(bytes).await;
        if written.is_ok() && half_close {
            let _ = writer.shutdown().await;
        }
    };
    let read = async {
        let mut buf = Vec::new();
        let mut chunk = vec![0u8; 64 * 1024];
        loop {
            match reader.read(&mut chunk).await {
                Ok(0) => return (parse_answers(&buf, true), Ending::Closed),
                Ok(n) => {
                    buf.extend_from_slice(&chunk[..n]);
                    let parsed = parse_answers(&buf, false);
                    if parsed.not_http {
                        return (parsed, Ending::NotHttp(escape(&buf, 60)));
                    }
                    if parsed.answers.len() >= want {
                        return (parsed, Ending::Answered);
                    }
                }
                Err(err) => return (parse_answers(&buf, true), Ending::Broken(err.to_string())),
            }
        }
    };
    let read = tokio::time::timeout(limit, read);
    tokio::pin!(write, read);
    let mut writing = true;
    loop {
        tokio::select! {
            () = &mut write, if writing => writing = false,
            outcome = &mut read => {
                return match outcome {
                    Ok((parsed, ending)) => (parsed.answers, ending),
                    Err(_) => (Vec::new(), Ending::TimedOut),
                };
            }
        }
    }
}

/// Sends `bytes` (one request that asks for `Connection: close`) on a new connection and reads
/// until the server closes it: the one whole answer, or what went wrong instead.
pub async fn send(addr: SocketAddr, bytes: &[u8], limit: Duration) -> Result<Answer, String> {
    let (answers, ending) = exchange(addr, bytes, false, usize::MAX, limit).await;
    if ending != Ending::Closed {
        return Err(match ending {
            Ending::TimedOut => format!("no answer within {limit:?}"),
            other => format!("{other:?} after {} answer(s)", answers.len()),
        });
    }
    match <[Answer; 1]>::try_from(answers) {
        Ok([answer]) if answer.complete => Ok(answer),
        Ok([answer]) => Err(format!("the answer broke off: {}", answer.describe())),
        Err(answers) => Err(format!("{} answers to one request: {answers:?}", answers.len())),
    }
}

/// Reads one answer from an open connection, waiting at most `limit`; the connection stays open.
pub async fn read_answer(stream: &mut TcpStream, limit: Duration) -> Result<Answer, String> {
    let deadline = tokio::time::Instant::now() + limit;
    let mut data = Vec::new();
    let mut chunk = [0u8; 4096];
    loop {
        let parsed = parse_answers(&data, false);
        if parsed.not_http {
            return Err(format!("not an HTTP answer: {}", escape(&data, 300)));
        }
        if let Some(answer) = parsed.answers.into_iter().next() {
            return Ok(answer);
        }
        match tokio::time::timeout_at(deadline, stream.read(&mut chunk)).await {
            Err(_) => return Err(format!("no whole answer within {limit:?}; got {}", escape(&data, 300))),
            Ok(Ok(0)) => {
                return Err(format!(
                    "the connection closed before a whole answer; got {}",
                    escape(&data, 300)
                ));
            }
            Ok(Ok(n)) => data.extend_from_slice(&chunk[..n]),
            Ok(Err(err)) => return Err(format!("reading the answer failed: {err}")),
        }
    }
}

/// A request as an upstream read it off the wire.
#[derive(Debug, Clone)]
pub struct Request {
    /// The method, as spelt.
    pub method: String,
    /// The request target, as spelt.
    pub target: String,
    /// The header fields in order, names in lower case, values trimmed.
    pub headers: Vec<(String, String)>,
    /// The body, de-chunked.
    pub body: Vec<u8>,
}

impl Request {
    /// A header's value (names compared without case).
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(n, _)| n.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }
}

/// Reads one whole request (head and body, framed by `Content-Length` or chunked); `None` if the
/// connection ends or breaks first.
pub async fn read_request(stream: &mut TcpStream) -> Option<Request> {
    let (head, mut rest) = read_head(stream).await?;
    let text = String::from_utf8_lossy(&head).into_owned();
    let mut lines = text.split("\r\n");
    let mut first = lines.next()?.split(' ');
    let method = first.next()?.to_owned();
    let target = first.next()?.to_owned();
    let headers: Vec<(String, String)> = lines
        .filter_map(|line| line.split_once(':'))
        .map(|(n, v)| (n.trim().to_ascii_lowercase(), v.trim().to_owned()))
        .collect();
    let value = |name: &str| headers.iter().find(|(n, _)| n == name).map(|(_, v)| v.clone());
    let body = if value("transfer-encoding").is_some_and(|v| v.to_ascii_lowercase().contains("chunked")) {
        loop {
            if let Some((body, _)) = dechunk(&rest) {
                break body;
            }
            read_more(stream, &mut rest).await?;
        }
    } else {
        let length: usize = value("content-length").and_then(|v| v.parse().ok()).unwrap_or(0);
        while rest.len() < length {
            read_more(stream, &mut rest).await?;
        }
        rest.truncate(length);
        rest
    };
    Some(Request {
        method,
        target,
        headers,
        body,
    })
}

/// Reads up to the end of a message head; returns the head (without its blank line) and what came
/// after it. `None` if the connection ends or breaks first.
pub async fn read_head(stream: &mut TcpStream) -> Option<(Vec<u8>, Vec<u8>)> {
    let mut buf = Vec::new();
    loop {
        if let Some(at) = find(&buf, b"\r\n\r\n") {
            let rest = buf.split_off(at + 4);
            buf.truncate(at);
            return Some((buf, rest));
        }
        read_more(stream, &mut buf).await?;
    }
}

async fn read_more(stream: &mut TcpStream, buf: &mut Vec<u8>) -> Option<()> {
    let mut chunk = [0u8; 16 * 1024];
    let n = stream.read(&mut chunk).await.ok()?;
    if n == 0 {
        return None;
    }
    buf.extend_from_slice(&chunk[..n]);
    Some(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn answers_are_parsed_whatever_their_framing() {
        let wire = b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 201 Created\r\ncontent-length: 2\r\nIdempotency-Replayed: true\r\n\r\nokHTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n3\r\nabc\r\n0\r\n\r\nHTTP/1.1 200 OK\r\ncontent-length: 9\r\n\r\nhalf";
        let parsed = parse_answers(wire, false);
        assert!(!parsed.not_http);
        assert_eq!(parsed.answers.len(), 2, "the third is not whole yet");
        assert_eq!(parsed.answers[0].status, 201);
        assert!(parsed.answers[0].replayed());
        assert_eq!(parsed.answers[0].body, b"ok");
        assert_eq!(parsed.answers[1].body, b"abc");
        let at_eof = parse_answers(wire, true);
        assert_eq!(at_eof.answers.len(), 3);
        assert!(!at_eof.answers[2].complete);
        assert!(parse_answers(b"SSH-2.0\r\n", false).not_http);
        assert_eq!(
            dechunk(b"2\r\nab\r\n0\r\nx-t: 1\r\n\r\nrest"),
            Some((b"ab".to_vec(), 20))
        );
        assert_eq!(dechunk(b"2\r\nab\r\n"), None);
    }
}

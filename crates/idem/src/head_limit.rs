//! The gateway's limit on a request's head: a request line and headers over [`MAX_HEAD_BYTES`]
//! are refused with `431 head-too-large` before anything is claimed or sent.
//!
//! hyper refuses a head that does not fit its read buffer, but only once a read leaves the
//! buffer full before the head is complete: how much one read brings depends on the capacity the
//! allocator hands the buffer, so a head somewhat over the limit may be read whole and passed on,
//! and then refused by the upstream mid-request (`502 upstream-failed`, the key left unknown).
//! Counting the head here makes the limit the same on every read.

use axum::body::Body;
use http::{Request, Response};
use idem_core::{Problem, ProblemKind};

/// The most bytes of a request line and headers the gateway passes on: hyper's own default read
/// limit (400 KiB), made exact.
pub(crate) const MAX_HEAD_BYTES: usize = 400 * 1024;

/// The answer to a request whose head is over [`MAX_HEAD_BYTES`]; `None` for one within it. Run
/// by the listener before the request reaches the router, without a layer of its own.
pub(crate) fn refusal<B>(request: &Request<B>) -> Option<Response<Body>> {
    let size = head_size(request);
    (size > MAX_HEAD_BYTES).then(|| {
        let detail = format!(
            "the request line and headers are {size} bytes, over the {MAX_HEAD_BYTES} this gateway passes on; nothing was run. Send smaller headers."
        );
        Problem::new(ProblemKind::HeadTooLarge, detail).to_response().map(Body::from)
    })
}

/// The bytes of `request`'s head as HTTP/1.1 writes it: the request line and each header line.
fn head_size<B>(request: &Request<B>) -> usize {
    let uri = request.uri();
    let target = uri.scheme_str().map_or(0, |scheme| scheme.len() + "://".len())
        + uri.authority().map_or(0, |authority| authority.as_str().len())
        + uri.path_and_query().map_or(0, |target| target.as_str().len());
    let line = request.method().as_str().len() + target + "  HTTP/1.1\r\n".len();
    request
        .headers()
        .iter()
        .map(|(name, value)| name.as_str().len() + value.len() + ": \r\n".len())
        .sum::<usize>()
        + line
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_the_request_line_and_every_header_line() {
        let request = Request::builder()
            .method("POST")
            .uri("/pay?x=1")
            .header("a", "bc")
            .header("a", "d")
            .body(Body::empty())
            .unwrap();
        let line = "POST /pay?x=1 HTTP/1.1\r\n".len();
        assert_eq!(head_size(&request), line + "a: bc\r\n".len() + "a: d\r\n".len());
    }
}

//! A request body's read timeout: the body a listener hands on fails once its client has kept the
//! gateway waiting too long for it, with an error ([`ClientBodyFailed`]) that the proxy tells
//! apart from an upstream's failure.

use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use hyper::body::{Body as HttpBody, Frame, SizeHint};
use tokio::time::{Instant, Sleep};

type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// A request body that fails once its client has kept the gateway waiting for more than the read
/// timeout in all. Only time spent waiting for the client counts (not time in which nobody asked
/// for the body), so a body dripped in byte by byte is cut off as surely as one that stops, and a
/// fast client is never cut off because the upstream reads slowly. The idempotency layer answers
/// a keyed request whose body fails `400 body-incomplete`, with nothing claimed.
#[derive(Debug)]
pub(crate) struct ReadTimeout<B> {
    body: B,
    limit: Duration,
    /// What is left of `limit`.
    left: Duration,
    /// Since when the current wait for the client has lasted.
    waiting_since: Option<Instant>,
    timer: Option<Pin<Box<Sleep>>>,
    timed_out: bool,
}

impl<B> ReadTimeout<B> {
    pub(crate) fn new(body: B, limit: Duration) -> Self {
        Self {
            body,
            limit,
            left: limit,
            waiting_since: None,
            timer: None,
            timed_out: false,
        }
    }
}

/// The error of a [`ReadTimeout`] body: its client was too slow, or the body broke off (a
/// malformed chunk, a connection closed mid-body). Either way the client's fault, never the
/// upstream's.
#[derive(Debug)]
pub(crate) enum ClientBodyFailed {
    /// The client took longer than the read timeout to send it.
    TimedOut(Duration),
    /// The body could not be read whole.
    Broken(BoxError),
}

impl std::fmt::Display for ClientBodyFailed {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::TimedOut(limit) => write!(
                f,
                "the client took longer than the read timeout ({}) to send it",
                humantime::format_duration(*limit)
            ),
            Self::Broken(err) => write!(f, "{err}"),
        }
    }
}

impl std::error::Error for ClientBodyFailed {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            Self::TimedOut(_) => None,
            Self::Broken(err) => Some(&**err),
        }
    }
}

impl<B> HttpBody for ReadTimeout<B>
where
    B: HttpBody<Data = Bytes> + Unpin,
    B::Error: Into<BoxError>,
{
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        let this = &mut *self;
        if this.timed_out {
            return Poll::Ready(None);
        }
        match Pin::new(&mut this.body).poll_frame(cx) {
            Poll::Ready(frame) => {
                if let Some(since) = this.waiting_since.take() {
                    this.left = this.left.saturating_sub(since.elapsed());
                }
                Poll::Ready(frame.map(|frame| frame.map_err(|err| ClientBodyFailed::Broken(err.into()).into())))
            }
            Poll::Pending => {
                if this.waiting_since.is_none() {
                    let now = Instant::now();
                    this.waiting_since = Some(now);
                    match &mut this.timer {
                        Some(timer) => timer.as_mut().reset(now + this.left),
                        None => this.timer = Some(Box::pin(tokio::time::sleep_until(now + this.left))),
                    }
                }
                let timer = this.timer.as_mut().expect("armed when the wait began");
                if timer.as_mut().poll(cx).is_ready() {
                    this.timed_out = true;
                    return Poll::Ready(Some(Err(ClientBodyFailed::TimedOut(this.limit).into())));
                }
                Poll::Pending
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        self.timed_out || self.body.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.body.size_hint()
    }
}

#[cfg(test)]
mod tests {
    use std::convert::Infallible;

    use super::*;
    use http_body_util::BodyExt as _;
    use http_body_util::StreamBody;

    /// A body that sends `chunks` one-byte frames, `every` apart.
    fn dripping(chunks: usize, every: Duration) -> impl HttpBody<Data = Bytes, Error = Infallible> + Unpin {
        let (tx, rx) = tokio::sync::mpsc::channel(1);
        tokio::spawn(async move {
            for _ in 0..chunks {
                tokio::time::sleep(every).await;
                if tx.send(Ok(Frame::data(Bytes::from_static(b"x")))).await.is_err() {
                    return;
                }
            }
        });
        StreamBody::new(tokio_stream_from(rx))
    }

    fn tokio_stream_from<T: Send + 'static>(
        mut rx: tokio::sync::mpsc::Receiver<T>,
    ) -> impl futures_util::Stream<Item = T> + Unpin {
        Box::pin(futures_util::stream::poll_fn(move |cx| rx.poll_recv(cx)))
    }

    /// Asserts that a body failed because the client took too long.
    fn assert_timed_out(err: &BoxError) {
        assert!(
            matches!(
                err.downcast_ref::<ClientBodyFailed>(),
                Some(ClientBodyFailed::TimedOut(_))
            ),
            "{err}"
        );
    }

    #[tokio::test]
    async fn a_body_that_comes_in_time_is_read_whole() {
        let body = ReadTimeout::new(dripping(5, Duration::from_millis(10)), Duration::from_secs(2));
        let bytes = body.collect().await.expect("in time").to_bytes();
        assert_eq!(&bytes[..], b"xxxxx");
    }

    #[tokio::test]
    async fn a_body_that_stops_fails_after_the_timeout() {
        let started = Instant::now();
        let body = ReadTimeout::new(dripping(1, Duration::from_secs(60)), Duration::from_millis(200));
        let err = body.collect().await.expect_err("the client stalled");
        assert_timed_out(&err);
        let waited = started.elapsed();
        assert!(
            waited >= Duration::from_millis(200) && waited < Duration::from_secs(5),
            "{waited:?}"
        );
    }

    #[tokio::test]
    async fn a_dripping_body_fails_when_its_waits_add_up_to_the_timeout() {
        // Each byte comes well within the timeout, but all of them together would not.
        let body = ReadTimeout::new(dripping(100, Duration::from_millis(50)), Duration::from_millis(300));
        let err = body.collect().await.expect_err("the client dripped");
        assert_timed_out(&err);
    }
}

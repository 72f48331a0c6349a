//! The body type the layer hands to the inner service and returns to the caller, and the helpers
//! that buffer a body up to a limit.

use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::Bytes;
use futures_util::StreamExt;
use http_body::{Body as HttpBody, Frame};
use http_body_util::{BodyExt, BodyStream, Full, StreamBody, combinators::UnsyncBoxBody};

/// The error type of [`Body`].
pub type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// A type-erased HTTP body: buffered bodies of keyed requests and replays, and the streamed bodies
/// of everything else.
// A newtype rather than an alias: projections through `dyn Error` aliases defeat `Send` inference
// of the futures that hold them.
pub struct Body(UnsyncBoxBody<Bytes, BoxError>);

impl Body {
    /// A body holding `bytes`.
    pub fn full(bytes: impl Into<Bytes>) -> Self {
        Self(Full::new(bytes.into()).map_err(|never| match never {}).boxed_unsync())
    }

    /// Erases a body's type.
    pub fn new<B>(body: B) -> Self
    where
        B: HttpBody<Data = Bytes> + Send + 'static,
        B::Error: Into<BoxError>,
    {
        Self(body.map_err(Into::into).boxed_unsync())
    }
}

impl std::fmt::Debug for Body {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Body").finish_non_exhaustive()
    }
}

impl HttpBody for Body {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        Pin::new(&mut self.0).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.0.is_end_stream()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        self.0.size_hint()
    }
}

/// A body holding `bytes`.
pub(crate) fn full(bytes: impl Into<Bytes>) -> Body {
    Body::full(bytes)
}

/// Erases a body's type.
pub(crate) fn boxed<B>(body: B) -> Body
where
    B: HttpBody<Data = Bytes> + Send + 'static,
    B::Error: Into<BoxError>,
{
    Body::new(body)
}

/// A body read up to a limit.
pub(crate) enum Collected {
    /// The whole body, within the limit.
    Whole(Bytes),
    /// The body went over the limit: what was read, and the rest still to stream.
    Overflow(Body),
    /// Reading failed before the limit.
    Failed(BoxError),
}

/// Reads `body` until it ends or grows past `limit` bytes.
pub(crate) async fn collect_up_to(mut body: Body, limit: usize) -> Collected {
    let mut chunks: Vec<Bytes> = Vec::new();
    let mut len = 0;
    loop {
        match body.frame().await {
            None => return Collected::Whole(concat(chunks)),
            Some(Err(err)) => return Collected::Failed(err),
            Some(Ok(frame)) => {
                // Trailers are not stored; only data counts.
                let Ok(data) = frame.into_data() else { continue };
                len += data.len();
                chunks.push(data);
                if len > limit {
                    let read = futures_util::stream::iter(chunks.into_iter().map(|c| Ok(Frame::data(c))));
                    let rest = BodyStream::new(body);
                    return Collected::Overflow(Body::new(StreamBody::new(read.chain(rest))));
                }
            }
        }
    }
}

fn concat(chunks: Vec<Bytes>) -> Bytes {
    match chunks.len() {
        0 => Bytes::new(),
        1 => chunks.into_iter().next().expect("one chunk"),
        _ => chunks.concat().into(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn chunked(chunks: &[&'static [u8]]) -> Body {
        let frames = chunks
            .iter()
            .map(|c| Ok::<_, BoxError>(Frame::data(Bytes::from_static(c))))
            .collect::<Vec<_>>();
        Body::new(StreamBody::new(futures_util::stream::iter(frames)))
    }

    #[tokio::test]
    async fn keeps_small_bodies_whole_and_streams_large_ones_intact() {
        let Collected::Whole(bytes) = collect_up_to(chunked(&[b"ab", b"cd"]), 4).await else {
            panic!("fits")
        };
        assert_eq!(bytes, "abcd");
        let Collected::Overflow(rest) = collect_up_to(chunked(&[b"ab", b"cd", b"e", b"fg"]), 4).await else {
            panic!("over the limit")
        };
        assert_eq!(
            rest.collect().await.unwrap().to_bytes(),
            "abcdefg",
            "nothing read is lost"
        );
    }
}

//! The response body handed to the caller, intact even when the layer has read its start.

use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::{Buf, Bytes, BytesMut};
use http::HeaderMap;
use http_body::{Body, Frame, SizeHint};
use http_body_util::BodyExt as _;

/// The response body returned by [`IdempotentRetry`](super::IdempotentRetry).
///
/// Usually the inner client's body as it is. For a `409` the layer first reads up to a bound
/// to tell "in progress, retry" from a business conflict; what it read is given back here first,
/// followed by whatever it did not read, so the caller sees the body byte for byte.
#[derive(Debug)]
pub struct ResponseBody<B> {
    head: Option<Bytes>,
    trailers: Option<HeaderMap>,
    rest: Option<Pin<Box<B>>>,
}

impl<B> ResponseBody<B> {
    pub(crate) fn new(body: B) -> Self {
        Self {
            head: None,
            trailers: None,
            rest: Some(Box::pin(body)),
        }
    }
}

impl<B> ResponseBody<B>
where
    B: Body,
{
    /// Reads frames until the body ends or more than `limit` bytes arrived. Returns the bytes
    /// read when the whole body fit, and the body to hand on either way.
    pub(crate) async fn peek(
        mut body: Pin<Box<B>>,
        limit: usize,
    ) -> Result<(Option<Bytes>, Self), B::Error> {
        let mut head = BytesMut::new();
        let mut trailers = None;
        let mut ended = false;
        while head.len() <= limit {
            match body.frame().await {
                None => {
                    ended = true;
                    break;
                }
                Some(frame) => match frame?.into_data() {
                    Ok(mut data) => head.extend_from_slice(&data.copy_to_bytes(data.remaining())),
                    Err(frame) => {
                        // Trailers close the body.
                        trailers = frame.into_trailers().ok();
                        ended = true;
                        break;
                    }
                },
            }
        }
        let head = head.freeze();
        let complete = ended.then(|| head.clone());
        let body = Self {
            head: (!head.is_empty()).then_some(head),
            trailers,
            rest: (!ended).then_some(body),
        };
        Ok((complete, body))
    }
}

impl<B> Body for ResponseBody<B>
where
    B: Body,
{
    type Data = Bytes;
    type Error = B::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Self::Data>, Self::Error>>> {
        let this = &mut *self;
        if let Some(head) = this.head.take() {
            return Poll::Ready(Some(Ok(Frame::data(head))));
        }
        if let Some(rest) = this.rest.as_mut() {
            let frame = match rest.as_mut().poll_frame(cx) {
                Poll::Pending => return Poll::Pending,
                Poll::Ready(frame) => frame,
            };
            match frame {
                Some(frame) => {
                    let frame = frame.map(|frame| {
                        frame.map_data(|mut data| data.copy_to_bytes(data.remaining()))
                    });
                    return Poll::Ready(Some(frame));
                }
                None => this.rest = None,
            }
        }
        Poll::Ready(
            this.trailers
                .take()
                .map(|trailers| Ok(Frame::trailers(trailers))),
        )
    }

    fn is_end_stream(&self) -> bool {
        self.head.is_none()
            && self.trailers.is_none()
            && self.rest.as_ref().is_none_or(|rest| rest.is_end_stream())
    }

    fn size_hint(&self) -> SizeHint {
        let head = self.head.as_ref().map_or(0, |head| head.len() as u64);
        let rest = self
            .rest
            .as_ref()
            .map_or_else(|| SizeHint::with_exact(0), |rest| rest.size_hint());
        let mut hint = SizeHint::new();
        if let Some(upper) = rest.upper() {
            hint.set_upper(upper.saturating_add(head));
        }
        hint.set_lower(rest.lower().saturating_add(head));
        hint
    }
}

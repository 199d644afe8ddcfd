//! The transactional part of an intent is never cancelled halfway.
//!
//! A client that hangs up drops the request's future. Dropping it in the middle of a
//! transaction would return a pooled connection with its transaction still open (sqlx has shipped
//! such a bug in `begin()`), and every later user of that connection would wait forever. So
//! the work runs in the caller's task, and only if the caller goes away does what is left of it
//! move to a task of its own.

use std::any::Any;
use std::future::Future;
use std::panic::AssertUnwindSafe;
use std::pin::Pin;
use std::task::{Context, Poll};

/// A future that is never cancelled halfway: it runs in the caller's task, and if the caller
/// drops it before it is done (a client hanging up mid-request), what is left of it moves to a
/// task of its own and finishes there, so no transaction is abandoned mid-statement. Unlike
/// spawning every request, the common case costs no task and no cross-thread wake-up. A panic
/// while it is polled here is caught and returned as `Err`.
pub(crate) struct Uncancelled<F: Future + Send + 'static> {
    future: Option<Pin<Box<F>>>,
}

impl<F: Future + Send + 'static> Uncancelled<F> {
    pub(crate) fn new(future: F) -> Self {
        Self {
            future: Some(Box::pin(future)),
        }
    }
}

impl<F> Future for Uncancelled<F>
where
    F: Future + Send + 'static,
    F::Output: Send + 'static,
{
    type Output = Result<F::Output, Box<dyn Any + Send>>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        // As with any future, polling again after completion is a caller's bug; pending
        // forever would hide it as a hang.
        let future = self
            .future
            .as_mut()
            .expect("`Uncancelled` polled after it completed");
        // The future is dropped right after a panic, never polled again, so whatever state the
        // panic left it in is not observed.
        let polled = std::panic::catch_unwind(AssertUnwindSafe(|| future.as_mut().poll(cx)));
        match polled {
            Ok(Poll::Pending) => Poll::Pending,
            Ok(Poll::Ready(output)) => {
                self.future = None;
                Poll::Ready(Ok(output))
            }
            Err(panic) => {
                self.future = None;
                Poll::Ready(Err(panic))
            }
        }
    }
}

impl<F: Future + Send + 'static> Drop for Uncancelled<F> {
    fn drop(&mut self) {
        if let Some(future) = self.future.take()
            && let Ok(runtime) = tokio::runtime::Handle::try_current()
        {
            runtime.spawn(async move {
                future.await;
            });
        }
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    #[tokio::test]
    async fn uncancelled_work_finishes_after_its_caller_is_dropped() {
        let (release, released) = tokio::sync::oneshot::channel::<()>();
        let (done, finished) = tokio::sync::oneshot::channel();
        let work = Uncancelled::new(async move {
            let _ = released.await;
            let _ = done.send("finished");
        });
        // The caller gives up while the work is parked mid-way.
        let gave_up = tokio::time::timeout(Duration::from_millis(10), work).await;
        assert!(gave_up.is_err());
        let _ = release.send(());
        assert_eq!(finished.await, Ok("finished"));
    }

    #[tokio::test]
    async fn uncancelled_work_that_panics_is_an_error_not_an_unwind() {
        let outcome = Uncancelled::new(async {
            if std::process::id() > 0 {
                panic!("handler bug");
            }
        })
        .await;
        assert!(outcome.is_err());
    }
}

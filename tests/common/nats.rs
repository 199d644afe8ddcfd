//! The shared NATS JetStream at 127.0.0.1:4222: a context on it, and the deletion of the
//! streams a test made there.

use async_nats::jetstream;

/// The shared server, as its host and port.
pub(crate) const ADDRESS: &str = "127.0.0.1:4222";

/// The shared server's URL.
pub(crate) const URL: &str = "nats://127.0.0.1:4222";

/// A JetStream context on the shared server; an unreachable server fails the test.
pub(crate) async fn connect() -> jetstream::Context {
    jetstream::new(
        async_nats::connect(URL)
            .await
            .expect("NATS must be reachable at 127.0.0.1:4222"),
    )
}

/// How many messages `stream` holds.
pub(crate) async fn messages(js: &jetstream::Context, stream: &str) -> u64 {
    let mut stream = js.get_stream(stream).await.unwrap();
    stream.info().await.unwrap().state.messages
}

/// Deletes `streams`; one already gone (or never made, when the test failed early) is fine.
pub(crate) async fn delete<S: AsRef<str>>(
    js: &jetstream::Context,
    streams: impl IntoIterator<Item = S>,
) {
    for stream in streams {
        let _ = js.delete_stream(stream.as_ref()).await;
    }
}

//! The inbox on NATS JetStream (through async-nats), with a durable pull consumer.
//!
//! [`NatsConsumer`] pulls from one durable consumer on a stream, runs each message through the
//! [`Inbox`], and acknowledges only after the inbox's transaction has ended. On
//! [`declare`](NatsConsumer::declare) it uses the stream as it is if it exists (a publisher
//! may have created it with server defaults) and creates it otherwise; it creates the durable
//! consumer (explicit acks, the [ack wait](NatsConsumer::ack_wait), 10 s by default, after which
//! a message whose consumer died is redelivered) and the dead-letter stream. While a handler
//! runs, its message is kept from redelivery by progress acks every third of the ack wait, so
//! a slow handler is never run twice at once and a dead consumer's message comes back soon.
//!
//! - Retry: `Nak` with the inbox's backoff as delay; the attempt count is JetStream's own
//!   delivery count.
//! - Outage ([`Verdict::Unavailable`]: the consumer's database or a dependency unreachable):
//!   no `Nak`, since every redelivery raises the delivery count (the inbox's attempt count, and
//!   what a `max_deliver` set on a durable consumer made elsewhere would run out of). The
//!   consumer keeps the message with progress acks, pauses for the outage backoff (the other
//!   messages in hand wait too), and handles it again, with the same attempt count, until the
//!   outage is over. The durable consumer this adapter creates has no `max_deliver`.
//! - Dead letter: the message is published to the dead-letter stream (by default
//!   `{DURABLE}_DEAD`, subjects `{durable}.dead.>`) with its `Nats-Msg-Id`, then acked. The
//!   copy carries why it died in the header **`Inbox-Reason`** (the reason is also logged at
//!   `WARN`) and the subject it was published on in `Inbox-Subject`. The dead-letter stream's
//!   duplicate window absorbs a copy published twice by a consumer that died in between.
//!
//! # When the broker goes away
//!
//! The async-nats client reconnects by itself, for as long as it runs, and the pull consumer's
//! message stream asks for messages again once it is back, so [`run`](NatsConsumer::run) goes
//! on by itself through a server restart. A consumer made with
//! [`connect`](NatsConsumer::connect) has a client whose waits between reconnection attempts
//! are jittered (up to 100 ms, the ceiling doubling to 5 s), so a fleet does not come back to a
//! restarted server at one instant; async-nats' own default, for a client you make, waits the
//! same for every client (doubling from nothing to 4 s). That client also pings the server
//! every 5 s, so a link gone silent (a server host that lost power, a partition that sends no
//! reset) is dropped as stale and reconnected within about 15 s, where async-nats' default ping
//! of a minute takes up to three (give a client of your own the same,
//! `ConnectOptions::ping_interval`). The errors seen meanwhile are logged at `WARN`. Handlers
//! that were running keep their transactions; an ack lost in the outage lets JetStream deliver
//! the message again after the ack wait, and the inbox skips it as a duplicate. Only a durable
//! consumer deleted from outside ends the stream, and `run` with it.
//!
//! ```no_run
//! # #[cfg(feature = "sqlite")]
//! # async fn run(store: axum_idempotency::SqliteStore) -> Result<(), async_nats::Error> {
//! use axum_idempotency::inbox::{Delivery, Failure, Inbox};
//! use axum_idempotency::inbox::nats::NatsConsumer;
//! use axum_idempotency::Tx;
//!
//! let inbox = Inbox::new("orders", store);
//! let consumer = NatsConsumer::connect(inbox, "nats://127.0.0.1:4222", "PAYMENTS", "orders")
//!     .await?
//!     .stream_subjects(["payments.>"])
//!     .filter_subject("payments.succeeded");
//! consumer.declare().await?; // dead letters: stream ORDERS_DEAD, subjects orders.dead.>
//! consumer
//!     .run(|_tx: Tx<sqlx::Sqlite>, _delivery: Delivery| async { Ok::<_, Failure>(()) })
//!     .await?;
//! # Ok(()) }
//! ```

use std::fmt;
use std::future::Future;
use std::time::Duration;

use async_nats::HeaderMap;
use async_nats::jetstream::consumer::{AckPolicy, PullConsumer, pull};
use async_nats::jetstream::message::AckKind;
use async_nats::jetstream::{Context, stream};
use futures_util::StreamExt;

use super::{Delivery, Failure, Inbox, Pause, ReplayReport, Verdict};
use crate::Backend;
use crate::broker;
use crate::tx::Tx;

/// The header a dead letter carries: why it died.
const REASON: &str = "Inbox-Reason";
/// The header a dead letter carries: the subject it was first published on.
const ORIGINAL_SUBJECT: &str = "Inbox-Subject";

/// Consumes a JetStream durable pull consumer through an [`Inbox`]. See the
/// [module docs](self).
pub struct NatsConsumer<DB: Backend> {
    inbox: Inbox<DB>,
    jetstream: Context,
    stream: String,
    subjects: Vec<String>,
    durable: String,
    filter: Option<String>,
    dead_stream: String,
    dead_prefix: String,
    ack_wait: Duration,
    concurrency: usize,
    batch: usize,
}

impl<DB: Backend> fmt::Debug for NatsConsumer<DB> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("NatsConsumer")
            .field("inbox", &self.inbox)
            .field("stream", &self.stream)
            .field("durable", &self.durable)
            .field("filter", &self.filter)
            .field("dead_stream", &self.dead_stream)
            .field("ack_wait", &self.ack_wait)
            .field("concurrency", &self.concurrency)
            .field("batch", &self.batch)
            .finish_non_exhaustive()
    }
}

impl<DB: Backend> NatsConsumer<DB> {
    /// A consumer of `stream` through the durable consumer `durable`, 4 messages at a time.
    pub fn new(
        inbox: Inbox<DB>,
        jetstream: Context,
        stream: impl Into<String>,
        durable: impl Into<String>,
    ) -> Self {
        let durable: String = durable.into();
        Self {
            inbox,
            jetstream,
            stream: stream.into(),
            subjects: Vec::new(),
            dead_stream: format!("{}_DEAD", durable.to_uppercase()),
            dead_prefix: format!("{durable}.dead"),
            durable,
            filter: None,
            ack_wait: Duration::from_secs(10),
            concurrency: 4,
            batch: 1,
        }
    }

    /// A consumer of `stream` through the durable consumer `durable`, 4 messages at a time, on
    /// a client of its own connected to `url` now (an unreachable server fails here). The
    /// client reconnects by itself with a jittered backoff (see the
    /// [module docs](self#when-the-broker-goes-away)).
    pub async fn connect(
        inbox: Inbox<DB>,
        url: &str,
        stream: impl Into<String>,
        durable: impl Into<String>,
    ) -> Result<Self, async_nats::ConnectError> {
        let jetstream = async_nats::jetstream::new(broker::nats(url).await?);
        Ok(Self::new(inbox, jetstream, stream, durable))
    }

    /// The subjects the stream is created with if it does not exist yet (default: the filter
    /// subject).
    #[must_use]
    pub fn stream_subjects<I, T>(mut self, subjects: I) -> Self
    where
        I: IntoIterator<Item = T>,
        T: Into<String>,
    {
        self.subjects = subjects.into_iter().map(Into::into).collect();
        self
    }

    /// Only messages on this subject reach the consumer (default: all of the stream).
    #[must_use]
    pub fn filter_subject(mut self, subject: impl Into<String>) -> Self {
        self.filter = Some(subject.into());
        self
    }

    /// Where dead letters go: stream `stream` with subjects `{prefix}.>` (default
    /// `{DURABLE}_DEAD` and `{durable}.dead`). Keep the prefix outside the consumed stream's
    /// subjects.
    #[must_use]
    pub fn dead_letters(mut self, stream: impl Into<String>, prefix: impl Into<String>) -> Self {
        self.dead_stream = stream.into();
        self.dead_prefix = prefix.into();
        self
    }

    /// How long JetStream waits for an ack before redelivering (default 10 s) when the
    /// consumer is created: about how long a message whose consumer died waits to be delivered
    /// again. A live handler keeps its message with progress acks every third of it, however
    /// long it runs. An existing durable consumer keeps the ack wait it was created with.
    #[must_use]
    pub fn ack_wait(mut self, wait: Duration) -> Self {
        self.ack_wait = wait;
        self
    }

    /// How many transactions apply messages at once (default 4).
    #[must_use]
    pub fn concurrency(mut self, transactions: usize) -> Self {
        self.concurrency = transactions.max(1);
        self
    }

    /// Applies up to `messages` of the messages in hand in one transaction (default 1), through
    /// [`Inbox::handle_batch`]: one commit for them all, which is what bounds a consumer whose
    /// database syncs each commit. A batch takes what has arrived, never waiting to fill, so
    /// a lone message is applied at once. Up to `concurrency × messages` are held at once.
    /// On SQLite a batch holds the database's one write lock while all of its handlers run:
    /// keep them quick, or the batch small.
    #[must_use]
    pub fn batch(mut self, messages: usize) -> Self {
        self.batch = messages.max(1);
        self
    }

    /// The dead-letter stream's name.
    pub fn dead_letter_stream(&self) -> &str {
        &self.dead_stream
    }

    /// Declares the stream (kept as it is if it exists), the durable consumer and the
    /// dead-letter stream. Idempotent.
    pub async fn declare(&self) -> Result<(), async_nats::Error> {
        let stream = self.stream().await?;
        stream
            .get_or_create_consumer(
                &self.durable,
                pull::Config {
                    durable_name: Some(self.durable.clone()),
                    ack_policy: AckPolicy::Explicit,
                    ack_wait: self.ack_wait,
                    // The inbox counts attempts and dead-letters; JetStream must not drop.
                    max_deliver: -1,
                    filter_subject: self.filter.clone().unwrap_or_default(),
                    max_ack_pending: 10_000,
                    ..pull::Config::default()
                },
            )
            .await?;
        self.jetstream
            .get_or_create_stream(stream::Config {
                name: self.dead_stream.clone(),
                subjects: vec![format!("{}.>", self.dead_prefix)],
                ..stream::Config::default()
            })
            .await?;
        Ok(())
    }

    async fn stream(&self) -> Result<stream::Stream, async_nats::Error> {
        if let Ok(stream) = self.jetstream.get_stream(&self.stream).await {
            return Ok(stream);
        }
        let subjects = if self.subjects.is_empty() {
            self.filter.iter().cloned().collect()
        } else {
            self.subjects.clone()
        };
        Ok(self
            .jetstream
            .get_or_create_stream(stream::Config {
                name: self.stream.clone(),
                subjects,
                ..stream::Config::default()
            })
            .await?)
    }

    async fn consumer(&self) -> Result<PullConsumer, async_nats::Error> {
        let stream = self.jetstream.get_stream(&self.stream).await?;
        stream.get_consumer(&self.durable).await
    }

    /// Pulls and handles messages until the durable consumer is deleted or the client closes
    /// for good (a lost connection is reconnected by the client). Each message is acked
    /// after the inbox's transaction ended (applied, duplicate, or dead-lettered once its copy
    /// is stored), or `Nak`ed with a delay for a retry.
    pub async fn run<H, Fut>(self, handler: H) -> Result<(), async_nats::Error>
    where
        H: Fn(Tx<DB>, Delivery) -> Fut + Clone + Send + Sync + 'static,
        Fut: Future<Output = Result<(), Failure>> + Send + 'static,
    {
        let consumer = self.consumer().await?;
        // The client asks for the next pull when half of the last is in, so up to one and a half
        // pulls are in its buffer, where no progress ack reaches them and an outage longer than
        // the ack wait sends each back as a copy: pulls of one batch (or, for small batches, of
        // one message per transaction, as pulls of a message each are slow) keep that small
        // however many transactions run.
        let limit = self.concurrency.saturating_mul(self.batch);
        let messages = consumer
            .stream()
            .max_messages_per_batch(self.batch.max(self.concurrency))
            .messages()
            .await?;
        let mut messages = std::pin::pin!(messages);
        let pause = Pause::default();
        // Messages in hand that wait for a free transaction, kept from redelivery with progress
        // acks: while an outage holds every transaction, as many as the pull brought wait here,
        // and each would otherwise come back as a copy after the ack wait, its delivery count
        // (the inbox's attempt count) raised by an outage.
        let mut waiting = std::collections::VecDeque::new();
        let mut running = futures_util::stream::FuturesUnordered::new();
        let (mut held, mut open) = (0, true);
        let every = self.progress_every();
        let mut ticks = tokio::time::interval_at(tokio::time::Instant::now() + every, every);
        loop {
            // A batch takes what waits, up to its size, and never waits to fill.
            while running.len() < self.concurrency && !waiting.is_empty() {
                let batch: Vec<_> = waiting.drain(..waiting.len().min(self.batch)).collect();
                let (this, pause, handler) = (&self, &pause, handler.clone());
                running.push(async move {
                    let size = batch.len();
                    if let Err(error) = this.process(batch, pause, handler).await {
                        tracing::warn!(consumer = %this.inbox.name(), %error, "JetStream message not settled");
                    }
                    size
                });
            }
            if !open && running.is_empty() {
                return Ok(());
            }
            tokio::select! {
                message = messages.next(), if open && held < limit => match message {
                    Some(Ok(message)) => {
                        waiting.push_back(message);
                        held += 1;
                    }
                    Some(Err(error)) => {
                        tracing::warn!(consumer = %self.inbox.name(), %error, "JetStream message not received");
                    }
                    None => open = false,
                },
                Some(settled) = running.next(), if !running.is_empty() => held -= settled,
                _ = ticks.tick(), if !waiting.is_empty() => {
                    for message in &waiting {
                        self.progress(message).await;
                    }
                }
            }
        }
    }

    /// Applies `messages`, in one transaction when there are several, and settles each.
    async fn process<H, Fut>(
        &self,
        messages: Vec<async_nats::jetstream::Message>,
        pause: &Pause,
        handler: H,
    ) -> Result<(), async_nats::Error>
    where
        H: Fn(Tx<DB>, Delivery) -> Fut + Clone + Send + 'static,
        Fut: Future<Output = Result<(), Failure>> + Send + 'static,
    {
        let deliveries: Vec<Delivery> = messages.iter().map(delivery_of_message).collect();
        // An outage is waited out with the message in hand rather than `Nak`ed: each `Nak` is
        // a delivery to JetStream, which would raise the count the inbox reads its attempts
        // from and, on a durable consumer made elsewhere with `max_deliver`, end its
        // deliveries for good. Progress acks keep it from redelivery meanwhile, and the other
        // messages in hand wait at the pause instead of each failing on the outage.
        let verdicts = self
            .keeping_alive(&messages, self.apply(&deliveries, pause, handler))
            .await;
        // Every message is settled, whatever became of the others: one left unsettled would
        // hold its place in the consumer's pending acks until its ack wait ran out.
        let settles = messages
            .iter()
            .zip(verdicts)
            .map(|(message, verdict)| self.settle(message, verdict));
        futures_util::future::join_all(settles)
            .await
            .into_iter()
            .collect()
    }

    /// Applies `deliveries`, several in one transaction, waiting out any outage with them in
    /// hand: those it met are tried again together after one pause.
    async fn apply<H, Fut>(
        &self,
        deliveries: &[Delivery],
        pause: &Pause,
        handler: H,
    ) -> Vec<Verdict>
    where
        H: Fn(Tx<DB>, Delivery) -> Fut + Clone + Send + 'static,
        Fut: Future<Output = Result<(), Failure>> + Send + 'static,
    {
        let mut verdicts: Vec<Option<Verdict>> = vec![None; deliveries.len()];
        loop {
            let waiting: Vec<usize> = (0..deliveries.len())
                .filter(|&index| verdicts[index].is_none())
                .collect();
            if waiting.is_empty() {
                return verdicts.into_iter().flatten().collect();
            }
            pause.wait().await;
            let tried = match waiting.as_slice() {
                [one] => vec![
                    self.inbox
                        .handle(deliveries[*one].clone(), handler.clone())
                        .await,
                ],
                several => {
                    let batch: Vec<Delivery> =
                        several.iter().map(|&i| deliveries[i].clone()).collect();
                    self.inbox.handle_batch(&batch, handler.clone()).await
                }
            };
            let mut held = false;
            for (index, verdict) in waiting.into_iter().zip(tried) {
                match verdict {
                    Verdict::Unavailable { after, .. } if !held => {
                        pause.hold(after);
                        held = true;
                    }
                    Verdict::Unavailable { .. } => {}
                    verdict => verdicts[index] = Some(verdict),
                }
            }
        }
    }

    /// Tells JetStream what became of `message`.
    async fn settle(
        &self,
        message: &async_nats::jetstream::Message,
        verdict: Verdict,
    ) -> Result<(), async_nats::Error> {
        match verdict {
            Verdict::Applied | Verdict::Duplicate => message.ack().await?,
            Verdict::Retry { after } => message.ack_with(AckKind::Nak(Some(after))).await?,
            // Not reached (an outage is waited out before settling); were it, a delayed `Nak`
            // would still bring the message back.
            Verdict::Unavailable { after, .. } => {
                message.ack_with(AckKind::Nak(Some(after))).await?;
            }
            Verdict::Dead { reason } => {
                self.dead_letter(message, &reason).await?;
                message.ack().await?;
            }
        }
        Ok(())
    }

    /// Runs `work` on `messages` while telling JetStream every third of the ack wait that each
    /// is in progress, so none is delivered again while its handler still runs.
    async fn keeping_alive<T>(
        &self,
        messages: &[async_nats::jetstream::Message],
        work: impl Future<Output = T>,
    ) -> T {
        let every = self.progress_every();
        let progress = async {
            let mut ticks = tokio::time::interval_at(tokio::time::Instant::now() + every, every);
            loop {
                ticks.tick().await;
                for message in messages {
                    self.progress(message).await;
                }
            }
        };
        tokio::select! {
            output = work => output,
            never = progress => match never {},
        }
    }

    /// How often a message in hand is said to be in progress: three times per ack wait.
    fn progress_every(&self) -> Duration {
        (self.ack_wait / 3).max(Duration::from_millis(100))
    }

    /// Tells JetStream that `message` is in progress, so that its ack wait starts again.
    async fn progress(&self, message: &async_nats::jetstream::Message) {
        if let Err(error) = message.ack_with(AckKind::Progress).await {
            // The next tick tries again; past the ack wait the message is redelivered and
            // its duplicate waits on the claim its first copy holds, or finds it applied.
            tracing::warn!(consumer = %self.inbox.name(), %error, "progress ack failed");
        }
    }

    /// Stores a copy in the dead-letter stream and waits for the stream's ack.
    async fn dead_letter(
        &self,
        message: &async_nats::jetstream::Message,
        reason: &str,
    ) -> Result<(), async_nats::Error> {
        let mut headers = message.headers.clone().unwrap_or_default();
        headers.insert(REASON, reason);
        headers.insert(ORIGINAL_SUBJECT, message.subject.as_str());
        let subject = format!("{}.{}", self.dead_prefix, message.subject);
        self.jetstream
            .publish_with_headers(subject, headers, message.payload.clone())
            .await?
            .await?;
        Ok(())
    }

    /// Replays up to `limit` dead letters through the same claim as live messages, for an
    /// operator once the cause is fixed. Each is one attempt: applied (or found applied
    /// already) → deleted from the dead-letter stream; failed again → left there.
    pub async fn replay_dead<H, Fut>(
        &self,
        handler: H,
        limit: usize,
    ) -> Result<ReplayReport, async_nats::Error>
    where
        H: Fn(Tx<DB>, Delivery) -> Fut + Clone + Send + Sync + 'static,
        Fut: Future<Output = Result<(), Failure>> + Send + 'static,
    {
        let mut stream = self.jetstream.get_stream(&self.dead_stream).await?;
        let state = stream.info().await?.state.clone();
        let mut report = ReplayReport::default();
        let mut seen = 0;
        for sequence in state.first_sequence..=state.last_sequence {
            if seen >= limit || state.messages == 0 {
                break;
            }
            // A sequence deleted by an earlier replay has no message: skip it.
            let Ok(dead) = stream.get_raw_message(sequence).await else {
                continue;
            };
            seen += 1;
            let delivery = delivery_of(Some(&dead.headers), dead.payload.clone(), 1);
            match self.inbox.replay(delivery, handler.clone()).await {
                Verdict::Applied => report.applied += 1,
                Verdict::Duplicate => report.duplicates += 1,
                Verdict::Retry { .. } | Verdict::Unavailable { .. } | Verdict::Dead { .. } => {
                    report.still_dead += 1;
                    continue;
                }
            }
            stream.delete_message(sequence).await?;
        }
        Ok(report)
    }
}

/// A JetStream message as the inbox sees it, its attempt JetStream's delivery count.
fn delivery_of_message(message: &async_nats::jetstream::Message) -> Delivery {
    let attempt = message
        .info()
        .map(|info| u32::try_from(info.delivered.max(1)).unwrap_or(u32::MAX))
        .unwrap_or(1);
    delivery_of(message.headers.as_ref(), message.payload.clone(), attempt)
}

fn delivery_of(headers: Option<&HeaderMap>, payload: bytes::Bytes, attempt: u32) -> Delivery {
    let mut delivery = Delivery::new(payload).with_attempt(attempt);
    if let Some(id) = headers.and_then(|h| h.get(async_nats::header::NATS_MESSAGE_ID)) {
        delivery = delivery.with_message_id(id.as_str());
    }
    delivery
}

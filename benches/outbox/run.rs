//! One row's runs: committing, relaying, verifying, round after round.

use std::collections::HashSet;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use axum_idempotency::Backend;
use axum_idempotency::outbox::{Dispatcher, Message, Outbox};
use sqlx::Pool;
use tokio::sync::oneshot;

use crate::broker::Broker;
use crate::store::Store;
use crate::{Profile, Settings, TOPIC, key, payload};

/// The app's pool, the outbox handlers enqueue into through it, and the outbox the dispatchers
/// run on (the same one, or one on a pool of their own).
pub(crate) struct Tables<DB: Backend> {
    pool: Pool<DB>,
    outbox: Outbox<DB>,
    dispatching: Outbox<DB>,
}

/// Commits `n` messages of `run`, one per transaction as a handler does, from `producers`
/// concurrent tasks, waking the dispatchers of `wake` after each commit; returns the time taken.
pub(crate) async fn produce<DB: Store>(
    tables: &Tables<DB>,
    run: &str,
    settings: &Settings,
    wake: Option<Outbox<DB>>,
) -> Duration {
    let (n, producers, size) = (
        settings.messages,
        settings.producers.max(1),
        settings.payload,
    );
    let run: Arc<str> = run.into();
    let started = Instant::now();
    let tasks: Vec<_> = (0..producers)
        .map(|p| {
            let (outbox, pool) = (tables.outbox.clone(), tables.pool.clone());
            let (run, wake) = (run.clone(), wake.clone());
            tokio::spawn(async move {
                for i in (p..n).step_by(producers) {
                    let message = Message::new(TOPIC, key(&run, i), payload(i, size));
                    let mut tx = pool.begin().await.expect("begin");
                    outbox.enqueue(&mut tx, message).await.expect("enqueue");
                    tx.commit().await.expect("commit");
                    if let Some(wake) = &wake {
                        wake.wake();
                    }
                }
            })
        })
        .collect();
    for task in tasks {
        task.await.expect("a producer panicked");
    }
    started.elapsed()
}

/// Starts the profile's dispatchers and waits until the broker has confirmed and the outbox has
/// recorded all of `settings.messages`; with `live`, the producers commit run `live` meanwhile;
/// with `nowhere`, the dispatchers send to a sender that publishes nothing. Returns the time
/// from the dispatchers' start to the last delivery recorded.
pub(crate) async fn relay<DB: Store>(
    tables: &Tables<DB>,
    broker: &Broker,
    profile: Profile,
    settings: &Settings,
    live: Option<&str>,
    nowhere: bool,
) -> Result<Duration, String> {
    let n = settings.messages;
    let confirmed = Arc::new(AtomicUsize::new(0));
    let (mut dispatchers, mut stops) = (Vec::new(), Vec::new());
    for _ in 0..profile.dispatchers {
        let sender = broker.sender(confirmed.clone(), nowhere).await;
        let mut dispatcher = Dispatcher::new(tables.dispatching.clone(), sender);
        if let Some(batch) = profile.batch {
            dispatcher = dispatcher.batch_size(batch);
        }
        let (stop, stopped) = oneshot::channel::<()>();
        stops.push(stop);
        dispatchers.push(dispatcher.run(async {
            let _ = stopped.await;
        }));
    }
    let started = Instant::now();
    let running: Vec<_> = dispatchers.into_iter().map(tokio::spawn).collect();
    let producing = async {
        if let Some(run) = live {
            produce(tables, run, settings, Some(tables.dispatching.clone())).await;
        }
    };
    // Generous: a relay this slow is a finding in itself, but the run must still end.
    let deadline = started + Duration::from_secs(60) + Duration::from_millis(10 * n as u64);
    let delivered = async {
        while confirmed.load(Ordering::Relaxed) < n {
            if Instant::now() > deadline {
                return Err(format!(
                    "only {} of {n} confirmed in {:?}",
                    confirmed.load(Ordering::Relaxed),
                    started.elapsed()
                ));
            }
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        // Confirmed by the broker; what remains is the dispatcher recording the last outcomes.
        loop {
            let (count, _) = DB::delivered(&tables.pool).await;
            if count as usize >= n {
                return Ok(started.elapsed());
            }
            if Instant::now() > deadline {
                return Err(format!("only {count} of {n} recorded delivered"));
            }
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
    };
    let ((), elapsed) = tokio::join!(producing, delivered);
    for stop in stops {
        let _ = stop.send(());
    }
    for task in running {
        task.await.expect("a dispatcher panicked");
    }
    let elapsed = elapsed?;
    let (count, attempts) = DB::delivered(&tables.pool).await;
    if count as usize != n || attempts as usize != n {
        return Err(format!(
            "the outbox shows {count} delivered after {attempts} attempts, for {n} messages"
        ));
    }
    Ok(elapsed)
}

#[derive(Debug, Clone, Copy)]
pub(crate) enum Scenario {
    Relay,
    Bare,
    Live,
    /// The relay without a broker: the dispatcher's database work alone.
    Nowhere,
}

/// One table row's measurements, every round's.
pub(crate) struct Row {
    pub(crate) store: &'static str,
    pub(crate) broker: &'static str,
    pub(crate) profile: Profile,
    pub(crate) commit: Vec<f64>,
    pub(crate) relay: Vec<f64>,
    pub(crate) bare: Vec<f64>,
    pub(crate) live: Vec<f64>,
    pub(crate) nowhere: Vec<f64>,
    pub(crate) errors: Vec<String>,
}

pub(crate) fn median(values: &[f64]) -> Option<f64> {
    let mut sorted = values.to_vec();
    sorted.sort_by(f64::total_cmp);
    match sorted.len() {
        0 => None,
        len if len % 2 == 1 => Some(sorted[len / 2]),
        len => Some((sorted[len / 2 - 1] + sorted[len / 2]) / 2.0),
    }
}

/// Measures one row; `nowhere` adds the broker-less relay (once per store and profile is
/// enough: it does not depend on the broker).
pub(crate) async fn measure<DB: Store>(
    pool: &Pool<DB>,
    broker: &Broker,
    profile: Profile,
    settings: &Settings,
    tag: u32,
    nowhere: bool,
) -> Row {
    let outbox = Outbox::new(pool.clone());
    let own_pool = match profile.own_pool {
        Some(size) => Some(
            sqlx::pool::PoolOptions::<DB>::new()
                .max_connections(size)
                .connect_with((*pool.connect_options()).clone())
                .await
                .expect("the dispatchers' pool"),
        ),
        None => None,
    };
    let tables = Tables {
        pool: pool.clone(),
        dispatching: own_pool.clone().map_or_else(|| outbox.clone(), Outbox::new),
        outbox,
    };
    let n = settings.messages;
    let mut row = Row {
        store: DB::LABEL,
        broker: broker.name(),
        profile,
        commit: Vec::new(),
        relay: Vec::new(),
        bare: Vec::new(),
        live: Vec::new(),
        nowhere: Vec::new(),
        errors: Vec::new(),
    };
    let mut scenarios = vec![Scenario::Relay, Scenario::Bare];
    if settings.live {
        scenarios.push(Scenario::Live);
    }
    if nowhere {
        scenarios.push(Scenario::Nowhere);
    }
    for round in 0..settings.rounds {
        for turn in 0..scenarios.len() {
            let scenario = scenarios[(round + turn) % scenarios.len()];
            // Ids of this run only: JetStream's duplicate window must never drop a message
            // another run already sent.
            let run = format!(
                "{tag}/{}/{}/{}/{round}/{scenario:?}",
                DB::LABEL,
                broker.name(),
                profile.label()
            );
            let expected: HashSet<String> = match scenario {
                Scenario::Nowhere => HashSet::new(),
                _ => (0..n).map(|i| key(&run, i).as_str().to_owned()).collect(),
            };
            let measured = match scenario {
                Scenario::Bare => {
                    // Built before the clock starts: the relay's messages are built by the
                    // producers, outside its timing too.
                    let messages: Vec<_> = (0..n)
                        .map(|i| (key(&run, i), payload(i, settings.payload)))
                        .collect();
                    let elapsed = broker.bare(&messages, profile.window()).await;
                    Ok((&mut row.bare, elapsed))
                }
                Scenario::Relay => {
                    DB::clear(pool).await;
                    let committing = produce(&tables, &run, settings, None).await;
                    row.commit.push(n as f64 / committing.as_secs_f64());
                    relay(&tables, broker, profile, settings, None, false)
                        .await
                        .map(|elapsed| (&mut row.relay, elapsed))
                }
                Scenario::Live => {
                    DB::clear(pool).await;
                    relay(&tables, broker, profile, settings, Some(&run), false)
                        .await
                        .map(|elapsed| (&mut row.live, elapsed))
                }
                Scenario::Nowhere => {
                    DB::clear(pool).await;
                    produce(&tables, &run, settings, None).await;
                    relay(&tables, broker, profile, settings, None, true)
                        .await
                        .map(|elapsed| (&mut row.nowhere, elapsed))
                }
            };
            let verified = broker.verify_and_empty(&expected).await;
            match (measured, verified) {
                (Ok((figures, elapsed)), Ok(())) => {
                    figures.push(n as f64 / elapsed.as_secs_f64());
                }
                (Err(error), _) | (_, Err(error)) => row.errors.push(format!(
                    "{} × {} ({}), {scenario:?} round {round}: {error}",
                    DB::LABEL,
                    broker.name(),
                    profile.label()
                )),
            }
        }
    }
    if let Some(own_pool) = own_pool {
        own_pool.close().await;
    }
    row
}

pub(crate) async fn measure_store<DB: Store>(
    pool: &Pool<DB>,
    brokers: &[Broker],
    profiles: &[Profile],
    settings: &Settings,
    tag: u32,
    rows: &mut Vec<Row>,
) {
    Outbox::new(pool.clone())
        .migrate()
        .await
        .expect("migrate the outbox");
    for (index, broker) in brokers.iter().enumerate() {
        for &profile in profiles {
            let row = measure(pool, broker, profile, settings, tag, index == 0).await;
            eprintln!(
                "measured {} × {} ({}): relay {:?}, bare {:?} msg/s",
                row.store,
                row.broker,
                profile.label(),
                row.relay.iter().map(|v| v.round()).collect::<Vec<_>>(),
                row.bare.iter().map(|v| v.round()).collect::<Vec<_>>()
            );
            rows.push(row);
        }
    }
}

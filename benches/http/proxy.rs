//! The TCP proxy between an app's pool and the database: counts wire round trips and pool
//! pings, and can hold every chunk to add a network hop's latency.

#[cfg(any(feature = "postgres", feature = "mysql"))]
use std::net::SocketAddr;
#[cfg(any(feature = "postgres", feature = "mysql"))]
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
#[cfg(any(feature = "postgres", feature = "mysql"))]
use std::time::{Duration, Instant};

#[cfg(any(feature = "postgres", feature = "mysql"))]
use crate::counting::COUNTING;

/// What one database proxy saw: exchanges answered (pings apart) while [`COUNTING`] is on, and
/// how long it actually held the chunks it forwarded.
#[derive(Default)]
pub(crate) struct Wire {
    pub(crate) trips: AtomicU64,
    pub(crate) pings: AtomicU64,
    pub(crate) chunks: AtomicU64,
    held_us: AtomicU64,
}

impl Wire {
    pub(crate) fn mean_hold_ms(&self) -> f64 {
        let chunks = self.chunks.load(Ordering::Relaxed).max(1);
        self.held_us.load(Ordering::Relaxed) as f64 / chunks as f64 / 1000.0
    }
}

/// What the client's last chunk before the server's answer was.
#[cfg(any(feature = "postgres", feature = "mysql"))]
mod exchange {
    pub(super) const NONE: u8 = 0;
    pub(super) const QUERY: u8 = 1;
    pub(super) const PING: u8 = 2;
}

/// Whether a client chunk is a pool's connection test and nothing else: PostgreSQL's lone Sync
/// (sqlx's `ping()`), or MySQL's COM_PING packet (sequence 0, payload 0x0e). A heuristic on
/// one read's bytes, not a protocol parser: a ping that shared a read with other messages
/// counts as a round trip, and it relies on sqlx sending the ping alone and waiting for it.
#[cfg(any(feature = "postgres", feature = "mysql"))]
fn is_ping(chunk: &[u8]) -> bool {
    const POSTGRES_SYNC: [u8; 5] = [b'S', 0, 0, 0, 4];
    const MYSQL_PING: [u8; 5] = [1, 0, 0, 0, 0x0e];
    chunk == POSTGRES_SYNC || chunk == MYSQL_PING
}

/// A TCP proxy to the database that counts round trips and can add latency. A round trip is
/// an answer from the server after the client has sent something: pipelined messages
/// (Parse/Bind/Execute/Sync in one flight) count once, as they cost one network wait. It reads
/// no protocol beyond [`is_ping`], so it counts MySQL's exchanges the same way as PostgreSQL's.
/// With a `delay`, every chunk is held that long in each direction, as on a network hop.
///
/// Blocking threads rather than tasks: tokio's timer rounds a 1 ms sleep up to the next
/// millisecond tick (1 to 2 ms), a thread's sleep is within tens of microseconds.
#[cfg(any(feature = "postgres", feature = "mysql"))]
pub(crate) fn db_proxy(
    upstream: SocketAddr,
    delay: Duration,
    wire: Arc<Wire>,
) -> std::io::Result<SocketAddr> {
    use std::net::{Shutdown, TcpListener, TcpStream};
    use std::sync::atomic::AtomicU8;

    let listener = TcpListener::bind("127.0.0.1:0")?;
    let addr = listener.local_addr()?;
    std::thread::spawn(move || {
        for client in listener.incoming() {
            let Ok(client) = client else {
                continue;
            };
            let wire = Arc::clone(&wire);
            std::thread::spawn(move || {
                let Ok(server) = TcpStream::connect(upstream) else {
                    let _ = client.shutdown(Shutdown::Both);
                    return;
                };
                let _ = client.set_nodelay(true);
                let _ = server.set_nodelay(true);
                let (Ok(client_read), Ok(server_read)) = (client.try_clone(), server.try_clone())
                else {
                    return;
                };
                let awaiting = Arc::new(AtomicU8::new(exchange::NONE));
                let sent = Arc::clone(&awaiting);
                let up_wire = Arc::clone(&wire);
                let up = std::thread::spawn(move || {
                    relay(client_read, server, delay, &up_wire, |chunk| {
                        // Marked on arrival, before forwarding, so the answer cannot overtake
                        // the mark. A ping never downgrades a query still awaiting its answer.
                        if is_ping(chunk) {
                            let _ = sent.compare_exchange(
                                exchange::NONE,
                                exchange::PING,
                                Ordering::SeqCst,
                                Ordering::SeqCst,
                            );
                        } else {
                            sent.store(exchange::QUERY, Ordering::SeqCst);
                        }
                    });
                });
                relay(server_read, client, delay, &wire, |_| {
                    let counter = match awaiting.swap(exchange::NONE, Ordering::SeqCst) {
                        exchange::QUERY => Some(&wire.trips),
                        exchange::PING => Some(&wire.pings),
                        _ => None,
                    };
                    if let Some(counter) = counter.filter(|_| COUNTING.load(Ordering::Relaxed)) {
                        counter.fetch_add(1, Ordering::Relaxed);
                    }
                });
                let _ = up.join();
            });
        }
    });
    Ok(addr)
}

/// Copies `from` to `to` until either end closes, calling `seen` on each chunk as it arrives
/// and writing it `delay` after its arrival. A writer thread keeps the chunks in order, and
/// each waits only for its own due time: one that arrived while an earlier one was held has
/// already served part of its delay, so a burst is not delayed once per chunk.
#[cfg(any(feature = "postgres", feature = "mysql"))]
fn relay(
    mut from: std::net::TcpStream,
    mut to: std::net::TcpStream,
    delay: Duration,
    wire: &Arc<Wire>,
    mut seen: impl FnMut(&[u8]),
) {
    use std::io::{Read, Write};

    let (queue, held) = std::sync::mpsc::channel::<(Instant, Vec<u8>)>();
    let wire = Arc::clone(wire);
    let writer = std::thread::spawn(move || {
        for (arrived, chunk) in held {
            std::thread::sleep((arrived + delay).saturating_duration_since(Instant::now()));
            let held_us = u64::try_from(arrived.elapsed().as_micros()).unwrap_or(u64::MAX);
            wire.chunks.fetch_add(1, Ordering::Relaxed);
            wire.held_us.fetch_add(held_us, Ordering::Relaxed);
            if to.write_all(&chunk).is_err() {
                break;
            }
        }
        let _ = to.shutdown(std::net::Shutdown::Write);
    });
    let mut buf = vec![0_u8; 64 * 1024];
    while let Ok(n @ 1..) = from.read(&mut buf) {
        let arrived = Instant::now();
        seen(&buf[..n]);
        if queue.send((arrived, buf[..n].to_vec())).is_err() {
            break;
        }
    }
    drop(queue);
    let _ = writer.join();
}

//! A loopback TCP link with a fixed one-way lag, standing in for the network between two
//! machines (two zones, say), which can be cut as when one end loses power: whatever the link
//! still holds is lost, and every connection is closed.

use std::net::SocketAddr;
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{mpsc, watch};
use tokio::task::JoinHandle;
use tokio::time::Instant;

pub(crate) struct Link {
    pub(crate) addr: SocketAddr,
    cut: watch::Sender<bool>,
    accept: JoinHandle<()>,
}

impl Link {
    /// Listens on a free loopback port; each connection reaches `target`, every byte `lag` late
    /// in either direction.
    pub(crate) async fn start(target: SocketAddr, lag: Duration) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr = listener.local_addr().expect("addr");
        let (cut, watching) = watch::channel(false);
        let accept = tokio::spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                tokio::spawn(carry(client, target, lag, watching.clone()));
            }
        });
        Self { addr, cut, accept }
    }

    /// Drops what the link holds and closes every connection; new ones are refused.
    pub(crate) fn cut(&self) {
        self.accept.abort();
        self.cut.send_replace(true);
    }
}

impl Drop for Link {
    fn drop(&mut self) {
        self.cut();
    }
}

async fn carry(
    client: TcpStream,
    target: SocketAddr,
    lag: Duration,
    mut cut: watch::Receiver<bool>,
) {
    let Ok(server) = TcpStream::connect(target).await else {
        return;
    };
    let _ = (client.set_nodelay(true), server.set_nodelay(true));
    let (client_read, client_write) = client.into_split();
    let (server_read, server_write) = server.into_split();
    tokio::select! {
        _ = async {
            tokio::join!(
                lagging(client_read, server_write, lag),
                lagging(server_read, client_write, lag),
            )
        } => {}
        // Dropping the halves here loses whatever is still queued in the lag.
        _ = cut.wait_for(|cut| *cut) => {}
    }
}

/// Copies one direction, each chunk delivered `lag` after it was read.
async fn lagging(mut from: OwnedReadHalf, mut to: OwnedWriteHalf, lag: Duration) {
    let (queue, mut queued) = mpsc::unbounded_channel::<(Instant, Vec<u8>)>();
    let read = async move {
        let mut buffer = vec![0; 64 * 1024];
        loop {
            match from.read(&mut buffer).await {
                Ok(0) | Err(_) => break,
                Ok(n) => {
                    if queue
                        .send((Instant::now() + lag, buffer[..n].to_vec()))
                        .is_err()
                    {
                        break;
                    }
                }
            }
        }
    };
    let write = async move {
        while let Some((due, chunk)) = queued.recv().await {
            tokio::time::sleep_until(due).await;
            if to.write_all(&chunk).await.is_err() {
                break;
            }
        }
        let _ = to.shutdown().await;
    };
    tokio::join!(read, write);
}

/// A loopback TCP link that can be unplugged and plugged back in, standing in for a network
/// partition between a consumer and its database: unplugged, every connection is closed and
/// each new one is closed as soon as it is accepted (a connection reset to the client). Made
/// with [`start_refusing`](Self::start_refusing), it stands in for a service that is down
/// instead: unplugged, it closes its port too, and a new connection is refused.
pub(crate) struct Plug {
    pub(crate) addr: SocketAddr,
    target: SocketAddr,
    refuse: bool,
    state: std::sync::Arc<std::sync::Mutex<Plugged>>,
    accept: std::sync::Mutex<Option<JoinHandle<()>>>,
}

struct Plugged {
    open: bool,
    /// Closes the connections carried since the link was last plugged in.
    cut: watch::Sender<bool>,
}

impl Plug {
    /// Listens on a free loopback port, plugged in; each connection reaches `target`.
    pub(crate) async fn start(target: SocketAddr) -> Self {
        Self::listen(target, false)
    }

    /// Like [`start`](Self::start), but unplugged its port is closed: connection refused.
    pub(crate) async fn start_refusing(target: SocketAddr) -> Self {
        Self::listen(target, true)
    }

    fn listen(target: SocketAddr, refuse: bool) -> Self {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
        let addr = listener.local_addr().expect("addr");
        let state = std::sync::Arc::new(std::sync::Mutex::new(Plugged {
            open: true,
            cut: watch::channel(false).0,
        }));
        let accept = accepting(listener, target, state.clone());
        Self {
            addr,
            target,
            refuse,
            state,
            accept: std::sync::Mutex::new(Some(accept)),
        }
    }

    /// Closes every connection and refuses new ones until [`plug_in`](Self::plug_in).
    pub(crate) fn unplug(&self) {
        if self.refuse
            && let Some(accept) = self.accept.lock().unwrap().take()
        {
            accept.abort();
        }
        let mut state = self.state.lock().unwrap();
        state.open = false;
        state.cut.send_replace(true);
        state.cut = watch::channel(false).0;
    }

    /// Carries new connections again (on the same port).
    pub(crate) fn plug_in(&self) {
        self.state.lock().unwrap().open = true;
        let mut accept = self.accept.lock().unwrap();
        if accept.is_none() {
            // The aborted accept loop drops its listener as the runtime gets to it.
            let deadline = std::time::Instant::now() + Duration::from_secs(5);
            let listener = loop {
                match std::net::TcpListener::bind(self.addr) {
                    Ok(listener) => break listener,
                    Err(error) if std::time::Instant::now() >= deadline => {
                        panic!("cannot listen on {} again: {error}", self.addr)
                    }
                    Err(_) => std::thread::sleep(Duration::from_millis(10)),
                }
            };
            *accept = Some(accepting(listener, self.target, self.state.clone()));
        }
    }
}

/// Accepts on `listener`: carried to `target` while plugged in, closed at once otherwise.
fn accepting(
    listener: std::net::TcpListener,
    target: SocketAddr,
    state: std::sync::Arc<std::sync::Mutex<Plugged>>,
) -> JoinHandle<()> {
    listener.set_nonblocking(true).expect("nonblocking");
    let listener = TcpListener::from_std(listener).expect("a tokio listener");
    tokio::spawn(async move {
        while let Ok((client, _)) = listener.accept().await {
            let cut = {
                let state = state.lock().unwrap();
                state.open.then(|| state.cut.subscribe())
            };
            match cut {
                Some(cut) => drop(tokio::spawn(carry(client, target, Duration::ZERO, cut))),
                None => drop(client),
            }
        }
    })
}

impl Drop for Plug {
    fn drop(&mut self) {
        if let Some(accept) = self.accept.lock().unwrap().take() {
            accept.abort();
        }
        let mut state = self.state.lock().unwrap();
        state.open = false;
        state.cut.send_replace(true);
    }
}

//! A TCP proxy in front of a shared broker that the bench can cut and restore: an outage of
//! the broker for this bench's clients only, never for the machine's other users.

use std::net::SocketAddr;
use std::time::Duration;

use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;

/// Forwards every connection on `addr` to the upstream while up. Cut, it closes the
/// connections it carries and stops listening, so a client sees its connection lost and every
/// reconnection refused, as when the broker's host is down; restored, it listens again on the
/// same port.
pub(crate) struct Proxy {
    pub(crate) addr: SocketAddr,
    up: watch::Sender<bool>,
}

impl Proxy {
    pub(crate) async fn start(upstream: SocketAddr) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("proxy bind");
        let addr = listener.local_addr().expect("proxy address");
        let (up, state) = watch::channel(true);
        tokio::spawn(serve(listener, addr, upstream, state));
        Self { addr, up }
    }

    pub(crate) fn cut(&self) {
        self.up.send_replace(false);
    }

    pub(crate) fn restore(&self) {
        self.up.send_replace(true);
    }
}

async fn serve(
    listener: TcpListener,
    addr: SocketAddr,
    upstream: SocketAddr,
    mut state: watch::Receiver<bool>,
) {
    let mut listener = Some(listener);
    loop {
        let Some(open) = &listener else {
            if state.wait_for(|up| *up).await.is_err() {
                return;
            }
            // The port was ours a moment ago; a client's connection left in TIME_WAIT does not
            // stop a listener (SO_REUSEADDR), so this only waits on a rare race.
            loop {
                match TcpListener::bind(addr).await {
                    Ok(bound) => break listener = Some(bound),
                    Err(_) => tokio::time::sleep(Duration::from_millis(10)).await,
                }
            }
            continue;
        };
        tokio::select! {
            accepted = open.accept() => {
                if let Ok((client, _)) = accepted {
                    tokio::spawn(forward(client, upstream, state.clone()));
                }
            }
            changed = state.changed() => {
                if changed.is_err() {
                    return;
                }
                if !*state.borrow_and_update() {
                    listener = None;
                }
            }
        }
    }
}

async fn forward(mut client: TcpStream, upstream: SocketAddr, mut state: watch::Receiver<bool>) {
    let Ok(mut server) = TcpStream::connect(upstream).await else {
        return;
    };
    let _ = client.set_nodelay(true);
    let _ = server.set_nodelay(true);
    tokio::select! {
        _ = tokio::io::copy_bidirectional(&mut client, &mut server) => {}
        _ = state.wait_for(|up| !*up) => {}
    }
}

//! A loopback TCP forwarder standing in for a virtual IP: the app connects to one address, and
//! the test moves that address to another server. Every connection open at the move is reset,
//! as when the address moves to another machine that knows none of them.

use std::net::SocketAddr;

use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;
use tokio::task::JoinHandle;

pub(crate) struct Vip {
    pub(crate) addr: SocketAddr,
    target: watch::Sender<SocketAddr>,
    accept: JoinHandle<()>,
}

/// An address where nothing listens: where a `Vip` moves to cut the link.
pub(crate) async fn dead_address() -> SocketAddr {
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    listener.local_addr().expect("addr")
}

impl Vip {
    /// Listens on a free loopback port and forwards each connection to `target`.
    pub(crate) async fn start(target: SocketAddr) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr = listener.local_addr().expect("addr");
        let (target, watching) = watch::channel(target);
        let accept = tokio::spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                tokio::spawn(forward(client, watching.clone()));
            }
        });
        Self {
            addr,
            target,
            accept,
        }
    }

    /// Sends new connections to `target` from now on and resets every open one.
    pub(crate) fn move_to(&self, target: SocketAddr) {
        self.target.send_replace(target);
    }
}

impl Drop for Vip {
    fn drop(&mut self) {
        // The listener goes with the accept task; open connections see the sender gone and end.
        self.accept.abort();
    }
}

async fn forward(mut client: TcpStream, mut target: watch::Receiver<SocketAddr>) {
    // Marked seen before connecting: a move from here on ends this connection too.
    let upstream = *target.borrow_and_update();
    let Ok(mut server) = TcpStream::connect(upstream).await else {
        // A dead server's address refuses; the client sees its connection reset.
        let _ = client.set_zero_linger();
        return;
    };
    tokio::select! {
        _ = tokio::io::copy_bidirectional(&mut client, &mut server) => {}
        _ = target.changed() => {
            // Closing with a zero linger sends RST rather than FIN: both ends learn at once
            // that the connection is gone, with no orderly shutdown.
            let _ = client.set_zero_linger();
            let _ = server.set_zero_linger();
        }
    }
}

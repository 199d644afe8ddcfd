//! A TCP proxy that can go silent: while blackholed it passes no byte either way and keeps
//! every connection open, as a partitioned network or a host that vanished without a reset
//! does; healed, it delivers what it held back.

use std::net::SocketAddr;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;

/// Forwards connections to an upstream; while blackholed it passes no byte either way (and
/// keeps every connection open), as a partitioned network does.
pub(crate) struct FaultProxy {
    pub(crate) addr: SocketAddr,
    silent: watch::Sender<bool>,
    accept: tokio::task::JoinHandle<()>,
}

impl FaultProxy {
    pub(crate) async fn start(upstream: &str) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr = listener.local_addr().expect("addr");
        let (silent, watching) = watch::channel(false);
        let upstream = upstream.to_owned();
        let accept = tokio::spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                let upstream = upstream.clone();
                let watching = watching.clone();
                tokio::spawn(async move {
                    let Ok(server) = TcpStream::connect(&upstream).await else {
                        return;
                    };
                    let (client_read, client_write) = client.into_split();
                    let (server_read, server_write) = server.into_split();
                    tokio::join!(
                        pipe(client_read, server_write, watching.clone()),
                        pipe(server_read, client_write, watching),
                    );
                });
            }
        });
        Self {
            addr,
            silent,
            accept,
        }
    }

    pub(crate) fn blackhole(&self, on: bool) {
        self.silent.send_replace(on);
    }
}

impl Drop for FaultProxy {
    fn drop(&mut self) {
        self.accept.abort();
    }
}

/// Copies bytes one way, holding each chunk back while the link is silent.
async fn pipe(
    mut from: tokio::net::tcp::OwnedReadHalf,
    mut to: tokio::net::tcp::OwnedWriteHalf,
    mut silent: watch::Receiver<bool>,
) {
    let mut buffer = vec![0; 16 * 1024];
    loop {
        let read = match from.read(&mut buffer).await {
            Ok(0) | Err(_) => break,
            Ok(read) => read,
        };
        if silent.wait_for(|silent| !silent).await.is_err() {
            break;
        }
        if to.write_all(&buffer[..read]).await.is_err() {
            break;
        }
    }
    let _ = to.shutdown().await;
}

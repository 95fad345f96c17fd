//! What a caller may hold of a gRPC server before it has said anything: every accepted
//! connection must send its first bytes (the HTTP/2 preface, or a TLS hello) within
//! [`Bounds::preface_within`], else it is closed, and at most [`Bounds::max_connections`] are
//! open at once (a connection past that is closed at once, logged). Without these, connections
//! that never speak each hold a descriptor and a task for ever, and hold up a graceful stop.

use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpStream;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tonic::transport::server::{Connected, TcpConnectInfo};

/// The bytes of the HTTP/2 client preface (`PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n`).
const PREFACE: usize = 24;

/// The listener's bounds.
#[derive(Debug, Clone, Copy)]
pub struct Bounds {
    pub preface_within: Duration,
    pub max_connections: usize,
}

impl Default for Bounds {
    fn default() -> Self {
        Self {
            preface_within: Duration::from_secs(10),
            max_connections: 4096,
        }
    }
}

/// Admits accepted connections within `bounds`: `None` for one past the bound (dropped, so
/// closed).
pub struct Admission {
    bounds: Bounds,
    places: Arc<Semaphore>,
}

impl Admission {
    pub fn new(bounds: Bounds) -> Self {
        Self {
            bounds,
            places: Arc::new(Semaphore::new(bounds.max_connections)),
        }
    }

    pub fn admit(&self, stream: TcpStream) -> Option<Guarded> {
        let Ok(place) = self.places.clone().try_acquire_owned() else {
            tracing::warn!(
                peer = ?stream.peer_addr().ok(),
                max_connections = self.bounds.max_connections,
                "gRPC connection refused: as many are open as the server allows"
            );
            return None;
        };
        Some(Guarded {
            stream,
            _place: place,
            preface: Some(Box::pin(tokio::time::sleep(self.bounds.preface_within))),
            read: 0,
        })
    }
}

/// An admitted connection: its place among the open ones, and its deadline until its first
/// bytes have come.
pub struct Guarded {
    stream: TcpStream,
    _place: OwnedSemaphorePermit,
    preface: Option<Pin<Box<tokio::time::Sleep>>>,
    read: usize,
}

impl AsyncRead for Guarded {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        let before = buf.filled().len();
        let this = &mut *self;
        match Pin::new(&mut this.stream).poll_read(cx, buf) {
            Poll::Ready(outcome) => {
                this.read += buf.filled().len() - before;
                if this.read >= PREFACE {
                    this.preface = None;
                }
                Poll::Ready(outcome)
            }
            Poll::Pending => match this.preface.as_mut().map(|d| d.as_mut().poll(cx)) {
                Some(Poll::Ready(())) => Poll::Ready(Err(std::io::Error::new(
                    std::io::ErrorKind::TimedOut,
                    "the connection sent no gRPC preface in time",
                ))),
                _ => Poll::Pending,
            },
        }
    }
}

impl AsyncWrite for Guarded {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.stream).poll_write(cx, buf)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.stream).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.stream).poll_shutdown(cx)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.stream).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.stream.is_write_vectored()
    }
}

impl Connected for Guarded {
    type ConnectInfo = TcpConnectInfo;

    fn connect_info(&self) -> Self::ConnectInfo {
        self.stream.connect_info()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::AsyncReadExt as _;

    async fn closed_within(stream: &mut TcpStream, within: Duration) -> bool {
        let mut buffer = [0u8; 256];
        let deadline = tokio::time::Instant::now() + within;
        loop {
            match tokio::time::timeout_at(deadline, stream.read(&mut buffer)).await {
                Err(_) => return false,
                Ok(Ok(0) | Err(_)) => return true,
                Ok(Ok(_)) => {}
            }
        }
    }

    /// A connection that says nothing is closed at its deadline; one past the bound is closed at
    /// once; a real caller is served once there is room.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn silent_connections_are_cut_and_bounded_and_callers_served() {
        let (listener, addr) = crate::bind("127.0.0.1:0").await.unwrap();
        let bounds = Bounds {
            preface_within: Duration::from_millis(400),
            max_connections: 2,
        };
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let server = tokio::spawn(
            crate::RpcServer::new().serve_within(listener, bounds, async {
                let _ = stopped.await;
            }),
        );
        let mut silent: Vec<TcpStream> = Vec::new();
        for _ in 0..2 {
            silent.push(TcpStream::connect(addr).await.unwrap());
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
        let mut third = TcpStream::connect(addr).await.unwrap();
        assert!(
            closed_within(&mut third, Duration::from_millis(300)).await,
            "a connection past the bound stayed open"
        );
        for stream in &mut silent {
            assert!(
                closed_within(stream, Duration::from_secs(2)).await,
                "a silent connection outlived its deadline"
            );
        }
        let channel = crate::channel(&addr.to_string()).unwrap();
        let mut health = tonic_health::pb::health_client::HealthClient::new(channel);
        health
            .check(tonic_health::pb::HealthCheckRequest::default())
            .await
            .expect("a caller is served once the silent ones are gone");
        let _ = stop.send(());
        server.await.unwrap().unwrap();
    }
}

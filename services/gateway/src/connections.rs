//! The gateway's HTTP listener, bounded so that what a caller sends before its token is checked
//! cannot hold the gateway: a deadline for each request's headers (which is also the most a
//! connection may idle between requests), at most `max_connections` open at once, and, when
//! full, the oldest connection on which no request has yet passed the token check is closed for
//! the new one; with none such, the new one is answered 503 and closed.

use crate::lock::lock;
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::net::TcpListener;
use tokio::sync::oneshot;

/// The bounds of the listener.
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    pub header_timeout: Duration,
    pub max_connections: usize,
    /// How long open connections may take to finish their requests once the gateway stops.
    pub drain: Duration,
}

/// The connection a request came on, for the token check to mark it as authenticated (a
/// request extension on every request this listener serves).
#[derive(Clone, Debug, Default)]
pub struct Connection(Arc<AtomicBool>);

impl Connection {
    pub fn authenticated(&self) {
        self.0.store(true, Ordering::Relaxed);
    }

    fn is_authenticated(&self) -> bool {
        self.0.load(Ordering::Relaxed)
    }
}

struct Open {
    connection: Connection,
    /// Closes the connection (its task drops it).
    evict: oneshot::Sender<()>,
}

/// The open connections, oldest first.
struct Registry {
    max: usize,
    next: u64,
    open: BTreeMap<u64, Open>,
}

/// Why a connection was not admitted.
#[derive(Debug, PartialEq, Eq)]
struct Full;

impl Registry {
    /// Admits a connection: in a free place, or in that of the oldest one that never
    /// authenticated (closed for it).
    fn admit(&mut self) -> Result<(u64, Connection, oneshot::Receiver<()>), Full> {
        if self.open.len() >= self.max {
            let oldest = self
                .open
                .iter()
                .find(|(_, o)| !o.connection.is_authenticated())
                .map(|(id, _)| *id)
                .ok_or(Full)?;
            if let Some(evicted) = self.open.remove(&oldest) {
                let _ = evicted.evict.send(());
            }
        }
        let (evict, evicted) = oneshot::channel();
        let connection = Connection::default();
        let id = self.next;
        self.next += 1;
        self.open.insert(
            id,
            Open {
                connection: connection.clone(),
                evict,
            },
        );
        Ok((id, connection, evicted))
    }
}

/// Serves `app` on `listener` within `limits` until `stopped`, then lets open requests finish
/// for at most `limits.drain`.
pub async fn serve(
    listener: TcpListener,
    app: axum::Router,
    limits: Limits,
    stopped: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    let mut http1 = hyper::server::conn::http1::Builder::new();
    http1
        .timer(hyper_util::rt::TokioTimer::new())
        .header_read_timeout(limits.header_timeout);
    let graceful = hyper_util::server::graceful::GracefulShutdown::new();
    let registry = Arc::new(Mutex::new(Registry {
        max: limits.max_connections,
        next: 0,
        open: BTreeMap::new(),
    }));
    let mut stopped = std::pin::pin!(stopped);
    loop {
        let (stream, peer) = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok(accepted) => accepted,
                Err(e) => {
                    // Out of descriptors (or a connection reset before it was taken): wait
                    // rather than spin; the bound above keeps this rare.
                    tracing::warn!("accepting an HTTP connection: {e}");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    continue;
                }
            },
            () = &mut stopped => break,
        };
        let admitted = lock(&registry).admit();
        let Ok((id, connection, evicted)) = admitted else {
            tracing::warn!(
                %peer,
                max_connections = limits.max_connections,
                "HTTP connection refused: every connection has authenticated \
                 (gateway.http.max_connections)"
            );
            tokio::spawn(refuse(stream));
            continue;
        };
        let _ = stream.set_nodelay(true);
        let app = app.clone();
        let service = hyper::service::service_fn(move |mut request: http::Request<_>| {
            request.extensions_mut().insert(connection.clone());
            tower::ServiceExt::oneshot(app.clone(), request)
        });
        let served =
            graceful.watch(http1.serve_connection(hyper_util::rt::TokioIo::new(stream), service));
        let registry = registry.clone();
        tokio::spawn(async move {
            tokio::select! {
                result = served => {
                    if let Err(e) = result {
                        tracing::debug!(%peer, "HTTP connection: {e}");
                    }
                }
                _ = evicted => tracing::debug!(
                    %peer,
                    "HTTP connection closed for a new one: it never authenticated"
                ),
            }
            lock(&registry).open.remove(&id);
        });
    }
    drop(listener);
    if tokio::time::timeout(limits.drain, graceful.shutdown())
        .await
        .is_err()
    {
        tracing::info!(
            "HTTP connections still open {} s after the stop are closed",
            limits.drain.as_secs()
        );
    }
    Ok(())
}

/// A 503 that says why, then the connection closes.
async fn refuse(mut stream: tokio::net::TcpStream) {
    use tokio::io::AsyncWriteExt as _;
    let body = "the gateway has as many connections open as it allows (gateway.http.max_connections); \
                retry shortly\n";
    let response = format!(
        "HTTP/1.1 503 Service Unavailable\r\nconnection: close\r\nretry-after: 1\r\n\
         content-type: text/plain\r\ncontent-length: {}\r\n\r\n{body}",
        body.len()
    );
    let _ = tokio::time::timeout(
        Duration::from_secs(1),
        stream.write_all(response.as_bytes()),
    )
    .await;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_full_registry_closes_the_oldest_unauthenticated_connection_first() {
        let mut registry = Registry {
            max: 3,
            next: 0,
            open: BTreeMap::new(),
        };
        let (a, first, mut a_evicted) = registry.admit().unwrap();
        let (_, _, mut b_evicted) = registry.admit().unwrap();
        let (_, _, mut c_evicted) = registry.admit().unwrap();
        first.authenticated();
        let (d, _, _) = registry.admit().expect("an unauthenticated one makes room");
        assert!(a_evicted.try_recv().is_err(), "the authenticated one stays");
        assert!(
            b_evicted.try_recv().is_ok(),
            "the oldest unauthenticated one goes"
        );
        assert!(c_evicted.try_recv().is_err());
        assert!(registry.open.contains_key(&a) && registry.open.contains_key(&d));
        // Then the next oldest that never authenticated.
        registry.admit().unwrap();
        assert!(c_evicted.try_recv().is_ok());
        for o in registry.open.values() {
            o.connection.authenticated();
        }
        assert_eq!(registry.admit().map(|_| ()), Err(Full));
    }
}

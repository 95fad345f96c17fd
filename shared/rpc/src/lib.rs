//! How every Nomad process serves and dials gRPC: one runtime shape, one server stack
//! (propagation layer, health, reflection, graceful shutdown), one client channel shape.

use std::future::Future;
use std::net::SocketAddr;
use std::path::Path;
use std::time::Duration;

use nomad_telemetry::grpc::{Trace, TraceLayer};
use tokio::net::TcpListener;
use tokio_stream::StreamExt as _;
use tonic::service::RoutesBuilder;
use tonic::transport::{Endpoint, Server};
use tonic_health::server::HealthReporter;
use tower::Layer;

/// The transport every generated client in Nomad uses: a lazily connected channel wrapped in
/// the client propagation layer and the one that sends the fleet's token.
pub type Channel = Trace<auth::ClientAuth<tonic::transport::Channel>>;

#[derive(Debug, thiserror::Error)]
pub enum RpcError {
    #[error("invalid address {address:?}: {reason}")]
    InvalidAddress { address: String, reason: String },
    // The reason is the source, which error chains print after this.
    #[error("cannot listen on {address}{}", in_use_hint(source))]
    Bind {
        address: String,
        #[source]
        source: std::io::Error,
    },
    #[error("writing address file {path}")]
    AddrFile {
        path: String,
        #[source]
        source: std::io::Error,
    },
    #[error("gRPC server: {0}")]
    Serve(#[from] tonic::transport::Error),
    #[error("TLS: {0}")]
    Tls(String),
    #[error("auth: {0}")]
    Auth(String),
}

/// What to do about a port another process holds.
fn in_use_hint(error: &std::io::Error) -> &'static str {
    if error.kind() == std::io::ErrorKind::AddrInUse {
        " (another process holds that port: stop it, or choose another port)"
    } else {
        ""
    }
}

/// A multi-thread runtime with at least two workers: exporters flush on the runtime while the
/// shutdown path waits, and a single worker would deadlock.
pub fn runtime() -> std::io::Result<tokio::runtime::Runtime> {
    let workers = std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(2)
        .max(2);
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(workers)
        .enable_all()
        .build()
}

/// Resolves on SIGINT (Ctrl-C) or SIGTERM.
pub async fn shutdown_signal() {
    let ctrl_c = tokio::signal::ctrl_c();
    #[cfg(unix)]
    {
        let mut term =
            match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
                Ok(term) => term,
                Err(e) => {
                    tracing::warn!("cannot watch SIGTERM ({e}); only Ctrl-C stops this process");
                    let _ = ctrl_c.await;
                    return;
                }
            };
        tokio::select! {
            _ = ctrl_c => {},
            _ = term.recv() => {},
        }
    }
    #[cfg(not(unix))]
    {
        let _ = ctrl_c.await;
    }
}

pub mod auth;
pub mod bootstrap;
pub mod incoming;
pub mod tls;

pub use bootstrap::{Service, ServiceArgs, StartOptions};

/// `host:port` or a URL, as the URL this process dials: `https://` when TLS is on (an
/// `http://` URL too: a peer's advertised address does not know this process's settings),
/// else `http://` for a bare address.
pub fn normalize_address(address: &str) -> String {
    let address = address.trim();
    let tls = tls::installed().client.is_some();
    match address.split_once("://") {
        Some(("http", rest)) if tls => format!("https://{rest}"),
        Some(_) => address.to_owned(),
        None if tls => format!("https://{address}"),
        None => format!("http://{address}"),
    }
}

/// A lazily connected, traced channel to `address`. Fails only on a malformed address; an
/// unreachable peer surfaces as UNAVAILABLE on the first call.
pub fn channel(address: &str) -> Result<Channel, RpcError> {
    let url = normalize_address(address);
    let endpoint = Endpoint::from_shared(url.clone()).map_err(|e| RpcError::InvalidAddress {
        address: address.to_owned(),
        reason: e.to_string(),
    })?;
    let endpoint = match &tls::installed().client {
        Some(config) => {
            endpoint
                .tls_config(config.clone())
                .map_err(|e| RpcError::InvalidAddress {
                    address: address.to_owned(),
                    reason: format!("TLS: {e}"),
                })?
        }
        None => endpoint,
    };
    let channel = endpoint
        // Calls abandoned by the thousand (deadlines, cancelled rollouts) reset their streams;
        // h2 remembers only 50 (for 1 s) by default, answers a late frame for a forgotten one with an
        // internal reset, and the 1,024th such reset closes the connection with every call on it.
        .http2_max_concurrent_reset_streams(MAX_PENDING_RESET_STREAMS)
        .connect_timeout(Duration::from_secs(5))
        .tcp_nodelay(true)
        .http2_keep_alive_interval(Duration::from_secs(10))
        .keep_alive_timeout(Duration::from_secs(10))
        .connect_lazy();
    Ok(TraceLayer::client().layer(auth::ClientAuthLayer::new(auth::installed()).layer(channel)))
}

/// Binds `address` (`127.0.0.1:0` picks a free port) and reports the address actually bound.
pub async fn bind(address: &str) -> Result<(TcpListener, SocketAddr), RpcError> {
    let bind_error = |source| RpcError::Bind {
        address: address.to_owned(),
        source,
    };
    let listener = TcpListener::bind(address).await.map_err(bind_error)?;
    let local = listener.local_addr().map_err(bind_error)?;
    Ok((listener, local))
}

/// Writes `addr` to `path` atomically, so a watcher never reads a half-written file.
pub fn write_addr_file(path: &Path, addr: SocketAddr) -> Result<(), RpcError> {
    let error = |source| RpcError::AddrFile {
        path: path.display().to_string(),
        source,
    };
    let tmp = path.with_extension("tmp");
    std::fs::write(&tmp, format!("{addr}\n")).map_err(error)?;
    std::fs::rename(&tmp, path).map_err(error)
}

/// A gRPC server with health and reflection; the service adds its own routes.
pub struct RpcServer {
    routes: RoutesBuilder,
    health: HealthReporter,
}

impl Default for RpcServer {
    fn default() -> Self {
        Self::new()
    }
}

/// Whether a call's error means the peer or the connection to it is gone, rather than an answer
/// the peer gave: `UNAVAILABLE`; `CANCELLED` that the caller did not ask for (a connection
/// closed under the request: whoever cancels a call drops its future and never sees this); or
/// an `UNKNOWN` or `INTERNAL` the client made from a transport error (an HTTP/2 error when the
/// peer shuts down mid-call is `INTERNAL`; either carries that error as its source, one the
/// peer sent has none).
pub fn peer_lost(status: &tonic::Status) -> bool {
    match status.code() {
        tonic::Code::Unavailable | tonic::Code::Cancelled => true,
        tonic::Code::Unknown | tonic::Code::Internal => std::error::Error::source(status).is_some(),
        _ => false,
    }
}

/// Whether a call failed before any of it reached the peer: no connection could be made (the
/// peer is not listening, as while it starts again). Such a call is safe to send again, whatever
/// it does; one that failed later may have run in part.
pub fn never_sent(status: &tonic::Status) -> bool {
    if status.code() != tonic::Code::Unavailable {
        return false;
    }
    let mut source: Option<&(dyn std::error::Error + 'static)> = std::error::Error::source(status);
    while let Some(error) = source {
        if let Some(io) = error.downcast_ref::<std::io::Error>()
            && matches!(
                io.kind(),
                std::io::ErrorKind::ConnectionRefused | std::io::ErrorKind::NotFound
            )
        {
            return true;
        }
        source = error.source();
    }
    false
}

/// Makes `call` again while it fails before reaching its peer ([`never_sent`]), waiting a little
/// longer each time (100 ms, doubling to 1 s), for at most `within`: a peer that is starting
/// again (the fleet restarts what dies) is waited for instead of failing every call meanwhile.
/// Any other outcome, and the last refusal, is the call's.
pub async fn while_unreachable<T, F, Fut>(
    within: std::time::Duration,
    mut call: F,
) -> Result<T, tonic::Status>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<T, tonic::Status>>,
{
    let deadline = tokio::time::Instant::now() + within;
    let mut wait = std::time::Duration::from_millis(100);
    loop {
        match call().await {
            Err(status) if never_sent(&status) && tokio::time::Instant::now() + wait < deadline => {
                tokio::time::sleep(wait).await;
                wait = (wait * 2).min(std::time::Duration::from_secs(1));
            }
            outcome => return outcome,
        }
    }
}

/// The largest message on the scheduler-to-worker hop (a whole batch of inputs, or of outputs):
/// above the scheduler's batch byte budget (`DEFAULT_MAX_BATCH_BYTES`, 16 MiB) with room for
/// outputs and framing. Every other hop keeps tonic's 4 MiB.
pub const WORKER_MESSAGE_LIMIT: usize = 64 << 20;

/// Streams a peer may reset before the server accepts them, and recently reset streams a client
/// remembers, per connection.
pub const MAX_PENDING_RESET_STREAMS: usize = 4096;

impl RpcServer {
    pub fn new() -> Self {
        let (health, health_service) = tonic_health::server::health_reporter();
        let mut routes = RoutesBuilder::default();
        routes.add_service(health_service);
        let reflection = tonic_reflection::server::Builder::configure()
            .register_encoded_file_descriptor_set(nomad_proto::FILE_DESCRIPTOR_SET)
            .register_encoded_file_descriptor_set(tonic_health::pb::FILE_DESCRIPTOR_SET);
        match reflection.build_v1() {
            Ok(service) => {
                routes.add_service(service);
            }
            Err(e) => tracing::warn!("gRPC reflection unavailable: {e}"),
        }
        Self { routes, health }
    }

    /// Where the service adds its generated server(s).
    pub fn routes(&mut self) -> &mut RoutesBuilder {
        &mut self.routes
    }

    pub fn health(&self) -> &HealthReporter {
        &self.health
    }

    /// Serves until `shutdown` resolves, then stops accepting and drains in-flight calls.
    pub async fn serve(
        self,
        listener: TcpListener,
        shutdown: impl Future<Output = ()>,
    ) -> Result<(), RpcError> {
        self.serve_within(listener, incoming::Bounds::default(), shutdown)
            .await
    }

    /// [`Self::serve`] with the listener's `bounds` on connections that have not spoken yet.
    pub async fn serve_within(
        self,
        listener: TcpListener,
        bounds: incoming::Bounds,
        shutdown: impl Future<Output = ()>,
    ) -> Result<(), RpcError> {
        let health = self.health.clone();
        let admission = incoming::Admission::new(bounds);
        let incoming =
            tokio_stream::wrappers::TcpListenerStream::new(listener).filter_map(move |conn| {
                match conn {
                    Ok(stream) => {
                        // Nagle's algorithm meets the peer's delayed ACK on small responses and
                        // stalls each exchange ~40 ms; gRPC frames are already batched by HTTP/2.
                        if let Err(e) = stream.set_nodelay(true) {
                            tracing::debug!("TCP_NODELAY not set on an accepted connection: {e}");
                        }
                        admission.admit(stream).map(Ok)
                    }
                    Err(e) => Some(Err(e)),
                }
            });
        let mut builder = Server::builder();
        if let Some(config) = &tls::installed().server {
            builder = builder.tls_config(config.clone())?;
        }
        builder
            // A caller that abandons many calls at once (deadlines under load) resets many
            // streams before they are accepted; h2's default of 20 then tears the whole
            // connection down with ENHANCE_YOUR_CALM, failing every other call on it. Still a
            // bound, against rapid-reset floods.
            .http2_max_pending_accept_reset_streams(Some(MAX_PENDING_RESET_STREAMS))
            // Authentication first: a refused call is answered before any trace context is
            // read or any span recorded, so no one without the token writes into a run's trace.
            .layer(auth::ServerAuthLayer::new(auth::installed().clone()))
            .layer(TraceLayer::server())
            .layer(tower::util::MapResponseLayer::new(name_the_message_limit))
            .add_routes(self.routes.routes())
            .serve_with_incoming_shutdown(incoming, async move {
                shutdown.await;
                health
                    .set_service_status("", tonic_health::ServingStatus::NotServing)
                    .await;
            })
            .await?;
        Ok(())
    }
}

/// tonic refuses an oversized request with OUT_OF_RANGE; gRPC's code for it is
/// RESOURCE_EXHAUSTED, and the caller needs to know what to change.
fn name_the_message_limit<B>(
    mut response: tonic::codegen::http::Response<B>,
) -> tonic::codegen::http::Response<B> {
    use tonic::codegen::http::HeaderValue;
    let headers = response.headers_mut();
    if headers.get("grpc-status").map(HeaderValue::as_bytes) != Some(b"11") {
        return response;
    }
    let Some(message) = headers.get("grpc-message").and_then(|m| m.to_str().ok()) else {
        return response;
    };
    let Some(text) = oversized_message_text(message) else {
        return response;
    };
    if let Ok(value) = HeaderValue::from_str(&text) {
        headers.insert("grpc-status", HeaderValue::from_static("8"));
        headers.insert("grpc-message", value);
    }
    response
}

/// The clear message for tonic's decode-limit error (percent-encoded as sent), if it is one.
fn oversized_message_text(grpc_message: &str) -> Option<String> {
    let message = grpc_message
        .replace("%20", " ")
        .replace("%3A", ":")
        .replace("%2C", ",");
    let rest = message.strip_prefix("Error, decoded message length too large: found ")?;
    let (found, rest) = rest.split_once(" bytes, the limit is: ")?;
    let limit = rest.strip_suffix(" bytes")?;
    let (found, limit): (u64, u64) = (found.parse().ok()?, limit.parse().ok()?);
    Some(format!(
        "the request message is {found} bytes, over this server's {limit}-byte limit: \
         send smaller inputs (split a large batch into several calls)"
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_decode_limit_error_becomes_a_clear_message() {
        let tonic_text = "Error, decoded message length too large: found 5000000 bytes, the limit is: 4194304 bytes";
        let text = oversized_message_text(tonic_text).unwrap();
        assert!(
            text.contains("5000000 bytes") && text.contains("4194304-byte limit"),
            "{text}"
        );
        assert_eq!(oversized_message_text("something else"), None);
    }
}

#[cfg(test)]
mod peer_tests {
    use super::peer_lost;
    use tonic::Status;

    #[test]
    fn a_broken_connection_is_a_lost_peer_and_an_unknown_the_peer_sent_is_not() {
        let broken = Status::from_error(Box::new(std::io::Error::new(
            std::io::ErrorKind::ConnectionReset,
            "connection reset by peer",
        )));
        assert_eq!(broken.code(), tonic::Code::Unknown);
        assert!(peer_lost(&broken));
        assert!(!peer_lost(&Status::unknown("the handler panicked")));
        assert!(peer_lost(&Status::unavailable("connection refused")));
        assert!(peer_lost(&Status::cancelled("operation was canceled")));
        assert!(!peer_lost(&Status::internal("model error")));
        // What the client makes of an HTTP/2 error as the worker shuts down mid-call.
        let mut h2 = Status::internal("h2 protocol error: http2 error");
        h2.set_source(std::sync::Arc::new(std::io::Error::other("http2 error")));
        assert!(peer_lost(&h2));
    }
}

#[cfg(test)]
mod never_sent_tests {
    use super::never_sent;

    /// A call to a port no one listens on was never sent; a status a peer answered, or a
    /// connection lost mid-call, is not "never sent".
    #[tokio::test]
    async fn a_refused_connection_is_never_sent_and_an_answer_is_not() {
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let channel = super::channel(&format!("127.0.0.1:{port}")).unwrap();
        let mut client = tonic_health::pb::health_client::HealthClient::new(channel);
        let refused = client
            .check(tonic_health::pb::HealthCheckRequest::default())
            .await
            .unwrap_err();
        assert!(never_sent(&refused), "{refused:?}");
        // Waited for, within its bound, then the refusal is the call's; a peer that comes up
        // meanwhile answers.
        let started = std::time::Instant::now();
        let waited = super::while_unreachable(std::time::Duration::from_millis(500), || {
            let mut client = client.clone();
            async move {
                client
                    .check(tonic_health::pb::HealthCheckRequest::default())
                    .await
            }
        })
        .await
        .unwrap_err();
        assert!(never_sent(&waited));
        assert!(started.elapsed() >= std::time::Duration::from_millis(300));
        assert!(!never_sent(&tonic::Status::unavailable(
            "the scheduler has no worker"
        )));
        let reset = tonic::Status::from_error(Box::new(std::io::Error::new(
            std::io::ErrorKind::ConnectionReset,
            "connection reset by peer",
        )));
        assert!(!never_sent(&reset));
    }
}

/// Makes ring the process's TLS provider: the HTTP clients (the registry client, the OTLP HTTP
/// exporter, MCP upstreams) are built on rustls without a provider of their own and panic
/// without one. Every service does this first (`bootstrap::main`); a second call is a no-op.
pub fn install_crypto_provider() {
    let _ = rustls::crypto::ring::default_provider().install_default();
}

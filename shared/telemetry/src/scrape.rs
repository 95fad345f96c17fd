//! The Prometheus scrape endpoint (`telemetry.prometheus_listen`): the same instruments as the
//! OTLP export, collected on each scrape and served as text on `GET /metrics`, with names, units
//! and types per the OpenTelemetry-to-Prometheus rules and the resource as `target_info`.

use std::net::SocketAddr;
use std::sync::Arc;

use opentelemetry_prometheus::PrometheusExporter;

use crate::TelemetryError;

/// A bound scrape endpoint; it stops serving when dropped.
#[derive(Debug)]
pub struct Endpoint {
    pub address: SocketAddr,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for Endpoint {
    fn drop(&mut self) {
        self.task.abort();
    }
}

fn error(message: String) -> TelemetryError {
    TelemetryError::Exporter {
        signal: "Prometheus",
        message,
    }
}

/// Who may scrape: given a request's `Authorization` header, whether to answer it (the fleet's
/// token check, from the process's auth layer).
#[derive(Clone)]
pub struct ScrapeAuth(pub Arc<Accepts>);

/// A check of an `Authorization` header value (absent: `None`).
pub type Accepts = dyn Fn(Option<&str>) -> bool + Send + Sync;

impl std::fmt::Debug for ScrapeAuth {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ScrapeAuth")
    }
}

/// The metric reader to add to the meter provider, and the endpoint serving what it reads;
/// with `auth`, a scrape it does not accept is answered 401 and gets nothing. Must run inside a
/// Tokio runtime.
pub fn start(
    listen: SocketAddr,
    auth: Option<ScrapeAuth>,
) -> Result<(PrometheusExporter, Endpoint), TelemetryError> {
    let registry = prometheus::Registry::new();
    let reader = opentelemetry_prometheus::exporter()
        .with_registry(registry.clone())
        .build()
        .map_err(|e| error(e.to_string()))?;
    let listener = std::net::TcpListener::bind(listen)
        .and_then(|l| l.set_nonblocking(true).map(|()| l))
        .and_then(tokio::net::TcpListener::from_std)
        .map_err(|e| error(format!("binding prometheus_listen {listen}: {e}")))?;
    let address = listener
        .local_addr()
        .map_err(|e| error(format!("prometheus_listen {listen}: {e}")))?;
    let app = axum::Router::new().route(
        "/metrics",
        axum::routing::get(move |headers: axum::http::HeaderMap| {
            let registry = registry.clone();
            let auth = auth.clone();
            async move {
                let authorization = headers
                    .get(axum::http::header::AUTHORIZATION)
                    .and_then(|v| v.to_str().ok());
                if let Some(ScrapeAuth(accepts)) = &auth
                    && !accepts(authorization)
                {
                    return (
                        axum::http::StatusCode::UNAUTHORIZED,
                        [(axum::http::header::CONTENT_TYPE, "text/plain")],
                        "this endpoint requires the fleet's bearer token (Authorization: Bearer \
                         <token>; in Prometheus: `authorization: {credentials_file: ...}`)\n"
                            .to_owned(),
                    );
                }
                let text = prometheus::TextEncoder::new().encode_to_string(&registry.gather());
                match text {
                    Ok(text) => (
                        axum::http::StatusCode::OK,
                        [(axum::http::header::CONTENT_TYPE, prometheus::TEXT_FORMAT)],
                        text,
                    ),
                    Err(e) => (
                        axum::http::StatusCode::INTERNAL_SERVER_ERROR,
                        [(axum::http::header::CONTENT_TYPE, "text/plain")],
                        format!("encoding metrics: {e}"),
                    ),
                }
            }
        }),
    );
    let task = tokio::spawn(async move {
        if let Err(e) = axum::serve(listener, app).await {
            tracing::warn!("the Prometheus endpoint stopped: {e}");
        }
    });
    tracing::info!(%address, "Prometheus metrics on http://{address}/metrics");
    Ok((reader, Endpoint { address, task }))
}

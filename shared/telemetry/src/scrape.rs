//! The Prometheus scrape endpoint (`telemetry.prometheus_listen`): the same instruments as the
//! OTLP export, collected on each scrape and served as text on `GET /metrics`, with names, units
//! and types per the OpenTelemetry-to-Prometheus rules and the resource as `target_info`.

use std::net::SocketAddr;

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

/// The metric reader to add to the meter provider, and the endpoint serving what it reads.
/// Must run inside a Tokio runtime.
pub fn start(listen: SocketAddr) -> Result<(PrometheusExporter, Endpoint), TelemetryError> {
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
        axum::routing::get(move || {
            let registry = registry.clone();
            async move {
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

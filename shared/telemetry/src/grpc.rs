//! The one propagation layer pair for every tonic server and client.
//!
//! The server layer extracts `traceparent`/`tracestate`/`baggage` from the request, starts the
//! `server` span (when that group is on) and runs the handler inside the resulting context. The
//! client layer injects the caller's context (and its `client` span, when on) into the request.
//! Either way the context travels, so a hop that records nothing still keeps the trace whole.

use std::future::Future;
use std::pin::Pin;
use std::task::{Context as TaskContext, Poll};

use opentelemetry::trace::{FutureExt as _, SpanKind};
use opentelemetry::{Context, KeyValue};
use tower::{Layer, Service};

use crate::groups::SpanGroup;
use crate::propagation;
use crate::spans::{GroupSpan, SpanOptions};

type BoxFuture<T> = Pin<Box<dyn Future<Output = T> + Send + 'static>>;

/// gRPC requests this process is serving now (`nomad.server.requests.in_flight`).
static IN_FLIGHT: std::sync::atomic::AtomicI64 = std::sync::atomic::AtomicI64::new(0);

pub(crate) fn requests_in_flight() -> i64 {
    IN_FLIGHT.load(std::sync::atomic::Ordering::Relaxed)
}

/// Counts one request in flight until dropped (also when the call is cancelled).
struct InFlight;

impl InFlight {
    fn enter() -> Self {
        IN_FLIGHT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        InFlight
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        IN_FLIGHT.fetch_sub(1, std::sync::atomic::Ordering::Relaxed);
    }
}

/// Splits `/nomad.v1.Scheduler/CallTool` into (`nomad.v1.Scheduler`, `CallTool`).
fn rpc_names(path: &str) -> (String, String) {
    let mut parts = path.trim_start_matches('/').splitn(2, '/');
    let service = parts.next().unwrap_or_default().to_owned();
    let method = parts.next().unwrap_or_default().to_owned();
    (service, method)
}

/// Calls that run on a timer rather than on anyone's behalf: a span each would bury real
/// traces under one-span traces. Their context still propagates.
const UNTRACED: &[&str] = &[
    "/grpc.health.v1.Health/",
    "/grpc.reflection.",
    "/nomad.v1.Scheduler/Heartbeat",
];

fn start_rpc_span(group: SpanGroup, kind: SpanKind, path: &str, parent: &Context) -> GroupSpan {
    if !crate::spans::enabled(group) || UNTRACED.iter().any(|p| path.starts_with(p)) {
        return GroupSpan::disabled(parent);
    }
    let (service, method) = rpc_names(path);
    GroupSpan::start_with(
        group,
        format!("{service}/{method}"),
        parent,
        SpanOptions {
            kind: Some(kind),
            attributes: vec![
                KeyValue::new("rpc.system", "grpc"),
                KeyValue::new("rpc.service", service),
                KeyValue::new("rpc.method", method),
            ],
            ..Default::default()
        },
    )
}

/// Records the gRPC status a response carries in its headers (errors are trailers-only
/// responses, so a missing header means the call succeeded or its status is in the trailers).
fn record_status<B>(span: &GroupSpan, response: &http::Response<B>) {
    if !span.is_recording() {
        return;
    }
    let code = response
        .headers()
        .get("grpc-status")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<i32>().ok())
        .unwrap_or(0);
    span.set_attribute(KeyValue::new("rpc.grpc.status_code", i64::from(code)));
    if code != 0 {
        let message = response
            .headers()
            .get("grpc-message")
            .and_then(|v| v.to_str().ok())
            .unwrap_or_default();
        span.set_error(format!("{:?}", tonic::Code::from_i32(code)), message);
    }
}

/// Server side: wraps a tonic router (`Server::builder().layer(ServerTraceLayer)`).
#[derive(Debug, Clone, Copy, Default)]
pub struct ServerTraceLayer;

impl<S> Layer<S> for ServerTraceLayer {
    type Service = ServerTrace<S>;

    fn layer(&self, inner: S) -> Self::Service {
        ServerTrace { inner }
    }
}

#[derive(Debug, Clone)]
pub struct ServerTrace<S> {
    inner: S,
}

impl<S, B, ResB> Service<http::Request<B>> for ServerTrace<S>
where
    S: Service<http::Request<B>, Response = http::Response<ResB>>,
    S::Future: Send + 'static,
    S::Error: 'static,
    ResB: 'static,
{
    type Response = S::Response;
    type Error = S::Error;
    type Future = BoxFuture<Result<S::Response, S::Error>>;

    fn poll_ready(&mut self, cx: &mut TaskContext<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: http::Request<B>) -> Self::Future {
        let in_flight = InFlight::enter();
        let parent = propagation::extract_headers(request.headers());
        let span = start_rpc_span(
            SpanGroup::Server,
            SpanKind::Server,
            request.uri().path(),
            &parent,
        );
        let cx = span.context().clone();
        let future = {
            let _attached = cx.clone().attach();
            self.inner.call(request)
        };
        Box::pin(async move {
            let result = future.with_context(cx).await;
            match &result {
                Ok(response) => record_status(&span, response),
                Err(_) => span.set_error("transport", "the server failed to answer"),
            }
            drop(in_flight);
            result
        })
    }
}

/// Client side: wraps a channel (`ClientTraceLayer.layer(channel)`); generated clients take it
/// as their transport.
#[derive(Debug, Clone, Copy, Default)]
pub struct ClientTraceLayer;

impl<S> Layer<S> for ClientTraceLayer {
    type Service = ClientTrace<S>;

    fn layer(&self, inner: S) -> Self::Service {
        ClientTrace { inner }
    }
}

#[derive(Debug, Clone)]
pub struct ClientTrace<S> {
    inner: S,
}

impl<S, B, ResB> Service<http::Request<B>> for ClientTrace<S>
where
    S: Service<http::Request<B>, Response = http::Response<ResB>>,
    S::Future: Send + 'static,
    S::Error: 'static,
    ResB: 'static,
{
    type Response = S::Response;
    type Error = S::Error;
    type Future = BoxFuture<Result<S::Response, S::Error>>;

    fn poll_ready(&mut self, cx: &mut TaskContext<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, mut request: http::Request<B>) -> Self::Future {
        let parent = Context::current();
        let span = start_rpc_span(
            SpanGroup::Client,
            SpanKind::Client,
            request.uri().path(),
            &parent,
        );
        propagation::inject_headers(span.context(), request.headers_mut());
        let future = self.inner.call(request);
        Box::pin(async move {
            let result = future.await;
            match &result {
                Ok(response) => record_status(&span, response),
                Err(_) => span.set_error("transport", "the call did not reach the server"),
            }
            result
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rpc_path_splits_into_service_and_method() {
        assert_eq!(
            rpc_names("/nomad.v1.Scheduler/CallTool"),
            ("nomad.v1.Scheduler".to_owned(), "CallTool".to_owned())
        );
        assert_eq!(rpc_names("/odd"), ("odd".to_owned(), String::new()));
    }
}

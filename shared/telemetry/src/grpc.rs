//! The one propagation layer for every tonic server and client.
//!
//! On a server it extracts `traceparent`/`tracestate`/`baggage` from the request, starts the
//! `server` span (when that group is on) and runs the handler inside the resulting context. On a
//! client it injects the caller's context (and its `client` span, when on) into the request.
//! Either way the context travels, so a hop that records nothing still keeps the trace whole.

use std::future::Future;
use std::pin::Pin;
use std::task::{Context as TaskContext, Poll, ready};

use opentelemetry::trace::{FutureExt as _, SpanKind, WithContext};
use opentelemetry::{Context, KeyValue};
use tower::{Layer, Service};

use crate::groups::SpanGroup;
use crate::propagation;
use crate::spans::{GroupSpan, SpanOptions};

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

/// Calls that run on a timer rather than on anyone's behalf (health checks, heartbeats, and
/// the views `nomad top` polls every second): a span each would bury real traces under
/// one-span traces. Their context still propagates.
const UNTRACED: &[&str] = &[
    "/grpc.health.v1.Health/",
    "/grpc.reflection.",
    "/nomad.v1.Scheduler/Heartbeat",
    "/nomad.v1.Scheduler/Snapshot",
    "/nomad.v1.Gateway/Status",
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

/// The status a gRPC response carries in `map` (its headers, for a trailers-only response, or
/// its trailers): the code and message, or `None` when `map` has no `grpc-status`.
fn grpc_status(map: &http::HeaderMap) -> Option<(i32, String)> {
    let code = map
        .get("grpc-status")
        .and_then(|v| v.to_str().ok())
        .map(|v| v.parse::<i32>().unwrap_or(tonic::Code::Unknown as i32))?;
    let message = map
        .get("grpc-message")
        .and_then(|v| v.to_str().ok())
        .map(|m| {
            percent_encoding::percent_decode_str(m)
                .decode_utf8_lossy()
                .into_owned()
        })
        .unwrap_or_default();
    Some((code, message))
}

/// Which end of a call a [`TraceLayer`] wraps.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Side {
    Server,
    Client,
}

/// The one tracing layer for both ends of a gRPC call: `TraceLayer::server()` wraps a tonic
/// router (`Server::builder().layer(..)`), `TraceLayer::client()` a channel (generated clients
/// take the result as their transport).
///
/// The span lasts as long as the call: it ends when the response body ends, with the status
/// read from the trailers (or from the headers of a trailers-only response), so a stream that
/// fails after some messages is recorded as the failure it is, at the time it failed.
#[derive(Debug, Clone, Copy)]
pub struct TraceLayer {
    side: Side,
}

impl TraceLayer {
    pub const fn server() -> Self {
        Self { side: Side::Server }
    }

    pub const fn client() -> Self {
        Self { side: Side::Client }
    }
}

impl<S> Layer<S> for TraceLayer {
    type Service = Trace<S>;

    fn layer(&self, inner: S) -> Self::Service {
        Trace {
            inner,
            side: self.side,
        }
    }
}

#[derive(Debug, Clone)]
pub struct Trace<S> {
    inner: S,
    side: Side,
}

impl<S, B, ResB> Service<http::Request<B>> for Trace<S>
where
    S: Service<http::Request<B>, Response = http::Response<ResB>>,
{
    type Response = http::Response<TracedBody<ResB>>;
    type Error = S::Error;
    type Future = ResponseFuture<S::Future>;

    fn poll_ready(&mut self, cx: &mut TaskContext<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, mut request: http::Request<B>) -> Self::Future {
        let path = request.uri().path();
        let call = match self.side {
            Side::Server => {
                let in_flight = InFlight::enter();
                let parent = propagation::extract_headers(request.headers());
                let span = start_rpc_span(SpanGroup::Server, SpanKind::Server, path, &parent);
                CallSpan::new(span, self.side, Some(in_flight))
            }
            Side::Client => {
                let span = start_rpc_span(
                    SpanGroup::Client,
                    SpanKind::Client,
                    path,
                    &Context::current(),
                );
                propagation::inject_headers(span.context(), request.headers_mut());
                CallSpan::new(span, self.side, None)
            }
        };
        let cx = call.span.context().clone();
        // A server's handler future is made inside `call`: it must see the caller's context.
        let future = {
            let _attached = cx.clone().attach();
            self.inner.call(request)
        };
        ResponseFuture {
            inner: future.with_context(cx),
            call: Some(call),
        }
    }
}

pin_project_lite::pin_project! {
    /// The response future of [`Trace`]: the inner call, run in the span's context.
    pub struct ResponseFuture<F> {
        #[pin]
        inner: WithContext<F>,
        call: Option<CallSpan>,
    }
}

impl<F, ResB, E> Future for ResponseFuture<F>
where
    F: Future<Output = Result<http::Response<ResB>, E>>,
{
    type Output = Result<http::Response<TracedBody<ResB>>, E>;

    fn poll(self: Pin<&mut Self>, cx: &mut TaskContext<'_>) -> Poll<Self::Output> {
        let this = self.project();
        let result = ready!(this.inner.poll(cx));
        let call = this.call.take();
        Poll::Ready(match result {
            Ok(response) => {
                // A trailers-only response (every error tonic returns before the first message)
                // has its status in the headers and nothing after them.
                let call = match (call, grpc_status(response.headers())) {
                    (Some(call), Some(status)) => {
                        call.finish(Outcome::Status(status));
                        None
                    }
                    (call, None) => call,
                    (None, Some(_)) => None,
                };
                Ok(response.map(|inner| TracedBody { inner, call }))
            }
            Err(error) => {
                if let Some(call) = call {
                    call.finish(Outcome::Transport);
                }
                Err(error)
            }
        })
    }
}

pin_project_lite::pin_project! {
    /// A response body that ends its call's span when it ends.
    pub struct TracedBody<B> {
        #[pin]
        inner: B,
        call: Option<CallSpan>,
    }
}

/// An empty body with no call to trace (a response made outside this layer, such as a refusal).
impl<B: Default> Default for TracedBody<B> {
    fn default() -> Self {
        Self {
            inner: B::default(),
            call: None,
        }
    }
}

impl<B: http_body::Body> http_body::Body for TracedBody<B> {
    type Data = B::Data;
    type Error = B::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut TaskContext<'_>,
    ) -> Poll<Option<Result<http_body::Frame<Self::Data>, Self::Error>>> {
        let this = self.project();
        let frame = ready!(this.inner.poll_frame(cx));
        let outcome = match &frame {
            Some(Ok(frame)) => frame
                .trailers_ref()
                .map(|trailers| match grpc_status(trailers) {
                    Some(status) => Outcome::Status(status),
                    None => Outcome::NoStatus,
                }),
            Some(Err(_)) => Some(Outcome::Transport),
            None => Some(Outcome::NoStatus),
        };
        if let Some(outcome) = outcome
            && let Some(call) = this.call.take()
        {
            call.finish(outcome);
        }
        Poll::Ready(frame)
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        self.inner.size_hint()
    }
}

/// How a call ended, as far as this layer saw it.
enum Outcome {
    /// A `grpc-status` (code and message) in the headers or trailers.
    Status((i32, String)),
    /// The body ended without a `grpc-status`.
    NoStatus,
    /// The connection or the body failed.
    Transport,
}

/// One call's span and, on a server, its place in the in-flight gauge: both end when the
/// response ends, or when it is dropped before its end (the call was cancelled).
struct CallSpan {
    span: GroupSpan,
    side: Side,
    _in_flight: Option<InFlight>,
    finished: bool,
}

impl CallSpan {
    fn new(span: GroupSpan, side: Side, in_flight: Option<InFlight>) -> Self {
        Self {
            span,
            side,
            _in_flight: in_flight,
            finished: false,
        }
    }

    fn finish(mut self, outcome: Outcome) {
        self.finished = true;
        let span = &self.span;
        if !span.is_recording() {
            return;
        }
        match outcome {
            Outcome::Status((code, message)) => {
                span.set_attribute(KeyValue::new("rpc.grpc.status_code", i64::from(code)));
                if code != 0 {
                    span.set_error(format!("{:?}", tonic::Code::from_i32(code)), message);
                }
            }
            Outcome::NoStatus => {
                span.set_error("protocol", "the response ended without a grpc-status")
            }
            Outcome::Transport => span.set_error(
                "transport",
                match self.side {
                    Side::Server => "the server failed to answer",
                    Side::Client => "the call did not reach the server or its answer broke off",
                },
            ),
        }
    }
}

impl Drop for CallSpan {
    fn drop(&mut self) {
        if !self.finished && self.span.is_recording() {
            let code = tonic::Code::Cancelled as i32;
            self.span
                .set_attribute(KeyValue::new("rpc.grpc.status_code", i64::from(code)));
            self.span.set_error(
                "Cancelled",
                match self.side {
                    Side::Server => "the caller went away before the response ended",
                    Side::Client => "the caller stopped reading before the response ended",
                },
            );
        }
    }
}

#[cfg(test)]
#[path = "grpc_tests.rs"]
mod body_tests;

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

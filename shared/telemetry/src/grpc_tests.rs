//! The trace layer against real tower services and http bodies: a span ends when the response
//! ends, with the status its trailers carry.

use std::convert::Infallible;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use futures::channel::mpsc;
use http_body_util::{BodyExt as _, StreamBody};
use opentelemetry::trace::{Status, TracerProvider as _};
use opentelemetry_sdk::error::OTelSdkResult;
use opentelemetry_sdk::trace::{SdkTracerProvider, SpanData, SpanExporter};
use tower::{Layer as _, ServiceExt as _};

use super::TraceLayer;
use crate::groups::SpanGroups;

type Frame = http_body::Frame<&'static [u8]>;

/// Every span this test binary ends, exported as it ends.
#[derive(Debug, Clone, Default)]
struct Collected(Arc<Mutex<Vec<SpanData>>>);

impl SpanExporter for Collected {
    fn export(
        &self,
        batch: Vec<SpanData>,
    ) -> impl std::future::Future<Output = OTelSdkResult> + Send {
        self.0.lock().unwrap().extend(batch);
        std::future::ready(Ok(()))
    }
}

fn collected() -> &'static Collected {
    static COLLECTED: OnceLock<Collected> = OnceLock::new();
    COLLECTED.get_or_init(|| {
        let collected = Collected::default();
        let provider = SdkTracerProvider::builder()
            .with_simple_exporter(collected.clone())
            .build();
        crate::spans::install(provider.tracer("grpc-tests"), SpanGroups::all());
        crate::propagation::install();
        collected
    })
}

/// The ended span named `name` (each test uses its own method name), if it has ended.
fn ended(name: &str) -> Option<SpanData> {
    let spans = collected().0.lock().unwrap();
    spans.iter().find(|s| s.name == name).cloned()
}

fn attribute(span: &SpanData, key: &str) -> Option<i64> {
    span.attributes
        .iter()
        .find(|kv| kv.key.as_str() == key)
        .and_then(|kv| match kv.value {
            opentelemetry::Value::I64(v) => Some(v),
            _ => None,
        })
}

fn request(path: &str) -> http::Request<()> {
    http::Request::builder()
        .uri(format!("http://localhost{path}"))
        .header(
            "traceparent",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
        )
        .body(())
        .unwrap()
}

fn trailers(code: &str, message: &str) -> Frame {
    let mut map = http::HeaderMap::new();
    map.insert("grpc-status", code.parse().unwrap());
    map.insert("grpc-message", message.parse().unwrap());
    Frame::trailers(map)
}

type Frames = mpsc::UnboundedSender<Result<Frame, Infallible>>;
type StreamedBody = StreamBody<mpsc::UnboundedReceiver<Result<Frame, Infallible>>>;

/// The response to `path` of a traced server whose one response streams whatever the test sends
/// into the returned sender.
async fn streamed(path: &str) -> (Frames, http::Response<super::TracedBody<StreamedBody>>) {
    let (frames, body) = mpsc::unbounded();
    let body = Mutex::new(Some(body));
    let inner = tower::service_fn(move |_request: http::Request<()>| {
        let body = body.lock().unwrap().take().expect("one call per server");
        async move { Ok::<_, Infallible>(http::Response::new(StreamBody::new(body))) }
    });
    let server = TraceLayer::server().layer(inner);
    (frames, server.oneshot(request(path)).await.unwrap())
}

#[tokio::test]
async fn a_stream_that_fails_after_some_items_ends_its_span_in_error_at_its_end() {
    collected();
    let (frames, response) = streamed("/nomad.v1.Test/FailsLate").await;
    let mut body = response.into_body();
    for item in [b"one".as_slice(), b"two".as_slice()] {
        frames.unbounded_send(Ok(Frame::data(item))).unwrap();
        let frame = body.frame().await.unwrap().unwrap();
        assert_eq!(frame.into_data().unwrap(), item);
    }
    assert!(
        ended("nomad.v1.Test/FailsLate").is_none(),
        "the span ended while the stream was still sending"
    );
    tokio::time::sleep(Duration::from_millis(120)).await;
    frames
        .unbounded_send(Ok(trailers("13", "the%20model%20failed")))
        .unwrap();
    assert!(body.frame().await.unwrap().unwrap().is_trailers());
    let span = ended("nomad.v1.Test/FailsLate").expect("the span ends with the stream");
    assert_eq!(attribute(&span, "rpc.grpc.status_code"), Some(13));
    assert_eq!(span.status, Status::error("the model failed"));
    assert_eq!(
        span.span_context.trace_id().to_string(),
        "4bf92f3577b34da6a3ce929d0e0e4736",
        "the server span continues the caller's trace"
    );
    let lasted = span.end_time.duration_since(span.start_time).unwrap();
    assert!(
        lasted >= Duration::from_millis(120),
        "the span lasted {lasted:?}, less than the stream"
    );
}

#[tokio::test]
async fn a_stream_that_ends_ok_records_status_zero_and_no_error() {
    collected();
    let (frames, response) = streamed("/nomad.v1.Test/Ok").await;
    frames.unbounded_send(Ok(Frame::data(b"x"))).unwrap();
    frames.unbounded_send(Ok(trailers("0", ""))).unwrap();
    drop(frames);
    let collected_body = response.into_body().collect().await.unwrap();
    assert_eq!(collected_body.trailers().unwrap()["grpc-status"], "0");
    let span = ended("nomad.v1.Test/Ok").expect("the span ends with the stream");
    assert_eq!(attribute(&span, "rpc.grpc.status_code"), Some(0));
    assert_eq!(span.status, Status::Unset);
}

#[tokio::test]
async fn a_trailers_only_error_ends_the_span_with_the_headers() {
    collected();
    let inner = tower::service_fn(|_request: http::Request<()>| async {
        let response = http::Response::builder()
            .header("grpc-status", "5")
            .header("grpc-message", "no tool named nope")
            .body(http_body_util::Empty::<&'static [u8]>::new())
            .unwrap();
        Ok::<_, Infallible>(response)
    });
    let response = TraceLayer::server()
        .layer(inner)
        .oneshot(request("/nomad.v1.Test/TrailersOnly"))
        .await
        .unwrap();
    // Servers do not poll a body that is already at its end: the span must not wait for it.
    let span = ended("nomad.v1.Test/TrailersOnly").expect("ended with the headers");
    assert_eq!(attribute(&span, "rpc.grpc.status_code"), Some(5));
    assert_eq!(span.status, Status::error("no tool named nope"));
    drop(response);
}

#[tokio::test]
async fn a_response_dropped_before_its_end_is_recorded_as_cancelled() {
    collected();
    let (frames, response) = streamed("/nomad.v1.Test/Dropped").await;
    frames.unbounded_send(Ok(Frame::data(b"x"))).unwrap();
    let mut body = response.into_body();
    body.frame().await.unwrap().unwrap();
    assert!(ended("nomad.v1.Test/Dropped").is_none());
    drop(body);
    let span = ended("nomad.v1.Test/Dropped").expect("dropping the body ends the span");
    assert_eq!(
        attribute(&span, "rpc.grpc.status_code"),
        Some(tonic::Code::Cancelled as i64)
    );
    assert!(matches!(span.status, Status::Error { .. }));
}

#[tokio::test]
async fn the_client_side_injects_its_span_and_ends_it_with_the_trailers() {
    collected();
    let (frames, body) = mpsc::unbounded::<Result<Frame, Infallible>>();
    let seen_traceparent = Arc::new(Mutex::new(None));
    let seen = seen_traceparent.clone();
    let body = Mutex::new(Some(body));
    let inner = tower::service_fn(move |request: http::Request<()>| {
        *seen.lock().unwrap() = request
            .headers()
            .get("traceparent")
            .map(|v| v.to_str().unwrap().to_owned());
        let body = body.lock().unwrap().take().unwrap();
        async move { Ok::<_, Infallible>(http::Response::new(StreamBody::new(body))) }
    });
    let response = TraceLayer::client()
        .layer(inner)
        .oneshot(
            http::Request::get("http://localhost/nomad.v1.Test/Client")
                .body(())
                .unwrap(),
        )
        .await
        .unwrap();
    frames
        .unbounded_send(Ok(trailers("14", "worker%20gone")))
        .unwrap();
    let mut body = response.into_body();
    assert!(body.frame().await.unwrap().unwrap().is_trailers());
    let span = ended("nomad.v1.Test/Client").expect("the client span ends with the trailers");
    assert_eq!(attribute(&span, "rpc.grpc.status_code"), Some(14));
    assert_eq!(span.status, Status::error("worker gone"));
    let traceparent = seen_traceparent.lock().unwrap().clone().expect("injected");
    assert!(
        traceparent.contains(&span.span_context.span_id().to_string()),
        "the request carries the client span ({traceparent})"
    );
}

#[test]
fn what_nomad_top_polls_records_no_span() {
    collected();
    let span = |path| {
        super::start_rpc_span(
            crate::groups::SpanGroup::Server,
            opentelemetry::trace::SpanKind::Server,
            path,
            &opentelemetry::Context::new(),
        )
    };
    assert!(
        span("/nomad.v1.Scheduler/CallTool").is_recording(),
        "the control"
    );
    for path in ["/nomad.v1.Scheduler/Snapshot", "/nomad.v1.Gateway/Status"] {
        assert!(!span(path).is_recording(), "{path}");
    }
}

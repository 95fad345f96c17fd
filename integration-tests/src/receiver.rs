//! An OTLP receiver for tests: the real OTLP/gRPC collector services (and OTLP/HTTP protobuf
//! endpoints), recording spans, metric names and the connections made to it.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures::StreamExt as _;
use opentelemetry_proto::tonic::collector::metrics::v1::metrics_service_server::{
    MetricsService, MetricsServiceServer,
};
use opentelemetry_proto::tonic::collector::metrics::v1::{
    ExportMetricsServiceRequest, ExportMetricsServiceResponse,
};
use opentelemetry_proto::tonic::collector::trace::v1::trace_service_server::{
    TraceService, TraceServiceServer,
};
use opentelemetry_proto::tonic::collector::trace::v1::{
    ExportTraceServiceRequest, ExportTraceServiceResponse,
};
use opentelemetry_proto::tonic::common::v1::KeyValue;
use opentelemetry_proto::tonic::trace::v1::ResourceSpans;

use crate::spans::{SpanRecord, from_otlp};

/// One exported metric data point.
#[derive(Debug, Clone, PartialEq)]
pub struct MetricRecord {
    pub service_name: String,
    pub name: String,
    pub unit: String,
    /// `counter` (monotonic sum), `updowncounter` (non-monotonic sum), `gauge` or `histogram`.
    pub kind: &'static str,
    pub attributes: std::collections::BTreeMap<String, String>,
    /// The value (sums, gauges) or the count (histograms); cumulative.
    pub value: f64,
    /// A histogram's sum and largest recorded value (cumulative); `None` for other kinds.
    pub sum: Option<f64>,
    pub max: Option<f64>,
}

/// Sum of the latest values of `name` from the scheduler whose attributes include `filter`.
pub fn scheduler_value(metrics: &[MetricRecord], name: &str, filter: &[(&str, &str)]) -> f64 {
    metrics
        .iter()
        .filter(|m| m.service_name == "nomad/scheduler" && m.name == name)
        .filter(|m| {
            filter
                .iter()
                .all(|(k, v)| m.attributes.get(*k).map(String::as_str) == Some(*v))
        })
        .map(|m| m.value)
        .sum()
}

/// Asserts that the scheduler exported its queue and in-flight gauges for `tool`, both at zero:
/// nothing is left queued or in flight.
pub fn assert_drained(metrics: &[MetricRecord], tool: &str) {
    for gauge in ["nomad.tool.queue.length", "nomad.tool.inflight.requests"] {
        assert!(
            metrics.iter().any(|m| m.name == gauge),
            "{gauge} was not exported"
        );
        assert_eq!(
            scheduler_value(metrics, gauge, &[("tool", tool)]),
            0.0,
            "{gauge}"
        );
    }
}

#[derive(Default)]
struct State {
    spans: Mutex<Vec<SpanRecord>>,
    /// Spans as received, for backends built on the receiver (the Jaeger query double).
    resource_spans: Mutex<Vec<ResourceSpans>>,
    metrics: Mutex<Vec<MetricRecord>>,
    connections: AtomicUsize,
    requests: AtomicUsize,
    /// Spans received; with `discard`, the only record of them (long runs).
    span_count: AtomicUsize,
    discard: std::sync::atomic::AtomicBool,
}

impl State {
    fn add_traces(&self, request: &ExportTraceServiceRequest) {
        self.requests.fetch_add(1, Ordering::SeqCst);
        let spans: usize = request
            .resource_spans
            .iter()
            .flat_map(|rs| &rs.scope_spans)
            .map(|ss| ss.spans.len())
            .sum();
        self.span_count.fetch_add(spans, Ordering::SeqCst);
        if self.discard.load(Ordering::Relaxed) {
            return;
        }
        self.spans
            .lock()
            .unwrap()
            .extend(from_otlp(&request.resource_spans));
        self.resource_spans
            .lock()
            .unwrap()
            .extend(request.resource_spans.iter().cloned());
    }

    fn add_metrics(&self, request: &ExportMetricsServiceRequest) {
        self.requests.fetch_add(1, Ordering::SeqCst);
        if self.discard.load(Ordering::Relaxed) {
            return;
        }
        let mut metrics = self.metrics.lock().unwrap();
        for rm in &request.resource_metrics {
            let service_name = rm
                .resource
                .as_ref()
                .and_then(|r| r.attributes.iter().find(|kv| kv.key == "service.name"))
                .and_then(|kv| kv.value.as_ref())
                .and_then(|v| match &v.value {
                    Some(
                        opentelemetry_proto::tonic::common::v1::any_value::Value::StringValue(s),
                    ) => Some(s.clone()),
                    _ => None,
                })
                .unwrap_or_default();
            for sm in &rm.scope_metrics {
                for m in &sm.metrics {
                    use opentelemetry_proto::tonic::metrics::v1::metric::Data;
                    use opentelemetry_proto::tonic::metrics::v1::number_data_point::Value;
                    let number = |v: &Option<Value>| match v {
                        Some(Value::AsDouble(d)) => *d,
                        Some(Value::AsInt(i)) => *i as f64,
                        None => f64::NAN,
                    };
                    let mut push = |kind, attributes: &[KeyValue], value, sum, max| {
                        metrics.push(MetricRecord {
                            service_name: service_name.clone(),
                            name: m.name.clone(),
                            unit: m.unit.clone(),
                            kind,
                            attributes: crate::spans::kv_map(attributes),
                            value,
                            sum,
                            max,
                        })
                    };
                    match &m.data {
                        Some(Data::Sum(sum)) => {
                            let kind = if sum.is_monotonic {
                                "counter"
                            } else {
                                "updowncounter"
                            };
                            for p in &sum.data_points {
                                push(kind, &p.attributes, number(&p.value), None, None);
                            }
                        }
                        Some(Data::Gauge(g)) => {
                            for p in &g.data_points {
                                push("gauge", &p.attributes, number(&p.value), None, None);
                            }
                        }
                        Some(Data::Histogram(h)) => {
                            for p in &h.data_points {
                                push("histogram", &p.attributes, p.count as f64, p.sum, p.max);
                            }
                        }
                        _ => {}
                    }
                }
            }
        }
    }
}

#[derive(Clone)]
struct Grpc(Arc<State>);

/// The receiver's OTLP/gRPC services: each request handed to the state as it comes.
macro_rules! grpc_services {
    ($($service:ident($request:ident -> $response:ident): $add:ident;)*) => {$(
        #[tonic::async_trait]
        impl $service for Grpc {
            async fn export(
                &self,
                request: tonic::Request<$request>,
            ) -> Result<tonic::Response<$response>, tonic::Status> {
                self.0.$add(request.get_ref());
                Ok(tonic::Response::new($response::default()))
            }
        }
    )*};
}

grpc_services! {
    TraceService(ExportTraceServiceRequest -> ExportTraceServiceResponse): add_traces;
    MetricsService(ExportMetricsServiceRequest -> ExportMetricsServiceResponse): add_metrics;
}

/// An OTLP/HTTP route: the body decoded as `R` and given to `add`, answered with an empty `A`
/// (a body that does not decode: 400).
fn otlp_http<R, A>(state: &Arc<State>, add: fn(&State, &R)) -> axum::routing::MethodRouter
where
    R: prost::Message + Default + 'static,
    A: prost::Message + Default + 'static,
{
    let state = state.clone();
    axum::routing::post(move |body: axum::body::Bytes| {
        let state = state.clone();
        async move {
            match R::decode(body) {
                Ok(request) => {
                    add(&state, &request);
                    (axum::http::StatusCode::OK, A::default().encode_to_vec())
                }
                Err(_) => (axum::http::StatusCode::BAD_REQUEST, vec![]),
            }
        }
    })
}

pub struct OtlpReceiver {
    pub addr: SocketAddr,
    /// The endpoint to give exporters (`http://127.0.0.1:PORT`).
    pub endpoint: String,
    state: Arc<State>,
    task: tokio::task::JoinHandle<()>,
}

impl OtlpReceiver {
    /// An OTLP/gRPC receiver on a free loopback port.
    pub async fn grpc() -> Self {
        Self::grpc_at("127.0.0.1:0").await
    }

    /// An OTLP/gRPC receiver on `address`.
    pub async fn grpc_at(address: &str) -> Self {
        let listener = tokio::net::TcpListener::bind(address).await.unwrap();
        let addr = listener.local_addr().unwrap();
        let state = Arc::new(State::default());
        let counted = state.clone();
        let incoming = tokio_stream::wrappers::TcpListenerStream::new(listener).inspect(move |c| {
            if c.is_ok() {
                counted.connections.fetch_add(1, Ordering::SeqCst);
            }
        });
        let service = Grpc(state.clone());
        let task = tokio::spawn(async move {
            tonic::transport::Server::builder()
                .add_service(TraceServiceServer::new(service.clone()))
                .add_service(MetricsServiceServer::new(service))
                .serve_with_incoming(incoming)
                .await
                .unwrap();
        });
        Self {
            addr,
            endpoint: format!("http://{addr}"),
            state,
            task,
        }
    }

    /// An OTLP/HTTP (protobuf) receiver: `POST /v1/traces`, `POST /v1/metrics`.
    pub async fn http() -> Self {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let state = Arc::new(State::default());
        let app = axum::Router::new()
            .route(
                "/v1/traces",
                otlp_http::<_, ExportTraceServiceResponse>(&state, State::add_traces),
            )
            .route(
                "/v1/metrics",
                otlp_http::<_, ExportMetricsServiceResponse>(&state, State::add_metrics),
            );
        let task = tokio::spawn(async move {
            axum::serve(listener, app).await.unwrap();
        });
        Self {
            addr,
            endpoint: format!("http://{addr}"),
            state,
            task,
        }
    }

    /// From now on, count what arrives but keep none of it (for long runs).
    pub fn discard(&self) {
        self.state.discard.store(true, Ordering::Relaxed);
    }

    /// Spans received so far, kept or not.
    pub fn span_count(&self) -> usize {
        self.state.span_count.load(Ordering::SeqCst)
    }

    /// Every `ResourceSpans` received, as sent.
    pub fn resource_spans(&self) -> Vec<ResourceSpans> {
        self.state.resource_spans.lock().unwrap().clone()
    }

    pub fn spans(&self) -> Vec<SpanRecord> {
        self.state.spans.lock().unwrap().clone()
    }

    /// Every data point received, in arrival order.
    pub fn metrics(&self) -> Vec<MetricRecord> {
        self.state.metrics.lock().unwrap().clone()
    }

    /// The latest point of each (service, metric, attributes): exports are cumulative.
    pub fn latest_metrics(&self) -> Vec<MetricRecord> {
        let mut latest: std::collections::BTreeMap<(String, String, String), MetricRecord> =
            Default::default();
        for m in self.metrics() {
            let key = (
                m.service_name.clone(),
                m.name.clone(),
                format!("{:?}", m.attributes),
            );
            latest.insert(key, m);
        }
        latest.into_values().collect()
    }

    /// TCP connections accepted (gRPC receiver only).
    pub fn connections(&self) -> usize {
        self.state.connections.load(Ordering::SeqCst)
    }

    /// Export requests received.
    pub fn requests(&self) -> usize {
        self.state.requests.load(Ordering::SeqCst)
    }

    /// Waits until `done(spans)` holds, or `timeout` passes; returns the spans either way.
    pub async fn wait_for_spans(
        &self,
        timeout: Duration,
        done: impl Fn(&[SpanRecord]) -> bool,
    ) -> Vec<SpanRecord> {
        let deadline = Instant::now() + timeout;
        loop {
            let spans = self.spans();
            if done(&spans) || Instant::now() >= deadline {
                return spans;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
}

impl Drop for OtlpReceiver {
    fn drop(&mut self) {
        self.task.abort();
    }
}

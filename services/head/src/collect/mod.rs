//! `nomad collect`: an OTLP receiver (gRPC and HTTP/protobuf) that writes what every process of
//! a job exports into `traces.jsonl`, `metrics.jsonl` and `logs.jsonl`, in the console
//! exporter's line format, so `nomad traces --from` and `jq` read it like a run directory.
//!
//! Nothing is dropped: requests wait for room in a bounded queue, and when it stays full the
//! exporter is told to retry (`UNAVAILABLE` / HTTP 503). On SIGTERM it keeps receiving until its
//! peers have gone quiet (they flush on the same signal), then writes out the queue and exits.
//!
//! It listens on loopback unless told otherwise, and beyond loopback only with the fleet's token
//! (`NOMAD_AUTH_TOKEN`), which every export must then carry (`authorization: Bearer <token>`,
//! as exporters send it with `OTEL_EXPORTER_OTLP_HEADERS`): a request without it is refused
//! before its body is read.

use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use anyhow::Context as _;
use axum::body::Bytes;
use axum::http::{HeaderMap, StatusCode, header};
use nomad_telemetry::otlp_lines;
use opentelemetry_proto::tonic::collector::logs::v1::logs_service_server::{
    LogsService, LogsServiceServer,
};
use opentelemetry_proto::tonic::collector::logs::v1::{
    ExportLogsServiceRequest, ExportLogsServiceResponse,
};
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
use tokio::sync::mpsc;

/// Export requests waiting to be written; beyond this, exporters are asked to retry.
const QUEUE_BATCHES: usize = 1024;
/// How long a request waits for room in the queue before being refused (exporters retry).
const ENQUEUE_WAIT: Duration = Duration::from_secs(5);
/// Largest export request accepted, and the most lines one may become (the SDK's batches are
/// far smaller).
const MAX_REQUEST_BYTES: usize = 64 << 20;

mod budget;

use budget::{Budget, Refusal};

#[derive(clap::Args)]
pub struct CollectArgs {
    /// Directory for traces.jsonl, metrics.jsonl and logs.jsonl (created; appended to).
    #[arg(long)]
    pub out: PathBuf,
    /// OTLP/gRPC address (beyond loopback only with NOMAD_AUTH_TOKEN).
    #[arg(long, default_value = "127.0.0.1:4317")]
    pub listen: String,
    /// OTLP/HTTP (protobuf) address: POST /v1/traces, /v1/metrics, /v1/logs.
    #[arg(long, default_value = "127.0.0.1:4318")]
    pub http_listen: String,
    /// Write the bound gRPC address here once listening.
    #[arg(long)]
    pub addr_file: Option<PathBuf>,
    /// Write the bound HTTP address here once listening.
    #[arg(long)]
    pub http_addr_file: Option<PathBuf>,
    /// After SIGTERM, keep receiving until no request came for this long (peers flushing).
    #[arg(long, default_value_t = 1.0)]
    pub quiet_seconds: f64,
    /// ... but no longer than this.
    #[arg(long, default_value_t = 10.0)]
    pub drain_seconds: f64,
    /// Bytes of lines written in all (the run directory's disk budget); later exports are
    /// refused.
    #[arg(long, default_value_t = 8 << 30)]
    pub max_bytes: u64,
    /// Bytes of lines accepted a second; beyond, exporters are asked to retry.
    #[arg(long, default_value_t = 64 << 20)]
    pub max_bytes_per_second: u64,
}

#[derive(Clone, Copy)]
enum Signal {
    Traces,
    Metrics,
    Logs,
}

/// One export request's lines, bound for one file.
type Batch = (Signal, String);

#[derive(Clone)]
struct Intake {
    queue: mpsc::Sender<Batch>,
    /// Milliseconds since `started` of the latest request: the drain waits for quiet.
    last_request_ms: Arc<AtomicU64>,
    started: Instant,
    /// How long a request waits for room in the queue before being refused.
    enqueue_wait: Duration,
    budget: Arc<Budget>,
}

impl Intake {
    async fn accept(&self, signal: Signal, lines: Vec<serde_json::Value>) -> Result<(), Refusal> {
        self.last_request_ms
            .store(self.started.elapsed().as_millis() as u64, Ordering::Relaxed);
        if lines.is_empty() {
            return Ok(());
        }
        let mut text = String::new();
        for line in lines {
            text.push_str(&line.to_string());
            text.push('\n');
            // Stop building a request's text once it is over the bound.
            if text.len() > MAX_REQUEST_BYTES {
                break;
            }
        }
        self.budget.take(text.len() as u64, Instant::now())?;
        self.queue
            .send_timeout((signal, text), self.enqueue_wait)
            .await
            .map_err(|_| Refusal::QueueFull(QUEUE_BATCHES))
    }
}

/// What the collector takes of one signal's OTLP export request, over gRPC and HTTP alike.
trait Export: prost::Message + Default + 'static {
    type Response: prost::Message + Default;
    const SIGNAL: Signal;
    /// The request's lines, in the console exporter's format.
    fn lines(&self) -> Vec<serde_json::Value>;
}

/// The three signals differ only in their types and in which lines a request makes: each one's
/// [`Export`] and its OTLP/gRPC service.
macro_rules! signals {
    ($($service:ident($request:ident -> $response:ident): $signal:expr, $lines:ident($field:ident);)*) => {$(
        impl Export for $request {
            type Response = $response;
            const SIGNAL: Signal = $signal;
            fn lines(&self) -> Vec<serde_json::Value> {
                otlp_lines::$lines(&self.$field)
            }
        }

        #[tonic::async_trait]
        impl $service for Intake {
            async fn export(
                &self,
                request: tonic::Request<$request>,
            ) -> Result<tonic::Response<$response>, tonic::Status> {
                let lines = request.get_ref().lines();
                self.accept(<$request as Export>::SIGNAL, lines).await.map_err(|r| r.grpc())?;
                Ok(tonic::Response::new($response::default()))
            }
        }
    )*};
}

signals! {
    TraceService(ExportTraceServiceRequest -> ExportTraceServiceResponse):
        Signal::Traces, span_lines(resource_spans);
    MetricsService(ExportMetricsServiceRequest -> ExportMetricsServiceResponse):
        Signal::Metrics, metric_lines(resource_metrics);
    LogsService(ExportLogsServiceRequest -> ExportLogsServiceResponse):
        Signal::Logs, log_lines(resource_logs);
}

/// One OTLP/HTTP request: a protobuf body decoded into lines, or a status naming what was wrong.
async fn http_export<R: Export>(
    intake: &Intake,
    headers: &HeaderMap,
    body: Bytes,
) -> (StatusCode, Vec<u8>) {
    let content_type = headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .unwrap_or("");
    if !content_type.starts_with("application/x-protobuf") {
        return (
            StatusCode::UNSUPPORTED_MEDIA_TYPE,
            format!(
                "content type {content_type:?} is not supported: send application/x-protobuf \
                 (OTEL_EXPORTER_OTLP_PROTOCOL=http/protobuf), or use OTLP/gRPC"
            )
            .into_bytes(),
        );
    }
    let request = match R::decode(body) {
        Ok(r) => r,
        Err(e) => {
            return (
                StatusCode::BAD_REQUEST,
                format!("the body is not an OTLP export request: {e}").into_bytes(),
            );
        }
    };
    match intake.accept(R::SIGNAL, request.lines()).await {
        Ok(()) => (
            StatusCode::OK,
            prost::Message::encode_to_vec(&R::Response::default()),
        ),
        Err(refusal) => (refusal.http(), refusal.to_string().into_bytes()),
    }
}

fn http_router(intake: Intake, auth: Arc<nomad_rpc::auth::Auth>) -> axum::Router {
    axum::Router::new()
        .route(
            "/v1/traces",
            http_route::<ExportTraceServiceRequest>(&intake),
        )
        .route(
            "/v1/metrics",
            http_route::<ExportMetricsServiceRequest>(&intake),
        )
        .route("/v1/logs", http_route::<ExportLogsServiceRequest>(&intake))
        .layer(axum::extract::DefaultBodyLimit::max(MAX_REQUEST_BYTES))
        // Outermost: a request without the token is answered before its body is read.
        .layer(axum::middleware::from_fn_with_state(auth, authenticate))
}

/// `POST` of one signal's OTLP/HTTP export requests.
fn http_route<R: Export>(intake: &Intake) -> axum::routing::MethodRouter {
    let intake = intake.clone();
    axum::routing::post(move |headers: HeaderMap, body: Bytes| {
        let intake = intake.clone();
        async move { http_export::<R>(&intake, &headers, body).await }
    })
}

/// Refuses an OTLP/HTTP request that lacks the collector's token (401), naming what to send.
async fn authenticate(
    axum::extract::State(auth): axum::extract::State<Arc<nomad_rpc::auth::Auth>>,
    request: axum::extract::Request,
    next: axum::middleware::Next,
) -> axum::response::Response {
    use axum::response::IntoResponse as _;
    let given = request
        .headers()
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok());
    if auth.accepts(given) {
        return next.run(request).await;
    }
    (
        StatusCode::UNAUTHORIZED,
        "this collector requires the fleet's bearer token: send `authorization: Bearer <token>` \
         (OTEL_EXPORTER_OTLP_HEADERS=authorization=Bearer%20<token>)\n",
    )
        .into_response()
}

/// Appends each batch to its file; flushes whenever the queue is empty, syncs at the end.
fn write_batches(dir: &Path, mut queue: mpsc::Receiver<Batch>) -> anyhow::Result<u64> {
    let open = |name: &str| -> anyhow::Result<std::io::BufWriter<std::fs::File>> {
        let path = dir.join(name);
        let file = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&path)
            .with_context(|| format!("opening {}", path.display()))?;
        Ok(std::io::BufWriter::new(file))
    };
    let mut files = [
        open("traces.jsonl")?,
        open("metrics.jsonl")?,
        open("logs.jsonl")?,
    ];
    let mut written = 0u64;
    while let Some((signal, text)) = queue.blocking_recv() {
        let file = &mut files[signal as usize];
        file.write_all(text.as_bytes()).context("writing")?;
        written += 1;
        if queue.is_empty() {
            for f in &mut files {
                f.flush().context("flushing")?;
            }
        }
    }
    for f in &mut files {
        f.flush().context("flushing")?;
        f.get_ref().sync_all().context("syncing")?;
    }
    Ok(written)
}

pub async fn collect(args: CollectArgs) -> anyhow::Result<bool> {
    let quiet =
        nomad_config::seconds("--quiet-seconds", args.quiet_seconds).map_err(anyhow::Error::msg)?;
    let drain =
        nomad_config::seconds("--drain-seconds", args.drain_seconds).map_err(anyhow::Error::msg)?;
    std::fs::create_dir_all(&args.out)
        .with_context(|| format!("creating {}", args.out.display()))?;
    let (queue, batches) = mpsc::channel(QUEUE_BATCHES);
    let dir = args.out.clone();
    let writer = tokio::task::spawn_blocking(move || write_batches(&dir, batches));
    let intake = Intake {
        queue,
        last_request_ms: Arc::new(AtomicU64::new(0)),
        started: Instant::now(),
        enqueue_wait: ENQUEUE_WAIT,
        budget: Arc::new(Budget::new(
            MAX_REQUEST_BYTES as u64,
            args.max_bytes_per_second,
            args.max_bytes,
            Instant::now(),
        )),
    };

    // The fleet's token from the environment (a Slurm job exports it to every step).
    let auth = nomad_rpc::auth::Auth::resolve(
        &nomad_config::ConfigFile::load(None)?,
        &nomad_config::ProcessEnv,
    )?;
    let auth = nomad_rpc::auth::install(auth)?;
    let bind = |address: String| async move {
        tokio::net::TcpListener::bind(&address)
            .await
            .with_context(|| format!("binding {address}"))
    };
    let grpc_listener = bind(args.listen.clone()).await?;
    let http_listener = bind(args.http_listen.clone()).await?;
    let grpc_addr = grpc_listener.local_addr()?;
    let http_addr = http_listener.local_addr()?;
    auth.check_listen("nomad collect --listen", grpc_addr)?;
    auth.check_listen("nomad collect --http-listen", http_addr)?;

    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    let stopped = |mut rx: tokio::sync::watch::Receiver<bool>| async move {
        let _ = rx.wait_for(|stop| *stop).await;
    };
    let grpc = tonic::transport::Server::builder()
        .layer(nomad_rpc::auth::ServerAuthLayer::new(auth.clone()))
        .add_service(
            TraceServiceServer::new(intake.clone()).max_decoding_message_size(MAX_REQUEST_BYTES),
        )
        .add_service(
            MetricsServiceServer::new(intake.clone()).max_decoding_message_size(MAX_REQUEST_BYTES),
        )
        .add_service(
            LogsServiceServer::new(intake.clone()).max_decoding_message_size(MAX_REQUEST_BYTES),
        )
        .serve_with_incoming_shutdown(
            tokio_stream::wrappers::TcpListenerStream::new(grpc_listener),
            stopped(stop_rx.clone()),
        );
    let http = axum::serve(
        http_listener,
        http_router(intake.clone(), Arc::new(auth.clone())),
    )
    .with_graceful_shutdown(stopped(stop_rx));
    let grpc = tokio::spawn(grpc);
    let http = tokio::spawn(async move { http.await });

    for (file, addr) in [
        (&args.addr_file, grpc_addr),
        (&args.http_addr_file, http_addr),
    ] {
        if let Some(path) = file {
            nomad_rpc::write_addr_file(path, addr)?;
        }
    }
    eprintln!(
        "nomad collect: OTLP/gRPC on {grpc_addr}, OTLP/HTTP on {http_addr}, writing to {}",
        args.out.display()
    );

    nomad_rpc::shutdown_signal().await;
    // Peers got the same signal and are flushing: take what they send until they are quiet.
    // Quiet counts from the signal at the earliest: a peer idle before it has yet to flush.
    let since_stop = Instant::now();
    let stopped_at = intake.started.elapsed();
    loop {
        let last = Duration::from_millis(intake.last_request_ms.load(Ordering::Relaxed));
        let idle = intake
            .started
            .elapsed()
            .saturating_sub(last.max(stopped_at));
        if idle >= quiet || since_stop.elapsed() >= drain {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let _ = stop_tx.send(true);
    grpc.await?.context("serving OTLP/gRPC")?;
    http.await?.context("serving OTLP/HTTP")?;
    drop(intake);
    let written = writer.await??;
    eprintln!(
        "nomad collect: stopped; {written} export requests written to {}",
        args.out.display()
    );
    Ok(true)
}

#[cfg(test)]
mod tests {
    use super::*;
    use opentelemetry_proto::tonic::trace::v1::{ResourceSpans, ScopeSpans, Span};
    use prost::Message as _;

    fn intake(capacity: usize) -> (Intake, mpsc::Receiver<Batch>) {
        let (queue, batches) = mpsc::channel(capacity);
        let intake = Intake {
            queue,
            last_request_ms: Arc::new(AtomicU64::new(0)),
            started: Instant::now(),
            enqueue_wait: Duration::from_millis(20),
            budget: Arc::new(Budget::new(1 << 20, 1 << 20, 1 << 20, Instant::now())),
        };
        (intake, batches)
    }

    fn request() -> Bytes {
        ExportTraceServiceRequest {
            resource_spans: vec![ResourceSpans {
                scope_spans: vec![ScopeSpans {
                    spans: vec![Span {
                        trace_id: vec![1; 16],
                        span_id: vec![2; 8],
                        name: "nomad.rollout".into(),
                        ..Default::default()
                    }],
                    ..Default::default()
                }],
                ..Default::default()
            }],
        }
        .encode_to_vec()
        .into()
    }

    fn headers(content_type: &str) -> HeaderMap {
        let mut h = HeaderMap::new();
        h.insert(header::CONTENT_TYPE, content_type.parse().unwrap());
        h
    }

    async fn post(intake: &Intake, content_type: &str, body: Bytes) -> (StatusCode, String) {
        let (status, body) =
            http_export::<ExportTraceServiceRequest>(intake, &headers(content_type), body).await;
        (status, String::from_utf8_lossy(&body).into_owned())
    }

    #[tokio::test]
    async fn http_protobuf_becomes_a_span_line_and_other_bodies_are_named() {
        let (intake, mut batches) = intake(4);
        let (status, _) = post(&intake, "application/x-protobuf", request()).await;
        assert_eq!(status, StatusCode::OK);
        let (_, text) = batches.try_recv().unwrap();
        let line: serde_json::Value = serde_json::from_str(text.trim()).unwrap();
        assert_eq!(line["name"], "nomad.rollout");
        assert_eq!(line["span_id"], "0202020202020202");

        let (status, message) = post(&intake, "application/json", request()).await;
        assert_eq!(status, StatusCode::UNSUPPORTED_MEDIA_TYPE);
        assert!(message.contains("application/x-protobuf"), "{message}");
        let (status, message) = post(
            &intake,
            "application/x-protobuf",
            Bytes::from_static(b"\xff\xff"),
        )
        .await;
        assert_eq!(status, StatusCode::BAD_REQUEST);
        assert!(message.contains("not an OTLP export request"), "{message}");
        assert!(batches.try_recv().is_err());
    }

    #[tokio::test]
    async fn a_full_queue_asks_the_exporter_to_retry_instead_of_dropping() {
        let (intake, _batches) = intake(1);
        assert_eq!(
            post(&intake, "application/x-protobuf", request()).await.0,
            StatusCode::OK
        );
        let (status, message) = post(&intake, "application/x-protobuf", request()).await;
        assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE);
        assert!(message.contains("retry"), "{message}");
    }

    /// Past the disk budget a request is refused whole (507, which exporters do not retry),
    /// naming the flag; nothing of it is queued.
    #[tokio::test]
    async fn a_spent_budget_refuses_by_name_and_writes_nothing() {
        let (mut intake, mut batches) = intake(4);
        post(&intake, "application/x-protobuf", request()).await;
        let written = batches.try_recv().unwrap().1.len() as u64;
        // Room for one request and a half.
        intake.budget = Arc::new(Budget::new(
            1 << 20,
            1 << 20,
            written * 3 / 2,
            Instant::now(),
        ));
        assert_eq!(
            post(&intake, "application/x-protobuf", request()).await.0,
            StatusCode::OK
        );
        assert!(batches.try_recv().is_ok());
        let (status, message) = post(&intake, "application/x-protobuf", request()).await;
        assert_eq!(status, StatusCode::INSUFFICIENT_STORAGE);
        assert!(message.contains("nomad collect --max-bytes"), "{message}");
        assert!(batches.try_recv().is_err());
    }

    #[test]
    fn the_writer_appends_each_signal_to_its_file() {
        let dir = std::env::temp_dir().join(format!("nomad-collect-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let (tx, rx) = mpsc::channel(4);
        tx.try_send((Signal::Metrics, "{\"m\":1}\n".into()))
            .unwrap();
        tx.try_send((Signal::Traces, "{\"t\":1}\n".into())).unwrap();
        drop(tx);
        assert_eq!(write_batches(&dir, rx).unwrap(), 2);
        let read = |name: &str| std::fs::read_to_string(dir.join(name)).unwrap();
        assert_eq!(read("traces.jsonl"), "{\"t\":1}\n");
        assert_eq!(read("metrics.jsonl"), "{\"m\":1}\n");
        assert_eq!(read("logs.jsonl"), "");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}

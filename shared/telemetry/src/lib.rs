//! Telemetry for every Nomad service: config resolution, exporters (OTLP gRPC, OTLP
//! HTTP/protobuf, console JSON lines), resource attributes, span groups, run-id baggage, the
//! gRPC propagation layers and the metric definition table.
//!
//! A service calls [`init`] once, inside its Tokio runtime, and [`Telemetry::shutdown`] on the
//! way out.

pub mod baggage;
pub mod config;
pub mod console;
mod export_log;
pub mod fields;
pub mod groups;
pub mod grpc;
pub mod metric_docs;
pub mod metrics;
pub mod otlp_lines;
pub mod process;
pub mod propagation;
pub mod records;
pub mod resource;
pub mod scrape;
mod span_line;
pub mod spans;
pub mod startup;

use std::time::Duration;

use opentelemetry::global;
use opentelemetry::trace::TracerProvider as _;
use opentelemetry_otlp::{WithExportConfig, WithHttpConfig, WithTonicConfig};
use opentelemetry_sdk::Resource;
use opentelemetry_sdk::logs::SdkLoggerProvider;
use opentelemetry_sdk::metrics::{PeriodicReader, SdkMeterProvider};
use opentelemetry_sdk::trace::{BatchSpanProcessor, SdkTracerProvider};
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::util::SubscriberInitExt;
use tracing_subscriber::{EnvFilter, Layer as _};

pub use config::{ExporterKind, OtlpProtocol, TelemetryBlock, TelemetrySettings};
pub use console::ConsoleSink;
pub use groups::{SpanGroup, SpanGroups};
pub use opentelemetry::{Context, KeyValue};
pub use resource::{ServerIdentity, ServerType};
pub use spans::{GroupSpan, SpanOptions};

#[derive(Debug, thiserror::Error)]
pub enum TelemetryError {
    #[error(transparent)]
    Config(#[from] nomad_config::ConfigError),
    #[error("building the {signal} exporter: {message}")]
    Exporter {
        signal: &'static str,
        message: String,
    },
}

/// The installed providers; flushes them on [`Telemetry::shutdown`].
#[derive(Debug)]
pub struct Telemetry {
    settings: TelemetrySettings,
    service_name: String,
    tracer: Option<SdkTracerProvider>,
    meter: Option<SdkMeterProvider>,
    logger: Option<SdkLoggerProvider>,
    _process: Option<process::ProcessMetrics>,
    scrape: Option<scrape::Endpoint>,
}

/// How a process wants telemetry set up beyond its settings.
#[derive(Debug, Clone, Default)]
pub struct InitOptions {
    /// Where console records go (stderr for a process whose stdout is a protocol).
    pub console_sink: ConsoleSink,
    /// Who may scrape `/metrics` (`None`: anyone who reaches it, as on loopback when the fleet
    /// has no token).
    pub scrape_auth: Option<scrape::ScrapeAuth>,
}

fn exporter_error(
    signal: &'static str,
) -> impl Fn(opentelemetry_otlp::ExporterBuildError) -> TelemetryError {
    move |e| TelemetryError::Exporter {
        signal,
        message: e.to_string(),
    }
}

fn tonic_metadata(headers: &[(String, String)]) -> tonic::metadata::MetadataMap {
    let mut map = tonic::metadata::MetadataMap::new();
    for (k, v) in headers {
        if let (Ok(key), Ok(value)) = (
            tonic::metadata::MetadataKey::from_bytes(k.to_ascii_lowercase().as_bytes()),
            v.parse(),
        ) {
            map.insert(key, value);
        }
    }
    map
}

/// Builds one OTLP exporter of either protocol from the resolved settings.
macro_rules! otlp_exporter {
    ($builder:expr, $settings:expr, $endpoint:expr, $signal:literal) => {{
        let settings: &TelemetrySettings = $settings;
        match settings.otlp_protocol {
            OtlpProtocol::Grpc => $builder
                .with_tonic()
                .with_endpoint($endpoint)
                .with_metadata(tonic_metadata(&settings.otlp_headers))
                .build(),
            OtlpProtocol::HttpProtobuf => $builder
                .with_http()
                .with_protocol(opentelemetry_otlp::Protocol::HttpBinary)
                .with_endpoint($endpoint)
                .with_headers(settings.otlp_headers.iter().cloned().collect())
                .build(),
        }
        .map_err(exporter_error($signal))?
    }};
}

fn tracer_provider(
    settings: &TelemetrySettings,
    resource: Resource,
    options: &InitOptions,
) -> Result<SdkTracerProvider, TelemetryError> {
    let builder = SdkTracerProvider::builder()
        .with_resource(resource)
        // Runs before the batch processor so the attributes are exported.
        .with_span_processor(baggage::RunIdSpanProcessor {
            process_run_id: settings.run_id.clone(),
        });
    let builder = match settings.traces.exporter {
        ExporterKind::Console => builder.with_span_processor(
            BatchSpanProcessor::builder(console::ConsoleSpanExporter::new(
                &options.console_sink,
                settings.console_max_bytes,
            ))
            .build(),
        ),
        ExporterKind::Otlp => {
            let exporter = otlp_exporter!(
                opentelemetry_otlp::SpanExporter::builder(),
                settings,
                settings.traces.endpoint.clone(),
                "trace"
            );
            builder.with_span_processor(BatchSpanProcessor::builder(exporter).build())
        }
    };
    Ok(builder.build())
}

/// The meter provider: the configured push exporter when metrics export is on, and the
/// Prometheus reader when a scrape endpoint is asked for.
fn meter_provider(
    settings: &TelemetrySettings,
    resource: Resource,
    options: &InitOptions,
    scrape: Option<opentelemetry_prometheus::PrometheusExporter>,
) -> Result<SdkMeterProvider, TelemetryError> {
    fn reader<E: opentelemetry_sdk::metrics::exporter::PushMetricExporter>(
        exporter: E,
        interval: Option<Duration>,
    ) -> PeriodicReader<E> {
        let builder = PeriodicReader::builder(exporter);
        match interval {
            Some(interval) => builder.with_interval(interval).build(),
            None => builder.build(),
        }
    }
    let mut builder = SdkMeterProvider::builder().with_resource(resource);
    if let Some(scrape) = scrape {
        builder = builder.with_reader(scrape);
    }
    if !settings.metrics_on() {
        return Ok(builder.build());
    }
    let interval = settings.metric_export_interval;
    let builder = match settings.metrics.exporter {
        ExporterKind::Console => builder.with_reader(reader(
            console::ConsoleMetricExporter::new(&options.console_sink, settings.console_max_bytes),
            interval,
        )),
        ExporterKind::Otlp => {
            let exporter = otlp_exporter!(
                opentelemetry_otlp::MetricExporter::builder(),
                settings,
                settings.metrics.endpoint.clone(),
                "metric"
            );
            builder.with_reader(reader(exporter, interval))
        }
    };
    Ok(builder.build())
}

fn logger_provider(
    settings: &TelemetrySettings,
    resource: Resource,
    options: &InitOptions,
) -> Result<SdkLoggerProvider, TelemetryError> {
    let builder = SdkLoggerProvider::builder().with_resource(resource);
    Ok(match settings.logs.exporter {
        ExporterKind::Console => builder
            .with_batch_exporter(console::ConsoleLogExporter::new(
                &options.console_sink,
                settings.console_max_bytes,
            ))
            .build(),
        ExporterKind::Otlp => {
            let exporter = otlp_exporter!(
                opentelemetry_otlp::LogExporter::builder(),
                settings,
                settings.logs.endpoint.clone(),
                "log"
            );
            builder.with_batch_exporter(exporter).build()
        }
    })
}

/// Targets whose events must never reach the OTel log pipeline: they are the exporters' own
/// transport, and exporting their logs would feed back into them.
/// Logs shown when `RUST_LOG` is not set: the MCP library's INFO lines (three a session, one of
/// them the client's whole request) are its own bookkeeping, kept to warnings.
pub const DEFAULT_LOG_FILTER: &str = "info,rmcp=warn";

fn is_exporter_internal(target: &str) -> bool {
    ["opentelemetry", "h2", "hyper", "tonic", "tower", "reqwest"]
        .iter()
        .any(|p| target.starts_with(p))
}

/// Installs the propagator, logging and (when export is on) the tracer, meter and logger
/// providers. Call once, inside a multi-thread Tokio runtime.
pub fn init(
    settings: TelemetrySettings,
    identity: &ServerIdentity,
    mut options: InitOptions,
) -> Result<Telemetry, TelemetryError> {
    propagation::install();
    // `console_file` takes the place of a standard stream; a file the process chose stays.
    if let (Some(path), ConsoleSink::Stdout | ConsoleSink::Stderr) =
        (&settings.console_file, &options.console_sink)
    {
        options.console_sink = ConsoleSink::File(path.clone());
    }
    let resource = resource::build(&settings, identity);
    let service_name = resource::service_name(&settings, identity);

    let tracer = if settings.traces_on() {
        let provider = tracer_provider(&settings, resource.clone(), &options)?;
        spans::install(provider.tracer("nomad"), settings.span_groups);
        Some(provider)
    } else {
        None
    };
    let (scrape_reader, scrape) = match settings.prometheus_listen {
        Some(listen) => {
            let (reader, endpoint) = scrape::start(listen, options.scrape_auth.clone())?;
            (Some(reader), Some(endpoint))
        }
        None => (None, None),
    };
    let meter = if settings.metrics_on() || scrape_reader.is_some() {
        let provider = meter_provider(&settings, resource.clone(), &options, scrape_reader)?;
        global::set_meter_provider(provider.clone());
        Some(provider)
    } else {
        None
    };
    let process = meter.is_some().then(|| {
        process::start(
            settings.runtime_sample_interval,
            settings.runtime_task_count,
        )
    });
    let logger = if settings.logs_on() {
        Some(logger_provider(&settings, resource, &options)?)
    } else {
        None
    };

    // Human-readable logs always go to stderr; stdout is reserved for console telemetry.
    let fmt = tracing_subscriber::fmt::layer()
        .with_writer(std::io::stderr)
        // Colour codes only for a terminal: a log file (a run directory's) stays plain text.
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .with_target(false)
        .with_filter(
            EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| EnvFilter::new(DEFAULT_LOG_FILTER)),
        )
        .with_filter(export_log::ExportErrorsOnce);
    let otel_logs = logger.as_ref().map(|provider| {
        opentelemetry_appender_tracing::layer::OpenTelemetryTracingBridge::new(provider)
            .with_filter(tracing_subscriber::filter::filter_fn(|meta| {
                !is_exporter_internal(meta.target())
                    && (!meta.target().starts_with("rmcp") || *meta.level() <= tracing::Level::WARN)
            }))
            .with_filter(tracing_subscriber::filter::LevelFilter::INFO)
    });
    // A second init in one process (tests) keeps the first subscriber.
    let _ = tracing_subscriber::registry()
        .with(fmt)
        .with(otel_logs)
        .try_init();

    if settings.enabled {
        // Where the export goes: an OTLP endpoint, or the console exporter's stream or file.
        let to = match (settings.exporter, &options.console_sink) {
            (ExporterKind::Otlp, _) => settings.traces.endpoint.to_string(),
            (ExporterKind::Console, ConsoleSink::Stdout) => "stdout".to_owned(),
            (ExporterKind::Console, ConsoleSink::Stderr) => "stderr".to_owned(),
            (ExporterKind::Console, ConsoleSink::File(path)) => path.display().to_string(),
        };
        tracing::info!(
            service.name = %service_name,
            traces = settings.traces_on(),
            metrics = settings.metrics_on(),
            logs = settings.logs_on(),
            exporter = settings.exporter.as_str(),
            to = %to,
            "telemetry export on"
        );
    }
    Ok(Telemetry {
        settings,
        service_name,
        tracer,
        meter,
        logger,
        _process: process,
        scrape,
    })
}

impl Telemetry {
    pub fn settings(&self) -> &TelemetrySettings {
        &self.settings
    }

    pub fn service_name(&self) -> &str {
        &self.service_name
    }

    /// Flushes and stops every provider, waiting at most `timeout`.
    ///
    /// Runs on a blocking thread: the exporters need the runtime's workers to make progress, and
    /// blocking one of them to wait would deadlock on a small runtime.
    pub async fn shutdown(self, timeout: Duration) {
        let Telemetry {
            tracer,
            meter,
            logger,
            _process: process,
            scrape,
            ..
        } = self;
        drop(process);
        drop(scrape);
        if tracer.is_none() && meter.is_none() && logger.is_none() {
            return;
        }
        let work = tokio::task::spawn_blocking(move || {
            let mut failures = Vec::new();
            if let Some(p) = tracer
                && let Err(e) = p.shutdown_with_timeout(timeout)
            {
                failures.push(format!("traces: {e}"));
            }
            if let Some(p) = meter
                && let Err(e) = p.shutdown_with_timeout(timeout)
            {
                failures.push(format!("metrics: {e}"));
            }
            if let Some(p) = logger
                && let Err(e) = p.shutdown_with_timeout(timeout)
            {
                failures.push(format!("logs: {e}"));
            }
            failures
        });
        match tokio::time::timeout(timeout + Duration::from_millis(500), work).await {
            Ok(Ok(failures)) if failures.is_empty() => {}
            Ok(Ok(failures)) => {
                tracing::warn!("telemetry flush incomplete: {}", failures.join("; "))
            }
            Ok(Err(e)) => tracing::warn!("telemetry flush failed: {e}"),
            Err(_) => tracing::warn!("telemetry flush timed out after {timeout:?}"),
        }
        let suppressed = export_log::suppressed();
        if suppressed > 0 {
            tracing::warn!(
                "{suppressed} more telemetry export failures were not logged (the first of each \
                 kind was); check that the OTLP endpoint is up"
            );
        }
    }
}

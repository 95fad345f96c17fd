//! The `telemetry:` block and its environment overrides, resolved by one pure function.
//!
//! Precedence, highest first: `NOMAD_OTEL_<FIELD>`; the standard OpenTelemetry variable where
//! one exists; the config file; the default. `OTEL_SDK_DISABLED=true` turns everything off.

use std::time::Duration;

use nomad_config::{ConfigError, Env};

use crate::fields::{self as field, FIELDS};
pub use crate::fields::{MemoryProfilingBlock, TelemetryBlock};
use crate::groups::SpanGroups;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ExporterKind {
    Otlp,
    Console,
}

impl ExporterKind {
    fn parse(variable: &str, value: &str) -> Result<Self, ConfigError> {
        one_of(variable, value, &[Self::Otlp, Self::Console], Self::as_str)
    }

    pub fn as_str(self) -> &'static str {
        match self {
            ExporterKind::Otlp => "otlp",
            ExporterKind::Console => "console",
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OtlpProtocol {
    Grpc,
    HttpProtobuf,
}

impl OtlpProtocol {
    fn parse(variable: &str, value: &str) -> Result<Self, ConfigError> {
        one_of(
            variable,
            value,
            &[Self::Grpc, Self::HttpProtobuf],
            Self::as_str,
        )
    }

    pub fn as_str(self) -> &'static str {
        match self {
            OtlpProtocol::Grpc => "grpc",
            OtlpProtocol::HttpProtobuf => "http/protobuf",
        }
    }

    fn default_endpoint(self) -> &'static str {
        match self {
            OtlpProtocol::Grpc => "http://localhost:4317",
            OtlpProtocol::HttpProtobuf => "http://localhost:4318",
        }
    }
}

/// One signal (traces, metrics, logs): whether it is exported, and how.
#[derive(Debug, Clone, PartialEq)]
pub struct SignalSettings {
    pub enabled: bool,
    pub exporter: ExporterKind,
    /// Full endpoint for OTLP: for http/protobuf it already ends in `/v1/<signal>`.
    pub endpoint: String,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Signal {
    Traces,
    Metrics,
    Logs,
}

impl Signal {
    fn upper(self) -> &'static str {
        match self {
            Signal::Traces => "TRACES",
            Signal::Metrics => "METRICS",
            Signal::Logs => "LOGS",
        }
    }

    fn path(self) -> &'static str {
        match self {
            Signal::Traces => "/v1/traces",
            Signal::Metrics => "/v1/metrics",
            Signal::Logs => "/v1/logs",
        }
    }
}

/// Fully resolved telemetry settings for one process.
#[derive(Debug, Clone, PartialEq)]
pub struct TelemetrySettings {
    /// Export is on. When false nothing is exported and no exporter is built.
    pub enabled: bool,
    pub service_name: String,
    pub service_name_per_server: bool,
    pub span_groups: SpanGroups,
    pub exporter: ExporterKind,
    pub traces: SignalSettings,
    pub metrics: SignalSettings,
    pub logs: SignalSettings,
    pub otlp_protocol: OtlpProtocol,
    pub otlp_headers: Vec<(String, String)>,
    pub run_id: Option<String>,
    pub memory_profiling_enabled: bool,
    pub memory_profiling_interval: Duration,
    pub runtime_sample_interval: Duration,
    pub runtime_task_count: bool,
    /// `None` leaves the SDK default (60 s).
    pub metric_export_interval: Option<Duration>,
    /// Serve the metrics for Prometheus to scrape here (besides any export).
    pub prometheus_listen: Option<std::net::SocketAddr>,
    /// Where the console exporter writes (`None`: the process's own choice, standard output).
    pub console_file: Option<std::path::PathBuf>,
    /// What `console_file` and its rotated copies may hold together (0: no rotation).
    pub console_max_bytes: u64,
}

impl TelemetrySettings {
    /// Settings with export off (what an empty config and environment give).
    pub fn disabled() -> Self {
        resolve(&TelemetryBlock::default(), &[] as &[(&str, &str)]).expect("the defaults are valid")
    }

    pub fn traces_on(&self) -> bool {
        self.enabled && self.traces.enabled
    }

    pub fn metrics_on(&self) -> bool {
        self.enabled && self.metrics.enabled
    }

    pub fn logs_on(&self) -> bool {
        self.enabled && self.logs.enabled
    }
}

/// The block's fields as the `NOMAD_OTEL_*` variables a child process reads back, set-if-unset:
/// a field is left out when `env` (the user's) already decides it, through its `NOMAD_OTEL_*`
/// variable or a standard one that outranks the file. A child given these (on top of `env`)
/// resolves the same settings as [`resolve`] gives for the block.
pub fn block_env(block: &TelemetryBlock, env: &(impl Env + ?Sized)) -> Vec<(String, String)> {
    FIELDS
        .iter()
        .filter(|f| {
            env.non_empty(f.variable).is_none()
                && f.standard.iter().all(|v| env.non_empty(v).is_none())
        })
        .filter_map(|f| (f.value)(block).map(|v| (f.variable.to_owned(), v)))
        .collect()
}

/// The one of `choices` that `value` names (trimmed, in any case), or an error listing them.
fn one_of<T: Copy>(
    variable: &str,
    value: &str,
    choices: &[T],
    name: fn(T) -> &'static str,
) -> Result<T, ConfigError> {
    let wanted = value.trim().to_ascii_lowercase();
    choices
        .iter()
        .copied()
        .find(|c| name(*c) == wanted)
        .ok_or_else(|| {
            let names: Vec<String> = choices.iter().map(|c| format!("`{}`", name(*c))).collect();
            invalid(variable, value, &format!("expected {}", names.join(" or ")))
        })
}

fn invalid(variable: &str, value: &str, reason: &str) -> ConfigError {
    ConfigError::Invalid {
        variable: variable.to_owned(),
        value: value.to_owned(),
        reason: reason.to_owned(),
    }
}

/// The first of `names` that is set, with the name it came from.
fn lookup<'a>(env: &(impl Env + ?Sized), names: &[&'a str]) -> Option<(&'a str, String)> {
    names
        .iter()
        .find_map(|name| env.non_empty(name).map(|v| (*name, v)))
}

fn bool_field(
    env: &(impl Env + ?Sized),
    variable: &str,
    file: Option<bool>,
) -> Result<Option<bool>, ConfigError> {
    Ok(env.bool(variable)?.or(file))
}

fn seconds(variable: &str, value: f64) -> Result<Duration, ConfigError> {
    nomad_config::seconds(variable, value)
        .map_err(|reason| invalid(variable, &value.to_string(), &reason))
}

fn seconds_field(
    env: &(impl Env + ?Sized),
    variable: &str,
    file_key: &str,
    file: Option<f64>,
) -> Result<Option<Duration>, ConfigError> {
    if let Some(raw) = env.non_empty(variable) {
        let value: f64 = raw
            .parse()
            .map_err(|_| invalid(variable, &raw, "must be a number of seconds"))?;
        return seconds(variable, value).map(Some);
    }
    file.map(|v| seconds(&format!("telemetry.{file_key}"), v))
        .transpose()
}

/// `key=value` pairs separated by commas, as in `OTEL_EXPORTER_OTLP_HEADERS` (values
/// percent-decoded, as the specification writes them: `authorization=Bearer%20<token>`).
fn parse_headers(variable: &str, raw: &str) -> Result<Vec<(String, String)>, ConfigError> {
    raw.split(',')
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .map(|pair| match pair.split_once('=') {
            Some((k, v)) if !k.trim().is_empty() => Ok((
                k.trim().to_owned(),
                percent_encoding::percent_decode_str(v.trim())
                    .decode_utf8_lossy()
                    .into_owned(),
            )),
            _ => Err(invalid(
                variable,
                raw,
                "expected comma-separated key=value pairs",
            )),
        })
        .collect()
}

fn check_endpoint(variable: &str, endpoint: &str) -> Result<String, ConfigError> {
    if endpoint.starts_with("http://") || endpoint.starts_with("https://") {
        Ok(endpoint.trim_end_matches('/').to_owned())
    } else {
        Err(invalid(
            variable,
            endpoint,
            "an OTLP endpoint needs a scheme, e.g. http://127.0.0.1:4317",
        ))
    }
}

/// An exporter variable such as `OTEL_TRACES_EXPORTER`: `Some(None)` means "none".
fn signal_exporter_var(
    env: &(impl Env + ?Sized),
    variable: &str,
) -> Result<Option<Option<ExporterKind>>, ConfigError> {
    match env.non_empty(variable) {
        None => Ok(None),
        Some(v) if v.eq_ignore_ascii_case("none") => Ok(Some(None)),
        Some(v) => ExporterKind::parse(variable, &v).map(|k| Some(Some(k))),
    }
}

/// Resolves the file block against the environment. Pure: all input comes from the arguments.
pub fn resolve(
    block: &TelemetryBlock,
    env: &(impl Env + ?Sized),
) -> Result<TelemetrySettings, ConfigError> {
    let sdk_disabled = env.bool("OTEL_SDK_DISABLED")?.unwrap_or(false);

    let protocol = match lookup(
        env,
        &[field::OTLP_PROTOCOL.variable, "OTEL_EXPORTER_OTLP_PROTOCOL"],
    ) {
        Some((var, v)) => OtlpProtocol::parse(var, &v)?,
        None => match &block.otlp_protocol {
            Some(v) => OtlpProtocol::parse("telemetry.otlp_protocol", v)?,
            None => OtlpProtocol::Grpc,
        },
    };

    let exporter_override = env
        .non_empty(field::EXPORTER.variable)
        .map(|v| ExporterKind::parse(field::EXPORTER.variable, &v))
        .transpose()?;
    let exporter = match (exporter_override, &block.exporter) {
        (Some(kind), _) => kind,
        (None, Some(v)) => ExporterKind::parse("telemetry.exporter", v)?,
        (None, None) => ExporterKind::Otlp,
    };

    let nomad_endpoint = env
        .non_empty(field::OTLP_ENDPOINT.variable)
        .map(|v| check_endpoint(field::OTLP_ENDPOINT.variable, &v))
        .transpose()?;
    let base_endpoint = env
        .non_empty("OTEL_EXPORTER_OTLP_ENDPOINT")
        .map(|v| check_endpoint("OTEL_EXPORTER_OTLP_ENDPOINT", &v))
        .transpose()?;
    let file_endpoint = block
        .otlp_endpoint
        .as_deref()
        .map(|v| check_endpoint("telemetry.otlp_endpoint", v))
        .transpose()?;

    let endpoint_for = |signal: Signal| -> Result<String, ConfigError> {
        let signal_var = format!("OTEL_EXPORTER_OTLP_{}_ENDPOINT", signal.upper());
        let with_path = |base: &str| match protocol {
            OtlpProtocol::Grpc => base.to_owned(),
            OtlpProtocol::HttpProtobuf => format!("{base}{}", signal.path()),
        };
        if let Some(e) = &nomad_endpoint {
            return Ok(with_path(e));
        }
        // A per-signal endpoint is used exactly as given, as the OTel spec says.
        if let Some(v) = env.non_empty(&signal_var) {
            return check_endpoint(&signal_var, &v);
        }
        let base = base_endpoint
            .as_deref()
            .or(file_endpoint.as_deref())
            .unwrap_or(protocol.default_endpoint());
        Ok(with_path(base))
    };

    let signal = |signal: Signal,
                  nomad_var: &str,
                  standard_var: &str,
                  file_enabled: Option<bool>,
                  default_enabled: bool|
     -> Result<SignalSettings, ConfigError> {
        let standard = signal_exporter_var(env, standard_var)?;
        let mut enabled = file_enabled.unwrap_or(default_enabled);
        let mut kind = exporter;
        if let Some(choice) = standard {
            match choice {
                None => enabled = false,
                Some(k) if exporter_override.is_none() => kind = k,
                Some(_) => {}
            }
        }
        if let Some(v) = env.bool(nomad_var)? {
            enabled = v;
        }
        Ok(SignalSettings {
            enabled,
            exporter: kind,
            endpoint: endpoint_for(signal)?,
        })
    };
    let traces = signal(
        Signal::Traces,
        field::TRACES_ENABLED.variable,
        "OTEL_TRACES_EXPORTER",
        block.traces_enabled,
        true,
    )?;
    let metrics = signal(
        Signal::Metrics,
        field::METRICS_ENABLED.variable,
        "OTEL_METRICS_EXPORTER",
        block.metrics_enabled,
        true,
    )?;
    let logs = signal(
        Signal::Logs,
        field::LOGS_ENABLED.variable,
        "OTEL_LOGS_EXPORTER",
        block.logs_enabled,
        false,
    )?;

    // Export turns on implicitly when nothing set `enabled` but an endpoint or exporter is named.
    let implicit = [
        field::EXPORTER.variable,
        field::OTLP_ENDPOINT.variable,
        "OTEL_EXPORTER_OTLP_ENDPOINT",
        "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
        "OTEL_EXPORTER_OTLP_METRICS_ENDPOINT",
    ]
    .iter()
    .any(|v| env.non_empty(v).is_some())
        || ["OTEL_TRACES_EXPORTER", "OTEL_METRICS_EXPORTER"]
            .iter()
            .any(|v| {
                env.non_empty(v)
                    .is_some_and(|x| !x.eq_ignore_ascii_case("none"))
            });
    let enabled = !sdk_disabled
        && bool_field(env, field::ENABLED.variable, block.enabled)?.unwrap_or(implicit);

    let service_name = lookup(env, &[field::SERVICE_NAME.variable, "OTEL_SERVICE_NAME"])
        .map(|(_, v)| v)
        .or_else(|| block.service_name.clone())
        .unwrap_or_else(|| "nomad".to_owned());

    let span_groups = match lookup(env, &[field::SPAN_GROUPS.variable]) {
        Some((var, v)) => SpanGroups::parse(&v).map_err(|e| invalid(var, &v, &e))?,
        None => match &block.span_groups {
            Some(v) => SpanGroups::parse(v).map_err(|e| invalid("telemetry.span_groups", v, &e))?,
            None => SpanGroups::default_preset(),
        },
    };

    let otlp_headers = match lookup(
        env,
        &[field::OTLP_HEADERS.variable, "OTEL_EXPORTER_OTLP_HEADERS"],
    ) {
        Some((var, v)) => parse_headers(var, &v)?,
        None => block
            .otlp_headers
            .clone()
            .unwrap_or_default()
            .into_iter()
            .collect(),
    };

    let memory = block.memory_profiling.clone().unwrap_or_default();
    let metric_export_interval = match env.non_empty(field::METRIC_EXPORT_INTERVAL_SECONDS.variable)
    {
        Some(_) => seconds_field(
            env,
            field::METRIC_EXPORT_INTERVAL_SECONDS.variable,
            "metric_export_interval_seconds",
            None,
        )?,
        None => match env.non_empty("OTEL_METRIC_EXPORT_INTERVAL") {
            Some(raw) => {
                let ms: u64 = raw.parse().map_err(|_| {
                    invalid(
                        "OTEL_METRIC_EXPORT_INTERVAL",
                        &raw,
                        "must be a whole number of milliseconds",
                    )
                })?;
                if ms == 0 {
                    return Err(invalid(
                        "OTEL_METRIC_EXPORT_INTERVAL",
                        &raw,
                        "must be greater than 0",
                    ));
                }
                Some(Duration::from_millis(ms))
            }
            None => block
                .metric_export_interval_seconds
                .map(|v| seconds("telemetry.metric_export_interval_seconds", v))
                .transpose()?,
        },
    };

    Ok(TelemetrySettings {
        enabled,
        service_name,
        service_name_per_server: bool_field(
            env,
            field::SERVICE_NAME_PER_SERVER.variable,
            block.service_name_per_server,
        )?
        .unwrap_or(true),
        span_groups,
        exporter,
        traces,
        metrics,
        logs,
        otlp_protocol: protocol,
        otlp_headers,
        run_id: env
            .non_empty(field::RUN_ID.variable)
            .or_else(|| block.run_id.clone()),
        memory_profiling_enabled: bool_field(
            env,
            field::MEMORY_PROFILING_ENABLED.variable,
            memory.enabled,
        )?
        .unwrap_or(false),
        memory_profiling_interval: seconds_field(
            env,
            field::MEMORY_PROFILING_INTERVAL_SECONDS.variable,
            "memory_profiling.interval_seconds",
            memory.interval_seconds,
        )?
        .unwrap_or(Duration::from_secs(1)),
        runtime_sample_interval: seconds_field(
            env,
            field::RUNTIME_SAMPLE_INTERVAL_SECONDS.variable,
            "runtime_sample_interval_seconds",
            block.runtime_sample_interval_seconds,
        )?
        .unwrap_or(Duration::from_secs(1)),
        runtime_task_count: bool_field(
            env,
            field::RUNTIME_TASK_COUNT.variable,
            block.runtime_task_count,
        )?
        .unwrap_or(false),
        metric_export_interval,
        prometheus_listen: prometheus_listen(env, block)?,
        console_file: env
            .non_empty(field::CONSOLE_FILE.variable)
            .or_else(|| block.console_file.clone())
            .map(std::path::PathBuf::from),
        console_max_bytes: match env.non_empty(field::CONSOLE_MAX_BYTES.variable) {
            Some(raw) => raw.parse().map_err(|_| {
                invalid(
                    field::CONSOLE_MAX_BYTES.variable,
                    &raw,
                    "must be a whole number of bytes (0: never rotate)",
                )
            })?,
            None => block.console_max_bytes.unwrap_or(DEFAULT_CONSOLE_MAX_BYTES),
        },
    })
}

/// What a process's console files hold at most by default.
pub const DEFAULT_CONSOLE_MAX_BYTES: u64 = 1 << 30;

fn prometheus_listen(
    env: &(impl Env + ?Sized),
    block: &TelemetryBlock,
) -> Result<Option<std::net::SocketAddr>, ConfigError> {
    let variable = field::PROMETHEUS_LISTEN.variable;
    let (source, value) = match env.non_empty(variable) {
        Some(v) => (variable, v),
        None => match &block.prometheus_listen {
            Some(v) => ("telemetry.prometheus_listen", v.clone()),
            None => return Ok(None),
        },
    };
    if value.eq_ignore_ascii_case("off") {
        return Ok(None);
    }
    value.parse().map(Some).map_err(|_| ConfigError::Invalid {
        variable: source.to_owned(),
        value: value.clone(),
        reason: "not an IP:port to serve /metrics on (e.g. 127.0.0.1:9464), or off".into(),
    })
}

#[cfg(test)]
#[path = "config_tests.rs"]
mod tests;

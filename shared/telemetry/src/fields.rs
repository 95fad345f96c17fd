//! The one table of telemetry settings: each field of the `telemetry:` block with its
//! `NOMAD_OTEL_*` variable, the standard OpenTelemetry variables that outrank the file for it,
//! its default, and how to read it from a block. The resolver names variables from here,
//! `nomad up` hands the block to its children through it, and docs/telemetry.md's field table is
//! generated from it (a test fails when it drifts).

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

/// The `telemetry:` block as written in the config file. Every field is optional.
#[derive(Debug, Clone, Default, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct TelemetryBlock {
    pub enabled: Option<bool>,
    pub service_name: Option<String>,
    pub service_name_per_server: Option<bool>,
    pub span_groups: Option<String>,
    pub exporter: Option<String>,
    pub traces_enabled: Option<bool>,
    pub metrics_enabled: Option<bool>,
    pub logs_enabled: Option<bool>,
    pub otlp_endpoint: Option<String>,
    pub otlp_protocol: Option<String>,
    pub otlp_headers: Option<BTreeMap<String, String>>,
    pub run_id: Option<String>,
    pub memory_profiling: Option<MemoryProfilingBlock>,
    pub runtime_sample_interval_seconds: Option<f64>,
    pub runtime_task_count: Option<bool>,
    pub metric_export_interval_seconds: Option<f64>,
    pub prometheus_listen: Option<String>,
    pub console_file: Option<String>,
    pub console_max_bytes: Option<u64>,
}

#[derive(Debug, Clone, Default, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct MemoryProfilingBlock {
    pub enabled: Option<bool>,
    pub interval_seconds: Option<f64>,
}

/// One field of the `telemetry:` block.
pub struct Field {
    /// The key in the block (`memory_profiling.enabled` for a nested one).
    pub key: &'static str,
    /// What docs/telemetry.md says after the key (allowed values, units).
    pub note: &'static str,
    pub variable: &'static str,
    /// Standard variables that outrank the config file for this field.
    pub standard: &'static [&'static str],
    /// How docs/telemetry.md describes the standard variables.
    pub standard_doc: &'static str,
    pub default: &'static str,
    /// The block's value, as its `NOMAD_OTEL_*` variable would spell it.
    pub value: fn(&TelemetryBlock) -> Option<String>,
}

fn flag(v: Option<bool>) -> Option<String> {
    v.map(|b| b.to_string())
}

fn number(v: Option<f64>) -> Option<String> {
    v.map(|n| n.to_string())
}

pub const ENABLED: Field = Field {
    key: "enabled",
    note: "",
    variable: "NOMAD_OTEL_ENABLED",
    standard: &[],
    standard_doc: "(see above)",
    default: "`false`",
    value: |b| flag(b.enabled),
};
pub const SERVICE_NAME: Field = Field {
    key: "service_name",
    note: "",
    variable: "NOMAD_OTEL_SERVICE_NAME",
    standard: &["OTEL_SERVICE_NAME"],
    standard_doc: "`OTEL_SERVICE_NAME`",
    default: "`nomad`",
    value: |b| b.service_name.clone(),
};
pub const SERVICE_NAME_PER_SERVER: Field = Field {
    key: "service_name_per_server",
    note: "",
    variable: "NOMAD_OTEL_SERVICE_NAME_PER_SERVER",
    standard: &[],
    standard_doc: "",
    default: "`true`",
    value: |b| flag(b.service_name_per_server),
};
pub const SPAN_GROUPS: Field = Field {
    key: "span_groups",
    note: "",
    variable: "NOMAD_OTEL_SPAN_GROUPS",
    standard: &[],
    standard_doc: "",
    default: "`default`",
    value: |b| b.span_groups.clone(),
};
pub const EXPORTER: Field = Field {
    key: "exporter",
    note: " (`otlp` \\| `console`)",
    variable: "NOMAD_OTEL_EXPORTER",
    standard: &[
        "OTEL_TRACES_EXPORTER",
        "OTEL_METRICS_EXPORTER",
        "OTEL_LOGS_EXPORTER",
    ],
    standard_doc: "`OTEL_TRACES_EXPORTER`, `OTEL_METRICS_EXPORTER`, `OTEL_LOGS_EXPORTER` (per \
                   signal; `none` turns that signal off)",
    default: "`otlp`",
    value: |b| b.exporter.clone(),
};
pub const TRACES_ENABLED: Field = Field {
    key: "traces_enabled",
    note: "",
    variable: "NOMAD_OTEL_TRACES_ENABLED",
    standard: &["OTEL_TRACES_EXPORTER"],
    standard_doc: "`OTEL_TRACES_EXPORTER=none`",
    default: "`true`",
    value: |b| flag(b.traces_enabled),
};
pub const METRICS_ENABLED: Field = Field {
    key: "metrics_enabled",
    note: "",
    variable: "NOMAD_OTEL_METRICS_ENABLED",
    standard: &["OTEL_METRICS_EXPORTER"],
    standard_doc: "`OTEL_METRICS_EXPORTER=none`",
    default: "`true`",
    value: |b| flag(b.metrics_enabled),
};
pub const LOGS_ENABLED: Field = Field {
    key: "logs_enabled",
    note: "",
    variable: "NOMAD_OTEL_LOGS_ENABLED",
    standard: &["OTEL_LOGS_EXPORTER"],
    standard_doc: "`OTEL_LOGS_EXPORTER=none`",
    default: "`false`",
    value: |b| flag(b.logs_enabled),
};
pub const OTLP_ENDPOINT: Field = Field {
    key: "otlp_endpoint",
    note: "",
    variable: "NOMAD_OTEL_OTLP_ENDPOINT",
    standard: &[
        "OTEL_EXPORTER_OTLP_ENDPOINT",
        "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
        "OTEL_EXPORTER_OTLP_METRICS_ENDPOINT",
        "OTEL_EXPORTER_OTLP_LOGS_ENDPOINT",
    ],
    standard_doc: "`OTEL_EXPORTER_OTLP_{TRACES,METRICS,LOGS}_ENDPOINT`, then \
                   `OTEL_EXPORTER_OTLP_ENDPOINT`",
    default: "`http://localhost:4317` (gRPC), `http://localhost:4318` (HTTP)",
    value: |b| b.otlp_endpoint.clone(),
};
pub const OTLP_PROTOCOL: Field = Field {
    key: "otlp_protocol",
    note: " (`grpc` \\| `http/protobuf`)",
    variable: "NOMAD_OTEL_OTLP_PROTOCOL",
    standard: &["OTEL_EXPORTER_OTLP_PROTOCOL"],
    standard_doc: "`OTEL_EXPORTER_OTLP_PROTOCOL`",
    default: "`grpc`",
    value: |b| b.otlp_protocol.clone(),
};
pub const OTLP_HEADERS: Field = Field {
    key: "otlp_headers",
    note: " (map; env: `k=v,k2=v2`)",
    variable: "NOMAD_OTEL_OTLP_HEADERS",
    standard: &["OTEL_EXPORTER_OTLP_HEADERS"],
    standard_doc: "`OTEL_EXPORTER_OTLP_HEADERS`",
    default: "none",
    value: |b| {
        b.otlp_headers.as_ref().map(|h| {
            h.iter()
                .map(|(k, v)| format!("{k}={v}"))
                .collect::<Vec<_>>()
                .join(",")
        })
    },
};
pub const RUN_ID: Field = Field {
    key: "run_id",
    note: "",
    variable: "NOMAD_OTEL_RUN_ID",
    standard: &[],
    standard_doc: "",
    default: "generated by the head",
    value: |b| b.run_id.clone(),
};
pub const MEMORY_PROFILING_ENABLED: Field = Field {
    key: "memory_profiling.enabled",
    note: "",
    variable: "NOMAD_OTEL_MEMORY_PROFILING_ENABLED",
    standard: &[],
    standard_doc: "",
    default: "`false`",
    value: |b| flag(b.memory_profiling.as_ref().and_then(|m| m.enabled)),
};
pub const MEMORY_PROFILING_INTERVAL_SECONDS: Field = Field {
    key: "memory_profiling.interval_seconds",
    note: " (> 0)",
    variable: "NOMAD_OTEL_MEMORY_PROFILING_INTERVAL_SECONDS",
    standard: &[],
    standard_doc: "",
    default: "`1`",
    value: |b| number(b.memory_profiling.as_ref().and_then(|m| m.interval_seconds)),
};
pub const RUNTIME_SAMPLE_INTERVAL_SECONDS: Field = Field {
    key: "runtime_sample_interval_seconds",
    note: " (> 0)",
    variable: "NOMAD_OTEL_RUNTIME_SAMPLE_INTERVAL_SECONDS",
    standard: &[],
    standard_doc: "",
    default: "`1`",
    value: |b| number(b.runtime_sample_interval_seconds),
};
pub const RUNTIME_TASK_COUNT: Field = Field {
    key: "runtime_task_count",
    note: "",
    variable: "NOMAD_OTEL_RUNTIME_TASK_COUNT",
    standard: &[],
    standard_doc: "",
    default: "`false`",
    value: |b| flag(b.runtime_task_count),
};
pub const METRIC_EXPORT_INTERVAL_SECONDS: Field = Field {
    key: "metric_export_interval_seconds",
    note: " (> 0)",
    variable: "NOMAD_OTEL_METRIC_EXPORT_INTERVAL_SECONDS",
    standard: &["OTEL_METRIC_EXPORT_INTERVAL"],
    standard_doc: "`OTEL_METRIC_EXPORT_INTERVAL` (ms)",
    default: "`60`",
    value: |b| number(b.metric_export_interval_seconds),
};

pub const PROMETHEUS_LISTEN: Field = Field {
    key: "prometheus_listen",
    note: " (`IP:port`; serves `/metrics`)",
    variable: "NOMAD_OTEL_PROMETHEUS_LISTEN",
    standard: &[],
    standard_doc: "",
    default: "off",
    value: |b| b.prometheus_listen.clone(),
};

pub const CONSOLE_FILE: Field = Field {
    key: "console_file",
    note: " (the console exporter writes here, rotated by size, instead of standard output)",
    variable: "NOMAD_OTEL_CONSOLE_FILE",
    standard: &[],
    standard_doc: "",
    default: "standard output (`nomad up`: `<run dir>/<service>.jsonl`)",
    value: |b| b.console_file.clone(),
};

pub const CONSOLE_MAX_BYTES: Field = Field {
    key: "console_max_bytes",
    note: " (`console_file` and its rotated copies together; 0: never rotate)",
    variable: "NOMAD_OTEL_CONSOLE_MAX_BYTES",
    standard: &[],
    standard_doc: "",
    default: "`1073741824` (1 GiB)",
    value: |b| b.console_max_bytes.map(|n| n.to_string()),
};

/// Every field, in docs/telemetry.md's order.
pub const FIELDS: &[Field] = &[
    ENABLED,
    SERVICE_NAME,
    SERVICE_NAME_PER_SERVER,
    SPAN_GROUPS,
    EXPORTER,
    TRACES_ENABLED,
    METRICS_ENABLED,
    LOGS_ENABLED,
    OTLP_ENDPOINT,
    OTLP_PROTOCOL,
    OTLP_HEADERS,
    RUN_ID,
    MEMORY_PROFILING_ENABLED,
    MEMORY_PROFILING_INTERVAL_SECONDS,
    RUNTIME_SAMPLE_INTERVAL_SECONDS,
    RUNTIME_TASK_COUNT,
    METRIC_EXPORT_INTERVAL_SECONDS,
    PROMETHEUS_LISTEN,
    CONSOLE_FILE,
    CONSOLE_MAX_BYTES,
];

/// docs/telemetry.md's table of the fields.
pub fn markdown_table() -> String {
    let mut out =
        String::from("| field | variable | standard variable | default |\n|---|---|---|---|\n");
    for f in FIELDS {
        out.push_str(&format!(
            "| `{}`{} | `{}` | {} | {} |\n",
            f.key, f.note, f.variable, f.standard_doc, f.default
        ));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A block with every field set: the table must read each one, so a field added to the
    /// block but not to the table fails here.
    #[test]
    fn the_table_reads_every_field_of_the_block() {
        let block = TelemetryBlock {
            enabled: Some(true),
            service_name: Some("s".into()),
            service_name_per_server: Some(false),
            span_groups: Some("all".into()),
            exporter: Some("console".into()),
            traces_enabled: Some(true),
            metrics_enabled: Some(true),
            logs_enabled: Some(true),
            otlp_endpoint: Some("http://x:1".into()),
            otlp_protocol: Some("grpc".into()),
            otlp_headers: Some([("a".to_owned(), "b".to_owned())].into()),
            run_id: Some("r".into()),
            memory_profiling: Some(MemoryProfilingBlock {
                enabled: Some(true),
                interval_seconds: Some(2.0),
            }),
            runtime_sample_interval_seconds: Some(1.0),
            runtime_task_count: Some(true),
            metric_export_interval_seconds: Some(5.0),
            prometheus_listen: Some("127.0.0.1:9464".into()),
            console_file: Some("/tmp/x.jsonl".into()),
            console_max_bytes: Some(1 << 20),
        };
        let json = serde_json::to_value(&block).unwrap();
        let mut keys: Vec<String> = Vec::new();
        for (k, v) in json.as_object().unwrap() {
            match v.as_object() {
                Some(nested) if k != "otlp_headers" => {
                    keys.extend(nested.keys().map(|n| format!("{k}.{n}")))
                }
                _ => keys.push(k.clone()),
            }
        }
        keys.sort();
        let mut table: Vec<String> = FIELDS.iter().map(|f| f.key.to_owned()).collect();
        table.sort();
        assert_eq!(keys, table);
        for f in FIELDS {
            assert!((f.value)(&block).is_some(), "{} reads nothing", f.key);
            assert!(f.variable.starts_with("NOMAD_OTEL_"), "{}", f.variable);
        }
    }

    #[test]
    fn docs_telemetry_field_table_matches_the_table() {
        let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../docs/telemetry.md");
        let readme = std::fs::read_to_string(&path).unwrap();
        let (start, end) = (
            "<!-- telemetry-fields:start -->\n",
            "<!-- telemetry-fields:end -->",
        );
        let a = readme
            .find(start)
            .expect("docs/telemetry.md has the telemetry-fields markers")
            + start.len();
        let b = readme[a..]
            .find(end)
            .expect("docs/telemetry.md has the end marker")
            + a;
        let expected = markdown_table();
        if readme[a..b] != expected {
            if std::env::var_os("NOMAD_BLESS").is_some() {
                let updated = format!("{}{expected}{}", &readme[..a], &readme[b..]);
                std::fs::write(&path, updated).unwrap();
            } else {
                panic!(
                    "docs/telemetry.md's field table is out of date with shared/telemetry/src/\
                     fields.rs; regenerate it with: NOMAD_BLESS=1 cargo test -p nomad-telemetry \
                     docs_telemetry_"
                );
            }
        }
    }
}

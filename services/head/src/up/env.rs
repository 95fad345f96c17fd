//! The environment `nomad up` gives its children: the `telemetry:` block as `NOMAD_OTEL_*`
//! variables, and its own defaults, never over a variable of the user's.

use nomad_config::Env;
pub use nomad_config::Layered;
use nomad_telemetry::TelemetryBlock;

/// Telemetry settings `nomad up` hands its children (and itself) when neither the config nor
/// the environment configures telemetry: console export into the run directory, with memory
/// profiling. Set-if-unset: nothing here replaces a variable of the user's.
pub fn telemetry_defaults(block: &TelemetryBlock, env: &dyn Env) -> Vec<(String, String)> {
    let configured = block.enabled.is_some()
        || block.exporter.is_some()
        || block.otlp_endpoint.is_some()
        || [
            "NOMAD_OTEL_ENABLED",
            "NOMAD_OTEL_EXPORTER",
            "NOMAD_OTEL_OTLP_ENDPOINT",
            "OTEL_SDK_DISABLED",
            "OTEL_EXPORTER_OTLP_ENDPOINT",
            "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
            "OTEL_EXPORTER_OTLP_METRICS_ENDPOINT",
            "OTEL_TRACES_EXPORTER",
            "OTEL_METRICS_EXPORTER",
        ]
        .iter()
        .any(|v| env.non_empty(v).is_some());
    if configured {
        return Vec::new();
    }
    // A field the block or the environment already sets is left to it.
    let interval_set = block.metric_export_interval_seconds.is_some()
        || env.non_empty("OTEL_METRIC_EXPORT_INTERVAL").is_some();
    let profiling_set = block
        .memory_profiling
        .as_ref()
        .is_some_and(|m| m.enabled.is_some());
    [
        ("NOMAD_OTEL_ENABLED", "true", false),
        ("NOMAD_OTEL_EXPORTER", "console", false),
        ("NOMAD_OTEL_MEMORY_PROFILING_ENABLED", "true", profiling_set),
        // Points every 2 s, so a short run's report still plots memory over time.
        (
            "NOMAD_OTEL_METRIC_EXPORT_INTERVAL_SECONDS",
            "2",
            interval_set,
        ),
        // Spans reach their file within a second (the SDK's default waits 5 s): what a server
        // that is SIGKILLed loses of its spans is its last second, and writing a local file
        // that often costs nothing measurable.
        ("OTEL_BSP_SCHEDULE_DELAY", "1000", false),
    ]
    .into_iter()
    .filter(|(k, _, set)| !set && env.non_empty(k).is_none())
    .map(|(k, v, _)| (k.to_owned(), v.to_owned()))
    .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use nomad_telemetry::ExporterKind;

    fn env(pairs: &[(&str, &str)]) -> std::collections::HashMap<String, String> {
        pairs
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect()
    }

    #[test]
    fn defaults_apply_only_where_nothing_configures_telemetry() {
        let none = TelemetryBlock::default();
        let defaults = telemetry_defaults(&none, &env(&[]));
        assert_eq!(defaults.len(), 5);
        let d = telemetry_defaults(&none, &env(&[("OTEL_METRIC_EXPORT_INTERVAL", "10000")]));
        assert!(
            !d.iter()
                .any(|(k, _)| k == "NOMAD_OTEL_METRIC_EXPORT_INTERVAL_SECONDS"),
            "the standard variable is the user's choice: {d:?}"
        );
        // The user's own choice of a field is left alone; the others still default.
        let d = telemetry_defaults(
            &none,
            &env(&[("NOMAD_OTEL_MEMORY_PROFILING_ENABLED", "off")]),
        );
        assert!(
            !d.iter()
                .any(|(k, _)| k == "NOMAD_OTEL_MEMORY_PROFILING_ENABLED")
        );
        assert_eq!(d.len(), 4);
        for configured in [
            ("NOMAD_OTEL_ENABLED", "false"),
            ("OTEL_EXPORTER_OTLP_ENDPOINT", "http://collector:4317"),
            ("OTEL_SDK_DISABLED", "true"),
        ] {
            assert!(
                telemetry_defaults(&none, &env(&[configured])).is_empty(),
                "{configured:?}"
            );
        }
        let block = TelemetryBlock {
            exporter: Some("otlp".into()),
            ..Default::default()
        };
        assert!(telemetry_defaults(&block, &env(&[])).is_empty());
    }

    #[test]
    fn the_user_env_wins_over_defaults_and_the_config_block() {
        let block = TelemetryBlock {
            enabled: Some(true),
            exporter: Some("otlp".into()),
            ..Default::default()
        };
        let user = env(&[("NOMAD_OTEL_EXPORTER", "console")]);
        let defaults = vec![("NOMAD_OTEL_EXPORTER".to_owned(), "otlp".to_owned())];
        let layered = Layered {
            user: &user,
            defaults: &defaults,
        };
        let settings = nomad_telemetry::config::resolve(&block, &layered).unwrap();
        assert_eq!(settings.exporter, ExporterKind::Console);
    }
}

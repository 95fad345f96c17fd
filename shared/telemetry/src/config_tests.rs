use super::*;
use crate::groups::SpanGroup;

fn block(yaml: &str) -> TelemetryBlock {
    nomad_config::ConfigFile::from_yaml_str(yaml)
        .section("telemetry")
        .unwrap()
}

fn settings(yaml: &str, env: &[(&str, &str)]) -> TelemetrySettings {
    resolve(&block(yaml), env).unwrap()
}

fn error(yaml: &str, env: &[(&str, &str)]) -> String {
    resolve(&block(yaml), env).unwrap_err().to_string()
}

/// One row per field: what the default, the file, a standard variable (where one exists) and
/// the NOMAD_OTEL_ variable give. Each row checks that each layer beats the one below.
struct Row {
    field: &'static str,
    file: &'static str,
    standard: Option<(&'static str, &'static str)>,
    nomad: (&'static str, &'static str),
    read: fn(&TelemetrySettings) -> String,
    default: &'static str,
    from_file: &'static str,
    from_standard: &'static str,
    from_nomad: &'static str,
}

fn rows() -> Vec<Row> {
    vec![
        Row {
            field: "enabled",
            file: "enabled: true",
            standard: None,
            nomad: ("NOMAD_OTEL_ENABLED", "false"),
            read: |s| s.enabled.to_string(),
            default: "false",
            from_file: "true",
            from_standard: "",
            from_nomad: "false",
        },
        Row {
            field: "service_name",
            file: "service_name: from-file",
            standard: Some(("OTEL_SERVICE_NAME", "from-otel")),
            nomad: ("NOMAD_OTEL_SERVICE_NAME", "from-nomad"),
            read: |s| s.service_name.clone(),
            default: "nomad",
            from_file: "from-file",
            from_standard: "from-otel",
            from_nomad: "from-nomad",
        },
        Row {
            field: "service_name_per_server",
            file: "service_name_per_server: false",
            standard: None,
            nomad: ("NOMAD_OTEL_SERVICE_NAME_PER_SERVER", "yes"),
            read: |s| s.service_name_per_server.to_string(),
            default: "true",
            from_file: "false",
            from_standard: "",
            from_nomad: "true",
        },
        Row {
            field: "span_groups",
            file: "span_groups: per_rollout",
            standard: None,
            nomad: ("NOMAD_OTEL_SPAN_GROUPS", "client"),
            read: |s| format!("{:?}", s.span_groups),
            default: "SpanGroups(job,rollout,verify,server,gateway,sandbox,upstream,tool,batch,device,startup)",
            from_file: "SpanGroups(job,rollout,verify,gateway)",
            from_standard: "",
            from_nomad: "SpanGroups(client)",
        },
        Row {
            field: "exporter",
            file: "exporter: console",
            standard: Some(("OTEL_TRACES_EXPORTER", "otlp")),
            nomad: ("NOMAD_OTEL_EXPORTER", "console"),
            read: |s| s.traces.exporter.as_str().to_owned(),
            default: "otlp",
            from_file: "console",
            from_standard: "otlp",
            from_nomad: "console",
        },
        Row {
            field: "traces_enabled",
            file: "traces_enabled: false",
            standard: Some(("OTEL_TRACES_EXPORTER", "none")),
            nomad: ("NOMAD_OTEL_TRACES_ENABLED", "on"),
            read: |s| s.traces.enabled.to_string(),
            default: "true",
            from_file: "false",
            from_standard: "false",
            from_nomad: "true",
        },
        Row {
            field: "metrics_enabled",
            file: "metrics_enabled: false",
            standard: Some(("OTEL_METRICS_EXPORTER", "none")),
            nomad: ("NOMAD_OTEL_METRICS_ENABLED", "1"),
            read: |s| s.metrics.enabled.to_string(),
            default: "true",
            from_file: "false",
            from_standard: "false",
            from_nomad: "true",
        },
        Row {
            field: "logs_enabled",
            file: "logs_enabled: true",
            standard: Some(("OTEL_LOGS_EXPORTER", "none")),
            nomad: ("NOMAD_OTEL_LOGS_ENABLED", "true"),
            read: |s| s.logs.enabled.to_string(),
            default: "false",
            from_file: "true",
            from_standard: "false",
            from_nomad: "true",
        },
        Row {
            field: "otlp_endpoint",
            file: "otlp_endpoint: http://file:4317",
            standard: Some(("OTEL_EXPORTER_OTLP_ENDPOINT", "http://otel:4317")),
            nomad: ("NOMAD_OTEL_OTLP_ENDPOINT", "http://nomad:4317"),
            read: |s| s.traces.endpoint.clone(),
            default: "http://localhost:4317",
            from_file: "http://file:4317",
            from_standard: "http://otel:4317",
            from_nomad: "http://nomad:4317",
        },
        Row {
            field: "otlp_protocol",
            file: "otlp_protocol: http/protobuf",
            standard: Some(("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc")),
            nomad: ("NOMAD_OTEL_OTLP_PROTOCOL", "http/protobuf"),
            read: |s| s.otlp_protocol.as_str().to_owned(),
            default: "grpc",
            from_file: "http/protobuf",
            from_standard: "grpc",
            from_nomad: "http/protobuf",
        },
        Row {
            field: "otlp_headers",
            file: "otlp_headers: {a: file}",
            // Values are percent-decoded, as the specification writes them.
            standard: Some(("OTEL_EXPORTER_OTLP_HEADERS", "a=Bearer%20otel")),
            nomad: ("NOMAD_OTEL_OTLP_HEADERS", "a=nomad,b=2"),
            read: |s| format!("{:?}", s.otlp_headers),
            default: "[]",
            from_file: r#"[("a", "file")]"#,
            from_standard: r#"[("a", "Bearer otel")]"#,
            from_nomad: r#"[("a", "nomad"), ("b", "2")]"#,
        },
        Row {
            field: "run_id",
            file: "run_id: file-run",
            standard: None,
            nomad: ("NOMAD_OTEL_RUN_ID", "env-run"),
            read: |s| format!("{:?}", s.run_id),
            default: "None",
            from_file: r#"Some("file-run")"#,
            from_standard: "",
            from_nomad: r#"Some("env-run")"#,
        },
        Row {
            field: "memory_profiling.enabled",
            file: "memory_profiling: {enabled: true}",
            standard: None,
            nomad: ("NOMAD_OTEL_MEMORY_PROFILING_ENABLED", "off"),
            read: |s| s.memory_profiling_enabled.to_string(),
            default: "false",
            from_file: "true",
            from_standard: "",
            from_nomad: "false",
        },
        Row {
            field: "memory_profiling.interval_seconds",
            file: "memory_profiling: {interval_seconds: 2.5}",
            standard: None,
            nomad: ("NOMAD_OTEL_MEMORY_PROFILING_INTERVAL_SECONDS", "0.5"),
            read: |s| format!("{:?}", s.memory_profiling_interval),
            default: "1s",
            from_file: "2.5s",
            from_standard: "",
            from_nomad: "500ms",
        },
        Row {
            field: "runtime_sample_interval_seconds",
            file: "runtime_sample_interval_seconds: 3",
            standard: None,
            nomad: ("NOMAD_OTEL_RUNTIME_SAMPLE_INTERVAL_SECONDS", "0.25"),
            read: |s| format!("{:?}", s.runtime_sample_interval),
            default: "1s",
            from_file: "3s",
            from_standard: "",
            from_nomad: "250ms",
        },
        Row {
            field: "runtime_task_count",
            file: "runtime_task_count: true",
            standard: None,
            nomad: ("NOMAD_OTEL_RUNTIME_TASK_COUNT", "no"),
            read: |s| s.runtime_task_count.to_string(),
            default: "false",
            from_file: "true",
            from_standard: "",
            from_nomad: "false",
        },
        Row {
            field: "metric_export_interval_seconds",
            file: "metric_export_interval_seconds: 10",
            standard: Some(("OTEL_METRIC_EXPORT_INTERVAL", "2000")),
            nomad: ("NOMAD_OTEL_METRIC_EXPORT_INTERVAL_SECONDS", "0.5"),
            read: |s| format!("{:?}", s.metric_export_interval),
            default: "None",
            from_file: "Some(10s)",
            from_standard: "Some(2s)",
            from_nomad: "Some(500ms)",
        },
        Row {
            field: "prometheus_listen",
            file: "prometheus_listen: '127.0.0.1:9464'",
            standard: None,
            nomad: ("NOMAD_OTEL_PROMETHEUS_LISTEN", "0.0.0.0:9000"),
            read: |s| format!("{:?}", s.prometheus_listen),
            default: "None",
            from_file: "Some(127.0.0.1:9464)",
            from_standard: "",
            from_nomad: "Some(0.0.0.0:9000)",
        },
        Row {
            field: "console_file",
            file: "console_file: /tmp/file.jsonl",
            standard: None,
            nomad: ("NOMAD_OTEL_CONSOLE_FILE", "/tmp/env.jsonl"),
            read: |s| format!("{:?}", s.console_file),
            default: "None",
            from_file: r#"Some("/tmp/file.jsonl")"#,
            from_standard: "",
            from_nomad: r#"Some("/tmp/env.jsonl")"#,
        },
        Row {
            field: "console_max_bytes",
            file: "console_max_bytes: 1000000",
            standard: None,
            nomad: ("NOMAD_OTEL_CONSOLE_MAX_BYTES", "0"),
            read: |s| s.console_max_bytes.to_string(),
            default: "1073741824",
            from_file: "1000000",
            from_standard: "",
            from_nomad: "0",
        },
    ]
}

#[test]
fn every_field_follows_nomad_then_standard_then_file_then_default() {
    for row in rows() {
        let file = format!("telemetry:\n  {}\n", row.file);
        let read = row.read;
        assert_eq!(
            read(&settings("", &[])),
            row.default,
            "{}: default",
            row.field
        );
        assert_eq!(
            read(&settings(&file, &[])),
            row.from_file,
            "{}: file",
            row.field
        );
        let mut env = vec![];
        if let Some(standard) = row.standard {
            env.push(standard);
            assert_eq!(
                read(&settings(&file, &env)),
                row.from_standard,
                "{}: standard variable beats the file",
                row.field
            );
        }
        env.push(row.nomad);
        assert_eq!(
            read(&settings(&file, &env)),
            row.from_nomad,
            "{}: NOMAD_OTEL_ variable beats everything",
            row.field
        );
    }
}

#[test]
fn every_documented_variable_has_a_row() {
    let rows = rows();
    for f in crate::fields::FIELDS {
        assert!(
            rows.iter()
                .any(|r| r.nomad.0 == f.variable && r.field == f.key),
            "{} ({}) has no precedence row",
            f.variable,
            f.key
        );
    }
}

#[test]
fn sdk_disabled_beats_enabled_everywhere() {
    let s = settings(
        "telemetry: {enabled: true}",
        &[
            ("NOMAD_OTEL_ENABLED", "true"),
            ("OTEL_SDK_DISABLED", "true"),
        ],
    );
    assert!(!s.enabled && !s.traces_on() && !s.metrics_on());
    let s = settings(
        "",
        &[("OTEL_SDK_DISABLED", "false"), ("NOMAD_OTEL_ENABLED", "1")],
    );
    assert!(s.enabled);
}

#[test]
fn endpoint_or_exporter_variables_enable_export_when_enabled_is_unset() {
    for var in [
        ("OTEL_EXPORTER_OTLP_ENDPOINT", "http://c:4317"),
        ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "http://c:4317"),
        ("OTEL_EXPORTER_OTLP_METRICS_ENDPOINT", "http://c:4317"),
        ("OTEL_TRACES_EXPORTER", "otlp"),
        ("OTEL_METRICS_EXPORTER", "console"),
        ("NOMAD_OTEL_EXPORTER", "console"),
        ("NOMAD_OTEL_OTLP_ENDPOINT", "http://c:4317"),
    ] {
        assert!(settings("", &[var]).enabled, "{var:?} should enable export");
        assert!(
            !settings("telemetry: {enabled: false}", &[var]).enabled,
            "{var:?} must not beat an explicit enabled: false"
        );
    }
    assert!(!settings("", &[("OTEL_TRACES_EXPORTER", "none")]).enabled);
}

#[test]
fn invalid_boolean_names_the_variable() {
    let msg = error("", &[("NOMAD_OTEL_ENABLED", "maybe")]);
    assert!(
        msg.contains("NOMAD_OTEL_ENABLED") && msg.contains("maybe"),
        "{msg}"
    );
    let msg = error("", &[("OTEL_SDK_DISABLED", "perhaps")]);
    assert!(msg.contains("OTEL_SDK_DISABLED"), "{msg}");
}

#[test]
fn bad_values_are_errors_naming_their_source() {
    // A variable with a bad value: the error names it (or says what is wrong).
    let variables = [
        ("NOMAD_OTEL_EXPORTER", "jaeger", "NOMAD_OTEL_EXPORTER"),
        ("OTEL_TRACES_EXPORTER", "zipkin", "OTEL_TRACES_EXPORTER"),
        (
            "OTEL_EXPORTER_OTLP_PROTOCOL",
            "http/json",
            "OTEL_EXPORTER_OTLP_PROTOCOL",
        ),
        (
            "NOMAD_OTEL_OTLP_ENDPOINT",
            "127.0.0.1:4317",
            "needs a scheme",
        ),
        ("NOMAD_OTEL_SPAN_GROUPS", "default,bogus", "bogus"),
        ("NOMAD_OTEL_OTLP_HEADERS", "novalue", "key=value"),
        (
            "NOMAD_OTEL_RUNTIME_SAMPLE_INTERVAL_SECONDS",
            "-1",
            "greater than 0",
        ),
        (
            "OTEL_METRIC_EXPORT_INTERVAL",
            "soon",
            "OTEL_METRIC_EXPORT_INTERVAL",
        ),
        (
            "NOMAD_OTEL_PROMETHEUS_LISTEN",
            ":9464",
            "NOMAD_OTEL_PROMETHEUS_LISTEN",
        ),
    ];
    let refused = |yaml: &str, env: &[(&str, &str)], expected: &str| {
        let msg = error(yaml, env);
        assert!(msg.contains(expected), "{env:?} {yaml}: {msg}");
    };
    for (variable, value, expected) in variables {
        refused("", &[(variable, value)], expected);
    }
    // A config block with a bad value: the error names the key.
    let blocks = [
        (
            "telemetry: {otlp_endpoint: 'collector:4317'}",
            "telemetry.otlp_endpoint",
        ),
        (
            "telemetry: {memory_profiling: {interval_seconds: 0}}",
            "greater than 0",
        ),
        (
            "telemetry: {prometheus_listen: 'localhost'}",
            "telemetry.prometheus_listen=\"localhost\": not an IP:port",
        ),
    ];
    for (yaml, expected) in blocks {
        refused(yaml, &[], expected);
    }
}

#[test]
fn unknown_field_in_the_block_is_rejected() {
    let err = nomad_config::ConfigFile::from_yaml_str("telemetry:\n  enabeld: true\n")
        .section::<TelemetryBlock>("telemetry")
        .unwrap_err()
        .to_string();
    assert!(err.contains("enabeld"), "{err}");
}

#[test]
fn http_protobuf_appends_signal_paths_except_to_per_signal_endpoints() {
    let s = settings(
        "telemetry: {otlp_protocol: http/protobuf, otlp_endpoint: 'http://c:4318/'}",
        &[("OTEL_EXPORTER_OTLP_METRICS_ENDPOINT", "http://m:9/custom")],
    );
    assert_eq!(s.traces.endpoint, "http://c:4318/v1/traces");
    assert_eq!(s.metrics.endpoint, "http://m:9/custom");
    assert_eq!(s.logs.endpoint, "http://c:4318/v1/logs");
    let s = settings("telemetry: {otlp_protocol: http/protobuf}", &[]);
    assert_eq!(s.traces.endpoint, "http://localhost:4318/v1/traces");
}

#[test]
fn standard_exporter_variable_sets_one_signal_only() {
    let s = settings(
        "telemetry: {enabled: true}",
        &[("OTEL_METRICS_EXPORTER", "console")],
    );
    assert_eq!(s.metrics.exporter, ExporterKind::Console);
    assert_eq!(s.traces.exporter, ExporterKind::Otlp);
    let s = settings(
        "",
        &[
            ("OTEL_TRACES_EXPORTER", "none"),
            ("NOMAD_OTEL_ENABLED", "1"),
        ],
    );
    assert!(s.enabled && !s.traces_on() && s.metrics_on());
}

#[test]
fn disabled_settings_enable_nothing() {
    let s = TelemetrySettings::disabled();
    assert!(!s.enabled && !s.traces_on() && !s.metrics_on() && !s.logs_on());
    assert!(s.span_groups.contains(SpanGroup::Rollout));
}

/// A child that reads the user's env plus [`block_env`] (and the same file) resolves what the
/// head resolves.
#[test]
fn block_env_hands_children_the_heads_settings() {
    let blocks = [
        "telemetry: {}",
        "telemetry: {enabled: true, exporter: console, service_name: fleet, span_groups: all, \
         traces_enabled: false, metrics_enabled: true, logs_enabled: true, \
         otlp_endpoint: 'http://collector:4318', otlp_protocol: http/protobuf, \
         otlp_headers: {a: '1', b: '2'}, run_id: r7, service_name_per_server: false, \
         memory_profiling: {enabled: true, interval_seconds: 2.5}, \
         runtime_sample_interval_seconds: 0.25, runtime_task_count: true, \
         metric_export_interval_seconds: 3}",
        "telemetry: {enabled: true, exporter: otlp, otlp_endpoint: 'http://c:4317'}",
    ];
    let envs: &[&[(&str, &str)]] = &[
        &[],
        &[("NOMAD_OTEL_EXPORTER", "otlp")],
        &[
            ("OTEL_TRACES_EXPORTER", "none"),
            ("OTEL_SERVICE_NAME", "mine"),
        ],
        &[
            ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "http://traces:4317"),
            ("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc"),
            ("OTEL_METRIC_EXPORT_INTERVAL", "500"),
        ],
        &[
            ("NOMAD_OTEL_MEMORY_PROFILING_ENABLED", "off"),
            ("NOMAD_OTEL_RUN_ID", "user-run"),
            ("OTEL_EXPORTER_OTLP_HEADERS", "x=y"),
        ],
    ];
    for yaml in blocks {
        let file = nomad_config::ConfigFile::from_yaml_str(yaml);
        let block: TelemetryBlock = file.section("telemetry").unwrap();
        for env in envs {
            let head = resolve(&block, *env).unwrap();
            let handed = block_env(&block, *env);
            let mut child_env: Vec<(&str, &str)> = env.to_vec();
            child_env.extend(handed.iter().map(|(k, v)| (k.as_str(), v.as_str())));
            // A field the user's standard variable decides is left to the file; otherwise the
            // variables alone carry the block.
            if env.iter().all(|(k, _)| k.starts_with("NOMAD_OTEL_")) {
                assert_eq!(
                    resolve(&TelemetryBlock::default(), child_env.as_slice()).unwrap(),
                    head,
                    "env only: {yaml} under {env:?} (handed {handed:?})"
                );
            }
            assert_eq!(
                resolve(&block, child_env.as_slice()).unwrap(),
                head,
                "env and file: {yaml} under {env:?}"
            );
            for (variable, _) in &handed {
                assert!(
                    env.iter().all(|(k, _)| k != variable),
                    "{variable} replaced the user's"
                );
            }
        }
    }
}

mod fuzz {
    use super::*;
    use proptest::prelude::*;

    fn variable() -> impl Strategy<Value = String> {
        let mut names: Vec<&'static str> =
            crate::fields::FIELDS.iter().map(|f| f.variable).collect();
        names.extend([
            "OTEL_SDK_DISABLED",
            "OTEL_SERVICE_NAME",
            "OTEL_TRACES_EXPORTER",
            "OTEL_METRICS_EXPORTER",
            "OTEL_LOGS_EXPORTER",
            "OTEL_EXPORTER_OTLP_ENDPOINT",
            "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
            "OTEL_EXPORTER_OTLP_PROTOCOL",
            "OTEL_EXPORTER_OTLP_HEADERS",
            "OTEL_METRIC_EXPORT_INTERVAL",
        ]);
        prop::sample::select(names).prop_map(str::to_owned)
    }

    fn value() -> impl Strategy<Value = String> {
        prop_oneof![
            ".{0,12}",
            prop::sample::select(vec![
                "true",
                "off",
                "yes",
                "2",
                "",
                " ",
                "none",
                "otlp",
                "console",
                "grpc",
                "http/protobuf",
                "http://h:4317",
                "h:4317",
                "a=b,c",
                "=x",
                "0",
                "-1",
                "NaN",
                "inf",
                "1e400",
                "0.5",
                "job,all",
                "nope",
            ])
            .prop_map(str::to_owned),
            any::<f64>().prop_map(|f| f.to_string()),
        ]
    }

    fn seconds() -> impl Strategy<Value = Option<f64>> {
        proptest::option::of(prop_oneof![
            any::<f64>(),
            Just(f64::NAN),
            Just(f64::INFINITY),
            Just(1e300),
            Just(-1.0),
            Just(0.0)
        ])
    }

    proptest! {
        /// Any environment over any block resolves or fails with an error that names the
        /// variable or field to change; it never panics.
        #[test]
        fn any_env_and_block_resolve_or_name_the_culprit(
            env in prop::collection::vec((variable(), value()), 0..8),
            exporter in proptest::option::of(value()),
            span_groups in proptest::option::of(value()),
            endpoint in proptest::option::of(value()),
            interval in seconds(),
            runtime in seconds(),
            memory in seconds(),
        ) {
            let block = TelemetryBlock {
                exporter,
                span_groups,
                otlp_endpoint: endpoint,
                metric_export_interval_seconds: interval,
                runtime_sample_interval_seconds: runtime,
                memory_profiling: Some(MemoryProfilingBlock { enabled: None, interval_seconds: memory }),
                ..Default::default()
            };
            let pairs: Vec<(&str, &str)> = env.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
            if let Err(e) = resolve(&block, pairs.as_slice()) {
                let message = e.to_string();
                prop_assert!(
                    env.iter().any(|(k, _)| message.contains(k.as_str())) || message.contains("telemetry."),
                    "{message}"
                );
            }
        }
    }
}

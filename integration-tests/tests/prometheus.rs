//! Every server of a `nomad up` fleet serves `/metrics`, and a real Prometheus server (Debian's
//! `prometheus`, started here on loopback with a generated config) scrapes them: PromQL over its
//! HTTP API finds the seed's serving metrics with the Prometheus types and suffixes, the
//! gateway's and the head's after a run, and data for every panel of the shipped Grafana
//! dashboard (`deploy/grafana/nomad.json`).

use std::path::Path;
use std::process::Stdio;
use std::time::{Duration, Instant};

use nomad_integration_tests::Fleet;
use nomad_integration_tests::fleet::nomad_up;
use nomad_integration_tests::process::send_signal;
use nomad_integration_tests::process::{clean, succeeded};
use nomad_integration_tests::unique_run_id;
use serde_json::Value;

async fn get(url: &str) -> Value {
    let response = nomad_integration_tests::http()
        .build()
        .unwrap()
        .get(url)
        .send()
        .await
        .unwrap();
    let text = response.text().await.unwrap();
    serde_json::from_str(&text).unwrap_or_else(|_| panic!("{url} answered {text}"))
}

/// The series of a PromQL query, by their labels.
async fn query(prometheus: &str, promql: &str) -> Vec<Value> {
    let url = format!(
        "{prometheus}/api/v1/query?query={}",
        promql
            .bytes()
            .map(|b| match b {
                b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'_' => (b as char).to_string(),
                _ => format!("%{b:02X}"),
            })
            .collect::<String>()
    );
    let answer = get(&url).await;
    assert_eq!(answer["status"], "success", "{promql}: {answer}");
    answer["data"]["result"]
        .as_array()
        .cloned()
        .unwrap_or_default()
}

fn value(series: &Value) -> f64 {
    series["value"][1].as_str().unwrap().parse().unwrap()
}

async fn wait_for(what: &str, timeout: Duration, mut check: impl AsyncFnMut() -> bool) {
    let deadline = Instant::now() + timeout;
    while !check().await {
        assert!(Instant::now() < deadline, "{what}: not within {timeout:?}");
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prometheus_scrapes_every_server_of_a_fleet_with_the_right_types() {
    let dir = Fleet::new_dir();
    let run_id = unique_run_id("it-prom");
    let (mut up, fleet_path) = nomad_up(&dir, &run_id).await;
    let fleet: Value =
        serde_json::from_str(&std::fs::read_to_string(&fleet_path).unwrap()).unwrap();
    let targets = fleet["prometheus"].as_object().unwrap().clone();
    let names: Vec<&str> = targets.keys().map(String::as_str).collect();
    assert_eq!(names, ["device-worker-0", "gateway", "head", "scheduler"]);
    // `nomad run` drives the rollouts below and serves its own /metrics while it runs (the
    // rollout and verification panels read it).
    let runner = format!("127.0.0.1:{}", nomad_integration_tests::free_port());

    // A real Prometheus, scraping each server every second with the fleet's token (every
    // /metrics of a fleet with one needs it, on loopback too).
    let token_file = dir.join("token");
    std::fs::write(&token_file, fleet["token"].as_str().unwrap()).unwrap();
    let auth = format!(
        "    authorization: {{credentials_file: '{}'}}\n",
        token_file.display()
    );
    let mut config =
        String::from("global: {scrape_interval: 1s, scrape_timeout: 1s}\nscrape_configs:\n");
    for (name, address) in &targets {
        config.push_str(&format!(
            "  - job_name: {name}\n    static_configs: [{{targets: ['{}']}}]\n{auth}",
            address.as_str().unwrap()
        ));
    }
    config.push_str(&format!(
        "  - job_name: runner\n    static_configs: [{{targets: ['{runner}']}}]\n{auth}"
    ));
    let config_path = dir.join("prometheus.yml");
    std::fs::write(&config_path, config).unwrap();
    let port = nomad_integration_tests::free_port();
    let prometheus = format!("http://127.0.0.1:{port}");
    let _server = tokio::process::Command::new("prometheus")
        .arg(format!("--config.file={}", config_path.display()))
        .arg(format!(
            "--storage.tsdb.path={}",
            dir.join("tsdb").display()
        ))
        .arg(format!("--web.listen-address=127.0.0.1:{port}"))
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(dir.join("prometheus.log")).unwrap())
        .kill_on_drop(true)
        .spawn()
        .expect("Debian's prometheus package (apt-get install prometheus)");

    // Prometheus scrapes the fleet before the run starts, so that the runner's /metrics, which
    // lives only as long as the run, is scraped several times (two at concurrency 2 keeps the
    // demo's tasks running for seconds on a fast build).
    wait_for(
        "Prometheus listening",
        Duration::from_secs(60),
        async || {
            tokio::net::TcpStream::connect(("127.0.0.1", port))
                .await
                .is_ok()
        },
    )
    .await;
    wait_for("every target up", Duration::from_secs(60), async || {
        let up = query(&prometheus, "up{job!=\"runner\"} == 1").await;
        up.len() == 4
    })
    .await;
    // Load: the demo's tasks through the fleet's gateway.
    let demo = Path::new(env!("CARGO_MANIFEST_DIR")).join("../services/head/demo");
    succeeded(
        clean("nomad")
            .env("NOMAD_OTEL_PROMETHEUS_LISTEN", &runner)
            .args(["run", "--concurrency", "2", "--fleet"])
            .arg(&fleet_path)
            .arg("--tasks")
            .arg(demo.join("tasks.jsonl"))
            .arg("--template")
            .arg(demo.join("agent.py"))
            .arg("--out")
            .arg(dir.join("results.jsonl")),
    )
    .await;

    // The scheduler's request counter reaches what the run sent (scraped after it ended).
    wait_for(
        "the run's requests in Prometheus",
        Duration::from_secs(60),
        async || {
            let series = query(
                &prometheus,
                "sum(nomad_tool_requests_total{job=\"scheduler\"})",
            )
            .await;
            series.first().is_some_and(|s| value(s) >= 20.0)
        },
    )
    .await;
    for promql in [
        "nomad_tool_request_duration_seconds_bucket{job=\"scheduler\"}",
        "nomad_tool_request_duration_seconds_sum{job=\"scheduler\"}",
        "nomad_tool_request_duration_seconds_count{job=\"scheduler\"}",
        "nomad_tool_batch_size_bucket{job=\"scheduler\"}",
        "nomad_tool_queue_length{job=\"scheduler\"}",
        "nomad_gateway_requests_total{job=\"gateway\"}",
        "nomad_gateway_sandbox_duration_seconds_count{job=\"gateway\"}",
        // The head of `nomad up` supervises (the rollouts ran in `nomad run`).
        "nomad_servers_active{job=\"head\",server_type=\"gateway\"}",
        "nomad_server_memory_usage_bytes{job=\"head\",server=\"scheduler\"}",
        "nomad_device_memory_allocated_bytes{job=\"scheduler\",nomad_worker_id=\"worker-0\"}",
        "process_memory_usage_bytes{job=\"device-worker-0\"}",
        "target_info{job=\"scheduler\",service_name=\"nomad/scheduler\"}",
    ] {
        let series = query(&prometheus, promql).await;
        assert!(!series.is_empty(), "no series for {promql}");
    }

    // Every panel of the shipped Grafana dashboard has data.
    let dashboard: Value = serde_json::from_str(
        &std::fs::read_to_string(
            Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy/grafana/nomad.json"),
        )
        .unwrap(),
    )
    .unwrap();
    let panels = dashboard["panels"].as_array().unwrap();
    assert!(panels.len() >= 12);
    for panel in panels {
        for target in panel["targets"].as_array().unwrap() {
            let promql = target["expr"].as_str().unwrap();
            let title = panel["title"].as_str().unwrap();
            wait_for(
                &format!("panel {title:?}: {promql}"),
                Duration::from_secs(30),
                async || !query(&prometheus, promql).await.is_empty(),
            )
            .await;
        }
    }

    // Types as Prometheus understood them from each endpoint.
    let metadata = get(&format!("{prometheus}/api/v1/metadata")).await;
    let kind = |name: &str| {
        metadata["data"][name][0]["type"]
            .as_str()
            .map(str::to_owned)
    };
    assert_eq!(
        kind("nomad_tool_requests_total").as_deref(),
        Some("counter"),
        "{metadata}"
    );
    assert_eq!(
        kind("nomad_tool_request_duration_seconds").as_deref(),
        Some("histogram")
    );
    assert_eq!(kind("nomad_tool_queue_length").as_deref(), Some("gauge"));
    assert_eq!(
        kind("nomad_gateway_requests_total").as_deref(),
        Some("counter")
    );

    // SIGTERM stops the fleet (and with it every endpoint).
    send_signal(up.id().unwrap(), libc::SIGTERM);
    let status = tokio::time::timeout(Duration::from_secs(60), up.wait())
        .await
        .unwrap()
        .unwrap();
    assert!(status.success());
    for address in targets.values() {
        assert!(
            nomad_integration_tests::http()
                .build()
                .unwrap()
                .get(format!("http://{}/metrics", address.as_str().unwrap()))
                .send()
                .await
                .is_err(),
            "{address} still serves after the fleet stopped"
        );
    }
    std::fs::remove_dir_all(&dir).ok();
}

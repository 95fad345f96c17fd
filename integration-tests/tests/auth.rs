//! Fleet trust: every hop needs the fleet's token, workers are who they say, and nothing listens
//! beyond loopback without a credential.

use std::time::{Duration, Instant};

use nomad_integration_tests::assert_status;
use nomad_integration_tests::fleet::{TEST_TOKEN, rpc_channel};
use nomad_integration_tests::process::send_signal;
use nomad_integration_tests::process::{clean, listening, refused_saying, wait_for_file};
use nomad_integration_tests::{Fleet, FleetOptions, OtlpReceiver};
use nomad_proto::v1::device_worker_client::DeviceWorkerClient;
use nomad_proto::v1::gateway_client::GatewayClient;
use nomad_proto::v1::head_client::HeadClient;
use nomad_proto::v1::scheduler_client::SchedulerClient;
use nomad_proto::v1::{
    DeviceInfo, GetRunRequest, ListToolsRequest, RegisterWorkerRequest, SearchToolsRequest,
    StatsRequest,
};
use tonic::Code;
use tonic::service::interceptor::InterceptedService;
use tonic::transport::Channel;

/// A plain channel whose calls carry `token` (or no authorization at all).
async fn dial(
    address: &str,
    token: Option<&'static str>,
) -> InterceptedService<Channel, impl tonic::service::Interceptor + Clone> {
    dial_with(address, token, Vec::new()).await
}

/// As [`dial`], every call also carrying `headers` (trace context, baggage).
async fn dial_with(
    address: &str,
    token: Option<&'static str>,
    headers: Vec<(&'static str, String)>,
) -> InterceptedService<Channel, impl tonic::service::Interceptor + Clone> {
    let channel = Channel::from_shared(format!("http://{}", address.trim_start_matches("http://")))
        .unwrap()
        .connect()
        .await
        .unwrap();
    InterceptedService::new(channel, move |mut request: tonic::Request<()>| {
        if let Some(token) = token {
            request
                .metadata_mut()
                .insert("authorization", format!("Bearer {token}").parse().unwrap());
        }
        for (key, value) in &headers {
            request.metadata_mut().insert(*key, value.parse().unwrap());
        }
        Ok(request)
    })
}

/// The status code of a call, `Ok` mapped to `None`.
fn code<T>(result: Result<T, tonic::Status>) -> Option<tonic::Code> {
    result.err().map(|s| s.code())
}

const WRONG: &str = "wrong-token-0123456789abcdef012";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_service_refuses_calls_without_the_fleets_token() {
    let mut fleet = Fleet::start(FleetOptions {
        auth: true,
        ..Default::default()
    })
    .await;
    let head = fleet.start_head_server().await;
    let workers = fleet.workers().await;
    let worker = workers[0].address.clone();

    for (token, expected) in [
        (None, Some(Code::Unauthenticated)),
        (Some(WRONG), Some(Code::Unauthenticated)),
        (Some(TEST_TOKEN), None),
    ] {
        let who = format!("{token:?}");
        let scheduler = SchedulerClient::new(dial(&fleet.scheduler_addr, token).await)
            .list_tools(ListToolsRequest {})
            .await;
        assert_eq!(code(scheduler), expected, "scheduler, {who}");
        let stats = DeviceWorkerClient::new(dial(&worker, token).await)
            .stats(StatsRequest {})
            .await;
        assert_eq!(code(stats), expected, "worker, {who}");
        let search = GatewayClient::new(dial(&fleet.gateway_addr, token).await)
            .search_tools(SearchToolsRequest::default())
            .await;
        assert_eq!(code(search), expected, "gateway, {who}");
        let run = HeadClient::new(dial(&head, token).await)
            .get_run(GetRunRequest {
                run_id: "nope".into(),
            })
            .await;
        let head_expected = expected.or(Some(Code::NotFound));
        assert_eq!(code(run), head_expected, "head, {who}");
    }
    // Health checks stay open.
    for address in [&fleet.scheduler_addr, &worker, &fleet.gateway_addr, &head] {
        let mut health =
            tonic_health::pb::health_client::HealthClient::new(dial(address, None).await);
        let reply = health
            .check(tonic_health::pb::HealthCheckRequest::default())
            .await
            .unwrap();
        assert_eq!(reply.get_ref().status, 1, "{address} is not serving");
    }

    // A worker without the token cannot register: the fleet keeps its one worker.
    let dir = Fleet::new_dir();
    let log = dir.join("stranger.stderr");
    let mut stranger = clean("nomad-device-worker")
        .args(["--backend", "sim", "--worker-id", "stranger", "--scheduler"])
        .arg(&fleet.scheduler_addr)
        .stderr(std::fs::File::create(&log).unwrap())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(20);
    let said = loop {
        let text = std::fs::read_to_string(&log).unwrap_or_default();
        if text.contains("cannot register with the scheduler") {
            break text;
        }
        assert!(
            Instant::now() < deadline,
            "the stranger never tried: {text}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert!(said.contains("requires its bearer token"), "{said}");
    let ids: Vec<String> = fleet
        .workers()
        .await
        .into_iter()
        .map(|w| w.worker_id)
        .collect();
    assert_eq!(ids, ["worker-0"]);
    let _ = stranger.start_kill();

    // An impostor with the token still cannot take a live worker's id.
    let impostor = SchedulerClient::new(rpc_channel(&fleet.scheduler_addr))
        .register_worker(RegisterWorkerRequest {
            worker_id: "worker-0".into(),
            address: "127.0.0.1:1".into(),
            device: Some(DeviceInfo::default()),
        })
        .await
        .unwrap_err();
    assert_status(&impostor, Code::AlreadyExists, "still heartbeating");
    let after = fleet.workers().await;
    assert_eq!(
        after[0].address, workers[0].address,
        "the real worker stays registered"
    );
    let run = fleet
        .run_head(&nomad_integration_tests::fleet::mlp_tasks(4), 2)
        .await;
    assert!(run.success, "{}", run.stderr);
    fleet.terminate().await;
    let _ = std::fs::remove_dir_all(dir);
}

/// A call refused for want of the token leaves no span: the trace id, parent, run id and
/// rollout id its caller sent reach no exporter. The open health check carries none of them, and
/// a health stream (`Watch`, held open as long as the caller likes) needs the token.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_call_records_no_span_and_health_streams_need_the_token() {
    use tonic_health::pb::HealthCheckRequest;
    use tonic_health::pb::health_client::HealthClient;
    let receiver = OtlpReceiver::grpc().await;
    let mut fleet = Fleet::start(
        FleetOptions {
            auth: true,
            ..Default::default()
        }
        .exporting_to(&receiver),
    )
    .await;
    const FORGED: &str = "4bf92f3577b34da6a3ce929d0e0e4736";
    const HONEST: &str = "0af7651916cd43dd8448eb211c80319c";
    let context = |trace: &str, run: &str| {
        vec![
            ("traceparent", format!("00-{trace}-00f067aa0ba902b7-01")),
            ("baggage", format!("nomad.run.id={run},nomad.rollout.id=r1")),
        ]
    };
    for token in [None, Some(WRONG)] {
        let listed = SchedulerClient::new(
            dial_with(&fleet.scheduler_addr, token, context(FORGED, "victim-run")).await,
        )
        .list_tools(ListToolsRequest {})
        .await;
        assert_eq!(code(listed), Some(Code::Unauthenticated));
        let searched = GatewayClient::new(
            dial_with(&fleet.gateway_addr, token, context(FORGED, "victim-run")).await,
        )
        .search_tools(SearchToolsRequest::default())
        .await;
        assert_eq!(code(searched), Some(Code::Unauthenticated));
    }
    let checked = HealthClient::new(
        dial_with(&fleet.scheduler_addr, None, context(FORGED, "victim-run")).await,
    )
    .check(HealthCheckRequest::default())
    .await;
    assert_eq!(code(checked), None, "the health check stays open");
    // The token holder's call is traced under the context it sent.
    let listed = SchedulerClient::new(
        dial_with(
            &fleet.scheduler_addr,
            Some(TEST_TOKEN),
            context(HONEST, "own-run"),
        )
        .await,
    )
    .list_tools(ListToolsRequest {})
    .await;
    assert_eq!(code(listed), None);
    let spans = receiver
        .wait_for_spans(Duration::from_secs(30), |spans| {
            spans.iter().any(|s| s.trace_id == HONEST)
        })
        .await;
    assert!(
        spans.iter().any(|s| s.trace_id == HONEST
            && s.name.contains("ListTools")
            && s.attr("nomad.run.id") == Some("own-run")),
        "the accepted call's span never came (or without its run id)"
    );
    let forged: Vec<_> = spans
        .iter()
        .filter(|s| s.trace_id == FORGED || s.attr("nomad.run.id") == Some("victim-run"))
        .map(|s| format!("{} ({})", s.name, s.service_name))
        .collect();
    assert!(
        forged.is_empty(),
        "spans under the forged context: {forged:?}"
    );

    // Watch: refused without the token, served with it.
    let watched = HealthClient::new(dial(&fleet.scheduler_addr, None).await)
        .watch(HealthCheckRequest::default())
        .await;
    assert_eq!(code(watched), Some(Code::Unauthenticated));
    let mut stream = HealthClient::new(dial(&fleet.scheduler_addr, Some(TEST_TOKEN)).await)
        .watch(HealthCheckRequest::default())
        .await
        .unwrap()
        .into_inner();
    let first = stream.message().await.unwrap().unwrap();
    assert_eq!(first.status, 1, "the scheduler is not serving");
    // An open stream would hold the server's graceful drain.
    drop(stream);
    fleet.terminate().await;
}

#[tokio::test]
async fn nothing_listens_beyond_loopback_without_a_credential_unless_auth_none() {
    let dir = Fleet::new_dir();
    refused_saying(
        clean("nomad-scheduler").args(["--listen", "0.0.0.0:0"]),
        &["no credential", "NOMAD_AUTH_TOKEN"],
    )
    .await;

    let config = dir.join("nomad.yaml");
    std::fs::write(&config, "auth: none\n").unwrap();
    let mut command = clean("nomad-scheduler");
    command.arg("--config").arg(&config);
    let (mut open, _) = listening(command, "0.0.0.0:0", &dir, "open", false).await;
    let said = std::fs::read_to_string(dir.join("open.stderr")).unwrap();
    assert!(said.contains("NO CREDENTIAL (auth: none)"), "{said}");
    let _ = open.start_kill();

    // /metrics: beyond loopback without a token, the server does not start.
    refused_saying(
        clean("nomad-scheduler")
            .env("NOMAD_OTEL_PROMETHEUS_LISTEN", "0.0.0.0:0")
            .args(["--listen", "127.0.0.1:0"]),
        &["prometheus_listen", "no credential"],
    )
    .await;
    // With a token, every scrape needs it, on loopback as beyond it (any local user reaches a
    // loopback port); without one, loopback is open.
    for (host, token, open) in [
        ("0.0.0.0", Some(TEST_TOKEN), false),
        ("127.0.0.1", Some(TEST_TOKEN), false),
        ("127.0.0.1", None, true),
    ] {
        let port = std::net::TcpListener::bind(format!("{host}:0"))
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let mut command = clean("nomad-scheduler");
        if let Some(token) = token {
            command.env("NOMAD_AUTH_TOKEN", token);
        }
        command.env("NOMAD_OTEL_PROMETHEUS_LISTEN", format!("{host}:{port}"));
        let stem = format!("metrics-{port}");
        let (mut scraped, _) = listening(command, "127.0.0.1:0", &dir, &stem, false).await;
        let url = format!("http://127.0.0.1:{port}/metrics");
        let client = nomad_integration_tests::http().build().unwrap();
        for (authorization, expected) in [
            (None, if open { 200 } else { 401 }),
            (
                Some(format!("Bearer {WRONG}")),
                if open { 200 } else { 401 },
            ),
            (Some(format!("Bearer {TEST_TOKEN}")), 200),
        ] {
            let mut request = client.get(&url);
            if let Some(value) = &authorization {
                request = request.header("authorization", value);
            }
            let response = request.send().await.unwrap();
            let status = response.status().as_u16();
            let body = response.text().await.unwrap();
            assert_eq!(
                status, expected,
                "{host}, token {token:?}, {authorization:?}: {body}"
            );
            assert_eq!(
                body.contains("target_info"),
                expected == 200,
                "{host}, token {token:?}, {authorization:?}: {body}"
            );
        }
        let _ = scraped.start_kill();
    }

    // A token that is too short to be a credential is refused at start-up.
    refused_saying(
        clean("nomad-scheduler")
            .env("NOMAD_AUTH_TOKEN", "short")
            .args(["--listen", "127.0.0.1:0"]),
        &["at least 16"],
    )
    .await;

    // A run id that is not a plain name never reaches the filesystem.
    refused_saying(
        clean("nomad")
            .args(["up", "--workers", "1", "--runs-dir"])
            .arg(dir.join("runs"))
            .env("NOMAD_OTEL_RUN_ID", "../x"),
        &["run id \"../x\"", "1 to 64"],
    )
    .await;
    assert!(!dir.join("x").exists() && !dir.join("runs").exists());
    let _ = std::fs::remove_dir_all(dir);
}

/// One OTLP trace export request with a span of `name` (the collector writes its name).
fn export_request(
    name: &str,
) -> opentelemetry_proto::tonic::collector::trace::v1::ExportTraceServiceRequest {
    use opentelemetry_proto::tonic::trace::v1::{ResourceSpans, ScopeSpans, Span};
    opentelemetry_proto::tonic::collector::trace::v1::ExportTraceServiceRequest {
        resource_spans: vec![ResourceSpans {
            scope_spans: vec![ScopeSpans {
                spans: vec![Span {
                    trace_id: vec![7; 16],
                    span_id: vec![9; 8],
                    name: name.into(),
                    ..Default::default()
                }],
                ..Default::default()
            }],
            ..Default::default()
        }],
    }
}

/// `nomad collect` (a Slurm job's collector) listens beyond loopback only with the token, and
/// every export must carry it: without it, OTLP/HTTP answers 401 and OTLP/gRPC UNAUTHENTICATED,
/// and nothing of the forged spans reaches `traces.jsonl`; the token holder's spans do.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_collector_writes_only_what_the_token_holder_exports() {
    use opentelemetry_proto::tonic::collector::trace::v1::trace_service_client::TraceServiceClient;
    use prost::Message as _;
    let dir = Fleet::new_dir();
    refused_saying(
        clean("nomad")
            .args(["collect", "--out"])
            .arg(dir.join("open"))
            .args(["--listen", "0.0.0.0:0", "--http-listen", "127.0.0.1:0"]),
        &["nomad collect --listen", "no credential"],
    )
    .await;

    let out = dir.join("otel");
    let (grpc_file, http_file, log) = (
        dir.join("collect.addr"),
        dir.join("collect-http.addr"),
        dir.join("collect.stderr"),
    );
    let mut collector = clean("nomad")
        .env("NOMAD_AUTH_TOKEN", TEST_TOKEN)
        .args(["collect", "--out"])
        .arg(&out)
        .args(["--listen", "0.0.0.0:0", "--http-listen", "0.0.0.0:0"])
        .arg("--addr-file")
        .arg(&grpc_file)
        .arg("--http-addr-file")
        .arg(&http_file)
        .args(["--quiet-seconds", "0.2"])
        .stderr(std::fs::File::create(&log).unwrap())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let port = |bound: String| bound.rsplit_once(':').unwrap().1.to_owned();
    let grpc = format!(
        "127.0.0.1:{}",
        port(wait_for_file(&grpc_file, &mut collector, "nomad collect", &log).await)
    );
    let http = format!(
        "http://127.0.0.1:{}/v1/traces",
        port(wait_for_file(&http_file, &mut collector, "nomad collect", &log).await)
    );

    let client = nomad_integration_tests::http().build().unwrap();
    for (token, name, expected) in [
        (None, "forged.http.none", 401),
        (Some(WRONG), "forged.http.wrong", 401),
        (Some(TEST_TOKEN), "honest.http", 200),
    ] {
        let mut request = client
            .post(&http)
            .header("content-type", "application/x-protobuf")
            .body(export_request(name).encode_to_vec());
        if let Some(token) = token {
            request = request.header("authorization", format!("Bearer {token}"));
        }
        let response = request.send().await.unwrap();
        let status = response.status().as_u16();
        let body = response.text().await.unwrap_or_default();
        assert_eq!(status, expected, "{name}: {body}");
        if expected == 401 {
            assert!(body.contains("bearer token"), "{name}: {body}");
        }
    }
    for (token, name, expected) in [
        (None, "forged.grpc.none", Some(Code::Unauthenticated)),
        (
            Some(WRONG),
            "forged.grpc.wrong",
            Some(Code::Unauthenticated),
        ),
        (Some(TEST_TOKEN), "honest.grpc", None),
    ] {
        let exported = TraceServiceClient::new(dial(&grpc, token).await)
            .export(export_request(name))
            .await;
        assert_eq!(code(exported), expected, "{name}");
    }

    // SIGTERM: the collector writes out what it took and stops.
    send_signal(collector.id().unwrap(), libc::SIGTERM);
    let status = tokio::time::timeout(Duration::from_secs(30), collector.wait())
        .await
        .expect("nomad collect stops on SIGTERM")
        .unwrap();
    assert!(
        status.success(),
        "{}",
        std::fs::read_to_string(&log).unwrap()
    );
    let traces = std::fs::read_to_string(out.join("traces.jsonl")).unwrap();
    assert!(
        traces.contains("honest.http") && traces.contains("honest.grpc"),
        "{traces}"
    );
    assert!(!traces.contains("forged"), "{traces}");
    let _ = std::fs::remove_dir_all(dir);
}

//! The serving path's behaviour at its edges: bad task inputs, health and reflection.

use std::time::Duration;

use nomad_integration_tests::{Fleet, FleetOptions, assert_status, finished_run};
use serde_json::json;
use tonic::Code;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_task_inputs_fail_their_own_rollout_with_a_clear_message() {
    let mut fleet = Fleet::start(FleetOptions::default()).await;
    let tasks = vec![
        json!({"id": "good", "tool": "mlp", "arguments": {"input": [0.1, 0.2, 0.3, 0.4, 0.5, 0.6]}}),
        json!({"id": "short", "tool": "mlp", "arguments": {"input": [0.1, 0.2]}}),
        json!({"id": "text", "tool": "mlp", "arguments": {"text": "password=hunter2 my private prompt"}}),
        json!({"id": "unknown", "tool": "nope", "arguments": {"input": [1.0]}}),
        json!({"id": "no-args", "tool": "mlp", "arguments": {}}),
        json!({"id": "server", "server": "elsewhere", "tool": "mlp", "arguments": {"input": [1.0]}}),
    ];
    let run = fleet.run_head(&tasks, 3).await;
    assert_eq!(run.code, Some(1), "failed rollouts exit 1: {}", run.stderr);
    let by_id = |id: &str| {
        run.results
            .iter()
            .find(|r| r["task_id"] == id)
            .unwrap_or_else(|| panic!("no result for {id}"))
            .clone()
    };
    assert_eq!(by_id("good")["status"], "ok");
    for (id, expected) in [
        ("short", "expected shape [6], got [2]"),
        (
            "text",
            "mlp takes `input` (an array of numbers), not `text`",
        ),
        (
            "unknown",
            "unknown tool \"nope\"; this scheduler serves: mlp",
        ),
        ("no-args", "arguments need `input` (an array of numbers)"),
        ("server", "unknown upstream server \"elsewhere\""),
    ] {
        let result = by_id(id);
        assert_eq!(result["status"], "error", "{result}");
        let error = result["error"].as_str().unwrap();
        assert!(error.contains(expected), "{id}: {error}");
    }
    fleet.terminate().await;
    // The gateway's log names a failed call's argument keys and size, never their values.
    let log = fleet.stderr(nomad_integration_tests::Service::Gateway);
    assert!(log.contains("upstream call failed"), "{log}");
    assert!(log.contains("keys [text]"), "{log}");
    assert!(
        !log.contains("hunter2") && !log.contains("private prompt"),
        "{log}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_service_answers_health_and_reflection() {
    use tonic_health::pb::HealthCheckRequest;
    use tonic_health::pb::health_client::HealthClient;
    use tonic_reflection::pb::v1::ServerReflectionRequest;
    use tonic_reflection::pb::v1::server_reflection_client::ServerReflectionClient;
    use tonic_reflection::pb::v1::server_reflection_request::MessageRequest;
    use tonic_reflection::pb::v1::server_reflection_response::MessageResponse;

    let mut fleet = Fleet::start(FleetOptions::default()).await;
    let head = fleet.start_head_server().await;
    let worker = std::fs::read_to_string(fleet.dir.join("device-worker.addr")).unwrap();
    for (addr, service) in [
        (fleet.scheduler_addr.clone(), "nomad.v1.Scheduler"),
        (fleet.gateway_addr.clone(), "nomad.v1.Gateway"),
        (worker.trim().to_owned(), "nomad.v1.DeviceWorker"),
        (head, "nomad.v1.Head"),
    ] {
        let channel = tonic::transport::Channel::from_shared(format!("http://{addr}"))
            .unwrap()
            .connect()
            .await
            .unwrap();
        let health = HealthClient::new(channel.clone())
            .check(HealthCheckRequest {
                service: String::new(),
            })
            .await
            .unwrap()
            .into_inner();
        assert_eq!(health.status, 1, "{addr} not SERVING");

        let mut reflection = ServerReflectionClient::new(channel);
        let request = ServerReflectionRequest {
            host: String::new(),
            message_request: Some(MessageRequest::ListServices(String::new())),
        };
        let mut responses = reflection
            .server_reflection_info(futures::stream::iter(vec![request]))
            .await
            .unwrap()
            .into_inner();
        let response = responses.message().await.unwrap().unwrap();
        let Some(MessageResponse::ListServicesResponse(list)) = response.message_response else {
            panic!("unexpected reflection response");
        };
        let names: Vec<String> = list.service.into_iter().map(|s| s.name).collect();
        assert!(names.contains(&service.to_owned()), "{addr}: {names:?}");
        assert!(
            names.contains(&"grpc.health.v1.Health".to_owned()),
            "{names:?}"
        );
    }
    fleet.terminate().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn head_server_starts_runs_and_reports_them() {
    use nomad_integration_tests::fleet::mlp_tasks;
    use nomad_proto::v1::head_client::HeadClient;
    use nomad_proto::v1::{GetRunRequest, StartRunRequest};

    let mut fleet = Fleet::start(FleetOptions::default()).await;
    let addr = fleet.start_head_server().await;
    let mut head = HeadClient::connect(format!("http://{addr}")).await.unwrap();

    let mut tasks: Vec<String> = mlp_tasks(3).iter().map(|t| t.to_string()).collect();
    tasks.push("{\"id\":\"x\"".into());
    let err = head
        .start_run(StartRunRequest {
            tasks_json: tasks.clone(),
            concurrency: 2,
        })
        .await
        .unwrap_err();
    assert_status(&err, Code::InvalidArgument, "tasks_json[3]");

    // Bounds: tasks per run (counted before any is parsed) and concurrency.
    for (tasks_json, concurrency, limit) in [
        (vec!["{}".to_owned(); 100_000], 1, "head.max_tasks_per_run"),
        (tasks[..3].to_vec(), 100_000, "head.max_concurrency"),
    ] {
        let refused = head
            .start_run(StartRunRequest {
                tasks_json,
                concurrency,
            })
            .await
            .unwrap_err();
        assert_eq!(refused.code(), Code::ResourceExhausted, "{limit}");
        assert!(refused.message().contains(limit), "{}", refused.message());
    }

    tasks.pop();
    let run_id = head
        .start_run(StartRunRequest {
            tasks_json: tasks,
            concurrency: 2,
        })
        .await
        .unwrap()
        .into_inner()
        .run_id;
    let within = (Duration::from_secs(30), Duration::from_millis(20));
    let run = finished_run(&mut head, &run_id, within, |_| {}).await;
    assert_eq!((run.total, run.succeeded, run.failed), (3, 3, 0));
    assert_eq!(run.results_json.len(), 3);
    let on_disk = std::fs::read_to_string(&run.results_path).unwrap();
    assert_eq!(on_disk.lines().count(), 3, "{}", run.results_path);
    assert!(
        run.results_path
            .starts_with(&fleet.dir.display().to_string())
    );
    for line in &run.results_json {
        let result: serde_json::Value = serde_json::from_str(line).unwrap();
        assert_eq!(result["run_id"], run_id.as_str());
        assert_eq!(result["output"]["shape"], json!([4]));
    }
    let missing = head
        .get_run(GetRunRequest {
            run_id: "nope".into(),
        })
        .await
        .unwrap_err();
    assert_eq!(missing.code(), Code::NotFound);
    fleet.terminate().await;
}

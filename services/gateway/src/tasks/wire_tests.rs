//! The task manager end to end over an in-memory store: every handle and `tasks/get` result it
//! makes checked against the extension's published JSON schema (`schema/`), and a cancel that
//! really drops the call.

use std::sync::atomic::{AtomicBool, Ordering};

use rmcp::model::{CallToolResult, ContentBlock};
use serde_json::{Value, json};

use super::*;

const SCHEMA: &str = include_str!("schema/ext-tasks.schema.json");

/// Checks `value` against the schema's definition `name`; panics naming every violation.
fn assert_valid(name: &str, value: &Value) {
    let mut schema: Value = serde_json::from_str(SCHEMA).unwrap();
    assert!(schema["$defs"][name].is_object(), "no definition {name}");
    schema["$ref"] = json!(format!("#/$defs/{name}"));
    let validator = jsonschema::validator_for(&schema).unwrap();
    let errors: Vec<String> = validator
        .iter_errors(value)
        .map(|e| format!("{} at {}", e, e.instance_path()))
        .collect();
    assert!(
        errors.is_empty(),
        "{name}: {value:#}\n{}",
        errors.join("\n")
    );
}

fn tasks(config: TasksConfig) -> Arc<Tasks> {
    Tasks::open(config, None).unwrap()
}

fn alice() -> Caller {
    Caller::with_token(Some("aaaaaaaaaaaaaaaaaaaa"))
}

async fn wait_for(tasks: &Arc<Tasks>, id: &str, status: &str) -> Value {
    for _ in 0..200 {
        let got = serde_json::to_value(tasks.get(&alice(), id.to_owned()).await.unwrap()).unwrap();
        if got["status"] == status {
            return got;
        }
        tokio::time::sleep(std::time::Duration::from_millis(10)).await;
    }
    panic!("task {id} never became {status}");
}

#[tokio::test]
async fn handles_and_results_match_the_published_schema() {
    let tasks = tasks(TasksConfig::default());
    let (release, released) = tokio::sync::oneshot::channel::<()>();
    let handle = tasks
        .start(&alice(), "slow", &Context::new(), |_| {
            Box::pin(async move {
                let _ = released.await;
                Ok(CallToolResult::structured(json!({"norm": 1.5})))
            })
        })
        .await
        .unwrap();
    let handle = serde_json::to_value(&handle).unwrap();
    assert_valid("CreateTaskResult", &handle);
    assert_eq!(handle["resultType"], "task");
    assert_eq!(handle["status"], "working");
    assert_eq!(handle["ttlMs"], 3_600_000);
    // The schema is live: a handle without its TTL is not one.
    let mut broken = handle.clone();
    broken.as_object_mut().unwrap().remove("ttlMs");
    assert!(std::panic::catch_unwind(|| assert_valid("CreateTaskResult", &broken)).is_err());
    let id = handle["taskId"].as_str().unwrap().to_owned();

    let working = wait_for(&tasks, &id, "working").await;
    assert_valid("GetTaskResult", &working);
    assert_valid("WorkingTask", &working);
    release.send(()).unwrap();
    let completed = wait_for(&tasks, &id, "completed").await;
    assert_valid("GetTaskResult", &completed);
    assert_valid("CompletedTask", &completed);
    assert_eq!(completed["resultType"], "complete");
    assert_eq!(
        completed["result"]["structuredContent"],
        json!({"norm": 1.5})
    );

    // A JSON-RPC error inline, as a failed task.
    let handle = tasks
        .start(&alice(), "slow", &Context::new(), |_| {
            Box::pin(async { Err(McpError::invalid_params("values: too short", None)) })
        })
        .await
        .unwrap();
    let failed = wait_for(&tasks, &handle.task.task_id, "failed").await;
    assert_valid("GetTaskResult", &failed);
    assert_valid("FailedTask", &failed);
    assert_eq!(failed["error"]["code"], -32602);
    assert_eq!(failed["statusMessage"], "values: too short");

    // The cancel acknowledgement.
    let ack = serde_json::to_value(rmcp::model::TaskAckResult::new()).unwrap();
    assert_valid("CancelTaskResult", &ack);
}

#[tokio::test]
async fn a_cancel_drops_the_call_and_reads_cancelled_for_its_owner_only() {
    let tasks = tasks(TasksConfig::default());
    let dropped = Arc::new(AtomicBool::new(false));
    struct Guard(Arc<AtomicBool>);
    impl Drop for Guard {
        fn drop(&mut self) {
            self.0.store(true, Ordering::SeqCst);
        }
    }
    let guard = Guard(dropped.clone());
    let handle = tasks
        .start(&alice(), "slow", &Context::new(), move |_| {
            Box::pin(async move {
                let _guard = guard;
                std::future::pending::<()>().await;
                Ok(CallToolResult::success(vec![ContentBlock::text("never")]))
            })
        })
        .await
        .unwrap();
    let id = handle.task.task_id;
    let mallory = Caller::with_token(Some("mmmmmmmmmmmmmmmmmmmm"));
    let e = tasks.get(&mallory, id.clone()).await.unwrap_err();
    assert_eq!(e.code, rmcp::model::ErrorCode::INVALID_PARAMS);
    assert!(e.message.contains("another credential"), "{}", e.message);
    assert!(tasks.cancel(&mallory, id.clone()).await.is_err());
    assert!(!dropped.load(Ordering::SeqCst));

    tasks.cancel(&alice(), id.clone()).await.unwrap();
    let cancelled = wait_for(&tasks, &id, "cancelled").await;
    assert_valid("CancelledTask", &cancelled);
    for _ in 0..100 {
        if dropped.load(Ordering::SeqCst) {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(10)).await;
    }
    assert!(
        dropped.load(Ordering::SeqCst),
        "the call went on after its cancel"
    );
    // Cancelling what ended is acknowledged and changes nothing.
    tasks.cancel(&alice(), id.clone()).await.unwrap();
    let again = wait_for(&tasks, &id, "cancelled").await;
    assert_eq!(again["status"], "cancelled");
}

#[tokio::test]
async fn a_full_store_refuses_a_task_by_name() {
    let tasks = tasks(TasksConfig {
        max_tasks: 1,
        ..TasksConfig::default()
    });
    let forever = |_| -> Work { Box::pin(std::future::pending()) };
    tasks
        .start(&alice(), "slow", &Context::new(), forever)
        .await
        .unwrap();
    let e = tasks
        .start(&alice(), "slow", &Context::new(), forever)
        .await
        .unwrap_err();
    assert!(
        e.message.contains("gateway.tasks.max_tasks is 1"),
        "{}",
        e.message
    );
    assert_eq!(
        e.data.unwrap()[crate::tool_error::ERROR_CODE_META],
        "RESOURCE_EXHAUSTED"
    );
}

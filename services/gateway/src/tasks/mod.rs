//! MCP Tasks (the `io.modelcontextprotocol/tasks` extension) on every MCP front of the gateway:
//! a `tools/call` from a client that declares the extension is answered at once with a task
//! handle, once the task is in the store; the call runs on, and the client reads its outcome
//! with `tasks/get` or stops it with `tasks/cancel` (which drops the call: a fleet request
//! leaves the scheduler's queue or batch, a sandboxed run is killed). A client that does not
//! declare the extension gets the result inline, as before.
//!
//! Each task is a span (`nomad.gateway.task`) under the `tools/call` that made it, with the
//! call's own spans beneath; polls make none. Its life is counted (`nomad.gateway.tasks.*`).

mod caller;
mod links;
pub mod store;

use crate::lock::lock;
use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};

use futures::future::BoxFuture;
use nomad_telemetry::metrics as defs;
use nomad_telemetry::{Context, GroupSpan, KeyValue, SpanGroup};
use opentelemetry::metrics::Counter;
use rmcp::model::{
    CallToolResult, CreateTaskResult, DetailedTask, GetTaskResult, JsonObject, Task, TaskPayload,
    TaskStatus,
};
use rmcp::service::RequestContext;
use rmcp::{ErrorData as McpError, RoleServer};
use serde::Deserialize;
use tokio_util::sync::CancellationToken;

pub use caller::Caller;
use store::{Cancelled, Limits, Outcome, Removed, Status, Store, StoreError};

/// `gateway.tasks`: when calls become tasks and what the store keeps.
#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct TasksConfig {
    /// Answer `tools/call` with a task for clients that declare the extension.
    pub enabled: bool,
    /// The store's file; unset: `tasks.sqlite` in the run directory (`nomad up` and `nomad
    /// serve` give the gateway one), else in memory, gone at a stop.
    pub path: Option<PathBuf>,
    /// How long a finished task's outcome is kept for `tasks/get`.
    pub ttl_seconds: f64,
    /// Tasks held at once, working or finished; a new one past it first evicts finished ones
    /// (oldest first), and is refused when every one is working.
    pub max_tasks: u64,
    /// Bytes of outcomes held at once, evicted and refused as `max_tasks`.
    pub max_bytes: u64,
    /// How often a client is asked to poll (`pollIntervalMs`).
    pub poll_interval_ms: u64,
    /// Tools always answered inline (quick ones, where a task only adds a round trip).
    pub inline_tools: Vec<String>,
    /// A result larger than this (bytes of its JSON or text) is kept here and answered as a
    /// `resource_link`, read with `resources/read`; `null` or 0: always inline.
    pub link_results_over_bytes: Option<u64>,
}

impl Default for TasksConfig {
    fn default() -> Self {
        Self {
            enabled: true,
            path: None,
            ttl_seconds: 3600.0,
            max_tasks: 1024,
            max_bytes: 256 << 20,
            poll_interval_ms: 1000,
            inline_tools: vec!["search_code_tools".into(), "get_model_card".into()],
            link_results_over_bytes: Some(1 << 20),
        }
    }
}

impl TasksConfig {
    fn limits(&self) -> Result<Limits, String> {
        let ttl = nomad_config::seconds("gateway.tasks.ttl_seconds", self.ttl_seconds)?;
        if self.max_tasks == 0 || self.max_bytes < store::ROW_BYTES {
            return Err(format!(
                "gateway.tasks.max_tasks must be at least 1 and max_bytes at least {}",
                store::ROW_BYTES
            ));
        }
        if self.poll_interval_ms == 0 {
            return Err("gateway.tasks.poll_interval_ms must be at least 1".into());
        }
        Ok(Limits {
            ttl_ms: ttl.as_millis() as u64,
            max_tasks: self.max_tasks,
            max_bytes: self.max_bytes,
        })
    }
}

/// What every MCP front of the gateway declares: tools, the tasks extension, and resources
/// (linked results are read as resources).
pub fn capabilities() -> rmcp::model::ServerCapabilities {
    rmcp::model::ServerCapabilities::builder()
        .enable_tools()
        .enable_tasks()
        .enable_resources()
        .build()
}

/// The `ServerHandler` methods of tasks and linked results, the same on every MCP front; a
/// handler that expands it holds the fleet's `tasks: Arc<Tasks>`.
macro_rules! task_methods {
    () => {
        async fn get_task(
            &self,
            request: rmcp::model::GetTaskParams,
            context: rmcp::service::RequestContext<rmcp::RoleServer>,
        ) -> Result<rmcp::model::GetTaskResult, rmcp::ErrorData> {
            let caller = crate::tasks::Caller::of(&context);
            self.tasks.get(&caller, request.task_id).await
        }

        async fn cancel_task(
            &self,
            request: rmcp::model::CancelTaskParams,
            context: rmcp::service::RequestContext<rmcp::RoleServer>,
        ) -> Result<(), rmcp::ErrorData> {
            let caller = crate::tasks::Caller::of(&context);
            self.tasks.cancel(&caller, request.task_id).await
        }

        async fn update_task(
            &self,
            request: rmcp::model::UpdateTaskParams,
            context: rmcp::service::RequestContext<rmcp::RoleServer>,
        ) -> Result<(), rmcp::ErrorData> {
            let caller = crate::tasks::Caller::of(&context);
            self.tasks.update(&caller, request.task_id).await
        }

        async fn read_resource(
            &self,
            request: rmcp::model::ReadResourceRequestParams,
            context: rmcp::service::RequestContext<rmcp::RoleServer>,
        ) -> Result<rmcp::model::ReadResourceResponse, rmcp::ErrorData> {
            let caller = crate::tasks::Caller::of(&context);
            let read = self.tasks.read(&caller, request.uri).await?;
            Ok(rmcp::model::ReadResourceResponse::Complete(read))
        }
    };
}
pub(crate) use task_methods;

/// What a task runs: the call, given the task's trace context and a token that stops it.
pub type Work = BoxFuture<'static, Result<CallToolResult, McpError>>;

/// How often finished tasks past their time are removed between requests.
const SWEEP_EVERY: std::time::Duration = std::time::Duration::from_secs(30);

pub struct Tasks {
    config: TasksConfig,
    limits: Limits,
    store: Mutex<Store>,
    /// The running tasks' stops, by id (at most `max_tasks`: each holds a row).
    running: Mutex<HashMap<String, CancellationToken>>,
    instruments: Instruments,
}

impl Tasks {
    /// Opens the store (`run_dir`'s `tasks.sqlite` unless the config names a file) and fails
    /// the tasks a stop cut off.
    pub fn open(
        config: TasksConfig,
        run_dir: Option<&std::path::Path>,
    ) -> anyhow::Result<Arc<Self>> {
        let limits = config.limits().map_err(anyhow::Error::msg)?;
        let path = config
            .path
            .clone()
            .or_else(|| run_dir.map(|d| d.join("tasks.sqlite")));
        if path.is_none() && config.enabled {
            tracing::warn!(
                "tasks are kept in memory and lost at a stop: set gateway.tasks.path to keep them"
            );
        }
        let (store, cut_off) = Store::open(path.as_deref(), limits, now_ms())?;
        if cut_off > 0 {
            tracing::warn!("{cut_off} tasks were working when the gateway stopped: now failed");
        }
        let tasks = Arc::new(Self {
            config,
            limits,
            store: Mutex::new(store),
            running: Mutex::new(HashMap::new()),
            instruments: Instruments::new(),
        });
        tasks.instruments.finished(Status::Failed, cut_off);
        let sweeping = Arc::downgrade(&tasks);
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(SWEEP_EVERY);
            tick.tick().await;
            loop {
                tick.tick().await;
                let Some(tasks) = sweeping.upgrade() else {
                    return;
                };
                match tasks.with_store(|s| s.sweep(now_ms())).await {
                    Ok(expired) => tasks.instruments.removed(Removed {
                        expired,
                        evicted: 0,
                    }),
                    Err(e) => tracing::warn!("removing expired tasks: {e}"),
                }
            }
        });
        Ok(tasks)
    }

    /// Whether this call becomes a task: the client declared the extension on it (or at
    /// `initialize`), tasks are on, and the tool is not one answered inline.
    pub fn wants_task(&self, tool: &str, context: &RequestContext<RoleServer>) -> bool {
        self.config.enabled
            && !self.config.inline_tools.iter().any(|t| t == tool)
            && context
                .client_capabilities()
                .is_some_and(|caps| caps.supports_tasks())
    }

    /// Stores a new task for `caller`'s call of `tool` and starts `work` on its own; returns
    /// its handle once the task is stored.
    pub async fn start(
        self: &Arc<Self>,
        caller: &Caller,
        tool: &str,
        parent: &Context,
        work: impl FnOnce(Context) -> Work,
    ) -> Result<CreateTaskResult, McpError> {
        let id = uuid::Uuid::new_v4().simple().to_string();
        let span = GroupSpan::start(SpanGroup::Gateway, "nomad.gateway.task", parent);
        span.set_attributes([
            KeyValue::new("nomad.task.id", id.clone()),
            KeyValue::new("nomad.tool", tool.to_owned()),
        ]);
        let (owner, tool_name, task_id) = (caller.owner().to_owned(), tool.to_owned(), id.clone());
        let created = self
            .with_store(move |s| s.create(&task_id, &owner, &tool_name, now_ms()))
            .await;
        let (record, removed) = match created {
            Ok(created) => created,
            Err(e) => {
                let reason = if e.is_full() { "full" } else { "store" };
                self.instruments.rejected(tool, reason);
                span.set_error(reason, e.to_string());
                span.end();
                return Err(refusal(&e));
            }
        };
        self.instruments.removed(removed);
        self.instruments.created(tool);
        let stop = CancellationToken::new();
        lock(&self.running).insert(id.clone(), stop.clone());
        let work = work(span.context().clone());
        let tasks = self.clone();
        let task_id = id.clone();
        tokio::spawn(async move {
            let ended = tokio::select! {
                ended = work => Some(ended),
                () = stop.cancelled() => None,
            };
            lock(&tasks.running).remove(&task_id);
            let Some(ended) = ended else {
                span.set_attribute(KeyValue::new("nomad.task.status", "cancelled"));
                span.end();
                return;
            };
            let outcome = match &ended {
                Ok(result) => Outcome::Completed(json_text(result)),
                Err(error) => Outcome::Failed {
                    error: json_text(error),
                    message: error.message.to_string(),
                },
            };
            let status = match outcome {
                Outcome::Completed(_) => Status::Completed,
                Outcome::Failed { .. } => Status::Failed,
            };
            let id = task_id.clone();
            match tasks
                .with_store(move |s| s.finish(&id, outcome, now_ms()))
                .await
            {
                Ok((true, removed)) => {
                    tasks.instruments.removed(removed);
                    tasks.instruments.finished(status, 1);
                    span.set_attribute(KeyValue::new("nomad.task.status", status.as_str()));
                    match ended {
                        Err(error) => span.set_error("failed", error.message),
                        Ok(_) => span.set_ok(),
                    }
                }
                // Cancelled while its answer was on the way: it stays cancelled.
                Ok((false, _)) => {
                    span.set_attribute(KeyValue::new("nomad.task.status", "cancelled"));
                }
                Err(e) => {
                    tracing::error!(task = %task_id, "recording how a task ended: {e}");
                    span.set_error("store", e.to_string());
                }
            }
            span.end();
        });
        Ok(CreateTaskResult::new(self.wire(&record)))
    }

    /// `tasks/get`: the caller's task, with its result or error once it ended.
    pub async fn get(
        self: &Arc<Self>,
        caller: &Caller,
        id: String,
    ) -> Result<GetTaskResult, McpError> {
        let record = self.record(caller, id).await?;
        let payload = |text: &Option<String>| -> Result<JsonObject, McpError> {
            text.as_deref()
                .map(serde_json::from_str)
                .transpose()
                .map_err(|e| McpError::internal_error(format!("a stored outcome: {e}"), None))?
                .ok_or_else(|| McpError::internal_error("a stored outcome is missing", None))
        };
        let detail = match record.status {
            Status::Working => TaskPayload::Working,
            Status::Cancelled => TaskPayload::Cancelled,
            Status::Completed => TaskPayload::Completed {
                result: payload(&record.payload)?,
            },
            Status::Failed => TaskPayload::Failed {
                error: payload(&record.payload)?,
            },
        };
        Ok(GetTaskResult::new(DetailedTask::new(
            self.wire(&record),
            detail,
        )))
    }

    /// `tasks/cancel`: stops the caller's working task (it is `cancelled` from now on); one that
    /// already ended is left as it is.
    pub async fn cancel(self: &Arc<Self>, caller: &Caller, id: String) -> Result<(), McpError> {
        let owner = caller.owner().to_owned();
        let task_id = id.clone();
        let found = self
            .with_store(move |s| s.cancel(&task_id, &owner, now_ms()))
            .await
            .map_err(|e| refusal(&e))?;
        match found {
            None => Err(not_found(&id)),
            Some(Cancelled::Now) => {
                if let Some(stop) = lock(&self.running).remove(&id) {
                    stop.cancel();
                }
                self.instruments.finished(Status::Cancelled, 1);
                Ok(())
            }
            Some(Cancelled::AlreadyEnded(_)) => Ok(()),
        }
    }

    /// The caller's task `id` as stored; not found as [`not_found`] says.
    async fn record(
        self: &Arc<Self>,
        caller: &Caller,
        id: String,
    ) -> Result<store::Record, McpError> {
        let owner = caller.owner().to_owned();
        let shown = id.clone();
        self.with_store(move |s| s.get(&id, &owner, now_ms()))
            .await
            .map_err(|e| refusal(&e))?
            .ok_or_else(|| not_found(&shown))
    }

    /// `tasks/update`: these tasks never ask for input, so there is nothing to answer; an
    /// unknown task is named as `tasks/get` names it.
    pub async fn update(self: &Arc<Self>, caller: &Caller, id: String) -> Result<(), McpError> {
        self.record(caller, id.clone()).await?;
        Err(McpError::invalid_params(
            format!("task {id:?} asks for no input: nothing to update"),
            None,
        ))
    }

    /// Fails every working task now (the gateway is stopping), so a client polling it learns
    /// at once instead of at the next start.
    pub async fn stop(self: &Arc<Self>) {
        for (_, stop) in lock(&self.running).drain() {
            stop.cancel();
        }
        match self.with_store(|s| s.fail_working(now_ms())).await {
            Ok(0) => {}
            Ok(n) => {
                self.instruments.finished(Status::Failed, n);
                tracing::info!("{n} working tasks failed: the gateway is stopping");
            }
            Err(e) => tracing::warn!("failing the working tasks at a stop: {e}"),
        }
    }

    fn wire(&self, record: &store::Record) -> Task {
        let status = match record.status {
            Status::Working => TaskStatus::Working,
            Status::Completed => TaskStatus::Completed,
            Status::Failed => TaskStatus::Failed,
            Status::Cancelled => TaskStatus::Cancelled,
        };
        let mut task = Task::new(
            record.id.clone(),
            status,
            iso(record.created_ms),
            iso(record.updated_ms),
        )
        .with_ttl_ms(record.ttl_ms(&self.limits));
        if status == TaskStatus::Working {
            task = task.with_poll_interval_ms(self.config.poll_interval_ms);
        }
        if let Some(message) = &record.message {
            task = task.with_status_message(message.clone());
        }
        task
    }

    /// Runs `f` on the store off the async threads (a write waits for the disk).
    async fn with_store<T: Send + 'static>(
        self: &Arc<Self>,
        f: impl FnOnce(&mut Store) -> Result<T, StoreError> + Send + 'static,
    ) -> Result<T, StoreError> {
        let tasks = self.clone();
        tokio::task::spawn_blocking(move || f(&mut lock(&tasks.store)))
            .await
            .unwrap_or_else(|e| {
                Err(StoreError::Corrupt(format!(
                    "a store operation panicked: {e}"
                )))
            })
    }
}

fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

/// ISO 8601 (UTC, milliseconds), as the extension states times.
fn iso(ms: u64) -> String {
    chrono::DateTime::<chrono::Utc>::from_timestamp_millis(ms as i64)
        .unwrap_or_default()
        .to_rfc3339_opts(chrono::SecondsFormat::Millis, true)
}

fn json_text(value: &impl serde::Serialize) -> String {
    serde_json::to_string(value).unwrap_or_else(|e| {
        serde_json::json!({"code": -32603, "message": format!("an outcome could not be kept: {e}")})
            .to_string()
    })
}

fn not_found(id: &str) -> McpError {
    McpError::invalid_params(
        format!(
            "no task {id:?}: it never existed, its result expired (kept gateway.tasks.ttl_seconds \
             after it ended), or another credential created it"
        ),
        None,
    )
}

/// A store refusal as a JSON-RPC error, its kind in `data` as tool errors carry it.
fn refusal(e: &StoreError) -> McpError {
    let code = if e.is_full() {
        "RESOURCE_EXHAUSTED"
    } else {
        "INTERNAL"
    };
    McpError::internal_error(
        e.to_string(),
        Some(serde_json::json!({crate::tool_error::ERROR_CODE_META: code})),
    )
}

/// The tasks' counters (names and units from the metric table).
struct Instruments {
    created: Counter<u64>,
    finished: Counter<u64>,
    rejected: Counter<u64>,
    removed: Counter<u64>,
}

impl Instruments {
    fn new() -> Self {
        Self {
            created: defs::GATEWAY_TASKS_CREATED.u64_counter(),
            finished: defs::GATEWAY_TASKS_FINISHED.u64_counter(),
            rejected: defs::GATEWAY_TASKS_REJECTED.u64_counter(),
            removed: defs::GATEWAY_TASKS_REMOVED.u64_counter(),
        }
    }

    fn created(&self, tool: &str) {
        self.created
            .add(1, &[KeyValue::new("tool", tool.to_owned())]);
    }

    fn finished(&self, status: Status, n: u64) {
        if n > 0 {
            self.finished
                .add(n, &[KeyValue::new("outcome", status.as_str())]);
        }
    }

    fn rejected(&self, tool: &str, reason: &'static str) {
        self.rejected.add(
            1,
            &[
                KeyValue::new("tool", tool.to_owned()),
                KeyValue::new("reason", reason),
            ],
        );
    }

    fn removed(&self, removed: Removed) {
        for (n, reason) in [(removed.expired, "expired"), (removed.evicted, "evicted")] {
            if n > 0 {
                self.removed.add(n, &[KeyValue::new("reason", reason)]);
            }
        }
    }
}

#[cfg(test)]
#[path = "wire_tests.rs"]
mod wire_tests;

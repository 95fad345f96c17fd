//! The tools as callers see them: each one's config, and what a worker said of it when it
//! described it (a Python model's own schemas, description and batch size; every tool's model
//! card; or why its source or environment failed). Tools are described once, on the first
//! worker that registers, so a broken source is found at start-up, not at the first call.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures::StreamExt as _;
use nomad_proto::kinds::{InputForm, InputType};
use nomad_proto::v1::{DescribeRequest, ToolDescription, ToolInfo, ToolInput, ToolState};

use crate::config::ToolConfig;
use crate::driver::Handle;
use crate::error::CallError;
use crate::workers::Worker;

/// Tools described at once on one worker.
const DESCRIBING_AT_ONCE: usize = 4;

#[derive(Debug, Clone)]
enum Described {
    Pending,
    Describing,
    Ready(ToolDescription),
    Failed(String),
}

/// How long a call to a tool not described yet waits for its description (a worker
/// registering, a Python model's environment building) before it is refused as still starting.
const CALL_WAITS_FOR_DESCRIPTION: Duration = Duration::from_secs(30);

pub struct Catalog {
    tools: Vec<ToolConfig>,
    described: Mutex<Vec<Described>>,
    /// Woken whenever a tool's description ends (ready or failed).
    settled: tokio::sync::Notify,
    /// [`CALL_WAITS_FOR_DESCRIPTION`], shorter in tests.
    call_wait: Duration,
    deadline: Duration,
}

impl Catalog {
    pub fn new(tools: Vec<ToolConfig>, deadline: Duration) -> Self {
        let described = Mutex::new(vec![Described::Pending; tools.len()]);
        Self {
            tools,
            described,
            settled: tokio::sync::Notify::new(),
            call_wait: CALL_WAITS_FOR_DESCRIPTION,
            deadline,
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Vec<Described>> {
        self.described.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn index(&self, tool: &str) -> Option<usize> {
        self.tools.iter().position(|t| t.name == tool)
    }

    /// Every tool with its state and, once described, its own schemas and description.
    pub fn infos(&self) -> Vec<ToolInfo> {
        let described = self.lock();
        self.tools
            .iter()
            .zip(described.iter())
            .map(|(t, d)| {
                let mut info = ToolInfo {
                    name: t.name.clone(),
                    kind: t.kind.clone(),
                    description: t.description.clone(),
                    batch_size: t.batch_size,
                    max_devices: t.max_devices,
                    max_pending: t.max_pending,
                    max_running: t.max_running.unwrap_or(0),
                    source: t.source.clone(),
                    ..Default::default()
                };
                match d {
                    Described::Pending | Described::Describing => {
                        info.set_state(ToolState::Pending)
                    }
                    Described::Failed(error) => {
                        info.set_state(ToolState::Failed);
                        info.error = error.clone();
                    }
                    Described::Ready(desc) => {
                        info.set_state(ToolState::Ready);
                        if info.description.is_empty() {
                            info.description = desc.description.clone();
                        }
                        if t.batch_size_from_model && desc.batch_size > 0 {
                            info.batch_size = desc.batch_size;
                        }
                        info.input_schema_json = desc.input_schema_json.clone();
                        info.output_schema_json = desc.output_schema_json.clone();
                        info.pinned_source = desc.pinned_source.clone();
                    }
                }
                info
            })
            .collect()
    }

    /// [`Self::check_call`], after waiting (at most [`CALL_WAITS_FOR_DESCRIPTION`]) for a tool
    /// that is not described yet: a call made while the fleet starts is served once its tool
    /// is, or refused as still starting, never as unknown.
    pub async fn ready_for_call(&self, tool: &str, input: &ToolInput) -> Result<(), CallError> {
        let Some(index) = self.index(tool) else {
            return Ok(()); // the driver answers unknown tools
        };
        let deadline = tokio::time::Instant::now() + self.call_wait;
        loop {
            // Registered before the state is read, so a description ending between the two
            // still wakes this call.
            let settled = self.settled.notified();
            if !matches!(
                self.lock()[index],
                Described::Pending | Described::Describing
            ) {
                return self.check_call(tool, input);
            }
            if tokio::time::timeout_at(deadline, settled).await.is_err() {
                return Err(CallError::StillStarting {
                    tool: tool.to_owned(),
                    seconds: self.call_wait.as_secs(),
                });
            }
        }
    }

    /// Refuses, before it is queued, a call the tool could only fail: its source or environment
    /// failed (named), or its input is of the wrong form for its kind.
    fn check_call(&self, tool: &str, input: &ToolInput) -> Result<(), CallError> {
        let Some(index) = self.index(tool) else {
            return Ok(()); // the driver answers unknown tools
        };
        // JSON arguments go to a model host, the other forms to the worker's own passes: a call
        // on the wrong side of that line is refused here by the kinds table's rule. Text and
        // tensors are the worker's to tell apart (a simulated worker serves either).
        let form = input.form();
        let refusal = nomad_proto::kinds::kind(&self.tools[index].kind)
            .filter(|kind| (kind.input == InputType::Json) != (form == InputForm::Json))
            .and_then(|kind| kind.input_refusal(form));
        if let Some(refusal) = refusal {
            return Err(CallError::WrongInput(format!("tool {tool:?}: {refusal}")));
        }
        match &self.lock()[index] {
            Described::Failed(error) => Err(CallError::CannotServe {
                tool: tool.to_owned(),
                why: error.clone(),
            }),
            _ => Ok(()),
        }
    }

    /// The README.md of `tool`'s model directory.
    pub fn model_card(&self, tool: &str) -> Result<String, CallError> {
        let Some(index) = self.index(tool) else {
            return Err(CallError::NoSuchTool {
                tool: tool.to_owned(),
                known: self.tools.iter().map(|t| t.name.clone()).collect(),
            });
        };
        match &self.lock()[index] {
            Described::Ready(d) => d.model_card.clone().ok_or_else(|| CallError::NoModelCard {
                tool: tool.to_owned(),
                directory: if self.tools[index].source.is_empty() {
                    "none: a Python callable".to_owned()
                } else {
                    self.tools[index].source.clone()
                },
            }),
            Described::Failed(error) => Err(CallError::CannotServe {
                tool: tool.to_owned(),
                why: error.clone(),
            }),
            Described::Pending | Described::Describing => Err(CallError::NotDescribed {
                tool: tool.to_owned(),
            }),
        }
    }

    /// Describes, on `worker`, every tool no worker has described yet; a Python model's batch
    /// size takes effect in the driver.
    pub fn describe_on(self: &Arc<Self>, worker: Worker, driver: Handle) {
        let todo: Vec<usize> = {
            let mut described = self.lock();
            described
                .iter_mut()
                .enumerate()
                .filter(|(_, d)| matches!(d, Described::Pending))
                .map(|(i, d)| {
                    *d = Described::Describing;
                    i
                })
                .collect()
        };
        if todo.is_empty() {
            return;
        }
        let catalog = self.clone();
        tokio::spawn(async move {
            futures::stream::iter(todo)
                .for_each_concurrent(DESCRIBING_AT_ONCE, |index| {
                    let catalog = catalog.clone();
                    let worker = worker.clone();
                    let driver = driver.clone();
                    async move { catalog.describe_one(index, worker, driver).await }
                })
                .await;
        });
    }

    async fn describe_one(&self, index: usize, worker: Worker, driver: Handle) {
        let tool = &self.tools[index];
        let request = DescribeRequest {
            model: Some(tool.model_spec()),
        };
        let mut client = worker.client.clone();
        let outcome = match tokio::time::timeout(self.deadline, client.describe(request)).await {
            Ok(Ok(reply)) => Ok(reply.into_inner()),
            Ok(Err(status)) if nomad_rpc::peer_lost(&status) => {
                // The worker went away: the next one to register describes the tool.
                tracing::warn!(tool = %tool.name, worker = %worker.id, "describing: {}", status.message());
                self.lock()[index] = Described::Pending;
                return;
            }
            Ok(Err(status)) => Err(status.message().to_owned()),
            Err(_) => Err(format!(
                "describing it took over {} s (tool_manager.prepare_timeout_seconds)",
                self.deadline.as_secs()
            )),
        };
        match outcome {
            Ok(description) => {
                tracing::info!(tool = %tool.name, worker = %worker.id, "tool described");
                if tool.batch_size_from_model && description.batch_size > 0 {
                    driver
                        .set_batch_size(&tool.name, description.batch_size)
                        .await;
                }
                self.settle(index, Described::Ready(description));
            }
            Err(error) => {
                tracing::error!(tool = %tool.name, worker = %worker.id, "tool cannot serve: {error}");
                self.settle(index, Described::Failed(error));
            }
        }
    }

    /// Ends a tool's description, waking the calls that wait for it.
    fn settle(&self, index: usize, described: Described) {
        self.lock()[index] = described;
        self.settled.notify_waiters();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn catalog() -> Arc<Catalog> {
        let tool = ToolConfig {
            name: "m".into(),
            kind: "embed".into(),
            source: "/nowhere".into(),
            base_dir: String::new(),
            description: String::new(),
            batch_size: 1,
            batch_size_from_model: false,
            max_devices: 1,
            max_pending: 8,
            execute_timeout: Duration::from_secs(1),
            max_batch_bytes: 1 << 20,
            max_batch_tokens: 0,
            max_running: None,
            kv_budget_bytes: 0,
            dense_prefill: false,
            continuous: false,
            oom_regrow_after: 0,
            python: None,
            registries: Default::default(),
        };
        let mut catalog = Catalog::new(vec![tool], Duration::from_secs(1));
        catalog.call_wait = Duration::from_secs(2);
        Arc::new(catalog)
    }

    fn text() -> ToolInput {
        ToolInput {
            value: Some(nomad_proto::v1::tool_input::Value::Text("x".into())),
            ..Default::default()
        }
    }

    /// The kinds table's rule, before the call is queued: an input of a form the tool's kind
    /// does not take is refused naming both.
    #[tokio::test]
    async fn an_input_of_the_wrong_form_is_refused_before_it_is_queued() {
        let catalog = catalog();
        catalog.settle(0, Described::Ready(ToolDescription::default()));
        let json = ToolInput {
            value: Some(nomad_proto::v1::tool_input::Value::Json("{}".into())),
            ..Default::default()
        };
        let refused = catalog.ready_for_call("m", &json).await.unwrap_err();
        assert_eq!(refused.category(), crate::error::Category::InvalidArgument);
        assert!(
            refused
                .to_string()
                .contains("\"m\": embed takes a text input, got JSON arguments"),
            "{refused}"
        );
        assert!(catalog.ready_for_call("m", &text()).await.is_ok());
    }

    #[tokio::test]
    async fn a_call_waits_for_its_tools_description_then_is_served_or_told_why() {
        let catalog = catalog();
        // Described while the call waits: it goes on.
        let waiting = tokio::spawn({
            let catalog = catalog.clone();
            async move { catalog.ready_for_call("m", &text()).await }
        });
        tokio::time::sleep(Duration::from_millis(100)).await;
        assert!(!waiting.is_finished());
        catalog.settle(0, Described::Ready(ToolDescription::default()));
        waiting.await.unwrap().unwrap();
        // Failed: refused naming why.
        catalog.settle(0, Described::Failed("no weights".into()));
        let refused = catalog.ready_for_call("m", &text()).await.unwrap_err();
        assert_eq!(
            refused.category(),
            crate::error::Category::FailedPrecondition
        );
        assert!(refused.to_string().contains("no weights"), "{refused:?}");
        // Never described: refused as starting once the wait is over, not as unknown.
        catalog.settle(0, Described::Describing);
        let refused = catalog.ready_for_call("m", &text()).await.unwrap_err();
        assert_eq!(refused.category(), crate::error::Category::Unavailable);
        assert!(
            refused.to_string().contains("still starting"),
            "{refused:?}"
        );
        // A tool the catalog does not have is the driver's to answer.
        assert!(catalog.ready_for_call("other", &text()).await.is_ok());
    }
}

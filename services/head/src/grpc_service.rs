//! The Head gRPC service (`nomad head`): starts runs in the background and reports on them.

use nomad_proto::v1::gateway_client::GatewayClient;
use nomad_proto::v1::head_server::Head;
use nomad_proto::v1::{GetRunRequest, Run, StartRunRequest, StartRunResponse};
use tonic::{Request, Response, Status};

use crate::rollouts::Runner;
use crate::run_registry::RunRegistry;
use crate::tasks;

pub struct HeadService {
    pub gateway: GatewayClient<nomad_rpc::Channel>,
    pub runs: RunRegistry,
    pub default_concurrency: usize,
}

#[tonic::async_trait]
impl Head for HeadService {
    async fn start_run(
        &self,
        request: Request<StartRunRequest>,
    ) -> Result<Response<StartRunResponse>, Status> {
        let StartRunRequest {
            tasks_json,
            concurrency,
        } = request.into_inner();
        // Counted before anything is parsed: a request of 100,000 tasks costs nothing more.
        let limit = self.runs.limits().max_tasks_per_run;
        if tasks_json.len() > limit {
            return Err(Status::resource_exhausted(
                crate::run_registry::Refusal::TooManyTasks {
                    given: tasks_json.len(),
                    limit,
                }
                .to_string(),
            ));
        }
        let tasks = tasks::parse_all(
            tasks_json
                .iter()
                .enumerate()
                .map(|(i, json)| (format!("tasks_json[{i}]"), json.as_str())),
            None,
        )
        .map_err(Status::invalid_argument)?;
        let run_id = crate::run_id::random();
        let concurrency = if concurrency == 0 {
            self.default_concurrency
        } else {
            concurrency as usize
        };
        self.runs
            .start(&run_id, tasks.len(), concurrency)
            .map_err(|e| match e {
                crate::run_registry::Refusal::Disk(_) => Status::internal(e.to_string()),
                _ => Status::resource_exhausted(e.to_string()),
            })?;
        let runner = Runner::new(
            self.gateway.clone(),
            run_id.clone(),
            concurrency,
            "embed".into(),
        );
        let runs = self.runs.clone();
        let id = run_id.clone();
        tracing::info!(run_id = %run_id, tasks = tasks.len(), "run started");
        tokio::spawn(async move {
            // A run of the head's API ends with its tasks (the head has no stop for it yet).
            let (_never, stop) = crate::rollouts::Stop::new();
            runner
                .run(tasks, &stop, |result| runs.record(&id, result))
                .await;
            runs.finish(&id);
            tracing::info!(run_id = %id, "run finished");
        });
        Ok(Response::new(StartRunResponse { run_id }))
    }

    async fn get_run(&self, request: Request<GetRunRequest>) -> Result<Response<Run>, Status> {
        let run_id = &request.get_ref().run_id;
        self.runs
            .get(run_id)
            .map(Response::new)
            .ok_or_else(|| Status::not_found(format!("no run {run_id:?} on this head")))
    }
}

//! The Gateway gRPC service (for the head): a thin adapter over [`Gateway`].

use std::sync::Arc;

use nomad_proto::v1::gateway_server::Gateway as GatewayApi;
use nomad_proto::v1::{
    ExecuteCodeRequest, ExecuteResponse, ExecuteScriptRequest, GatewayCallToolRequest,
    GatewayCallToolResponse, GatewayStatus, GatewayStatusRequest, SandboxLayer, SearchToolsRequest,
    SearchToolsResponse, UpstreamTool,
};
use nomad_telemetry::Context;
use tonic::{Request, Response, Status};

use crate::execute::{ExecuteReply, Gateway};
use crate::upstream::nomad;

pub struct GatewayService {
    pub gateway: Arc<Gateway>,
}

fn response(reply: ExecuteReply) -> ExecuteResponse {
    ExecuteResponse {
        result_json: reply.result.to_string(),
        stdout: reply.stdout,
        stderr: reply.stderr,
        returncode: reply.returncode,
        error: reply.error,
    }
}

#[tonic::async_trait]
impl GatewayApi for GatewayService {
    async fn search_tools(
        &self,
        request: Request<SearchToolsRequest>,
    ) -> Result<Response<SearchToolsResponse>, Status> {
        let r = request.into_inner();
        let full = match r.detail_level.as_str() {
            "" | "brief" => false,
            "full" => true,
            other => {
                return Err(Status::invalid_argument(format!(
                    "detail_level {other:?}: use brief or full"
                )));
            }
        };
        let limit = if r.limit == 0 { 20 } else { r.limit as usize };
        let found = self
            .gateway
            .search(&r.query, &r.server_filter, full, limit)
            .await
            .map_err(Status::not_found)?;
        let tools = found
            .into_iter()
            .map(|t| UpstreamTool {
                server: t["server"].as_str().unwrap_or_default().to_owned(),
                name: t["name"].as_str().unwrap_or_default().to_owned(),
                description: t["description"].as_str().unwrap_or_default().to_owned(),
                input_schema_json: t
                    .get("input_schema")
                    .map(|s| s.to_string())
                    .unwrap_or_default(),
                python_signature: t["signature"].as_str().unwrap_or_default().to_owned(),
            })
            .collect();
        Ok(Response::new(SearchToolsResponse { tools }))
    }

    async fn execute_code(
        &self,
        request: Request<ExecuteCodeRequest>,
    ) -> Result<Response<ExecuteResponse>, Status> {
        let ExecuteCodeRequest { code, env } = request.into_inner();
        if code.trim().is_empty() {
            return Err(Status::invalid_argument("`code` is empty"));
        }
        let reply = self
            .gateway
            .execute_code(code, env.into_iter().collect(), &Context::current())
            .await
            .map_err(|e| e.status())?;
        Ok(Response::new(response(reply)))
    }

    async fn execute_script(
        &self,
        request: Request<ExecuteScriptRequest>,
    ) -> Result<Response<ExecuteResponse>, Status> {
        let ExecuteScriptRequest { script_path, env } = request.into_inner();
        let reply = self
            .gateway
            .execute_script(&script_path, env.into_iter().collect(), &Context::current())
            .await
            .map_err(|e| e.status())?;
        Ok(Response::new(response(reply)))
    }

    async fn call_tool(
        &self,
        request: Request<GatewayCallToolRequest>,
    ) -> Result<Response<GatewayCallToolResponse>, Status> {
        let GatewayCallToolRequest {
            server,
            tool,
            arguments_json,
        } = request.into_inner();
        if tool.is_empty() {
            return Err(Status::invalid_argument("`tool` is required"));
        }
        let server = if server.is_empty() {
            nomad::NAME.to_owned()
        } else {
            server
        };
        let arguments: serde_json::Value = if arguments_json.trim().is_empty() {
            serde_json::json!({})
        } else {
            serde_json::from_str(&arguments_json).map_err(|e| {
                Status::invalid_argument(format!(
                    "{server}.{tool}: arguments must be a JSON object: {e}"
                ))
            })?
        };
        let value = self
            .gateway
            .call_tool(&Context::current(), &server, &tool, &arguments)
            .await?;
        Ok(Response::new(GatewayCallToolResponse {
            result_json: value.to_string(),
        }))
    }

    async fn status(
        &self,
        _request: Request<GatewayStatusRequest>,
    ) -> Result<Response<GatewayStatus>, Status> {
        use std::sync::atomic::Ordering::Relaxed;
        let sandbox = &self.gateway.sandbox;
        let isolation = sandbox.isolation();
        let counts = sandbox.counts();
        Ok(Response::new(GatewayStatus {
            sandbox_layers: isolation
                .layers()
                .into_iter()
                .map(|(name, in_force)| SandboxLayer {
                    name: name.to_owned(),
                    in_force,
                })
                .collect(),
            sandbox_lost: isolation.lost().into_iter().map(String::from).collect(),
            landlock_abi: isolation.report.landlock_abi,
            sandbox_limits: match &isolation.cgroup {
                Ok(dir) => format!("cgroup {}", dir.display()),
                Err(why) => format!("rlimits: {why}"),
            },
            supplementary_groups: isolation.report.supplementary_groups as u32,
            runs_active: counts.running.load(Relaxed) as u32,
            runs_queued: counts.queued.load(Relaxed) as u32,
            runners_warm: counts.warm.load(Relaxed) as u32,
            max_concurrent: sandbox.max_concurrent() as u32,
            max_queued: sandbox.config().max_queued as u32,
            warm_starts: counts.warm_starts.load(Relaxed),
            cold_starts: counts.cold_starts.load(Relaxed),
        }))
    }
}

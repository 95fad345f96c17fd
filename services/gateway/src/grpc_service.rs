//! The Gateway gRPC service (for the head): a thin adapter over [`Gateway`].

use std::sync::Arc;

use nomad_proto::v1::gateway_server::Gateway as GatewayApi;
use nomad_proto::v1::{
    ExecuteCodeRequest, ExecuteResponse, ExecuteScriptRequest, GatewayCallToolRequest,
    GatewayCallToolResponse, GatewayStatus, GatewayStatusRequest, SandboxLayer, SearchToolsRequest,
    SearchToolsResponse, ToolCallRecord, UnavailableServer, UpstreamTool,
};
use nomad_telemetry::Context;
use tonic::{Request, Response, Status};

use crate::execute::{ExecuteReply, Gateway};
use crate::search::{DetailLevel, SearchRequest};
use crate::upstream::nomad;

pub struct GatewayService {
    pub gateway: Arc<Gateway>,
}

fn response(reply: ExecuteReply) -> ExecuteResponse {
    let json = |v: Option<serde_json::Value>| v.map(|x| x.to_string()).unwrap_or_default();
    ExecuteResponse {
        result_json: reply.result.to_string(),
        stdout: reply.stdout,
        stderr: reply.stderr,
        returncode: reply.returncode,
        error: reply.error,
        duration_seconds: reply.duration_seconds,
        status: reply.status.as_str().to_owned(),
        tool_calls: reply
            .tool_calls
            .unwrap_or_default()
            .into_iter()
            .map(|c| ToolCallRecord {
                server: c.server,
                tool: c.tool,
                status: c.status.as_str().to_owned(),
                start_offset_seconds: c.start_offset_seconds,
                duration_seconds: c.duration_seconds,
                arguments_json: json(c.arguments),
                output_json: json(c.output),
                error: c.error.unwrap_or_default(),
                code: c.code.map(|c| c.as_str().to_owned()).unwrap_or_default(),
            })
            .collect(),
        tool_calls_dropped: reply.tool_calls_dropped,
    }
}

#[tonic::async_trait]
impl GatewayApi for GatewayService {
    async fn search_tools(
        &self,
        request: Request<SearchToolsRequest>,
    ) -> Result<Response<SearchToolsResponse>, Status> {
        let r = request.into_inner();
        let detail = DetailLevel::parse(Some(&r.detail_level))
            .map_err(|e| Status::invalid_argument(e.to_string()))?;
        let request = SearchRequest {
            query: &r.query,
            server_filter: &r.server_filter,
            detail,
            limit: (r.limit > 0).then_some(r.limit as usize),
        };
        let reply = self
            .gateway
            .search
            .search(&request)
            .await
            .map_err(|e| e.status())?;
        let text =
            |v: &serde_json::Value, key: &str| v[key].as_str().unwrap_or_default().to_owned();
        let json = |v: &serde_json::Value, key: &str| {
            v.get(key)
                .filter(|s| !s.is_null())
                .map(|s| s.to_string())
                .unwrap_or_default()
        };
        let tools = reply
            .tools
            .iter()
            .map(|t| UpstreamTool {
                server: text(t, "server"),
                name: text(t, "name"),
                description: text(t, "description"),
                input_schema_json: json(t, "input_schema"),
                python_signature: text(t, "signature"),
                import_path: text(t, "import"),
                output_schema_json: json(t, "output_schema"),
                title: text(t, "title"),
            })
            .collect();
        Ok(Response::new(SearchToolsResponse {
            tools,
            ranking: reply.ranking.as_str().to_owned(),
            unavailable_servers: reply
                .unavailable
                .into_iter()
                .map(|(server, error)| UnavailableServer { server, error })
                .collect(),
        }))
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
            .execute_code(code, env.into_iter().collect(), &Context::current(), None)
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
            .execute_script(
                &script_path,
                env.into_iter().collect(),
                &Context::current(),
                None,
            )
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
            .await
            .map_err(Status::from)?;
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

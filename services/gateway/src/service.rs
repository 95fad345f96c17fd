//! The Gateway gRPC service (for the head). Code execution arrives with the sandbox; until then
//! ExecuteCode and ExecuteScript answer UNIMPLEMENTED and say so.

use std::time::Instant;

use nomad_proto::v1::gateway_server::Gateway;
use nomad_proto::v1::scheduler_client::SchedulerClient;
use nomad_proto::v1::{
    CallToolRequest, ExecuteCodeRequest, ExecuteResponse, ExecuteScriptRequest,
    GatewayCallToolRequest, GatewayCallToolResponse, ListToolsRequest, SearchToolsRequest,
    SearchToolsResponse, UpstreamTool,
};
use nomad_telemetry::metrics as defs;
use nomad_telemetry::{Context, GroupSpan, KeyValue, SpanGroup};
use opentelemetry::metrics::{Counter, Histogram};
use opentelemetry::trace::FutureExt as _;
use tonic::{Request, Response, Status};

use crate::nomad_tools;

/// The built-in upstream's name.
pub const NOMAD_SERVER: &str = "nomad";

pub struct GatewayService {
    scheduler: SchedulerClient<nomad_rpc::Channel>,
    requests: Counter<u64>,
    request_duration: Histogram<f64>,
    upstream_calls: Counter<u64>,
    upstream_duration: Histogram<f64>,
}

impl GatewayService {
    pub fn new(scheduler: SchedulerClient<nomad_rpc::Channel>) -> Self {
        Self {
            scheduler,
            requests: defs::GATEWAY_REQUESTS.u64_counter(),
            request_duration: defs::GATEWAY_REQUEST_DURATION.f64_histogram(),
            upstream_calls: defs::GATEWAY_UPSTREAM_TOOL_CALLS.u64_counter(),
            upstream_duration: defs::GATEWAY_UPSTREAM_TOOL_DURATION.f64_histogram(),
        }
    }

    /// Calls one upstream tool, recording the `upstream` span and metrics.
    async fn call_upstream(
        &self,
        server: &str,
        tool: &str,
        arguments_json: &str,
    ) -> Result<serde_json::Value, Status> {
        let span = GroupSpan::start(
            SpanGroup::Upstream,
            "nomad.gateway.upstream_tool",
            &Context::current(),
        );
        span.set_attributes([
            KeyValue::new("nomad.gateway.server", server.to_owned()),
            KeyValue::new("nomad.gateway.tool", tool.to_owned()),
        ]);
        let started = Instant::now();
        let result = self
            .call_nomad_tool(server, tool, arguments_json)
            .with_context(span.context().clone())
            .await;
        let status = if result.is_ok() { "ok" } else { "error" };
        span.set_attribute(KeyValue::new("nomad.gateway.status", status));
        if let Err(e) = &result {
            span.set_error(format!("{:?}", e.code()), e.message().to_owned());
        }
        let attributes = [
            KeyValue::new("server", server.to_owned()),
            KeyValue::new("tool", tool.to_owned()),
            KeyValue::new("status", status),
        ];
        self.upstream_calls.add(1, &attributes);
        self.upstream_duration
            .record(started.elapsed().as_secs_f64(), &attributes);
        result
    }

    async fn call_nomad_tool(
        &self,
        server: &str,
        tool: &str,
        arguments_json: &str,
    ) -> Result<serde_json::Value, Status> {
        if server != NOMAD_SERVER {
            return Err(Status::not_found(format!(
                "unknown upstream server {server:?}; configured: {NOMAD_SERVER}"
            )));
        }
        let input = nomad_tools::input_from_json(arguments_json)
            .map_err(|e| Status::invalid_argument(format!("{server}.{tool}: {e}")))?;
        let reply = self
            .scheduler
            .clone()
            .call_tool(CallToolRequest {
                tool: tool.to_owned(),
                input: Some(input),
            })
            .await?
            .into_inner();
        let output = reply.output.ok_or_else(|| {
            Status::internal(format!("{server}.{tool}: the scheduler returned no output"))
        })?;
        nomad_tools::output_to_json(&output)
            .map_err(|e| Status::internal(format!("{server}.{tool}: {e}")))
    }
}

#[tonic::async_trait]
impl Gateway for GatewayService {
    async fn search_tools(
        &self,
        request: Request<SearchToolsRequest>,
    ) -> Result<Response<SearchToolsResponse>, Status> {
        let SearchToolsRequest {
            query,
            server_filter,
            limit,
            ..
        } = request.into_inner();
        if !server_filter.is_empty() && server_filter != NOMAD_SERVER {
            return Ok(Response::new(SearchToolsResponse { tools: vec![] }));
        }
        let listed = self
            .scheduler
            .clone()
            .list_tools(ListToolsRequest {})
            .await?
            .into_inner();
        let query = query.to_lowercase();
        let limit = if limit == 0 {
            usize::MAX
        } else {
            limit as usize
        };
        let tools = listed
            .tools
            .into_iter()
            .filter(|t| {
                query.is_empty()
                    || t.name.to_lowercase().contains(&query)
                    || t.description.to_lowercase().contains(&query)
                    || t.kind.to_lowercase().contains(&query)
            })
            .take(limit)
            .map(|t| UpstreamTool {
                server: NOMAD_SERVER.to_owned(),
                description: t.description,
                input_schema_json: String::new(),
                python_signature: String::new(),
                name: t.name,
            })
            .collect();
        Ok(Response::new(SearchToolsResponse { tools }))
    }

    async fn execute_code(
        &self,
        _request: Request<ExecuteCodeRequest>,
    ) -> Result<Response<ExecuteResponse>, Status> {
        Err(Status::unimplemented(
            "execute_mcp_code needs the sandbox runner, which this gateway does not have yet",
        ))
    }

    async fn execute_script(
        &self,
        _request: Request<ExecuteScriptRequest>,
    ) -> Result<Response<ExecuteResponse>, Status> {
        Err(Status::unimplemented(
            "execute_mcp_script needs the sandbox runner, which this gateway does not have yet",
        ))
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
            NOMAD_SERVER.to_owned()
        } else {
            server
        };
        let started = Instant::now();
        let kind = [KeyValue::new("request.kind", "call_tool")];
        self.requests.add(1, &kind);
        let result = self.call_upstream(&server, &tool, &arguments_json).await;
        let status = if result.is_ok() { "ok" } else { "error" };
        self.request_duration.record(
            started.elapsed().as_secs_f64(),
            &[kind[0].clone(), KeyValue::new("status", status)],
        );
        result.map(|value| {
            Response::new(GatewayCallToolResponse {
                result_json: value.to_string(),
            })
        })
    }
}

//! MCP over Streamable HTTP, behind the bearer token: code mode (or, with `--mcp-front
//! tools`, the fleet's tools) at `/mcp`, the fleet's tools, each an MCP tool of its own, at
//! `/tools`, and the OpenAI-compatible routes under `/v1`.

use std::sync::Arc;

use crate::{direct, mcp_server};

/// What `/mcp` (and stdio) offers.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Front {
    /// `search_code_tools`, `execute_mcp_code`, `execute_mcp_script`.
    Code,
    /// Every tool of the fleet as an MCP tool of its own, and `get_model_card`.
    Tools,
}

/// Streamable HTTP at `/mcp` and `/tools`: the fleet's bearer token (`nomad_rpc::auth`), the
/// `Host` and `Origin` allowlists, and the same refusal to listen beyond loopback without a
/// credential as every gRPC server.
pub async fn serve(
    code: mcp_server::McpFrontEnd,
    tools: direct::DirectTools,
    front: Front,
    listen: &str,
    http: &crate::config::GatewayConfig,
    addr_file: Option<&std::path::Path>,
    stopped: impl Future<Output = ()> + Send + 'static,
) -> anyhow::Result<()> {
    use rmcp::transport::streamable_http_server::{
        StreamableHttpServerConfig, StreamableHttpService,
    };
    let (header_timeout, body_timeout, session_idle) =
        http.http.timeouts().map_err(anyhow::Error::msg)?;
    let (listener, local) = nomad_rpc::bind(listen).await?;
    let auth = nomad_rpc::auth::installed();
    if !auth.has_client_credential() && !local.ip().is_loopback() && !auth.open {
        anyhow::bail!(
            "the MCP endpoint would listen on {local} with no token: set NOMAD_AUTH_TOKEN (or \
             auth.token), or listen on a loopback address; `auth: none` serves it open"
        );
    }
    if let Some(path) = addr_file {
        nomad_rpc::write_addr_file(path, local)?;
    }
    let mut config = StreamableHttpServerConfig::default();
    // The loopback names rmcp allows by default, plus the names callers reach this gateway by
    // (a compose service or Kubernetes Service name); DNS rebinding stays out.
    config
        .allowed_hosts
        .extend(http.mcp_allowed_hosts.iter().cloned());
    if !http.mcp_allowed_origins.is_empty() {
        config.allowed_origins = http.mcp_allowed_origins.clone();
    }
    let bounded = crate::sessions::Sessions::new(http.http.max_sessions);
    let sessions = || bounded.endpoint(session_idle);
    let openai = crate::openai::router(tools.gateway.clone());
    let direct = {
        let tools = tools.clone();
        StreamableHttpService::new(move || Ok(tools.clone()), sessions(), config.clone())
    };
    let app = match front {
        Front::Code => axum::Router::new().nest_service(
            "/mcp",
            StreamableHttpService::new(move || Ok(code.clone()), sessions(), config),
        ),
        Front::Tools => axum::Router::new().nest_service(
            "/mcp",
            StreamableHttpService::new(move || Ok(tools.clone()), sessions(), config),
        ),
    }
    .nest_service("/tools", direct)
    .layer(axum::middleware::from_fn(move |request, next| {
        refuse_sessions_when_full(bounded.clone(), request, next)
    }))
    .layer(axum::middleware::from_fn(name_the_task))
    .merge(openai)
    .layer(axum::middleware::from_fn(move |request, next| {
        bearer_auth(body_timeout, request, next)
    }));
    tracing::info!(
        "nomad-gateway MCP (Streamable HTTP) listening on http://{local}/mcp ({}) and \
         http://{local}/tools (the fleet's tools)",
        match front {
            Front::Code => "code mode",
            Front::Tools => "the fleet's tools",
        }
    );
    let limits = crate::connections::Limits {
        header_timeout,
        max_connections: http.http.max_connections,
        drain: std::time::Duration::from_secs(10),
    };
    crate::connections::serve(listener, app, limits, stopped).await?;
    Ok(())
}

/// A new MCP session (a POST without `Mcp-Session-Id`) while every session is busy: 503 at
/// once, saying why, rather than rmcp's 500.
async fn refuse_sessions_when_full(
    sessions: Arc<crate::sessions::Sessions>,
    request: axum::extract::Request,
    next: axum::middleware::Next,
) -> axum::response::Response {
    let opens_session =
        request.method() == http::Method::POST && !request.headers().contains_key("mcp-session-id");
    if opens_session && sessions.full() {
        let why = crate::sessions::SessionError::Full {
            max: sessions.max(),
        };
        return refusal(
            http::StatusCode::SERVICE_UNAVAILABLE,
            REFUSED_UNAVAILABLE,
            &why.to_string(),
            [(http::header::RETRY_AFTER, "1")],
        );
    }
    next.run(request).await
}

/// JSON-RPC error codes (the implementation-defined server range) of the refusals the HTTP
/// layer answers before MCP: clients (the official SDK among them) show a JSON-RPC error body's
/// message, where a plain-text one reaches the user as "Server returned an error response".
const REFUSED_UNAUTHENTICATED: i32 = -32001;
const REFUSED_UNAVAILABLE: i32 = -32002;

/// An HTTP refusal of an MCP request, its reason as a JSON-RPC error (`id` null: the request
/// was not read).
fn refusal<const N: usize>(
    status: http::StatusCode,
    code: i32,
    why: &str,
    headers: [(http::HeaderName, &'static str); N],
) -> axum::response::Response {
    use axum::response::IntoResponse as _;
    let body = serde_json::json!({"jsonrpc": "2.0", "id": null,
        "error": {"code": code, "message": why.trim_end()}});
    (status, headers, axum::Json(body)).into_response()
}

/// 401 unless the request carries the fleet's `Authorization: Bearer <token>` (and the
/// connection closes: a caller without the token gets one answer per connection). A request
/// that passes marks its connection as authenticated and has `body_timeout` for its body.
async fn bearer_auth(
    body_timeout: std::time::Duration,
    request: axum::extract::Request,
    next: axum::middleware::Next,
) -> axum::response::Response {
    use axum::response::IntoResponse as _;
    let given = request
        .headers()
        .get(http::header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok());
    let Some(credential) = nomad_rpc::auth::installed().accepts_client(given) else {
        // Say which: a client that sent nothing needs to be told where the token is.
        let why = match given {
            None => {
                "this endpoint needs the fleet's token: send the header `Authorization: Bearer \
                 <token>` (nomad up keeps the token in runs/<run id>/fleet.json, as \"token\"; \
                 a fleet started with NOMAD_AUTH_TOKEN uses that)\n"
            }
            Some(v) if !v.starts_with("Bearer ") => {
                "the Authorization header must be `Bearer <token>` (the fleet's token)\n"
            }
            Some(_) if nomad_rpc::auth::installed().clients.is_empty() => {
                "the bearer token is not this fleet's token\n"
            }
            Some(_) => "the bearer token is not this fleet's token, nor one of its client tokens\n",
        };
        // The OpenAI routes answer in OpenAI's error shape, so its clients show the reason.
        if request.uri().path().starts_with("/v1/") {
            let body = serde_json::json!({"error": {"message": why.trim_end(),
                "type": "invalid_request_error", "param": null, "code": "invalid_api_key"}});
            return (
                http::StatusCode::UNAUTHORIZED,
                [
                    (http::header::WWW_AUTHENTICATE, "Bearer"),
                    (http::header::CONNECTION, "close"),
                ],
                axum::Json(body),
            )
                .into_response();
        }
        return refusal(
            http::StatusCode::UNAUTHORIZED,
            REFUSED_UNAUTHENTICATED,
            why,
            [
                (http::header::WWW_AUTHENTICATE, "Bearer"),
                (http::header::CONNECTION, "close"),
            ],
        );
    };
    let caller = crate::tasks::Caller::with_token(credential);
    let mut request = request;
    request.extensions_mut().insert(caller);
    if let Some(connection) = request.extensions().get::<crate::connections::Connection>() {
        connection.authenticated();
    }
    let deadline = tokio::time::Instant::now() + body_timeout;
    let request = request.map(|body| axum::body::Body::new(DeadlineBody::new(body, deadline)));
    next.run(request).await
}

/// The most a `tasks/*` request's body may hold when its `Mcp-Name` is read from it.
const TASK_REQUEST_BYTES: usize = 64 << 10;

/// A `tasks/get`, `tasks/update` or `tasks/cancel` without the `Mcp-Name` header the
/// 2026-07-28 revision asks for gets it from its `params.taskId`, so that clients which leave it
/// out (fastmcp-tasks among them) are served as those that send it; a header that is there is
/// left to be checked against the body. Runs after the token is checked.
async fn name_the_task(
    request: axum::extract::Request,
    next: axum::middleware::Next,
) -> axum::response::Response {
    let method = match request.headers().get("mcp-method").map(|v| v.as_bytes()) {
        Some(b"tasks/get") => "tasks/get",
        Some(b"tasks/update") => "tasks/update",
        Some(b"tasks/cancel") => "tasks/cancel",
        _ => return next.run(request).await,
    };
    if request.headers().contains_key("mcp-name") {
        return next.run(request).await;
    }
    let (mut parts, body) = request.into_parts();
    let bytes = match axum::body::to_bytes(body, TASK_REQUEST_BYTES).await {
        Ok(bytes) => bytes,
        Err(e) => {
            return refusal(
                http::StatusCode::BAD_REQUEST,
                rmcp::model::ErrorCode::INVALID_REQUEST.0,
                &format!(
                    "a {method} request of more than {TASK_REQUEST_BYTES} bytes, or cut off: {e}"
                ),
                [],
            );
        }
    };
    let task_id = serde_json::from_slice::<serde_json::Value>(&bytes)
        .ok()
        .and_then(|v| v["params"]["taskId"].as_str().map(str::to_owned))
        .and_then(|id| http::HeaderValue::from_str(&id).ok());
    if let Some(task_id) = task_id {
        parts.headers.insert("mcp-name", task_id);
    }
    next.run(axum::extract::Request::from_parts(
        parts,
        axum::body::Body::from(bytes),
    ))
    .await
}

/// A request body that fails once its deadline passes before it has all arrived.
struct DeadlineBody {
    body: axum::body::Body,
    deadline: std::pin::Pin<Box<tokio::time::Sleep>>,
}

impl DeadlineBody {
    fn new(body: axum::body::Body, deadline: tokio::time::Instant) -> Self {
        Self {
            body,
            deadline: Box::pin(tokio::time::sleep_until(deadline)),
        }
    }
}

impl http_body::Body for DeadlineBody {
    type Data = axum::body::Bytes;
    type Error = axum::BoxError;

    fn poll_frame(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<http_body::Frame<Self::Data>, Self::Error>>> {
        use std::task::Poll;
        if let Poll::Ready(frame) = std::pin::Pin::new(&mut self.body).poll_frame(cx) {
            return Poll::Ready(frame.map(|f| f.map_err(Into::into)));
        }
        match self.deadline.as_mut().poll(cx) {
            Poll::Ready(()) => Poll::Ready(Some(Err(
                "the request's body did not arrive within gateway.http.body_timeout_seconds".into(),
            ))),
            Poll::Pending => Poll::Pending,
        }
    }

    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        self.body.size_hint()
    }
}

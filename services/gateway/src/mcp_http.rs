//! MCP over Streamable HTTP at `/mcp`, behind the bearer token.

use std::net::SocketAddr;
use std::sync::Arc;

use crate::mcp_server;

/// Streamable HTTP at `/mcp`. Without a token it only binds loopback addresses.
pub async fn serve(
    front: mcp_server::McpFrontEnd,
    listen: &str,
    token: Option<String>,
    addr_file: Option<&std::path::Path>,
    stopped: impl Future<Output = ()> + Send + 'static,
) -> anyhow::Result<()> {
    use rmcp::transport::streamable_http_server::session::local::LocalSessionManager;
    use rmcp::transport::streamable_http_server::{
        StreamableHttpServerConfig, StreamableHttpService,
    };
    let (listener, local) = nomad_rpc::bind(listen).await?;
    anyhow::ensure!(
        token.is_some() || local.ip().is_loopback(),
        "the MCP endpoint would listen on {local} with no token: set gateway.token or \
         NOMAD_GATEWAY_TOKEN, or listen on a loopback address"
    );
    if let Some(path) = addr_file {
        nomad_rpc::write_addr_file(path, local)?;
    }
    let service = StreamableHttpService::new(
        move || Ok(front.clone()),
        Arc::new(LocalSessionManager::default()),
        StreamableHttpServerConfig::default(),
    );
    let app = axum::Router::new().nest_service("/mcp", service).layer(
        axum::middleware::from_fn_with_state(Arc::new(token), bearer_auth),
    );
    tracing::info!("nomad-gateway MCP (Streamable HTTP) listening on http://{local}/mcp");
    axum::serve(listener, app)
        .with_graceful_shutdown(stopped)
        .await?;
    let _: SocketAddr = local;
    Ok(())
}

/// 401 unless the request carries `Authorization: Bearer <token>` (when a token is set).
async fn bearer_auth(
    axum::extract::State(token): axum::extract::State<Arc<Option<String>>>,
    request: axum::extract::Request,
    next: axum::middleware::Next,
) -> axum::response::Response {
    use axum::response::IntoResponse as _;
    if let Some(expected) = token.as_deref() {
        let given = request
            .headers()
            .get(http::header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.strip_prefix("Bearer "));
        // Constant-time compare: a mismatch takes as long wherever it is.
        let ok = given.is_some_and(|g| {
            g.len() == expected.len()
                && g.bytes()
                    .zip(expected.bytes())
                    .fold(0u8, |acc, (a, b)| acc | (a ^ b))
                    == 0
        });
        if !ok {
            return (
                http::StatusCode::UNAUTHORIZED,
                [(http::header::WWW_AUTHENTICATE, "Bearer")],
                "missing or wrong bearer token",
            )
                .into_response();
        }
    }
    next.run(request).await
}

//! MCP over Streamable HTTP at `/mcp`, behind the bearer token.

use std::sync::Arc;

use crate::mcp_server;

/// Streamable HTTP at `/mcp`: the fleet's bearer token (`nomad_rpc::auth`), the `Host` and
/// `Origin` allowlists, and the same refusal to listen beyond loopback without a credential as
/// every gRPC server.
pub async fn serve(
    front: mcp_server::McpFrontEnd,
    listen: &str,
    http: &crate::config::GatewayConfig,
    addr_file: Option<&std::path::Path>,
    stopped: impl Future<Output = ()> + Send + 'static,
) -> anyhow::Result<()> {
    use rmcp::transport::streamable_http_server::session::local::LocalSessionManager;
    use rmcp::transport::streamable_http_server::{
        StreamableHttpServerConfig, StreamableHttpService,
    };
    let (listener, local) = nomad_rpc::bind(listen).await?;
    let auth = nomad_rpc::auth::installed();
    if auth.token.is_none() && !local.ip().is_loopback() && !auth.open {
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
    let service = StreamableHttpService::new(
        move || Ok(front.clone()),
        Arc::new(LocalSessionManager::default()),
        config,
    );
    let app = axum::Router::new()
        .nest_service("/mcp", service)
        .layer(axum::middleware::from_fn(bearer_auth));
    tracing::info!("nomad-gateway MCP (Streamable HTTP) listening on http://{local}/mcp");
    axum::serve(listener, app)
        .with_graceful_shutdown(stopped)
        .await?;
    Ok(())
}

/// 401 unless the request carries the fleet's `Authorization: Bearer <token>`.
async fn bearer_auth(
    request: axum::extract::Request,
    next: axum::middleware::Next,
) -> axum::response::Response {
    use axum::response::IntoResponse as _;
    let given = request
        .headers()
        .get(http::header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok());
    if !nomad_rpc::auth::installed().accepts(given) {
        return (
            http::StatusCode::UNAUTHORIZED,
            [(http::header::WWW_AUTHENTICATE, "Bearer")],
            "missing or wrong bearer token",
        )
            .into_response();
    }
    next.run(request).await
}

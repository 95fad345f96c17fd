//! The one credential of a fleet: a bearer token on every gRPC hop (and the gateway's MCP
//! endpoint), checked by one tower layer on every server and sent by one on every client. With
//! TLS, client certificates (`tls.client_ca`) can stand in for it or come on top.
//!
//! The token comes from `NOMAD_AUTH_TOKEN`, else `auth.token`, else the file `auth.token_file`.
//! The gateway's HTTP front (MCP and the OpenAI routes) also takes the client tokens of
//! `auth.client_tokens_file`, one per client: each is a credential of its own there (a task is
//! read only with the credential that made it), and none of them reaches a gRPC hop.
//! Without one a process serves only on loopback, unless the config says `auth: none`, which is
//! logged as an error at start-up. Health checks stay open.

use std::future::Future;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::pin::Pin;
use std::sync::{Arc, OnceLock};
use std::task::{Context, Poll};

use nomad_config::{ConfigFile, Env};
use serde::Deserialize;
use tower::{Layer, Service};

use crate::RpcError;

/// The `auth:` section: `none`, or a token (inline or in a file).
#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(untagged)]
pub enum AuthBlock {
    /// `auth: none`: serve without a credential, even beyond loopback.
    Mode(String),
    Token {
        token: Option<String>,
        token_file: Option<PathBuf>,
        /// One client token per line (`#` comments and blank lines skipped).
        client_tokens_file: Option<PathBuf>,
    },
}

impl Default for AuthBlock {
    fn default() -> Self {
        AuthBlock::Token {
            token: None,
            token_file: None,
            client_tokens_file: None,
        }
    }
}

/// What a process checks and sends.
#[derive(Debug, Clone, Default)]
pub struct Auth {
    pub token: Option<Arc<str>>,
    /// Tokens the gateway's HTTP front accepts besides the fleet's, one per client.
    pub clients: Vec<Arc<str>>,
    /// `auth: none` was written out.
    pub open: bool,
}

/// The shortest token accepted: a guessable one is no credential.
pub const MIN_TOKEN_LEN: usize = 16;

impl Auth {
    /// The section and `NOMAD_AUTH_TOKEN` (which wins).
    pub fn resolve(file: &ConfigFile, env: &(impl Env + ?Sized)) -> Result<Self, RpcError> {
        let block: AuthBlock = file
            .section("auth")
            .map_err(|e| RpcError::Auth(e.to_string()))?;
        let (configured, clients, open) = match block {
            AuthBlock::Mode(mode) if mode == "none" => (None, Vec::new(), true),
            AuthBlock::Mode(other) => {
                return Err(RpcError::Auth(format!(
                    "auth: {other:?} is not a mode; write `auth: none` or `auth: {{token: ...}}`"
                )));
            }
            AuthBlock::Token {
                token,
                token_file,
                client_tokens_file,
            } => {
                let from_file = token_file
                    .map(|path| {
                        std::fs::read_to_string(&path)
                            .map(|t| t.trim().to_owned())
                            .map_err(|e| {
                                RpcError::Auth(format!("auth.token_file {}: {e}", path.display()))
                            })
                    })
                    .transpose()?;
                let clients = match client_tokens_file {
                    Some(path) => client_tokens(&path)?,
                    None => Vec::new(),
                };
                (token.or(from_file), clients, false)
            }
        };
        let token = env.non_empty("NOMAD_AUTH_TOKEN").or(configured);
        if let Some(t) = &token
            && t.len() < MIN_TOKEN_LEN
        {
            return Err(RpcError::Auth(format!(
                "the fleet token is {} characters; use at least {MIN_TOKEN_LEN} (nomad up makes \
                 a random one)",
                t.len()
            )));
        }
        Ok(Auth {
            token: token.map(Arc::from),
            clients,
            open,
        })
    }

    /// Whether `Authorization` carries this process's token (constant time in the token).
    pub fn accepts(&self, authorization: Option<&str>) -> bool {
        let Some(expected) = self.token.as_deref() else {
            return true;
        };
        same_token(bearer(authorization), expected)
    }

    /// The gateway's HTTP front: the credential `Authorization` carries if it is the fleet's
    /// token or a client token (`Some(None)`: nothing to check, the front is open), `None` if
    /// it is neither.
    pub fn accepts_client<'a>(&self, authorization: Option<&'a str>) -> Option<Option<&'a str>> {
        if self.token.is_none() && self.clients.is_empty() {
            return Some(None);
        }
        let given = bearer(authorization);
        // Every token compared, so the time taken says nothing of which one matched.
        let matched = self
            .token
            .iter()
            .chain(&self.clients)
            .fold(false, |found, t| same_token(given, t) | found);
        matched.then_some(Some(given))
    }

    /// Whether the gateway's HTTP front has any credential to check.
    pub fn has_client_credential(&self) -> bool {
        self.token.is_some() || !self.clients.is_empty()
    }

    /// Refuses to serve on `local` beyond loopback without a credential (a token, or client
    /// certificates), unless `auth: none` says to.
    pub fn check_listen(&self, what: &str, local: SocketAddr) -> Result<(), RpcError> {
        let credential = self.token.is_some() || crate::tls::requires_client_certificates();
        if local.ip().is_loopback() || credential {
            return Ok(());
        }
        if self.open {
            tracing::error!(
                "{what} serves {local} with NO CREDENTIAL (auth: none): anyone who can reach it \
                 can use it"
            );
            return Ok(());
        }
        Err(RpcError::Auth(format!(
            "{what} would listen on {local} with no credential: set NOMAD_AUTH_TOKEN (or \
             auth.token / auth.token_file), or tls.client_ca, or listen on a loopback address; \
             `auth: none` serves it open"
        )))
    }
}

fn bearer(authorization: Option<&str>) -> &str {
    authorization
        .and_then(|v| v.strip_prefix("Bearer "))
        .unwrap_or_default()
}

/// Compares in time that depends on the expected token's length only.
fn same_token(given: &str, expected: &str) -> bool {
    given.len() == expected.len()
        && given
            .bytes()
            .zip(expected.bytes())
            .fold(0u8, |acc, (a, b)| acc | (a ^ b))
            == 0
}

/// `auth.client_tokens_file`: one token per line, each at least [`MIN_TOKEN_LEN`] long.
fn client_tokens(path: &std::path::Path) -> Result<Vec<Arc<str>>, RpcError> {
    let text = std::fs::read_to_string(path)
        .map_err(|e| RpcError::Auth(format!("auth.client_tokens_file {}: {e}", path.display())))?;
    let mut tokens = Vec::new();
    for (i, line) in text.lines().enumerate() {
        let line = line.trim();
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        if line.len() < MIN_TOKEN_LEN || line.contains(char::is_whitespace) {
            return Err(RpcError::Auth(format!(
                "auth.client_tokens_file {} line {}: a client token is one word of at least \
                 {MIN_TOKEN_LEN} characters (`openssl rand -hex 16` makes one)",
                path.display(),
                i + 1
            )));
        }
        tokens.push(Arc::from(line));
    }
    Ok(tokens)
}

/// The process's credential, installed once at start-up by the bootstrap; the layers are built
/// with it (and tests build them with their own).
static AUTH: OnceLock<Auth> = OnceLock::new();

/// The installed credential (none until [`configure_from`] ran).
pub fn installed() -> &'static Auth {
    AUTH.get_or_init(Auth::default)
}

/// Reads the `auth:` section and the environment and installs them, once per process.
pub fn configure_from(file: &ConfigFile) -> Result<&'static Auth, RpcError> {
    install(Auth::resolve(file, &nomad_config::ProcessEnv)?)
}

/// Installs `auth`, once per process, before any server or channel exists.
pub fn install(auth: Auth) -> Result<&'static Auth, RpcError> {
    AUTH.set(auth)
        .map_err(|_| RpcError::Auth("auth was configured twice in one process".into()))?;
    Ok(installed())
}

/// The one call that stays open: container and orchestrator health checks carry no credential.
/// `Watch` holds a stream open, so it needs the token like everything else (unauthenticated,
/// thousands of them would cost the server memory for as long as the caller likes).
fn open_path(path: &str) -> bool {
    path == "/grpc.health.v1.Health/Check"
}

type BoxFuture<T> = Pin<Box<dyn Future<Output = T> + Send + 'static>>;

/// Server side: answers UNAUTHENTICATED to a call without the token it was built with.
#[derive(Debug, Clone, Default)]
pub struct ServerAuthLayer {
    auth: Arc<Auth>,
}

impl ServerAuthLayer {
    pub fn new(auth: Auth) -> Self {
        Self {
            auth: Arc::new(auth),
        }
    }
}

impl<S> Layer<S> for ServerAuthLayer {
    type Service = ServerAuth<S>;

    fn layer(&self, inner: S) -> Self::Service {
        ServerAuth {
            inner,
            auth: self.auth.clone(),
        }
    }
}

#[derive(Debug, Clone)]
pub struct ServerAuth<S> {
    inner: S,
    auth: Arc<Auth>,
}

impl<S, B, ResB> Service<http::Request<B>> for ServerAuth<S>
where
    S: Service<http::Request<B>, Response = http::Response<ResB>>,
    S::Future: Send + 'static,
    S::Error: 'static,
    ResB: Default + Send + 'static,
{
    type Response = S::Response;
    type Error = S::Error;
    type Future = BoxFuture<Result<S::Response, S::Error>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, mut request: http::Request<B>) -> Self::Future {
        let authorization = request
            .headers()
            .get(http::header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok());
        if self.auth.accepts(authorization) {
            return Box::pin(self.inner.call(request));
        }
        if open_path(request.uri().path()) {
            // Answered without the token, so it carries none of the caller's trace context:
            // its span starts a trace of its own and names no one's run.
            for header in ["traceparent", "tracestate", "baggage"] {
                request.headers_mut().remove(header);
            }
            return Box::pin(self.inner.call(request));
        }
        let message = if authorization.is_some() {
            "wrong bearer token"
        } else {
            "this Nomad fleet requires its bearer token (authorization: Bearer <token>; nomad up \
             writes it to fleet.json)"
        };
        let response = tonic::Status::unauthenticated(message).into_http::<ResB>();
        Box::pin(async move { Ok(response) })
    }
}

/// Client side: sends the token it was built with on every call (none: nothing).
#[derive(Debug, Clone, Default)]
pub struct ClientAuthLayer {
    authorization: Option<http::HeaderValue>,
}

impl ClientAuthLayer {
    pub fn new(auth: &Auth) -> Self {
        let authorization = auth.token.as_deref().and_then(|token| {
            let mut value = http::HeaderValue::from_str(&format!("Bearer {token}")).ok()?;
            value.set_sensitive(true);
            Some(value)
        });
        Self { authorization }
    }
}

impl<S> Layer<S> for ClientAuthLayer {
    type Service = ClientAuth<S>;

    fn layer(&self, inner: S) -> Self::Service {
        ClientAuth {
            inner,
            authorization: self.authorization.clone(),
        }
    }
}

#[derive(Debug, Clone)]
pub struct ClientAuth<S> {
    inner: S,
    authorization: Option<http::HeaderValue>,
}

impl<S, B> Service<http::Request<B>> for ClientAuth<S>
where
    S: Service<http::Request<B>>,
{
    type Response = S::Response;
    type Error = S::Error;
    type Future = S::Future;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, mut request: http::Request<B>) -> Self::Future {
        if let Some(value) = &self.authorization {
            request
                .headers_mut()
                .insert(http::header::AUTHORIZATION, value.clone());
        }
        self.inner.call(request)
    }
}

/// A fresh random token (128 bits, hex).
pub fn random_token() -> String {
    format!(
        "{}{}",
        uuid::Uuid::new_v4().simple(),
        uuid::Uuid::new_v4().simple()
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn resolve(yaml: &str, env: &[(&str, &str)]) -> Result<Auth, RpcError> {
        Auth::resolve(&ConfigFile::from_yaml_str(yaml), env)
    }

    #[test]
    fn the_token_comes_from_the_env_then_the_file_and_must_be_long() {
        let auth = resolve("auth: {token: aaaaaaaaaaaaaaaaaaaa}\n", &[]).unwrap();
        assert_eq!(auth.token.as_deref(), Some("aaaaaaaaaaaaaaaaaaaa"));
        let auth = resolve(
            "auth: {token: aaaaaaaaaaaaaaaaaaaa}\n",
            &[("NOMAD_AUTH_TOKEN", "bbbbbbbbbbbbbbbbbbbb")],
        )
        .unwrap();
        assert_eq!(auth.token.as_deref(), Some("bbbbbbbbbbbbbbbbbbbb"));
        let e = resolve("auth: {token: short}\n", &[])
            .unwrap_err()
            .to_string();
        assert!(e.contains("at least 16"), "{e}");
        let e = resolve("auth: maybe\n", &[]).unwrap_err().to_string();
        assert!(e.contains("auth: none"), "{e}");
        assert!(resolve("auth: none\n", &[]).unwrap().open);
        assert!(resolve("", &[]).unwrap().token.is_none());
    }

    #[test]
    fn only_the_exact_bearer_token_is_accepted() {
        let auth = Auth {
            token: Some(Arc::from("0123456789abcdef0123")),
            ..Auth::default()
        };
        assert!(auth.accepts(Some("Bearer 0123456789abcdef0123")));
        for bad in [
            None,
            Some("Bearer 0123456789abcdef012"),
            Some("Bearer 0123456789abcdef01234"),
            Some("0123456789abcdef0123"),
            Some("Bearer x123456789abcdef0123"),
        ] {
            assert!(!auth.accepts(bad), "{bad:?}");
        }
        assert!(Auth::default().accepts(None), "no token: nothing to check");
    }

    /// The layers carry their own credential: a server built with one token refuses another,
    /// and a client built with a token sends it; nothing is read from the process.
    #[tokio::test]
    async fn each_layer_checks_and_sends_the_token_it_was_built_with() {
        let auth = |token: &str| Auth {
            token: Some(Arc::from(token)),
            ..Auth::default()
        };
        let echo = tower::service_fn(|request: http::Request<()>| async move {
            let seen = request
                .headers()
                .get(http::header::AUTHORIZATION)
                .map(|v| v.to_str().unwrap().to_owned());
            Ok::<_, std::convert::Infallible>(http::Response::new(seen))
        });
        let client = ClientAuthLayer::new(&auth("0123456789abcdef0123")).layer(echo);
        let sent = tower::ServiceExt::oneshot(client, http::Request::new(()))
            .await
            .unwrap()
            .into_body();
        assert_eq!(sent.as_deref(), Some("Bearer 0123456789abcdef0123"));

        let grpc_status = |response: &http::Response<Option<String>>| {
            response
                .headers()
                .get("grpc-status")
                .map(|v| v.to_str().unwrap().to_owned())
        };
        let server = |token: &str| ServerAuthLayer::new(auth(token)).layer(echo);
        let call = |token: &str| {
            http::Request::builder()
                .uri("/nomad.v1.Scheduler/CallTool")
                .header("authorization", format!("Bearer {token}"))
                .body(())
                .unwrap()
        };
        let refused = tower::ServiceExt::oneshot(
            server("0123456789abcdef0123"),
            call("ffffffffffffffffffff"),
        )
        .await
        .unwrap();
        assert_eq!(
            grpc_status(&refused).as_deref(),
            Some("16"),
            "UNAUTHENTICATED"
        );
        let accepted = tower::ServiceExt::oneshot(
            server("ffffffffffffffffffff"),
            call("ffffffffffffffffffff"),
        )
        .await
        .unwrap();
        assert_eq!(grpc_status(&accepted), None);
        assert_eq!(
            accepted.into_body().as_deref(),
            Some("Bearer ffffffffffffffffffff")
        );
    }

    #[test]
    fn client_tokens_open_the_http_front_each_as_itself_and_never_a_grpc_hop() {
        let dir = std::env::temp_dir().join(format!("nomad-auth-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let file = dir.join("clients");
        std::fs::write(
            &file,
            "# one per client\naaaaaaaaaaaaaaaaaaaa\n\nbbbbbbbbbbbbbbbbbbbb\n",
        )
        .unwrap();
        let yaml = format!(
            "auth: {{token: ffffffffffffffffffff, client_tokens_file: {}}}\n",
            file.display()
        );
        let auth = resolve(&yaml, &[]).unwrap();
        assert_eq!(auth.clients.len(), 2);
        let a = Some("Bearer aaaaaaaaaaaaaaaaaaaa");
        assert_eq!(auth.accepts_client(a), Some(Some("aaaaaaaaaaaaaaaaaaaa")));
        assert_eq!(
            auth.accepts_client(Some("Bearer ffffffffffffffffffff")),
            Some(Some("ffffffffffffffffffff"))
        );
        assert_eq!(
            auth.accepts_client(Some("Bearer cccccccccccccccccccc")),
            None
        );
        assert_eq!(auth.accepts_client(None), None);
        assert!(!auth.accepts(a), "a client token is no fleet token");
        assert_eq!(Auth::default().accepts_client(None), Some(None));
        std::fs::write(&file, "aaaaaaaaaaaaaaaaaaaa\nshort\n").unwrap();
        let e = resolve(&yaml, &[]).unwrap_err().to_string();
        assert!(e.contains("line 2") && e.contains("at least 16"), "{e}");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn no_credential_means_loopback_only_unless_auth_none() {
        let none = Auth::default();
        let loopback: SocketAddr = "127.0.0.1:7002".parse().unwrap();
        let everywhere: SocketAddr = "0.0.0.0:7002".parse().unwrap();
        assert!(none.check_listen("x", loopback).is_ok());
        let e = none.check_listen("x", everywhere).unwrap_err().to_string();
        assert!(
            e.contains("NOMAD_AUTH_TOKEN") && e.contains("auth: none"),
            "{e}"
        );
        let open = Auth {
            open: true,
            ..Auth::default()
        };
        assert!(open.check_listen("x", everywhere).is_ok());
        let token = Auth {
            token: Some(Arc::from("0123456789abcdef0123")),
            ..Auth::default()
        };
        assert!(token.check_listen("x", everywhere).is_ok());
    }
}

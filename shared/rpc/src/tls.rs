//! Optional TLS on every gRPC hop of a process, from the `tls:` config section or `NOMAD_TLS_*`
//! variables (which win). With a CA, every channel the process opens is TLS and verifies its peer
//! against that CA; with a certificate and key, every server it runs is TLS. Installed once at
//! start-up, before any channel or server exists.

use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use nomad_config::{ConfigFile, Env};
use serde::Deserialize;
use tonic::transport::{Certificate, ClientTlsConfig, Identity, ServerTlsConfig};

use crate::RpcError;

/// The `tls:` section.
#[derive(Debug, Clone, Default, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct TlsBlock {
    /// This server's certificate chain (PEM).
    pub cert: Option<PathBuf>,
    /// This server's private key (PEM).
    pub key: Option<PathBuf>,
    /// The CA that signed every Nomad server's certificate (PEM): peers are verified with it.
    pub ca: Option<PathBuf>,
    /// The name to verify in peers' certificates (default: the host of the address dialled).
    pub server_name: Option<String>,
    /// The CA that signed the clients' certificates: set, a server accepts only clients that
    /// present one (mutual TLS), and clients present `cert` and `key`.
    pub client_ca: Option<PathBuf>,
}

impl TlsBlock {
    /// The section, with `NOMAD_TLS_CERT`, `NOMAD_TLS_KEY`, `NOMAD_TLS_CA` and
    /// `NOMAD_TLS_SERVER_NAME` taking precedence.
    pub fn resolve(file: &ConfigFile, env: &(impl Env + ?Sized)) -> Result<Self, RpcError> {
        let block: TlsBlock = file
            .section("tls")
            .map_err(|e| RpcError::Tls(e.to_string()))?;
        Ok(TlsBlock {
            cert: env
                .non_empty("NOMAD_TLS_CERT")
                .map(PathBuf::from)
                .or(block.cert),
            key: env
                .non_empty("NOMAD_TLS_KEY")
                .map(PathBuf::from)
                .or(block.key),
            ca: env
                .non_empty("NOMAD_TLS_CA")
                .map(PathBuf::from)
                .or(block.ca),
            server_name: env.non_empty("NOMAD_TLS_SERVER_NAME").or(block.server_name),
            client_ca: env
                .non_empty("NOMAD_TLS_CLIENT_CA")
                .map(PathBuf::from)
                .or(block.client_ca),
        })
    }
}

#[derive(Debug, Clone, Default)]
pub(crate) struct Tls {
    pub(crate) client: Option<ClientTlsConfig>,
    pub(crate) server: Option<ServerTlsConfig>,
    /// Servers require client certificates.
    pub(crate) mutual: bool,
}

/// Whether this process's servers accept only clients with a certificate of `tls.client_ca`.
pub fn requires_client_certificates() -> bool {
    installed().mutual
}

static TLS: OnceLock<Tls> = OnceLock::new();

pub(crate) fn installed() -> &'static Tls {
    TLS.get_or_init(Tls::default)
}

fn read(what: &str, path: &Path) -> Result<Vec<u8>, RpcError> {
    std::fs::read(path).map_err(|e| RpcError::Tls(format!("{what} {}: {e}", path.display())))
}

/// Loads and installs the process's TLS settings; `serves` says whether it runs a gRPC server
/// (which then needs a certificate and key whenever TLS is on). Returns whether TLS is on.
pub fn configure(block: &TlsBlock, serves: bool) -> Result<bool, RpcError> {
    let mut tls = Tls::default();
    let mut identity = None;
    match (&block.cert, &block.key) {
        (Some(cert), Some(key)) => {
            let id = Identity::from_pem(read("tls.cert", cert)?, read("tls.key", key)?);
            // A TLS handshake that does not finish in time is dropped, as a silent connection
            // is (`incoming`).
            let mut server = ServerTlsConfig::new()
                .identity(id.clone())
                .timeout(std::time::Duration::from_secs(10));
            if let Some(client_ca) = &block.client_ca {
                server =
                    server.client_ca_root(Certificate::from_pem(read("tls.client_ca", client_ca)?));
                tls.mutual = true;
            }
            tls.server = Some(server);
            identity = Some(id);
        }
        (None, None) => {}
        (Some(_), None) => return Err(RpcError::Tls("tls.cert is set but tls.key is not".into())),
        (None, Some(_)) => return Err(RpcError::Tls("tls.key is set but tls.cert is not".into())),
    }
    if let Some(ca) = &block.ca {
        let mut client =
            ClientTlsConfig::new().ca_certificate(Certificate::from_pem(read("tls.ca", ca)?));
        if let Some(name) = &block.server_name {
            client = client.domain_name(name.clone());
        }
        // Where servers ask for client certificates, this process presents its own.
        if block.client_ca.is_some()
            && let Some(id) = identity
        {
            client = client.identity(id);
        }
        tls.client = Some(client);
    }
    if serves && tls.client.is_some() != tls.server.is_some() {
        return Err(RpcError::Tls(
            "a Nomad server needs tls.ca (to dial its peers over TLS) and tls.cert + tls.key \
             (to serve TLS) together, or none of them"
                .into(),
        ));
    }
    if block.client_ca.is_some() && tls.server.is_none() && serves {
        return Err(RpcError::Tls(
            "tls.client_ca is set but tls.cert and tls.key are not: mutual TLS needs both".into(),
        ));
    }
    if !serves && tls.server.is_some() && tls.client.is_none() {
        return Err(RpcError::Tls(
            "tls.cert is set but tls.ca is not: clients need the CA".into(),
        ));
    }
    let on = tls.client.is_some();
    TLS.set(tls)
        .map_err(|_| RpcError::Tls("TLS was configured twice in one process".into()))?;
    Ok(on)
}

/// Reads the `tls:` section and the environment, and installs them (see [`configure`]).
pub fn configure_from(file: &ConfigFile, serves: bool) -> Result<bool, RpcError> {
    configure(&TlsBlock::resolve(file, &nomad_config::ProcessEnv)?, serves)
}

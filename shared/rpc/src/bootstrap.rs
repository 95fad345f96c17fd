//! The one start-up every Nomad service shares: read the config file, install TLS, resolve the
//! telemetry settings and start them under the service's identity; bind and serve gRPC with the
//! standard stack; flush telemetry on the way out. A `main.rs` then only wires its own parts.

use std::future::Future;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use nomad_config::ConfigFile;
use nomad_telemetry::startup::{Phases, Startup};
use nomad_telemetry::{
    InitOptions, KeyValue, ServerIdentity, ServerType, Telemetry, TelemetrySettings,
};
use tokio::net::TcpListener;

use crate::RpcError;

/// The arguments every service takes (`#[command(flatten)]`).
#[derive(clap::Args, Debug, Clone, Default)]
pub struct ServiceArgs {
    /// Config file (YAML or TOML): `telemetry:`, `tls:` and the service's own sections.
    #[arg(long, env = "NOMAD_CONFIG")]
    pub config: Option<PathBuf>,
    /// Server name in telemetry (default: the service's kind).
    #[arg(long)]
    pub server_name: Option<String>,
    /// Write the bound gRPC address here once listening.
    #[arg(long)]
    pub addr_file: Option<PathBuf>,
}

/// `/metrics` needs the fleet's token whenever the fleet has one, on loopback too (every local
/// user can reach a loopback port); without one it is open on loopback only (`auth: none`
/// serves it open beyond, logged).
fn scrape_auth(
    listen: SocketAddr,
) -> Result<Option<nomad_telemetry::scrape::ScrapeAuth>, RpcError> {
    let auth = crate::auth::installed();
    if auth.token.is_some() {
        let accepts =
            std::sync::Arc::new(|given: Option<&str>| crate::auth::installed().accepts(given));
        return Ok(Some(nomad_telemetry::scrape::ScrapeAuth(accepts)));
    }
    if listen.ip().is_loopback() || auth.open {
        return Ok(None);
    }
    Err(RpcError::Auth(format!(
        "telemetry.prometheus_listen would serve /metrics on {listen} with no credential: set \
         NOMAD_AUTH_TOKEN (scrapers then send `Authorization: Bearer <token>`), or listen on a \
         loopback address; `auth: none` serves it open"
    )))
}

/// How a service starts beyond its arguments.
#[derive(Debug, Clone)]
pub struct StartOptions {
    /// Whether it serves gRPC (TLS then needs a certificate, not only a CA).
    pub serves: bool,
    pub init: InitOptions,
    /// Number of GPUs, for the `host.gpu.count` resource attribute.
    pub gpu_count: Option<u64>,
    /// The fleet's token when neither `NOMAD_AUTH_TOKEN` nor the config gives one (a client
    /// that read it from `fleet.json`).
    pub token: Option<String>,
    /// Start-up phases timed so far. A serving process traces its start-up anyway (until it
    /// listens); one that does not serve only when it gives these (`nomad up`).
    pub startup: Option<Phases>,
    /// Telemetry variables that apply where the environment sets none (a client of a fleet
    /// takes the fleet's).
    pub env_defaults: Vec<(String, String)>,
}

impl Default for StartOptions {
    fn default() -> Self {
        Self {
            serves: true,
            init: InitOptions::default(),
            gpu_count: None,
            token: None,
            startup: None,
            env_defaults: Vec::new(),
        }
    }
}

/// A started service: its config, identity and running telemetry.
pub struct Service {
    pub config: ConfigFile,
    pub identity: ServerIdentity,
    /// Open until the service listens (or its owner finishes it).
    pub startup: Startup,
    telemetry: Telemetry,
    /// A server (says when it stops) or a client command (stops quietly).
    serves: bool,
}

impl Service {
    /// Config, TLS and telemetry for a service of `kind`.
    pub fn start(kind: ServerType, args: &ServiceArgs) -> anyhow::Result<Self> {
        Self::start_with(kind, args, StartOptions::default(), |_| Ok(()))
    }

    /// As [`Service::start`]; `adjust` may change the resolved telemetry settings before they
    /// take effect (the head gives its run id there).
    pub fn start_with(
        kind: ServerType,
        args: &ServiceArgs,
        mut options: StartOptions,
        adjust: impl FnOnce(&mut TelemetrySettings) -> anyhow::Result<()>,
    ) -> anyhow::Result<Self> {
        let mut phases = options.startup.take().unwrap_or_default();
        let config = ConfigFile::load(args.config.as_deref())?;
        crate::tls::configure_from(&config, options.serves)?;
        let mut auth = crate::auth::Auth::resolve(&config, &nomad_config::ProcessEnv)?;
        if auth.token.is_none() {
            auth.token = options.token.clone().map(Into::into);
        }
        crate::auth::install(auth)?;
        let block: nomad_telemetry::TelemetryBlock = config.section("telemetry")?;
        let env = nomad_config::Layered {
            user: &nomad_config::ProcessEnv,
            defaults: &options.env_defaults,
        };
        let mut settings = nomad_telemetry::config::resolve(&block, &env)?;
        adjust(&mut settings)?;
        phases.mark("config");
        if options.serves {
            options.startup = Some(phases);
        }
        Self::with_settings(kind, args.server_name.clone(), config, settings, options)
    }

    /// TLS and auth are configured and the settings resolved already (`nomad up` resolves them against
    /// its own defaults and needs the run id first): starts telemetry under the identity.
    pub fn with_settings(
        kind: ServerType,
        server_name: Option<String>,
        config: ConfigFile,
        settings: TelemetrySettings,
        mut options: StartOptions,
    ) -> anyhow::Result<Self> {
        let mut open_metrics = None;
        if let Some(listen) = settings.prometheus_listen {
            options.init.scrape_auth = scrape_auth(listen)?;
            open_metrics = options
                .init
                .scrape_auth
                .is_none()
                .then_some(listen)
                .filter(|l| !l.ip().is_loopback());
        }
        let mut identity = ServerIdentity::new(kind).named(server_name);
        identity.gpu_count = options.gpu_count;
        let run_id = settings.run_id.clone();
        let telemetry = nomad_telemetry::init(settings, &identity, options.init)?;
        if let Some(listen) = open_metrics {
            tracing::error!(
                "telemetry.prometheus_listen serves {listen} with NO CREDENTIAL (auth: none): \
                 anyone who can reach it reads the fleet's metrics"
            );
        }
        let startup = match options.startup {
            Some(mut phases) => {
                phases.mark("telemetry");
                let name = if kind == ServerType::Head {
                    "nomad.startup"
                } else {
                    "nomad.server.startup"
                };
                let mut attributes = vec![KeyValue::new("nomad.server.type", kind.as_str())];
                attributes.extend(run_id.map(|id| KeyValue::new("nomad.run.id", id)));
                // A server started by `nomad up` continues the head's start-up trace.
                let parent = nomad_telemetry::propagation::extract_env(&nomad_config::ProcessEnv);
                Startup::open(name, phases, &parent, attributes)
            }
            None => Startup::disabled(),
        };
        Ok(Self {
            config,
            identity,
            startup,
            telemetry,
            serves: options.serves,
        })
    }

    /// Binds `listen` (`127.0.0.1:0` picks a free port), writes `addr_file` and says where it
    /// listens.
    pub async fn listen(
        &self,
        what: &str,
        listen: &str,
        addr_file: Option<&std::path::Path>,
    ) -> anyhow::Result<(TcpListener, SocketAddr)> {
        let phase = self.startup.phase("listen", vec![]);
        let (listener, local) = crate::bind(listen).await?;
        crate::auth::installed().check_listen(what, local)?;
        if let Some(path) = addr_file {
            crate::write_addr_file(path, local)?;
        }
        tracing::info!("{what} listening on {local}");
        phase.end();
        self.startup.finish();
        Ok((listener, local))
    }

    /// Flushes telemetry (at most 5 s).
    pub async fn stop(self) {
        if self.serves {
            tracing::info!("shutting down");
        } else {
            tracing::debug!("shutting down");
        }
        self.telemetry.shutdown(Duration::from_secs(5)).await;
    }
}

/// Runs `body` on the standard runtime. An error is printed as `<name>: <error>` with its
/// causes, and the exit status is `failure`.
pub fn main<F>(name: &str, failure: u8, body: impl FnOnce() -> F) -> ExitCode
where
    F: Future<Output = anyhow::Result<ExitCode>>,
{
    crate::install_crypto_provider();
    let result = crate::runtime()
        .map_err(|e| anyhow::anyhow!("starting the runtime: {e}"))
        .and_then(|rt| rt.block_on(body()));
    match result {
        Ok(code) => code,
        Err(e) => {
            eprintln!("{name}: {e:#}");
            ExitCode::from(failure)
        }
    }
}

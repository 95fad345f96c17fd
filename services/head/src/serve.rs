//! `nomad serve CONFIG`: the original Nomad's command. The config's tools (its `fmod_models`,
//! its callables, Nomad's built-in kinds) are served over MCP, each tool an MCP tool of its own
//! with `get_model_card` beside them, on stdio (for MCP Inspector, Claude Desktop, an agent that
//! spawns it) or Streamable HTTP. The scheduler, the device workers and the gateway start as
//! children, as `nomad up` starts them, and calls go through the scheduler's queues.

use std::path::PathBuf;

use crate::up::{self, fleet::GatewayFront};

#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Transport {
    Stdio,
    Http,
}

#[derive(clap::Args)]
pub struct ServeArgs {
    /// The config: `fmod_models:` and `tools:` as the original's nomad.yml has them.
    #[arg(env = "NOMAD_SERVE_CONFIG")]
    pub config: PathBuf,
    /// `stdio` for a local MCP client that starts this command, `http` for clients that connect.
    #[arg(
        short = 't',
        long,
        value_enum,
        default_value = "stdio",
        env = "NOMAD_SERVE_TRANSPORT"
    )]
    pub transport: Transport,
    /// Interface to listen on with `http` (beyond loopback it requires the fleet's token).
    #[arg(long, default_value = "127.0.0.1", env = "NOMAD_SERVE_HOST")]
    pub host: String,
    /// Port to listen on with `http`; MCP is served at http://HOST:PORT/mcp.
    #[arg(long, default_value_t = 8000, env = "NOMAD_SERVE_PORT")]
    pub port: u16,
    /// Fail start-up when a tool cannot serve (a missing source, an environment that cannot
    /// install); without it the others serve and the failure is printed.
    #[arg(long)]
    pub strict: bool,
    /// CPU device workers to start (default: one per GPU that nvidia-smi lists, else one).
    #[arg(long)]
    pub workers: Option<usize>,
    /// Run directories go here: runs/<run id>/ holds each server's log and telemetry.
    #[arg(long, default_value = "runs")]
    pub runs_dir: PathBuf,
    /// Directory of the service binaries (default: the one holding `nomad`).
    #[arg(long)]
    pub bin_dir: Option<PathBuf>,
    /// Seconds the services may take to start (describing the tools may take longer: a Python
    /// model's environment is built once per host).
    #[arg(long, default_value_t = 120.0)]
    pub ready_timeout: f64,
}

pub async fn serve(args: ServeArgs) -> anyhow::Result<crate::exit::Exit> {
    let ready_timeout =
        nomad_config::seconds("--ready-timeout", args.ready_timeout).map_err(anyhow::Error::msg)?;
    let host = if args.host == "localhost" {
        "127.0.0.1".to_owned()
    } else {
        args.host.clone()
    };
    let front = match args.transport {
        Transport::Stdio => GatewayFront::ToolsStdio,
        Transport::Http => {
            port_free(&host, args.port)?;
            GatewayFront::ToolsHttp {
                listen: format!("{host}:{}", args.port),
            }
        }
    };
    up::up(up::UpOptions {
        config: Some(args.config),
        workers: args.workers,
        runs_dir: args.runs_dir,
        models_dir: PathBuf::from("models"),
        bin_dir: args.bin_dir,
        tasks: None,
        concurrency: 1,
        embed_tool: String::new(),
        ready_timeout,
        front,
        strict: args.strict,
    })
    .await
}

/// Refuses a port another process holds before any server starts, naming the flag that picks
/// another (the gateway would find it later, and only its log would say so).
fn port_free(host: &str, port: u16) -> anyhow::Result<()> {
    match std::net::TcpListener::bind((host, port)) {
        Ok(_) => Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::AddrInUse => anyhow::bail!(
            "port {port} on {host} is in use (another `nomad serve`, or another program): choose \
             another with --port"
        ),
        Err(e) => anyhow::bail!("cannot listen on {host}:{port}: {e} (see --host and --port)"),
    }
}

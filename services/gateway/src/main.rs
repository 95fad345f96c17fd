//! `nomad-gateway`: the code-mode gateway. An MCP server (Streamable HTTP and stdio) and a gRPC
//! service exposing search, sandboxed code execution and tool calls over the upstream tools: the
//! scheduler's (as the built-in `nomad` server) and external MCP servers.

mod config;
mod connections;
mod direct;
mod execute;
mod grpc_service;
mod json_len;
mod lock;
mod mcp_call;
mod mcp_http;
mod mcp_server;
mod openai;
mod sandbox;
mod schema;
mod search;
mod serve;
mod sessions;
mod tasks;
mod tool_error;
mod upstream;

use std::path::PathBuf;
use std::process::ExitCode;

use clap::Parser;
use nomad_rpc::ServiceArgs;

#[derive(Parser)]
#[command(name = "nomad-gateway", version, about = "Nomad code-mode gateway")]
pub struct Args {
    /// Also read: `gateway:`, `servers:` and `sandbox:` from the config file.
    #[command(flatten)]
    pub service: ServiceArgs,
    /// Address to serve gRPC on (default 127.0.0.1:7001; none with --mcp-stdio unless given).
    #[arg(long)]
    pub listen: Option<String>,
    /// Address to serve MCP over Streamable HTTP on, at /mcp.
    #[arg(long, default_value = "127.0.0.1:7010")]
    pub mcp_listen: String,
    /// Serve MCP over stdin/stdout instead of HTTP (logs and console telemetry go to stderr).
    #[arg(long)]
    pub mcp_stdio: bool,
    /// What /mcp and stdio offer: `code` mode (search and run code), or the fleet's `tools`,
    /// each an MCP tool of its own (as the original's `nomad serve`). Over HTTP, /tools always
    /// offers the tools.
    #[arg(long, value_enum, default_value = "code")]
    pub mcp_front: mcp_http::Front,
    /// The scheduler serving the built-in `nomad` tools.
    #[arg(long, env = "NOMAD_SCHEDULER", default_value = "127.0.0.1:7002")]
    pub scheduler: String,
    /// Write the bound MCP HTTP address here once listening.
    #[arg(long)]
    pub mcp_addr_file: Option<PathBuf>,
    /// The run directory (`nomad up` gives it): the task store is kept there unless
    /// `gateway.tasks.path` names a file.
    #[arg(long)]
    pub run_dir: Option<PathBuf>,
}

fn main() -> ExitCode {
    // The first process of every sandboxed run is this binary in its own mode (see
    // `sandbox::init`): checked before anything else is set up.
    if std::env::args_os().nth(1).as_deref() == Some(std::ffi::OsStr::new(sandbox::init::ARG)) {
        sandbox::init::main();
    }
    let args = Args::parse();
    nomad_rpc::bootstrap::main("nomad-gateway", 1, || async {
        serve::serve(args).await.map(|()| ExitCode::SUCCESS)
    })
}

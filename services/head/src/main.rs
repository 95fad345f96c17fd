//! `nomad`: the head. `nomad up` starts a fleet, `nomad run` drives rollouts from a tasks JSONL
//! file through its gateway, `nomad serve` offers runs over gRPC, `nomad traces` shows a run's
//! rollouts, `nomad health` checks a server.

mod health;
mod memory;
mod rollouts;
mod run;
mod run_id;
mod runs;
mod serve;
mod service;
mod supervisor;
mod tasks;
mod traces;
mod up;
mod verify;

use std::process::ExitCode;

use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(
    name = "nomad",
    version,
    about = "Nomad head: start a fleet, run rollouts against it, and read their traces"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Start the fleet (scheduler, device workers, gateway) as child processes; with --demo or
    /// --tasks, run a task set through it, then stop.
    Up(up::UpArgs),
    /// Run every task of a tasks JSONL file as one rollout and write one result line per task.
    Run(run::RunArgs),
    /// Serve the Head gRPC API: start runs of rollouts and report on them.
    Serve(serve::ServeArgs),
    /// Show a run's rollouts as waterfall trees of their spans, slowest first.
    Traces(traces::TracesArgs),
    /// Check a Nomad server's gRPC health (exit 0 when serving): for container health checks.
    Health {
        /// The server's address, e.g. 127.0.0.1:7002.
        address: String,
    },
}

/// Exit 0 when everything succeeded, 1 when a rollout or check failed, 2 on an error.
fn main() -> ExitCode {
    let cli = Cli::parse();
    nomad_rpc::bootstrap::main("nomad", 2, || async {
        let ok = match cli.command {
            Command::Up(args) => up::command(args).await?,
            Command::Run(args) => run::run(args).await?,
            Command::Serve(args) => serve::serve(args).await.map(|()| true)?,
            Command::Traces(args) => traces::show(args).await?,
            Command::Health { address } => health::health(&address).await?,
        };
        Ok(if ok {
            ExitCode::SUCCESS
        } else {
            ExitCode::from(1)
        })
    })
}

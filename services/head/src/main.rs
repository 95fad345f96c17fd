//! `nomad`: the head. It starts fleets (`up`, or `submit` as a Slurm job), drives rollouts
//! through them (`run`, `serve`) and reads their traces (`traces`); see each command's help.

mod cli;
mod collect;
mod config_sources;
mod exit;
mod export;
mod fleets;
mod grpc_service;
mod head_api;
mod health;
mod memory;
mod report;
mod rollouts;
mod run;
mod run_id;
mod run_registry;
mod serve;
mod slurm;
mod supervisor;
mod tasks;
mod top;
mod traces;
mod up;
mod verify;

use std::process::ExitCode;

use clap::Parser as _;

/// Exit 0 when everything succeeded, 1 when a rollout or check failed, 2 on an error, 130 when
/// interrupted (see [`exit::Exit`]).
fn main() -> ExitCode {
    let cli = cli::Cli::parse();
    nomad_rpc::bootstrap::main("nomad", 2, || async {
        Ok(ExitCode::from(cli.command.run().await?))
    })
}

//! The `nomad` command line: one subcommand per job, each handed to its module.

use clap::{Parser, Subcommand};

use crate::exit::Exit;
use crate::{
    collect, export, fleets, head_api, health, report, run, serve, slurm, top, traces, up,
};

/// Nomad head: start a fleet, run rollouts against it, and read their traces.
#[derive(Parser)]
#[command(name = "nomad", version)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Subcommand)]
pub enum Command {
    /// Start the fleet as child processes; with --demo or --tasks, run a task set, then stop.
    #[command(after_help = crate::tasks::FORMAT)]
    Up(up::UpArgs),
    /// List the fleets `nomad up` started under a runs directory (running ones; --all).
    Ps(fleets::PsArgs),
    /// Stop a fleet `nomad up` started (the one running, or the run id given).
    Down(fleets::DownArgs),
    /// Run every task of a tasks JSONL file as one rollout and write one result line per task.
    #[command(after_help = crate::tasks::FORMAT)]
    Run(run::RunArgs),
    /// Serve a config's tools over MCP, each tool an MCP tool of its own (as the original
    /// Nomad's `nomad serve`): the scheduler and device workers start as children.
    Serve(serve::ServeArgs),
    /// Copy every model of a config into a directory, or push each to an OCI registry, and
    /// write the config that names them there (by digest), with their cards and a report.
    Export(export::ExportArgs),
    /// Serve the Head gRPC API: start runs of rollouts and report on them.
    Head(head_api::HeadArgs),
    /// Show a run's rollouts as waterfall trees of their spans, slowest first.
    Traces(traces::TracesArgs),
    /// Write a run's report: one HTML file of plots and its slowest rollouts' waterfalls.
    Report(report::ReportArgs),
    /// Submit a run as a Slurm job: the fleet on every node, with a collector beside it.
    Submit(slurm::SubmitArgs),
    /// A fleet's or a submitted job's state and progress (`nomad status latest`).
    Status(slurm::status::StatusArgs),
    /// Receive OTLP (gRPC and HTTP) and write it as JSON lines: a Slurm job's collector.
    Collect(collect::CollectArgs),
    /// The body of a job `nomad submit` wrote (runs inside the job).
    #[command(hide = true)]
    SlurmJob(slurm::job::JobArgs),
    /// A live view of a fleet: tools, workers, the sandbox and the run's progress.
    Top(top::TopArgs),
    /// Check a Nomad server's gRPC health at ADDRESS (exit 0 when serving).
    Health {
        /// The server's gRPC address, host:port (e.g. 127.0.0.1:7002).
        address: String,
    },
}

impl Command {
    /// Runs the command; how it ended.
    pub async fn run(self) -> anyhow::Result<Exit> {
        let succeeded = match self {
            Command::Up(args) => return up::command(args).await,
            Command::Ps(args) => fleets::ps(args),
            Command::Down(args) => fleets::down(args).await,
            Command::Run(args) => run::run(args).await,
            Command::Serve(args) => return serve::serve(args).await,
            Command::Export(args) => export::export(args).await,
            Command::Head(args) => head_api::serve(args).await.map(|()| true),
            Command::Traces(args) => traces::show(args).await,
            Command::Report(args) => report::report(args).await,
            Command::Submit(args) => slurm::submit(args).await,
            Command::Status(args) => slurm::status::status(args).await,
            Command::Collect(args) => collect::collect(args).await,
            Command::SlurmJob(args) => slurm::job::job(args).await,
            Command::Top(args) => top::top(args).await,
            Command::Health { address } => health::health(&address).await,
        };
        succeeded.map(Exit::from)
    }
}

#[cfg(test)]
mod tests {
    use clap::CommandFactory as _;

    /// `nomad run --help` and `nomad up --help` show the tasks file's format.
    #[test]
    fn the_tasks_format_is_in_the_help() {
        let mut cli = super::Cli::command();
        for name in ["run", "up"] {
            let help = cli
                .find_subcommand_mut(name)
                .unwrap()
                .render_long_help()
                .to_string();
            assert!(help.contains("Tasks file (--tasks)"), "{name}: {help}");
            assert!(help.contains("\"similarity\""), "{name}: {help}");
        }
    }

    /// Every visible argument of every command says what it is, and a client command does not
    /// offer a server's flags.
    #[test]
    fn every_argument_has_help_and_clients_offer_no_server_flags() {
        let cli = super::Cli::command();
        let mut missing = Vec::new();
        for command in cli.get_subcommands().filter(|c| !c.is_hide_set()) {
            for arg in command.get_arguments().filter(|a| !a.is_hide_set()) {
                let id = arg.get_id().as_str();
                if id == "help" || id == "version" {
                    continue;
                }
                if arg
                    .get_help()
                    .is_none_or(|h| h.to_string().trim().is_empty())
                {
                    missing.push(format!("{} {id}", command.get_name()));
                }
            }
        }
        assert!(missing.is_empty(), "arguments without help: {missing:?}");
        let run = cli.find_subcommand("run").unwrap();
        for server_flag in ["addr_file", "server_name"] {
            assert!(
                run.get_arguments().all(|a| a.get_id() != server_flag),
                "nomad run offers --{server_flag}"
            );
        }
        assert_eq!(crate::up::count(1, "task"), "1 task");
        assert_eq!(crate::up::count(3, "task"), "3 tasks");
    }
}

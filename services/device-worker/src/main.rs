//! `nomad-device-worker`: one per accelerator (or one CPU worker). Serves the DeviceWorker gRPC
//! API and registers itself with the scheduler (`serve`); also writes test models and measures
//! the models (`make-mlp`, `bench`).

mod bench;
mod device;
mod grpc_service;
mod models;
mod registration;
mod serve;
mod stats;
mod store;
mod streaming;
mod wire;

use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::Context as _;
use clap::{Parser, Subcommand};

use crate::device::DeviceSpec;

#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

#[derive(Parser)]
#[command(name = "nomad-device-worker", version, about = "Nomad device worker")]
struct Cli {
    #[command(subcommand)]
    command: Option<Command>,
    #[command(flatten)]
    serve: serve::ServeArgs,
}

#[derive(Subcommand)]
enum Command {
    /// Write a randomly initialised MLP model directory (for tests and demos).
    MakeMlp {
        /// Output directory (created).
        #[arg(long)]
        out: PathBuf,
        /// Layer widths, input first: e.g. 8,16,4.
        #[arg(long, value_delimiter = ',', default_value = "8,16,4")]
        layers: Vec<usize>,
        #[arg(long, default_value_t = 0)]
        seed: u64,
    },
    /// Measure the real models' throughput on this machine (JSON lines).
    Bench(bench::BenchArgs),
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    // `bench` measures the CPU models as a CPU worker runs them.
    let device = match cli.command {
        Some(Command::Bench(_)) => DeviceSpec::Cpu,
        _ => cli.serve.device,
    };
    device::single_threaded_matmuls_on_cpu(device);
    let done = |result: anyhow::Result<()>| result.map(|()| ExitCode::SUCCESS);
    match cli.command {
        Some(Command::MakeMlp { out, layers, seed }) => print_error(done(
            models::kinds::mlp::Mlp::write_random(&out, &layers, seed)
                .with_context(|| format!("writing an mlp to {}", out.display())),
        )),
        Some(Command::Bench(args)) => print_error(done(bench::run(args))),
        None => nomad_rpc::bootstrap::main("nomad-device-worker", 1, || async {
            done(serve::serve(cli.serve).await)
        }),
    }
}

fn print_error(result: anyhow::Result<ExitCode>) -> ExitCode {
    result.unwrap_or_else(|e| {
        eprintln!("nomad-device-worker: {e:#}");
        ExitCode::FAILURE
    })
}

//! `nomad-device-worker`: one per accelerator (or one CPU worker). Serves the DeviceWorker gRPC
//! API and registers itself with the scheduler.

mod bench;
mod device;
mod models;
mod registration;
mod service;
mod stats;
mod store;

use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context as _;
use clap::{Parser, Subcommand};
use nomad_proto::v1::device_worker_server::DeviceWorkerServer;
use nomad_proto::v1::scheduler_client::SchedulerClient;
use nomad_telemetry::{InitOptions, ServerIdentity, ServerType};

use crate::device::DeviceSpec;

#[derive(Parser)]
#[command(name = "nomad-device-worker", version, about = "Nomad device worker")]
struct Cli {
    #[command(subcommand)]
    command: Option<Command>,
    #[command(flatten)]
    serve: ServeArgs,
}

#[derive(clap::Args)]
struct ServeArgs {
    /// Config file (YAML or TOML); its `telemetry:` block configures export.
    #[arg(long, env = "NOMAD_CONFIG")]
    config: Option<PathBuf>,
    /// Address to serve gRPC on.
    #[arg(long, default_value = "127.0.0.1:0")]
    listen: String,
    /// Address the scheduler should dial (default: the bound listen address, or this host's
    /// name and the port when listening on every interface).
    #[arg(long)]
    advertise: Option<String>,
    /// The scheduler to register with.
    #[arg(long, env = "NOMAD_SCHEDULER", default_value = "127.0.0.1:7002")]
    scheduler: String,
    /// cpu, cuda:N or metal:N.
    #[arg(long, default_value = "cpu")]
    device: DeviceSpec,
    /// `candle` runs real models; `sim` simulates them from the config's `sim:` section.
    #[arg(long, default_value = "candle")]
    backend: BackendKind,
    /// Memory one batch may use on this worker (weights plus estimated activations); a batch
    /// over it is refused as out of memory, as a GPU would fail it. Default: no limit.
    #[arg(long)]
    memory_budget_bytes: Option<u64>,
    /// Worker id (default: host-pid-device).
    #[arg(long)]
    worker_id: Option<String>,
    /// Server name in telemetry (default: device-worker).
    #[arg(long)]
    server_name: Option<String>,
    /// Write the bound address here once listening.
    #[arg(long)]
    addr_file: Option<PathBuf>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum BackendKind {
    Candle,
    Sim,
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

/// On CPU, candle's f32 matmuls scale poorly across threads at these model sizes; the worker
/// instead runs them single-threaded and splits a batch's sequences across the cores (see
/// `models::embed`). Set before any thread exists; an explicit RAYON_NUM_THREADS wins.
fn single_threaded_matmuls_on_cpu(device: DeviceSpec) {
    if device == DeviceSpec::Cpu && std::env::var_os("RAYON_NUM_THREADS").is_none() {
        // SAFETY: called first thing in main, before any other thread is started.
        unsafe { std::env::set_var("RAYON_NUM_THREADS", "1") };
    }
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    // `bench` measures the CPU models as a CPU worker runs them.
    let device = match cli.command {
        Some(Command::Bench(_)) => DeviceSpec::Cpu,
        _ => cli.serve.device,
    };
    single_threaded_matmuls_on_cpu(device);
    let result = match cli.command {
        Some(Command::MakeMlp { out, layers, seed }) => {
            models::mlp::Mlp::write_random(&out, &layers, seed)
                .with_context(|| format!("writing an mlp to {}", out.display()))
        }
        Some(Command::Bench(args)) => bench::run(args),
        None => nomad_rpc::runtime()
            .context("starting the runtime")
            .and_then(|rt| rt.block_on(serve(cli.serve))),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("nomad-device-worker: {e:#}");
            ExitCode::FAILURE
        }
    }
}

async fn serve(args: ServeArgs) -> anyhow::Result<()> {
    let file = nomad_config::ConfigFile::load(args.config.as_deref())?;
    nomad_rpc::tls::configure_from(&file, true)?;
    let settings = nomad_telemetry::load_settings(&file)?;
    let mut identity = ServerIdentity::new(ServerType::DeviceWorker).named(args.server_name);
    if args.device != DeviceSpec::Cpu {
        identity.gpu_count = Some(1);
    }
    let telemetry = nomad_telemetry::init(settings, &identity, InitOptions::default())?;

    let backend = match args.backend {
        BackendKind::Candle => models::Backend::Candle,
        BackendKind::Sim => models::Backend::Sim(Arc::new(models::sim::SimDevice::new(
            models::sim::SimConfig::checked(file.section("sim")?)?,
        ))),
    };
    tracing::info!("{}", device::capabilities());
    let device = args.device.open()?;
    let mut device_info = args.device.info();
    device_info.memory_total_bytes = device::memory_info(&device).map(|(_, total)| total);
    tracing::info!(device = %args.device, backend = ?args.backend, memory_total_bytes = ?device_info.memory_total_bytes, "device ready");
    let backend = Arc::new(backend);
    let store = Arc::new(store::ModelStore::new(device));
    let on_accelerator = args.device != DeviceSpec::Cpu;

    let (listener, local) = nomad_rpc::bind(&args.listen).await?;
    if let Some(path) = &args.addr_file {
        nomad_rpc::write_addr_file(path, local)?;
    }
    let host = gethostname::gethostname().to_string_lossy().into_owned();
    let worker_id = args
        .worker_id
        .unwrap_or_else(|| format!("{host}-{}-{}", std::process::id(), args.device));
    // Listening on every interface (a container): the scheduler reaches us by host name, which
    // stays distinct when a service is scaled to several replicas.
    let address = match args.advertise {
        Some(a) => nomad_rpc::normalize_address(&a),
        None if local.ip().is_unspecified() => format!("http://{host}:{}", local.port()),
        None => format!("http://{local}"),
    };
    tracing::info!(%worker_id, %address, "nomad-device-worker listening on {local}");

    let registration = registration::Registration {
        scheduler: SchedulerClient::new(nomad_rpc::channel(&args.scheduler)?),
        worker_id,
        address,
        device: device_info,
        store: store.clone(),
        backend: backend.clone(),
        on_accelerator,
    };
    let registering = tokio::spawn(registration.run());

    let mut server = nomad_rpc::RpcServer::new();
    server
        .routes()
        .add_service(DeviceWorkerServer::new(service::WorkerService {
            store,
            backend,
            limits: models::ExecLimits {
                memory_budget: args.memory_budget_bytes,
            },
            device_name: args.device.to_string(),
            on_accelerator,
        }));
    server.serve(listener, nomad_rpc::shutdown_signal()).await?;
    registering.abort();
    tracing::info!("shutting down");
    telemetry.shutdown(Duration::from_secs(5)).await;
    Ok(())
}

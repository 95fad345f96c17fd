//! Serving: the DeviceWorker gRPC API on one device, and registration with the scheduler.

use std::sync::Arc;

use nomad_proto::v1::device_worker_server::DeviceWorkerServer;
use nomad_proto::v1::scheduler_client::SchedulerClient;
use nomad_rpc::{Service, ServiceArgs, StartOptions};
use nomad_telemetry::ServerType;

use crate::device::{self, DeviceSpec};
use crate::{grpc_service, models, registration, store};

#[derive(clap::Args)]
pub struct ServeArgs {
    #[command(flatten)]
    service: ServiceArgs,
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
    pub device: DeviceSpec,
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
    /// Python models' environments, cloned model sources and the model host program live here
    /// (default: $XDG_CACHE_HOME/nomad, else ~/.cache/nomad). Workers on one host share it.
    #[arg(long, env = "NOMAD_CACHE_DIR")]
    cache_dir: Option<std::path::PathBuf>,
    /// The interpreter of a Python model that names none (`python:`); with `env`, the one its
    /// environment is built from.
    #[arg(long, env = "NOMAD_PYTHON", default_value = "python3")]
    python: String,
    /// How long building a Python model's environment, or loading the model, may take.
    #[arg(long, default_value_t = 1800.0)]
    env_timeout_seconds: f64,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum BackendKind {
    Candle,
    Sim,
}

pub async fn serve(args: ServeArgs) -> anyhow::Result<()> {
    let options = StartOptions {
        gpu_count: (args.device != DeviceSpec::Cpu).then_some(1),
        ..Default::default()
    };
    let service =
        Service::start_with(ServerType::DeviceWorker, &args.service, options, |_| Ok(()))?;
    let file = &service.config;

    let host = gethostname::gethostname().to_string_lossy().into_owned();
    let worker_id = args
        .worker_id
        .clone()
        .unwrap_or_else(|| format!("{host}-{}-{}", std::process::id(), args.device));
    let backend = match args.backend {
        BackendKind::Candle => models::load::Backend::Candle,
        BackendKind::Sim => {
            models::load::Backend::Sim(Arc::new(models::backends::sim::SimDevice::new(
                models::backends::sim::SimConfig::checked(file.section("sim")?)?,
                &worker_id,
            )))
        }
    };
    tracing::info!("{}", device::capabilities());
    let opening = service.startup.phase(
        "device",
        vec![nomad_telemetry::KeyValue::new(
            "nomad.device",
            args.device.to_string(),
        )],
    );
    let device = args.device.open()?;
    opening.end();
    let mut device_info = args.device.info();
    device_info.memory_total_bytes = device::memory_info(&device).map(|(_, total)| total);
    tracing::info!(device = %args.device, backend = ?args.backend, memory_total_bytes = ?device_info.memory_total_bytes, "device ready");
    let backend = Arc::new(backend);
    let store = Arc::new(store::ModelStore::new(device));
    let on_accelerator = args.device != DeviceSpec::Cpu;

    let addr_file = args.service.addr_file.as_deref();
    let (listener, local) = service
        .listen("nomad-device-worker", &args.listen, addr_file)
        .await?;
    // Listening on every interface (a container): the scheduler reaches us by host name, which
    // stays distinct when a service is scaled to several replicas.
    let address = match args.advertise {
        Some(a) => nomad_rpc::normalize_address(&a),
        None if local.ip().is_unspecified() => format!("http://{host}:{}", local.port()),
        None => format!("http://{local}"),
    };
    tracing::info!(%worker_id, %address, "registering with the scheduler");

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

    let python_settings = models::backends::python::PythonSettings {
        cache: args
            .cache_dir
            .clone()
            .unwrap_or_else(nomad_sources::default_cache_dir),
        python: args.python.clone(),
        env_timeout: nomad_config::seconds("--env-timeout-seconds", args.env_timeout_seconds)
            .map_err(anyhow::Error::msg)?,
        // A host sees this worker's GPU only (as its cuda:0), or none on a CPU worker.
        visible_devices: match args.device {
            DeviceSpec::Cuda(index) => index.to_string(),
            DeviceSpec::Cpu | DeviceSpec::Metal(_) => String::new(),
        },
        device: match args.device {
            DeviceSpec::Cuda(_) => "cuda",
            DeviceSpec::Metal(_) => "mps",
            DeviceSpec::Cpu => "cpu",
        },
        service_name: format!("nomad/{}", service.identity.name),
    };
    let mut server = nomad_rpc::RpcServer::new();
    server.routes().add_service(
        DeviceWorkerServer::new(grpc_service::WorkerService {
            store,
            backend,
            limits: models::model::ExecLimits {
                memory_budget: args.memory_budget_bytes,
            },
            device_name: args.device.to_string(),
            on_accelerator,
            python: python_settings,
        })
        .max_decoding_message_size(nomad_rpc::WORKER_MESSAGE_LIMIT)
        .max_encoding_message_size(nomad_rpc::WORKER_MESSAGE_LIMIT),
    );
    server.serve(listener, nomad_rpc::shutdown_signal()).await?;
    registering.abort();
    service.stop().await;
    Ok(())
}

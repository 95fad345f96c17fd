//! Resource attributes every span and metric of a process carries.

use opentelemetry::KeyValue;
use opentelemetry_sdk::Resource;

use crate::config::TelemetrySettings;

/// Which Nomad server this process is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ServerType {
    Head,
    Gateway,
    Scheduler,
    DeviceWorker,
}

impl ServerType {
    pub fn as_str(self) -> &'static str {
        match self {
            ServerType::Head => "head",
            ServerType::Gateway => "gateway",
            ServerType::Scheduler => "scheduler",
            ServerType::DeviceWorker => "device-worker",
        }
    }
}

/// The process's identity as a Nomad server.
#[derive(Debug, Clone)]
pub struct ServerIdentity {
    /// Server name, `service.name` suffix (defaults to the type, e.g. `scheduler`).
    pub name: String,
    pub server_type: ServerType,
    /// GPUs this process can see, where known.
    pub gpu_count: Option<u64>,
}

impl ServerIdentity {
    pub fn new(server_type: ServerType) -> Self {
        Self {
            name: server_type.as_str().to_owned(),
            server_type,
            gpu_count: None,
        }
    }

    pub fn named(mut self, name: Option<String>) -> Self {
        if let Some(name) = name.filter(|n| !n.is_empty()) {
            self.name = name;
        }
        self
    }
}

/// `service.name` for this process: `<service_name>/<server>` unless per-server naming is off.
pub fn service_name(settings: &TelemetrySettings, identity: &ServerIdentity) -> String {
    if settings.service_name_per_server {
        format!("{}/{}", settings.service_name, identity.name)
    } else {
        settings.service_name.clone()
    }
}

fn host_name() -> String {
    gethostname::gethostname()
        .into_string()
        .unwrap_or_else(|_| "unknown".to_owned())
}

pub fn build(settings: &TelemetrySettings, identity: &ServerIdentity) -> Resource {
    let mut attributes = vec![
        KeyValue::new("nomad.service_group", settings.service_name.clone()),
        KeyValue::new("nomad.server.name", identity.name.clone()),
        KeyValue::new("nomad.server.type", identity.server_type.as_str()),
        KeyValue::new("service.version", env!("CARGO_PKG_VERSION")),
        KeyValue::new("service.instance.id", uuid::Uuid::new_v4().to_string()),
        KeyValue::new("host.name", host_name()),
        KeyValue::new("process.pid", i64::from(std::process::id())),
    ];
    if let Some(gpus) = identity.gpu_count {
        attributes.push(KeyValue::new("host.gpu.count", gpus as i64));
    }
    if let Some(run_id) = &settings.run_id {
        attributes.push(KeyValue::new("nomad.run.id", run_id.clone()));
    }
    // `builder()` keeps OTEL_RESOURCE_ATTRIBUTES; our service name wins over OTEL_SERVICE_NAME,
    // which the settings already folded in with Nomad's precedence.
    Resource::builder()
        .with_service_name(service_name(settings, identity))
        .with_attributes(attributes)
        .build()
}

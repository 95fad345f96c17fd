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

/// Slurm's variables and the resource attributes they become, for a process run as a job step.
const SLURM: [(&str, &str); 4] = [
    ("SLURM_JOB_ID", "slurm.job.id"),
    ("SLURM_STEP_ID", "slurm.step.id"),
    ("SLURMD_NODENAME", "slurm.node.name"),
    ("SLURM_CLUSTER_NAME", "slurm.cluster.name"),
];

/// Bytes of a Slurm variable kept as an attribute value.
const SLURM_VALUE_BYTES: usize = 256;

/// `slurm.*` attributes from the variables `env` finds set (none outside Slurm).
fn slurm_attributes(env: impl Fn(&str) -> Option<String>) -> Vec<KeyValue> {
    SLURM
        .iter()
        .filter_map(|(variable, attribute)| {
            let mut value = env(variable).filter(|v| !v.is_empty())?;
            if value.len() > SLURM_VALUE_BYTES {
                let mut end = SLURM_VALUE_BYTES;
                while !value.is_char_boundary(end) {
                    end -= 1;
                }
                value.truncate(end);
            }
            Some(KeyValue::new(*attribute, value))
        })
        .collect()
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
    attributes.extend(slurm_attributes(|name| std::env::var(name).ok()));
    // `builder()` keeps OTEL_RESOURCE_ATTRIBUTES; our service name wins over OTEL_SERVICE_NAME,
    // which the settings already folded in with Nomad's precedence.
    Resource::builder()
        .with_service_name(service_name(settings, identity))
        .with_attributes(attributes)
        .build()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slurm_variables_become_slurm_attributes_and_nothing_outside_slurm() {
        let job = |name: &str| match name {
            "SLURM_JOB_ID" => Some("4242".to_owned()),
            "SLURM_STEP_ID" => Some("3".to_owned()),
            "SLURMD_NODENAME" => Some("n2".to_owned()),
            "SLURM_CLUSTER_NAME" => Some("x".repeat(300)),
            _ => None,
        };
        let attributes: Vec<(String, String)> = slurm_attributes(job)
            .into_iter()
            .map(|kv| (kv.key.to_string(), kv.value.to_string()))
            .collect();
        assert_eq!(
            attributes[..3],
            [
                ("slurm.job.id".to_owned(), "4242".to_owned()),
                ("slurm.step.id".to_owned(), "3".to_owned()),
                ("slurm.node.name".to_owned(), "n2".to_owned()),
            ]
        );
        assert_eq!(attributes[3].0, "slurm.cluster.name");
        assert_eq!(attributes[3].1.len(), SLURM_VALUE_BYTES);
        assert!(slurm_attributes(|_| None).is_empty());
        assert!(slurm_attributes(|_| Some(String::new())).is_empty());
    }
}

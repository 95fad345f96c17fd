//! The scheduler's instruments, built from the shared definition table.

use nomad_telemetry::KeyValue;
use nomad_telemetry::metrics as defs;
use opentelemetry::metrics::{Counter, Histogram};

use nomad_proto::v1::DeviceInfo;

pub struct Metrics {
    pub requests: Counter<u64>,
    pub request_errors: Counter<u64>,
    pub request_rejections: Counter<u64>,
    pub request_duration: Histogram<f64>,
    pub request_queue_wait: Histogram<f64>,
    pub batch_duration: Histogram<f64>,
    pub batch_size: Histogram<u64>,
    pub device_load_duration: Histogram<f64>,
    pub disk_loads: Counter<u64>,
    pub disk_load_duration: Histogram<f64>,
}

impl Metrics {
    pub fn new() -> Self {
        Self {
            requests: defs::TOOL_REQUESTS.u64_counter(),
            request_errors: defs::TOOL_REQUEST_ERRORS.u64_counter(),
            request_rejections: defs::TOOL_REQUEST_REJECTIONS.u64_counter(),
            request_duration: defs::TOOL_REQUEST_DURATION.f64_histogram(),
            request_queue_wait: defs::TOOL_REQUEST_QUEUE_WAIT.f64_histogram(),
            batch_duration: defs::TOOL_BATCH_DURATION.f64_histogram(),
            batch_size: defs::TOOL_BATCH_SIZE.u64_histogram(),
            device_load_duration: defs::TOOL_DEVICE_LOAD_DURATION.f64_histogram(),
            disk_loads: defs::TOOL_DISK_LOADS.u64_counter(),
            disk_load_duration: defs::TOOL_DISK_LOAD_DURATION.f64_histogram(),
        }
    }
}

/// `tool`, `device`, `device.type`, `device.index` for batch and device metrics.
pub fn device_attributes(tool: &str, device: &DeviceInfo) -> Vec<KeyValue> {
    vec![
        KeyValue::new("tool", tool.to_owned()),
        KeyValue::new("device", format!("{}:{}", device.r#type, device.index)),
        KeyValue::new("device.type", device.r#type.clone()),
        KeyValue::new("device.index", i64::from(device.index)),
    ]
}

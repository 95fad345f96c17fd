//! The simulated backend (`--backend sim`): a model that takes time to load and run, occupies
//! memory and runs out of it, without computing anything. Outputs echo inputs, so a test can
//! check that every request got its own answer back. The scheduler cannot tell a sim worker
//! from a candle one: same process, same gRPC API.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use candle_core::Device;
use serde::Deserialize;

use crate::models::batch::invalid;
use crate::models::model::{Answer, ExecError, ExecLimits, Input, Model, Output, Value};

/// The `sim:` config section.
#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct SimConfig {
    /// Device memory of this worker's slot.
    pub memory_bytes: u64,
    /// Time a load from "disk" takes.
    pub load_ms: f64,
    /// Per-batch latency: `base_latency_ms + per_item_latency_ms * batch size`.
    pub base_latency_ms: f64,
    pub per_item_latency_ms: f64,
    /// Weights of every simulated model, unless overridden in `models`.
    pub model_bytes: u64,
    /// Activation memory per request in a batch.
    pub activation_bytes_per_item: u64,
    /// Per-tool overrides.
    pub models: HashMap<String, SimModelConfig>,
    /// The worker (by `--worker-id`) whose model never finishes its first batch: it sleeps until
    /// the process ends, as a hung model would (deadline tests); later batches run.
    pub hang_worker: Option<String>,
    /// A text input that makes any worker running it exit at once, as an input that crashes
    /// the model would (poison-input tests).
    pub crash_on: Option<String>,
}

impl SimConfig {
    /// The config, if every latency is a usable number of milliseconds.
    pub fn checked(self) -> anyhow::Result<Self> {
        let mut latencies = vec![
            ("sim.load_ms".to_owned(), self.load_ms),
            ("sim.base_latency_ms".to_owned(), self.base_latency_ms),
            (
                "sim.per_item_latency_ms".to_owned(),
                self.per_item_latency_ms,
            ),
        ];
        for (tool, o) in &self.models {
            latencies.extend(
                o.base_latency_ms
                    .map(|v| (format!("sim.models.{tool}.base_latency_ms"), v)),
            );
            latencies.extend(
                o.per_item_latency_ms
                    .map(|v| (format!("sim.models.{tool}.per_item_latency_ms"), v)),
            );
        }
        for (what, ms) in latencies {
            nomad_config::seconds_or_zero(&what, ms / 1000.0)
                .map_err(|e| anyhow::anyhow!("{e} (milliseconds: {ms})"))?;
        }
        Ok(self)
    }
}

impl Default for SimConfig {
    fn default() -> Self {
        Self {
            memory_bytes: 16 << 30,
            load_ms: 0.0,
            base_latency_ms: 0.0,
            per_item_latency_ms: 0.0,
            model_bytes: 100 << 20,
            activation_bytes_per_item: 1 << 20,
            models: HashMap::new(),
            hang_worker: None,
            crash_on: None,
        }
    }
}

#[derive(Debug, Clone, Default, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct SimModelConfig {
    pub model_bytes: Option<u64>,
    pub activation_bytes_per_item: Option<u64>,
    pub base_latency_ms: Option<f64>,
    pub per_item_latency_ms: Option<f64>,
}

/// The simulated device: its memory high-water mark and busy time, which it reports as an
/// accelerator backend would (reserved memory, utilization).
#[derive(Debug)]
pub struct SimDevice {
    pub config: SimConfig,
    /// This worker hangs on its first batch (`hang_worker` names it); cleared once it has.
    hangs: std::sync::atomic::AtomicBool,
    /// Peak bytes in use since the last cache clear (a caching allocator's reserve).
    peak: AtomicU64,
    busy_nanos: AtomicU64,
    /// (when, busy_nanos) at the last utilization sample.
    last_sample: Mutex<(Instant, u64)>,
}

impl SimDevice {
    pub fn new(config: SimConfig, worker_id: &str) -> Self {
        Self {
            hangs: (config.hang_worker.as_deref() == Some(worker_id)).into(),
            config,
            peak: AtomicU64::new(0),
            busy_nanos: AtomicU64::new(0),
            last_sample: Mutex::new((Instant::now(), 0)),
        }
    }

    /// Reserved bytes: at least what is allocated now.
    pub fn reserved(&self, allocated: u64) -> u64 {
        self.peak.load(Ordering::Relaxed).max(allocated)
    }

    /// Fraction of wall time spent executing since the previous sample.
    pub fn utilization(&self) -> f64 {
        let busy = self.busy_nanos.load(Ordering::Relaxed);
        let now = Instant::now();
        let mut last = self.last_sample.lock().unwrap_or_else(|e| e.into_inner());
        let wall = now.duration_since(last.0).as_nanos() as f64;
        let ratio = if wall > 0.0 {
            (busy.saturating_sub(last.1) as f64 / wall).min(1.0)
        } else {
            0.0
        };
        *last = (now, busy);
        ratio
    }

    /// Releases the reserve above `allocated`; returns the bytes released.
    pub fn clear_cache(&self, allocated: u64) -> u64 {
        let before = self.peak.swap(allocated, Ordering::Relaxed);
        before.saturating_sub(allocated)
    }
}

#[derive(Debug, Clone)]
pub struct SimModel {
    device: Arc<SimDevice>,
    model_bytes: u64,
    activation_bytes_per_item: u64,
    memory_bytes: u64,
    base_latency: f64,
    per_item_latency: f64,
}

impl SimModel {
    /// "Loads" `tool`: sleeps for the configured load time.
    pub fn load(tool: &str, device: &Arc<SimDevice>) -> Self {
        let config = &device.config;
        if config.load_ms > 0.0 {
            std::thread::sleep(Duration::from_secs_f64(config.load_ms / 1000.0));
        }
        let o = config.models.get(tool).cloned().unwrap_or_default();
        SimModel {
            device: device.clone(),
            model_bytes: o.model_bytes.unwrap_or(config.model_bytes),
            activation_bytes_per_item: o
                .activation_bytes_per_item
                .unwrap_or(config.activation_bytes_per_item),
            memory_bytes: config.memory_bytes,
            base_latency: o.base_latency_ms.unwrap_or(config.base_latency_ms),
            per_item_latency: o.per_item_latency_ms.unwrap_or(config.per_item_latency_ms),
        }
    }

    /// Memory a batch of `n` needs on the device.
    fn needs(&self, n: usize) -> u64 {
        self.model_bytes
            .saturating_add(self.activation_bytes_per_item.saturating_mul(n as u64))
    }
}

/// The input as its own output, or why there is none.
fn echo(index: usize, input: &Input) -> Answer {
    Answer::Output(match &input.value {
        Value::Text(t) => Output::Text(t.clone()),
        Value::Tensor { values, shape } => Output::Tensor {
            values: values.clone(),
            shape: shape.clone(),
        },
        Value::Json(j) => Output::Json(j.clone()),
        Value::Missing => return invalid(index, "empty input"),
        Value::Unreadable(why) => return invalid(index, why),
    })
}

impl Model for SimModel {
    fn bytes(&self) -> u64 {
        self.model_bytes
    }

    fn to_device(&self, _device: &Device) -> Result<Arc<dyn Model>, ExecError> {
        if self.model_bytes > self.memory_bytes {
            return Err(ExecError::OutOfMemory(format!(
                "model of {} bytes does not fit in {} bytes of device memory",
                self.model_bytes, self.memory_bytes
            )));
        }
        Ok(Arc::new(self.clone()))
    }

    fn execute(&self, inputs: &[Input], _limits: &ExecLimits) -> Result<Vec<Answer>, ExecError> {
        let need = self.needs(inputs.len());
        if need > self.memory_bytes {
            return Err(ExecError::OutOfMemory(format!(
                "a batch of {} needs {need} bytes, the device has {}",
                inputs.len(),
                self.memory_bytes
            )));
        }
        if let Some(marker) = &self.device.config.crash_on
            && inputs
                .iter()
                .any(|i| matches!(&i.value, Value::Text(t) if t == marker))
        {
            tracing::error!("sim: the input {marker:?} crashes this worker (sim.crash_on)");
            std::process::exit(101);
        }
        if self.device.hangs.swap(false, Ordering::Relaxed) {
            tracing::warn!("sim: this batch never finishes (sim.hang_worker)");
            loop {
                std::thread::sleep(Duration::from_secs(3600));
            }
        }
        let started = Instant::now();
        self.device.peak.fetch_max(need, Ordering::Relaxed);
        let latency = self.base_latency + self.per_item_latency * inputs.len() as f64;
        if latency > 0.0 {
            std::thread::sleep(Duration::from_secs_f64(latency / 1000.0));
        }
        self.device
            .busy_nanos
            .fetch_add(started.elapsed().as_nanos() as u64, Ordering::Relaxed);
        Ok(inputs
            .iter()
            .enumerate()
            .map(|(i, input)| echo(i, input))
            .collect())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn text(s: &str) -> Input {
        crate::models::testing::text_input(s, "")
    }

    #[test]
    fn echoes_each_input_in_order() {
        let model = SimModel::load("t", &Arc::new(SimDevice::new(SimConfig::default(), "w")));
        let out = model
            .execute(
                &[
                    text("a"),
                    text("b"),
                    Input {
                        value: Value::Missing,
                        options: String::new(),
                    },
                ],
                &ExecLimits::default(),
            )
            .unwrap();
        let texts: Vec<_> = out
            .iter()
            .map(|r| match r {
                Answer::Output(Output::Text(t)) => t.clone(),
                Answer::Invalid(m) => format!("invalid: {m}"),
                other => panic!("{other:?}"),
            })
            .collect();
        assert_eq!(texts, ["a", "b", "invalid: request 2: empty input"]);
    }

    #[test]
    fn a_batch_that_does_not_fit_is_out_of_memory_and_half_of_it_fits() {
        let config = SimConfig {
            memory_bytes: 1000,
            model_bytes: 200,
            activation_bytes_per_item: 100,
            ..Default::default()
        };
        let device = Arc::new(SimDevice::new(config, "w"));
        let model = SimModel::load("t", &device);
        let batch: Vec<_> = (0..10).map(|i| text(&i.to_string())).collect();
        assert!(matches!(
            model.execute(&batch, &ExecLimits::default()),
            Err(ExecError::OutOfMemory(_))
        ));
        assert_eq!(
            model
                .execute(&batch[..8], &ExecLimits::default())
                .unwrap()
                .len(),
            8
        );
        // The 8-batch peaked at 1000 bytes; clearing the cache keeps what is allocated.
        assert_eq!(device.reserved(200), 1000);
        assert_eq!(device.clear_cache(200), 800);
        assert_eq!(device.reserved(200), 200);
    }

    #[test]
    fn utilization_is_the_busy_fraction_since_the_last_sample() {
        let config = SimConfig {
            base_latency_ms: 30.0,
            ..Default::default()
        };
        let device = Arc::new(SimDevice::new(config, "w"));
        device.utilization();
        let model = SimModel::load("t", &device);
        model.execute(&[text("a")], &ExecLimits::default()).unwrap();
        let busy = device.utilization();
        assert!(busy > 0.5 && busy <= 1.0, "{busy}");
        std::thread::sleep(Duration::from_millis(20));
        assert_eq!(device.utilization(), 0.0);
    }

    #[test]
    fn per_tool_overrides_apply() {
        let mut config = SimConfig::default();
        config.models.insert(
            "big".into(),
            SimModelConfig {
                model_bytes: Some(config.memory_bytes + 1),
                ..Default::default()
            },
        );
        let device = Arc::new(SimDevice::new(config, "w"));
        let big = SimModel::load("big", &device);
        assert!(matches!(
            big.to_device(&Device::Cpu),
            Err(ExecError::OutOfMemory(_))
        ));
        assert!(
            SimModel::load("small", &device)
                .to_device(&Device::Cpu)
                .is_ok()
        );
    }
}

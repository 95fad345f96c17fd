//! The simulated backend (`--backend sim`): a model that takes time to load and run, occupies
//! memory and runs out of it, without computing anything. Outputs echo inputs, so a test can
//! check that every request got its own answer back. The scheduler cannot tell a sim worker
//! from a candle one: same process, same gRPC API.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use candle_core::Device;
use nomad_proto::v1::{ItemResult, ToolInput, ToolOutput, item_result, tool_input, tool_output};
use serde::Deserialize;

use super::{ExecError, Model, invalid};

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

#[derive(Debug, Clone)]
pub struct SimModel {
    model_bytes: u64,
    activation_bytes_per_item: u64,
    memory_bytes: u64,
    base_latency: f64,
    per_item_latency: f64,
}

impl SimModel {
    /// "Loads" `tool`: sleeps for the configured load time.
    pub fn load(tool: &str, config: &SimConfig) -> Self {
        if config.load_ms > 0.0 {
            std::thread::sleep(Duration::from_secs_f64(config.load_ms / 1000.0));
        }
        let o = config.models.get(tool).cloned().unwrap_or_default();
        SimModel {
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

fn echo(input: &ToolInput) -> Option<ToolOutput> {
    let value = match input.value.as_ref()? {
        tool_input::Value::Text(t) => tool_output::Value::Text(t.clone()),
        tool_input::Value::Tensor(t) => tool_output::Value::Tensor(t.clone()),
    };
    Some(ToolOutput { value: Some(value) })
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

    fn execute(&self, inputs: &[ToolInput]) -> Result<Vec<ItemResult>, ExecError> {
        let need = self.needs(inputs.len());
        if need > self.memory_bytes {
            return Err(ExecError::OutOfMemory(format!(
                "a batch of {} needs {need} bytes, the device has {}",
                inputs.len(),
                self.memory_bytes
            )));
        }
        let latency = self.base_latency + self.per_item_latency * inputs.len() as f64;
        if latency > 0.0 {
            std::thread::sleep(Duration::from_secs_f64(latency / 1000.0));
        }
        Ok(inputs
            .iter()
            .enumerate()
            .map(|(i, input)| match echo(input) {
                Some(output) => ItemResult {
                    result: Some(item_result::Result::Output(output)),
                },
                None => invalid(i, "empty input"),
            })
            .collect())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn text(s: &str) -> ToolInput {
        ToolInput {
            value: Some(tool_input::Value::Text(s.into())),
            options_json: String::new(),
        }
    }

    #[test]
    fn echoes_each_input_in_order() {
        let model = SimModel::load("t", &SimConfig::default());
        let out = model
            .execute(&[text("a"), text("b"), ToolInput::default()])
            .unwrap();
        let texts: Vec<_> = out
            .iter()
            .map(|r| match &r.result {
                Some(item_result::Result::Output(ToolOutput {
                    value: Some(tool_output::Value::Text(t)),
                })) => t.clone(),
                Some(item_result::Result::InvalidInput(m)) => format!("invalid: {m}"),
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
        let model = SimModel::load("t", &config);
        let batch: Vec<_> = (0..10).map(|i| text(&i.to_string())).collect();
        assert!(matches!(
            model.execute(&batch),
            Err(ExecError::OutOfMemory(_))
        ));
        assert_eq!(model.execute(&batch[..8]).unwrap().len(), 8);
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
        let big = SimModel::load("big", &config);
        assert!(matches!(
            big.to_device(&Device::Cpu),
            Err(ExecError::OutOfMemory(_))
        ));
        assert!(
            SimModel::load("small", &config)
                .to_device(&Device::Cpu)
                .is_ok()
        );
    }
}

//! An independent forward pass of the `mlp` model format, to check the worker's outputs.

use std::path::Path;

use safetensors::SafeTensors;
use serde::Deserialize as _;

/// Computes the MLP on `input` straight from `model.safetensors` and `config.json` in `dir`.
pub fn mlp_forward(dir: &Path, input: &[f32]) -> Vec<f32> {
    let config: serde_json::Value =
        serde_json::from_slice(&std::fs::read(dir.join("config.json")).unwrap()).unwrap();
    let dims = Vec::<usize>::deserialize(&config["layers"]).unwrap();
    let bytes = std::fs::read(dir.join("model.safetensors")).unwrap();
    let tensors = SafeTensors::deserialize(&bytes).unwrap();
    let floats = |name: &str| -> Vec<f32> {
        tensors
            .tensor(name)
            .unwrap()
            .data()
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect()
    };
    let mut x = input.to_vec();
    let layers = dims.len() - 1;
    for i in 0..layers {
        let (fan_in, fan_out) = (dims[i], dims[i + 1]);
        let w = floats(&format!("layers.{i}.weight"));
        let b = floats(&format!("layers.{i}.bias"));
        x = (0..fan_out)
            .map(|o| {
                let sum: f32 = (0..fan_in).map(|k| w[o * fan_in + k] * x[k]).sum::<f32>() + b[o];
                if i + 1 < layers { sum.max(0.0) } else { sum }
            })
            .collect();
    }
    x
}

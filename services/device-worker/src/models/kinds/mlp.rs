//! A small feed-forward model (`mlp`): linear layers with ReLU between them, from a directory
//! holding `config.json` (`{"kind": "mlp", "layers": [in, hidden.., out]}`) and
//! `model.safetensors` (`layers.{i}.weight` [out, in], `layers.{i}.bias` [out]).

use std::collections::HashMap;
use std::path::Path;
use std::sync::Arc;

use candle_core::{DType, Device, Tensor};
use rand::{Rng, SeedableRng};
use serde::{Deserialize, Serialize};

use crate::models::batch::{self, invalid};
use crate::models::model::{Answer, ExecError, ExecLimits, Input, LoadError, Model, Value};

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct MlpConfig {
    pub kind: String,
    /// Layer widths: input, hidden..., output.
    pub layers: Vec<usize>,
}

pub struct Mlp {
    dims: Vec<usize>,
    /// (weight [out, in], bias [out]) per layer.
    layers: Vec<(Tensor, Tensor)>,
    device: Device,
}

impl Mlp {
    pub fn load(dir: &Path) -> Result<Self, LoadError> {
        let invalid = |reason: String| LoadError::Invalid {
            path: dir.to_owned(),
            reason,
        };
        let config_path = dir.join("config.json");
        let text = std::fs::read_to_string(&config_path)
            .map_err(|e| invalid(format!("reading config.json: {e}")))?;
        let config: MlpConfig =
            serde_json::from_str(&text).map_err(|e| invalid(format!("config.json: {e}")))?;
        if config.kind != "mlp" {
            return Err(invalid(format!(
                "config.json says kind {:?}, expected \"mlp\"",
                config.kind
            )));
        }
        if config.layers.len() < 2 || config.layers.contains(&0) {
            return Err(invalid(
                "config.json `layers` needs at least two non-zero widths".into(),
            ));
        }
        let weights_path = dir.join("model.safetensors");
        let mut tensors = candle_core::safetensors::load(&weights_path, &Device::Cpu)
            .map_err(|e| invalid(format!("reading model.safetensors: {e}")))?;
        let mut layers = Vec::new();
        for (i, pair) in config.layers.windows(2).enumerate() {
            let (fan_in, fan_out) = (pair[0], pair[1]);
            let mut take = |name: String, shape: &[usize]| {
                let t = tensors
                    .remove(&name)
                    .ok_or_else(|| invalid(format!("model.safetensors lacks {name}")))?;
                if t.dims() != shape {
                    return Err(invalid(format!(
                        "{name} has shape {:?}, config.json implies {shape:?}",
                        t.dims()
                    )));
                }
                t.to_dtype(DType::F32)
                    .map_err(|e| invalid(format!("{name}: {e}")))
            };
            let w = take(format!("layers.{i}.weight"), &[fan_out, fan_in])?;
            let b = take(format!("layers.{i}.bias"), &[fan_out])?;
            layers.push((w, b));
        }
        Ok(Mlp {
            dims: config.layers,
            layers,
            device: Device::Cpu,
        })
    }

    fn input_width(&self) -> usize {
        self.dims[0]
    }

    /// The rows of one request, or why it cannot run.
    fn row(&self, index: usize, input: &Input) -> Result<Vec<f32>, Answer> {
        let width = self.input_width();
        batch::check_form(index, input, &nomad_proto::kinds::MLP)?;
        let Value::Tensor { values, shape } = &input.value else {
            return Err(invalid(
                index,
                format!("empty input; mlp takes a tensor of shape [{width}]"),
            ));
        };
        let shape_ok = matches!(shape.as_slice(), [w] if *w as usize == width)
            || matches!(shape.as_slice(), [1, w] if *w as usize == width);
        if !shape_ok {
            return Err(invalid(
                index,
                format!("expected shape [{width}], got {shape:?}"),
            ));
        }
        Ok(values.clone())
    }

    fn forward(&self, rows: &[Vec<f32>]) -> Result<Vec<Vec<f32>>, ExecError> {
        let flat: Vec<f32> = rows.iter().flatten().copied().collect();
        let mut x = Tensor::from_vec(flat, (rows.len(), self.input_width()), &self.device)?;
        let last = self.layers.len() - 1;
        for (i, (w, b)) in self.layers.iter().enumerate() {
            x = x.matmul(&w.t()?)?.broadcast_add(b)?;
            if i != last {
                x = x.relu()?;
            }
        }
        Ok(x.to_device(&Device::Cpu)?.to_vec2::<f32>()?)
    }

    /// Writes a randomly initialised MLP (seeded, so the same seed gives the same model).
    pub fn write_random(dir: &Path, dims: &[usize], seed: u64) -> anyhow::Result<()> {
        anyhow::ensure!(
            dims.len() >= 2 && !dims.contains(&0),
            "an mlp needs at least two non-zero layer widths, got {dims:?}"
        );
        std::fs::create_dir_all(dir)?;
        let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
        let mut tensors = HashMap::new();
        for (i, pair) in dims.windows(2).enumerate() {
            let (fan_in, fan_out) = (pair[0], pair[1]);
            let scale = 1.0 / (fan_in as f32).sqrt();
            let mut random = |n: usize| -> Vec<f32> {
                (0..n).map(|_| rng.random_range(-scale..scale)).collect()
            };
            let w = Tensor::from_vec(random(fan_in * fan_out), (fan_out, fan_in), &Device::Cpu)?;
            let b = Tensor::from_vec(random(fan_out), fan_out, &Device::Cpu)?;
            tensors.insert(format!("layers.{i}.weight"), w);
            tensors.insert(format!("layers.{i}.bias"), b);
        }
        candle_core::safetensors::save(&tensors, dir.join("model.safetensors"))?;
        let config = MlpConfig {
            kind: "mlp".into(),
            layers: dims.to_vec(),
        };
        std::fs::write(
            dir.join("config.json"),
            serde_json::to_string_pretty(&config)? + "\n",
        )?;
        Ok(())
    }
}

impl Model for Mlp {
    fn bytes(&self) -> u64 {
        self.layers
            .iter()
            .map(|(w, b)| ((w.elem_count() + b.elem_count()) * 4) as u64)
            .sum()
    }

    fn to_device(&self, device: &Device) -> Result<Arc<dyn Model>, ExecError> {
        let layers = self
            .layers
            .iter()
            .map(|(w, b)| Ok((w.to_device(device)?, b.to_device(device)?)))
            .collect::<Result<_, candle_core::Error>>()?;
        Ok(Arc::new(Mlp {
            dims: self.dims.clone(),
            layers,
            device: device.clone(),
        }))
    }

    fn execute(&self, inputs: &[Input], limits: &ExecLimits) -> Result<Vec<Answer>, ExecError> {
        batch::run(
            inputs,
            |index, input| self.row(index, input),
            |rows, _| {
                let widest = self.dims.iter().copied().max().unwrap_or(0);
                limits.check(
                    self.bytes(),
                    (rows.len() * widest * 2 * 4) as u64,
                    rows.len(),
                )?;
                Ok(self
                    .forward(&rows)?
                    .into_iter()
                    .map(batch::vector)
                    .collect())
            },
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tensor_input(values: &[f32], shape: Vec<u64>) -> Input {
        Input {
            value: Value::Tensor {
                values: values.to_vec(),
                shape,
            },
            options: String::new(),
        }
    }

    use crate::models::testing::vector_of as output;

    fn temp_model(dims: &[usize], seed: u64) -> (std::path::PathBuf, Mlp) {
        let dir = std::env::temp_dir().join(format!(
            "nomad-mlp-{}-{}",
            std::process::id(),
            uuid::Uuid::new_v4()
        ));
        Mlp::write_random(&dir, dims, seed).unwrap();
        let mlp = Mlp::load(&dir).unwrap();
        (dir, mlp)
    }

    #[test]
    fn batch_rows_equal_single_rows_and_invalid_inputs_are_named() {
        let (_dir, mlp) = temp_model(&[3, 5, 2], 7);
        let a = tensor_input(&[0.1, 0.2, 0.3], vec![3]);
        let b = tensor_input(&[-1.0, 0.5, 2.0], vec![1, 3]);
        let text = crate::models::testing::text_input("hi", "");
        let missing = Input {
            value: Value::Missing,
            options: String::new(),
        };
        let wrong = tensor_input(&[1.0, 2.0], vec![2]);
        let batch = mlp
            .execute(
                &[a.clone(), text, b.clone(), wrong, missing],
                &ExecLimits::default(),
            )
            .unwrap();
        assert_eq!(batch.len(), 5);
        assert_eq!(
            output(&batch[0]),
            output(&mlp.execute(&[a], &ExecLimits::default()).unwrap()[0])
        );
        assert_eq!(
            output(&batch[2]),
            output(&mlp.execute(&[b], &ExecLimits::default()).unwrap()[0])
        );
        for (i, expected) in [
            (1, "got text"),
            (3, "expected shape [3]"),
            (4, "empty input"),
        ] {
            match &batch[i] {
                Answer::Invalid(msg) => {
                    assert!(
                        msg.starts_with(&format!("request {i}:")) && msg.contains(expected),
                        "{msg}"
                    )
                }
                other => panic!("request {i}: expected invalid_input, got {other:?}"),
            }
        }
    }

    #[test]
    fn forward_matches_a_hand_computed_layer() {
        let (dir, mlp) = temp_model(&[2, 1], 3);
        let t =
            candle_core::safetensors::load(dir.join("model.safetensors"), &Device::Cpu).unwrap();
        let w = t["layers.0.weight"]
            .flatten_all()
            .unwrap()
            .to_vec1::<f32>()
            .unwrap();
        let b = t["layers.0.bias"].to_vec1::<f32>().unwrap();
        let got = output(
            &mlp.execute(
                &[tensor_input(&[2.0, -3.0], vec![2])],
                &ExecLimits::default(),
            )
            .unwrap()[0],
        );
        let want = w[0] * 2.0 + w[1] * -3.0 + b[0];
        assert!((got[0] - want).abs() < 1e-6, "{got:?} vs {want}");
    }

    #[test]
    fn same_seed_same_weights_and_bad_files_are_clear_errors() {
        let (_a, m1) = temp_model(&[4, 3], 11);
        let (_b, m2) = temp_model(&[4, 3], 11);
        let x = tensor_input(&[1.0, 2.0, 3.0, 4.0], vec![4]);
        assert_eq!(
            output(
                &m1.execute(std::slice::from_ref(&x), &ExecLimits::default())
                    .unwrap()[0]
            ),
            output(&m2.execute(&[x], &ExecLimits::default()).unwrap()[0])
        );

        let (dir, _) = temp_model(&[4, 3], 1);
        std::fs::write(dir.join("config.json"), r#"{"kind":"mlp","layers":[5,3]}"#).unwrap();
        let msg = Mlp::load(&dir).err().unwrap().to_string();
        assert!(
            msg.contains("layers.0.weight") && msg.contains("[3, 5]"),
            "{msg}"
        );
        std::fs::remove_file(dir.join("model.safetensors")).unwrap();
        let msg = Mlp::load(&dir).err().unwrap().to_string();
        assert!(msg.contains("model.safetensors"), "{msg}");
    }
}

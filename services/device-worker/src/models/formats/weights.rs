//! Where a decoder's tensors come from, asked for by llama.cpp's names: a GGUF file as it is,
//! or a transformers directory's safetensors (its names translated, its weights as f32).

use std::io::{Read, Seek};
use std::path::{Path, PathBuf};

use candle_core::quantized::{GgmlDType, QTensor, gguf_file};
use candle_core::safetensors::MmapedSafetensors;
use candle_core::{DType, Device, Result};

pub trait Weights {
    /// The tensor llama.cpp names `name`, if the model has it.
    fn get(&mut self, name: &str) -> Result<Option<QTensor>>;

    /// What the model's own files call `name` (for messages).
    fn own_name(&self, name: &str) -> String;

    /// The tensor llama.cpp names `name`, which the model must have.
    fn need(&mut self, name: &str) -> Result<QTensor> {
        match self.get(name)? {
            Some(t) => Ok(t),
            None => candle_core::bail!("the model lacks {}", self.own_name(name)),
        }
    }
}

pub struct Gguf<'a, R> {
    pub content: &'a gguf_file::Content,
    pub reader: &'a mut R,
    pub device: &'a Device,
}

impl<R: Read + Seek> Weights for Gguf<'_, R> {
    fn get(&mut self, name: &str) -> Result<Option<QTensor>> {
        if !self.content.tensor_infos.contains_key(name) {
            return Ok(None);
        }
        self.content
            .tensor(self.reader, name, self.device)
            .map(Some)
    }

    fn own_name(&self, name: &str) -> String {
        name.to_owned()
    }
}

/// A transformers directory's `*.safetensors` files (one, or the shards of one model).
pub struct Safetensors {
    tensors: MmapedSafetensors,
    device: Device,
}

impl Safetensors {
    pub fn open(dir: &Path, device: &Device) -> std::result::Result<Self, String> {
        let files = safetensors_files(dir)?;
        // SAFETY: the files are mapped read-only; the model's directory is not written while
        // it is served (as for every safetensors model the worker maps).
        let tensors = unsafe { MmapedSafetensors::multi(&files) }
            .map_err(|e| format!("reading the safetensors files: {e}"))?;
        Ok(Self {
            tensors,
            device: device.clone(),
        })
    }
}

/// The `.safetensors` files in `dir`, in name order; none is an error.
pub fn safetensors_files(dir: &Path) -> std::result::Result<Vec<PathBuf>, String> {
    let mut files: Vec<PathBuf> = std::fs::read_dir(dir)
        .map_err(|e| e.to_string())?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "safetensors"))
        .collect();
    files.sort();
    if files.is_empty() {
        return Err("no .safetensors file beside config.json".into());
    }
    Ok(files)
}

impl Weights for Safetensors {
    fn get(&mut self, name: &str) -> Result<Option<QTensor>> {
        let own = self.own_name(name);
        if self.tensors.get(&own).is_err() {
            return Ok(None);
        }
        let tensor = self
            .tensors
            .load(&own, &self.device)?
            .to_dtype(DType::F32)?;
        QTensor::quantize(&tensor, GgmlDType::F32).map(Some)
    }

    fn own_name(&self, name: &str) -> String {
        transformers_name(name)
    }
}

/// transformers' name for the tensor llama.cpp names `name`.
fn transformers_name(name: &str) -> String {
    let Some((layer, rest)) = name
        .strip_prefix("blk.")
        .and_then(|rest| rest.split_once('.'))
    else {
        return match name {
            "token_embd.weight" => "model.embed_tokens.weight",
            "output_norm.weight" => "model.norm.weight",
            "output.weight" => "lm_head.weight",
            other => other,
        }
        .to_owned();
    };
    let (tensor, kind) = rest.rsplit_once('.').unwrap_or((rest, "weight"));
    let part = match tensor {
        "attn_q" => "self_attn.q_proj",
        "attn_k" => "self_attn.k_proj",
        "attn_v" => "self_attn.v_proj",
        "attn_output" => "self_attn.o_proj",
        "attn_q_norm" => "self_attn.q_norm",
        "attn_k_norm" => "self_attn.k_norm",
        "attn_norm" => "input_layernorm",
        "ffn_norm" => "post_attention_layernorm",
        "ffn_gate" => "mlp.gate_proj",
        "ffn_up" => "mlp.up_proj",
        "ffn_down" => "mlp.down_proj",
        other => other,
    };
    format!("model.layers.{layer}.{part}.{kind}")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_translate_to_transformers() {
        for (ours, theirs) in [
            ("token_embd.weight", "model.embed_tokens.weight"),
            ("output.weight", "lm_head.weight"),
            (
                "blk.11.attn_q.bias",
                "model.layers.11.self_attn.q_proj.bias",
            ),
            (
                "blk.0.attn_k_norm.weight",
                "model.layers.0.self_attn.k_norm.weight",
            ),
            (
                "blk.3.ffn_norm.weight",
                "model.layers.3.post_attention_layernorm.weight",
            ),
            (
                "blk.3.ffn_down.weight",
                "model.layers.3.mlp.down_proj.weight",
            ),
        ] {
            assert_eq!(transformers_name(ours), theirs);
        }
    }
}

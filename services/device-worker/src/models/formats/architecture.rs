//! What a decoder's files say about it: the family (a GGUF's `general.architecture`, or
//! `model_type` in a transformers directory's `config.json`), its hyperparameters (under the
//! family's own key prefix in a GGUF), and how the family differs from llama. Read once here, so
//! the loader, the KV budget and the refusals agree.

use candle_core::quantized::gguf_file;

use crate::models::formats::rope_scaling::Scaling;
use crate::models::kernels::host_attention::RopeStyle;

/// The decoder families served, and what each adds to llama's block.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Family {
    /// Llama 1/2/3 and Mistral (llama.cpp writes Mistral 7B as `llama`).
    Llama,
    /// `mistral` as its own architecture name: llama's block.
    Mistral,
    /// Biases on q, k and v.
    Qwen2,
    /// An RMS norm on each head of q and k before rotation; head width from `key_length`.
    Qwen3,
}

/// The architectures this worker serves, as `general.architecture` and `model_type` name them.
const SERVED: &[(&str, Family)] = &[
    ("llama", Family::Llama),
    ("mistral", Family::Mistral),
    ("qwen2", Family::Qwen2),
    ("qwen3", Family::Qwen3),
];

/// The names of [`SERVED`], for messages.
fn served_names() -> String {
    SERVED
        .iter()
        .map(|(n, _)| *n)
        .collect::<Vec<_>>()
        .join(", ")
}

impl Family {
    fn from_name(name: &str) -> Option<Self> {
        SERVED.iter().find(|(n, _)| *n == name).map(|(_, f)| *f)
    }

    /// How a GGUF of this family pairs rotated dimensions (transformers' weights always pair
    /// halves: llama.cpp permutes llama's q and k when it converts them).
    pub fn gguf_rope_style(self) -> RopeStyle {
        match self {
            Self::Llama | Self::Mistral => RopeStyle::Interleaved,
            Self::Qwen2 | Self::Qwen3 => RopeStyle::Halves,
        }
    }

    pub fn qk_norm(self) -> bool {
        self == Self::Qwen3
    }
}

/// A decoder's shape as its GGUF states it.
#[derive(Debug, Clone, PartialEq)]
pub struct Architecture {
    pub family: Family,
    pub rope: RopeStyle,
    /// Tokens a sequence may hold: the trained context, or a sliding window that only some
    /// layers keep to, or one read from a GGUF (attention beyond it is never computed, so
    /// answers stay the model's).
    pub context_length: usize,
    /// A sliding window every layer keeps to (a transformers directory's `sliding_window`):
    /// each token attends to the last `window` positions only, itself included.
    pub sliding_window: Option<usize>,
    pub layers: usize,
    pub hidden: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    pub eps: f64,
    pub freq_base: f32,
    /// One divisor per rotary frequency, from the rope scaling the files ask for.
    pub rope_divisors: Option<Vec<f32>>,
}

impl Architecture {
    pub fn read(ct: &gguf_file::Content) -> Result<Self, String> {
        let name = text(ct, "general.architecture")?;
        let family = Family::from_name(&name).ok_or_else(|| {
            format!(
                "architecture {name:?} is not served (served: {})",
                served_names()
            )
        })?;
        let key = |k: &str| format!("{name}.{k}");
        let number = |k: &str| -> Result<usize, String> {
            let key = key(k);
            value(ct, &key)?
                .to_u32()
                .map(|v| v as usize)
                .map_err(|e| format!("{key}: {e}"))
        };
        let optional = |k: &str| -> Result<Option<usize>, String> {
            match ct.metadata.get(&key(k)) {
                Some(_) => number(k).map(Some),
                None => Ok(None),
            }
        };
        let heads = number("attention.head_count")?;
        let kv_heads = number("attention.head_count_kv").unwrap_or(heads);
        let hidden = number("embedding_length")?;
        if heads == 0 || kv_heads == 0 || heads % kv_heads != 0 {
            return Err(format!("{heads} attention heads over {kv_heads} kv heads"));
        }
        let head_dim = optional("attention.key_length")?.unwrap_or(hidden / heads);
        if let Some(v) = optional("attention.value_length")?
            && v != head_dim
        {
            return Err(format!(
                "keys of {head_dim} and values of {v} dimensions per head are not served"
            ));
        }
        let rope_dim = optional("rope.dimension_count")?.unwrap_or(head_dim);
        if rope_dim != head_dim {
            return Err(format!(
                "rope over {rope_dim} of {head_dim} dimensions per head is not served"
            ));
        }
        let scaling = match ct.metadata.get(&key("rope.scaling.type")) {
            Some(kind) => {
                let kind = kind.to_string().map_err(|e| e.to_string())?;
                let factor = match ct.metadata.get(&key("rope.scaling.factor")) {
                    Some(v) => Some(v.to_f32().map_err(|e| e.to_string())?),
                    None => None,
                };
                Scaling::from_gguf(kind, factor, &key("rope.scaling.type"))?
            }
            None => None,
        };
        let mut context_length = number("context_length")?;
        if let Some(window) = optional("attention.sliding_window")?
            && window > 0
        {
            context_length = context_length.min(window);
        }
        let eps = value(ct, &key("attention.layer_norm_rms_epsilon"))?
            .to_f32()
            .map_err(|e| e.to_string())? as f64;
        let freq_base = match ct.metadata.get(&key("rope.freq_base")) {
            Some(v) => v.to_f32().map_err(|e| e.to_string())?,
            None => 10_000.0,
        };
        Ok(Self {
            family,
            rope: family.gguf_rope_style(),
            context_length,
            sliding_window: None,
            layers: number("block_count")?,
            hidden,
            heads,
            kv_heads,
            head_dim,
            eps,
            freq_base,
            rope_divisors: scaling.map(|s| s.divisors(head_dim, freq_base)),
        })
    }

    /// From a transformers directory's `config.json`.
    pub fn from_config(config: &serde_json::Value) -> Result<Self, String> {
        let name = config["model_type"].as_str().unwrap_or("(none)");
        let family = Family::from_name(name).ok_or_else(|| {
            format!(
                "config.json: model_type {name:?} is not a decoder family served (served: {})",
                served_names()
            )
        })?;
        let number = |key: &str| -> Result<Option<usize>, String> {
            match config.get(key) {
                None | Some(serde_json::Value::Null) => Ok(None),
                Some(v) => v
                    .as_u64()
                    .map(|v| Some(v as usize))
                    .ok_or_else(|| format!("config.json: {key} = {v} is not a whole number")),
            }
        };
        let need = |key: &str| number(key)?.ok_or_else(|| format!("config.json lacks {key}"));
        let flag = |key: &str| config.get(key).and_then(serde_json::Value::as_bool);
        for key in ["mlp_bias", "attention_bias"] {
            if flag(key) == Some(true) {
                return Err(format!("config.json: {key} = true is not served"));
            }
        }
        // transformers 5 keeps rope's settings in `rope_parameters`; earlier versions beside.
        let rope = config.get("rope_parameters").unwrap_or(config);
        let scaling = Scaling::from_config(config)?;
        let heads = need("num_attention_heads")?;
        let kv_heads = number("num_key_value_heads")?.unwrap_or(heads);
        let hidden = need("hidden_size")?;
        if heads == 0 || kv_heads == 0 || heads % kv_heads != 0 {
            return Err(format!("{heads} attention heads over {kv_heads} kv heads"));
        }
        let mut context_length = need("max_position_embeddings")?;
        let layers = need("num_hidden_layers")?;
        let mut sliding_window = None;
        if let Some(window) = number("sliding_window")?.filter(|w| *w > 0) {
            // Which layers keep to it, as transformers decides: every layer of Mistral's (and
            // of a llama config that names one); in Qwen's, with `use_sliding_window`, those
            // `layer_types` calls sliding, or from `max_window_layers` on.
            let sliding = match family {
                Family::Llama | Family::Mistral => layers,
                Family::Qwen2 | Family::Qwen3 if flag("use_sliding_window") == Some(true) => {
                    match config
                        .get("layer_types")
                        .and_then(serde_json::Value::as_array)
                    {
                        Some(types) => types
                            .iter()
                            .filter(|t| t.as_str() == Some("sliding_attention"))
                            .count(),
                        None => layers.saturating_sub(number("max_window_layers")?.unwrap_or(0)),
                    }
                }
                Family::Qwen2 | Family::Qwen3 => 0,
            };
            if sliding == layers {
                sliding_window = Some(window);
            } else if sliding > 0 {
                context_length = context_length.min(window);
            }
        }
        let head_dim = number("head_dim")?.unwrap_or(hidden / heads);
        let freq_base = rope["rope_theta"].as_f64().unwrap_or(10_000.0) as f32;
        Ok(Self {
            family,
            rope: RopeStyle::Halves,
            context_length,
            sliding_window,
            layers,
            hidden,
            heads,
            kv_heads,
            head_dim,
            eps: config["rms_norm_eps"].as_f64().unwrap_or(1e-6),
            freq_base,
            rope_divisors: scaling.map(|s| s.divisors(head_dim, freq_base)),
        })
    }

    /// The same model where attention has no sliding window (candle's, on an accelerator):
    /// the context ends at the window instead.
    pub fn without_window(mut self) -> Self {
        if let Some(window) = self.sliding_window.take() {
            self.context_length = self.context_length.min(window);
        }
        self
    }

    /// Bytes of KV cache one token occupies (all layers, keys and values, f32).
    pub fn kv_bytes_per_token(&self) -> u64 {
        (self.layers * 2 * self.kv_heads * self.head_dim * 4) as u64
    }
}

fn value<'a>(ct: &'a gguf_file::Content, key: &str) -> Result<&'a gguf_file::Value, String> {
    ct.metadata
        .get(key)
        .ok_or_else(|| format!("the GGUF lacks {key}"))
}

fn text(ct: &gguf_file::Content, key: &str) -> Result<String, String> {
    value(ct, key)?
        .to_string()
        .cloned()
        .map_err(|e| format!("{key}: {e}"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use gguf_file::Value;

    fn content(entries: &[(&str, Value)]) -> gguf_file::Content {
        gguf_file::Content {
            magic: gguf_file::VersionedMagic::GgufV3,
            metadata: entries
                .iter()
                .map(|(k, v)| (k.to_string(), v.clone()))
                .collect(),
            tensor_infos: Default::default(),
            tensor_data_offset: 0,
        }
    }

    fn qwen3() -> Vec<(&'static str, Value)> {
        vec![
            ("general.architecture", Value::String("qwen3".into())),
            ("qwen3.context_length", Value::U32(40960)),
            ("qwen3.block_count", Value::U32(2)),
            ("qwen3.embedding_length", Value::U32(64)),
            ("qwen3.attention.head_count", Value::U32(4)),
            ("qwen3.attention.head_count_kv", Value::U32(2)),
            ("qwen3.attention.key_length", Value::U32(32)),
            ("qwen3.attention.layer_norm_rms_epsilon", Value::F32(1e-6)),
            ("qwen3.rope.freq_base", Value::F32(1e6)),
        ]
    }

    #[test]
    fn each_family_reads_its_own_keys() {
        let arch = Architecture::read(&content(&qwen3())).unwrap();
        assert_eq!(arch.family, Family::Qwen3);
        assert_eq!((arch.heads, arch.kv_heads, arch.head_dim), (4, 2, 32));
        assert_eq!(arch.context_length, 40960);
        assert_eq!(arch.freq_base, 1e6);
        assert_eq!(arch.kv_bytes_per_token(), 2 * 2 * 2 * 32 * 4);
        assert_eq!(arch.rope, RopeStyle::Halves);
        assert!(arch.family.qk_norm());
    }

    #[test]
    fn what_is_not_served_is_named() {
        let mut gpt = qwen3();
        gpt[0].1 = Value::String("gpt2".into());
        let err = Architecture::read(&content(&gpt)).unwrap_err();
        assert!(err.contains("architecture \"gpt2\" is not served"), "{err}");
        assert!(err.contains("llama, mistral, qwen2, qwen3"), "{err}");

        let mut scaled = qwen3();
        scaled.push(("qwen3.rope.scaling.type", Value::String("yarn".into())));
        let err = Architecture::read(&content(&scaled)).unwrap_err();
        assert!(err.contains("qwen3.rope.scaling.type = \"yarn\""), "{err}");

        let mut missing = qwen3();
        missing.retain(|(k, _)| *k != "qwen3.block_count");
        let err = Architecture::read(&content(&missing)).unwrap_err();
        assert_eq!(err, "the GGUF lacks qwen3.block_count");
    }

    #[test]
    fn a_transformers_config_reads_as_its_gguf_does() {
        let config = serde_json::json!({
            "model_type": "mistral", "hidden_size": 64, "num_hidden_layers": 2,
            "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 16,
            "rms_norm_eps": 1e-5, "max_position_embeddings": 32768, "sliding_window": 4096,
            "rope_parameters": {"rope_theta": 1e6, "rope_type": "default"}
        });
        let arch = Architecture::from_config(&config).unwrap();
        assert_eq!(arch.family, Family::Mistral);
        assert_eq!(arch.rope, RopeStyle::Halves);
        assert_eq!((arch.heads, arch.kv_heads, arch.head_dim), (4, 1, 16));
        assert_eq!((arch.context_length, arch.freq_base), (32768, 1e6));
        assert_eq!(arch.sliding_window, Some(4096));
        assert_eq!(arch.clone().without_window().context_length, 4096);
        assert_eq!(arch.rope_divisors, None);
        let mut scaled = config.clone();
        scaled["rope_parameters"]["rope_type"] = "yarn".into();
        assert!(
            Architecture::from_config(&scaled)
                .unwrap_err()
                .starts_with("config.json: rope_type \"yarn\": this rope scaling is not served"),
        );
        let mut linear = config.clone();
        linear["rope_parameters"] = serde_json::json!({"rope_type": "linear", "factor": 2.0,
            "rope_theta": 1e6});
        assert_eq!(
            Architecture::from_config(&linear).unwrap().rope_divisors,
            Some(vec![2.0; 8])
        );
        let mut gpt = config;
        gpt["model_type"] = "gpt2".into();
        assert!(
            Architecture::from_config(&gpt)
                .unwrap_err()
                .starts_with("config.json: model_type \"gpt2\" is not a decoder family served")
        );
    }

    #[test]
    fn a_sliding_window_bounds_the_context() {
        let mut windowed = qwen3();
        windowed.push(("qwen3.attention.sliding_window", Value::U32(4096)));
        assert_eq!(
            Architecture::read(&content(&windowed))
                .unwrap()
                .context_length,
            4096
        );
    }

    #[test]
    fn a_window_every_layer_keeps_to_is_served_and_a_partial_one_bounds_the_context() {
        let qwen2 = |extra: serde_json::Value| {
            let mut config = serde_json::json!({
                "model_type": "qwen2", "hidden_size": 64, "num_hidden_layers": 2,
                "num_attention_heads": 4, "num_key_value_heads": 2,
                "max_position_embeddings": 32768, "sliding_window": 128,
            });
            config
                .as_object_mut()
                .unwrap()
                .extend(extra.as_object().unwrap().clone());
            let arch = Architecture::from_config(&config).unwrap();
            (arch.context_length, arch.sliding_window)
        };
        use serde_json::json;
        // Every layer slides: the window is served, the context stays.
        assert_eq!(
            qwen2(json!({"use_sliding_window": true, "max_window_layers": 0})),
            (32768, Some(128))
        );
        assert_eq!(
            qwen2(json!({"use_sliding_window": true,
                "layer_types": ["sliding_attention", "sliding_attention"]})),
            (32768, Some(128))
        );
        // Some layers slide: the context ends at the window.
        assert_eq!(
            qwen2(json!({"use_sliding_window": true, "max_window_layers": 1})),
            (128, None)
        );
        // None slide (transformers' default of max_window_layers covers every layer), or the
        // window is off: full attention over the whole context.
        assert_eq!(
            qwen2(json!({"use_sliding_window": true, "max_window_layers": 28})),
            (32768, None)
        );
        assert_eq!(qwen2(json!({"use_sliding_window": false})), (32768, None));
    }
}

//! What a decoder's files say about serving it, everything but the weights: the architecture,
//! the tokenizer, the chat template, the BOS token a prompt begins with and the tokens that end
//! a generation; from a GGUF's metadata or a transformers directory (`config.json`,
//! `tokenizer.json`, `tokenizer_config.json`, `chat_template.jinja`, `generation_config.json`).
//! Read at load and, alone, when the tool is checked at start-up.

use std::path::Path;

use candle_core::quantized::gguf_file;
use serde_json::Value;
use tokenizers::Tokenizer;

use crate::models::formats::architecture::Architecture;
use crate::models::formats::chat_template::ChatTemplate;
use crate::models::formats::gguf::{load_error, tokenizer_from_gguf};
use crate::models::model::LoadError;

/// Tokens that end a turn in the families served, besides those the files name.
const END_OF_TURN: &[&str] = &[
    "<|im_end|>",
    "<|endoftext|>",
    "<|eot_id|>",
    "<|eom_id|>",
    "<|end|>",
];

pub struct Metadata {
    pub arch: Architecture,
    pub tokenizer: Tokenizer,
    /// The model's own chat template, when its files have one.
    pub template: Option<ChatTemplate>,
    /// The token a prompt begins with where the worker must add it (a GGUF's
    /// `add_bos_token`; a `tokenizer.json` adds its own through its post-processor).
    pub bos: Option<(u32, String)>,
    /// Token ids that end a generation.
    pub stop: Vec<u32>,
    /// The sampling the files recommend for a request that names none.
    pub sampling: SamplingDefaults,
}

/// The sampling a model's files recommend, used for each setting a request leaves out (as
/// transformers' `generate` and llama.cpp do): a directory's `generation_config.json` (its
/// temperature, top_p and top_k when it samples, `do_sample`, with transformers' defaults for
/// those it leaves out; its repetition_penalty either way), or a GGUF's `general.sampling.*`.
/// Values are kept within the `generate` options' ranges. None named: greedy, as before.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct SamplingDefaults {
    pub temperature: Option<f64>,
    pub top_p: Option<f64>,
    pub top_k: Option<u64>,
    pub repeat_penalty: Option<f64>,
}

impl SamplingDefaults {
    /// From a transformers `generation_config.json`.
    pub fn from_generation_config(config: &Value) -> Self {
        let number = |key: &str| config[key].as_f64();
        let repeat_penalty = number("repetition_penalty").filter(|p| *p != 1.0);
        if config["do_sample"] != true {
            return Self {
                repeat_penalty,
                ..Self::default()
            }
            .bounded();
        }
        Self {
            temperature: Some(number("temperature").unwrap_or(1.0)),
            top_p: number("top_p"),
            top_k: Some(config["top_k"].as_u64().unwrap_or(50)),
            repeat_penalty,
        }
        .bounded()
    }

    /// From a GGUF's `general.sampling.temp`, `.top_p`, `.top_k` and `.penalty_repeat`.
    pub fn from_gguf(ct: &gguf_file::Content) -> Self {
        let number = |key: &str| {
            let v = ct.metadata.get(key)?;
            v.to_f32().map(f64::from).or_else(|_| v.to_f64()).ok()
        };
        let top_k = ct.metadata.get("general.sampling.top_k").and_then(|v| {
            v.to_u32()
                .map(u64::from)
                .or_else(|_| v.to_i32().map(|k| k.max(0) as u64))
                .ok()
        });
        Self {
            temperature: number("general.sampling.temp"),
            top_p: number("general.sampling.top_p"),
            top_k,
            repeat_penalty: number("general.sampling.penalty_repeat").filter(|p| *p != 1.0),
        }
        .bounded()
    }

    /// Each value within its `generate` option's range (a file's 0 top_k means "all", as ours).
    fn bounded(self) -> Self {
        let within =
            |x: Option<f64>, lo: f64, hi: f64| x.filter(|x| x.is_finite()).map(|x| x.clamp(lo, hi));
        Self {
            temperature: within(self.temperature, 0.0, 2.0),
            top_p: within(self.top_p, 0.01, 1.0),
            top_k: self.top_k.map(|k| k.min(1000)),
            repeat_penalty: within(self.repeat_penalty, 0.5, 2.0),
        }
    }
}

impl Metadata {
    pub fn from_gguf(path: &Path, ct: &gguf_file::Content) -> Result<Self, LoadError> {
        let tokenizer = tokenizer_from_gguf(ct).map_err(|e| load_error(path, e))?;
        let arch = Architecture::read(ct).map_err(|e| load_error(path, e))?;
        let id = |key: &str| -> Result<Option<u32>, LoadError> {
            ct.metadata
                .get(key)
                .map(|v| {
                    v.to_u32()
                        .map_err(|e| load_error(path, format!("{key}: {e}")))
                })
                .transpose()
        };
        let eos = id("tokenizer.ggml.eos_token_id")?
            .ok_or_else(|| load_error(path, "the GGUF lacks tokenizer.ggml.eos_token_id"))?;
        let mut ends = vec![eos];
        for key in ["tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id"] {
            ends.extend(id(key)?);
        }
        let bos = id("tokenizer.ggml.bos_token_id")?;
        let source = match ct.metadata.get("tokenizer.chat_template") {
            Some(v) => Some(v.to_string().map_err(|e| load_error(path, e))?.clone()),
            None => None,
        };
        let add_bos = ct
            .metadata
            .get("tokenizer.ggml.add_bos_token")
            .and_then(|v| v.to_bool().ok())
            .unwrap_or(false);
        let pre = ct
            .metadata
            .get("tokenizer.ggml.pre")
            .and_then(|v| v.to_string().ok())
            .map_or("gpt-2", String::as_str);
        let parts = Parts {
            path,
            tokenizer,
            arch,
            bos_id: bos,
            bos_text: None,
            eos_ids: ends,
            eos_text: None,
            template: source,
        };
        let mut metadata = parts.finish(pre)?;
        if !add_bos {
            metadata.bos = None;
        }
        metadata.sampling = SamplingDefaults::from_gguf(ct);
        Ok(metadata)
    }

    /// A transformers directory: `config.json`, `tokenizer.json` and the model's own settings.
    pub fn from_dir(dir: &Path) -> Result<Self, LoadError> {
        let json = |name: &str, required: bool| -> Result<Option<Value>, LoadError> {
            let file = dir.join(name);
            match std::fs::read_to_string(&file) {
                Ok(text) => serde_json::from_str(&text)
                    .map(Some)
                    .map_err(|e| load_error(dir, format!("{name}: {e}"))),
                Err(e) if !required && e.kind() == std::io::ErrorKind::NotFound => Ok(None),
                Err(e) => Err(load_error(dir, format!("{name}: {e}"))),
            }
        };
        let config = json("config.json", true)?.unwrap_or_default();
        let arch = Architecture::from_config(&config).map_err(|e| load_error(dir, e))?;
        let tokenizer = Tokenizer::from_file(dir.join("tokenizer.json"))
            .map_err(|e| load_error(dir, format!("tokenizer.json: {e}")))?;
        let settings = json("tokenizer_config.json", false)?.unwrap_or_default();
        let generation = json("generation_config.json", false)?.unwrap_or_default();
        // The template: transformers writes it to its own file, or kept it in the settings
        // (a string, or named templates of which `default` is the chat one).
        let template = match std::fs::read_to_string(dir.join("chat_template.jinja")) {
            Ok(text) => Some(text),
            Err(_) => match &settings["chat_template"] {
                Value::String(t) => Some(t.clone()),
                Value::Array(named) => named
                    .iter()
                    .find(|t| t["name"] == "default")
                    .or(named.first())
                    .and_then(|t| t["template"].as_str())
                    .map(str::to_owned),
                _ => None,
            },
        };
        let ids = |v: &Value| -> Vec<u32> {
            match v {
                Value::Array(a) => a
                    .iter()
                    .filter_map(Value::as_u64)
                    .map(|i| i as u32)
                    .collect(),
                v => v.as_u64().map(|i| i as u32).into_iter().collect(),
            }
        };
        let mut eos_ids = ids(&generation["eos_token_id"]);
        eos_ids.extend(ids(&config["eos_token_id"]));
        // A special token in the settings: its text, or `{"content": ...}`.
        let text = |v: &Value| {
            v.as_str()
                .or_else(|| v["content"].as_str())
                .map(str::to_owned)
        };
        let parts = Parts {
            path: dir,
            tokenizer,
            arch,
            bos_id: ids(&config["bos_token_id"]).first().copied(),
            bos_text: text(&settings["bos_token"]),
            eos_ids,
            eos_text: text(&settings["eos_token"]),
            template,
        };
        let mut metadata = parts.finish("tokenizer.json")?;
        metadata.bos = None;
        metadata.sampling = SamplingDefaults::from_generation_config(&generation);
        Ok(metadata)
    }
}

/// What either source gives, before the stops and template are made from it.
struct Parts<'a> {
    path: &'a Path,
    tokenizer: Tokenizer,
    arch: Architecture,
    bos_id: Option<u32>,
    bos_text: Option<String>,
    eos_ids: Vec<u32>,
    eos_text: Option<String>,
    template: Option<String>,
}

impl Parts<'_> {
    fn finish(self, pre: &str) -> Result<Metadata, LoadError> {
        let Parts {
            path,
            tokenizer,
            arch,
            ..
        } = self;
        let named = |id: Option<u32>, text: Option<String>, what: &str| match (id, text) {
            (_, Some(text)) => Ok(Some((tokenizer.token_to_id(&text), text))),
            (Some(id), None) => tokenizer
                .id_to_token(id)
                .map(|t| Some((Some(id), t)))
                .ok_or_else(|| {
                    load_error(
                        path,
                        format!("the {what} token {id} is not in the vocabulary"),
                    )
                }),
            (None, None) => Ok(None),
        };
        let bos = named(self.bos_id, self.bos_text, "BOS")?;
        let eos = named(self.eos_ids.first().copied(), self.eos_text, "EOS")?;
        let mut stop = self.eos_ids;
        stop.extend(eos.as_ref().and_then(|(id, _)| *id));
        stop.extend(END_OF_TURN.iter().filter_map(|t| tokenizer.token_to_id(t)));
        stop.sort_unstable();
        stop.dedup();
        if stop.is_empty() {
            return Err(load_error(path, "the model names no end-of-sequence token"));
        }
        let template = match self.template {
            Some(source) => Some(
                ChatTemplate::new(&source, text_of(&bos), text_of(&eos))
                    .map_err(|e| load_error(path, e))?,
            ),
            None => None,
        };
        tracing::info!(
            model = %path.display(),
            family = ?arch.family,
            tokenizer = pre,
            chat_template = template.is_some(),
            layers = arch.layers,
            hidden = arch.hidden,
            heads = arch.heads,
            kv_heads = arch.kv_heads,
            head_dim = arch.head_dim,
            context = arch.context_length,
            "generation model"
        );
        Ok(Metadata {
            arch,
            tokenizer,
            template,
            bos: bos.and_then(|(id, text)| Some((id?, text))),
            stop,
            sampling: SamplingDefaults::default(),
        })
    }
}

/// A special token's text, or nothing.
fn text_of(token: &Option<(Option<u32>, String)>) -> &str {
    token.as_ref().map_or("", |(_, text)| text.as_str())
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::SamplingDefaults;

    #[test]
    fn a_generation_config_that_samples_gives_its_settings_and_transformers_defaults() {
        let qwen = json!({"do_sample": true, "temperature": 0.7, "top_p": 0.8, "top_k": 20,
                          "repetition_penalty": 1.05});
        assert_eq!(
            SamplingDefaults::from_generation_config(&qwen),
            SamplingDefaults {
                temperature: Some(0.7),
                top_p: Some(0.8),
                top_k: Some(20),
                repeat_penalty: Some(1.05),
            }
        );
        // Sampling with nothing else said: transformers' temperature 1 and top_k 50.
        let bare = SamplingDefaults::from_generation_config(&json!({"do_sample": true}));
        assert_eq!(
            (bare.temperature, bare.top_k, bare.top_p),
            (Some(1.0), Some(50), None)
        );
        // Greedy (no do_sample): nothing but a repetition penalty, within its range.
        let greedy = json!({"temperature": 0.6, "top_p": 0.9, "repetition_penalty": 9.0});
        assert_eq!(
            SamplingDefaults::from_generation_config(&greedy),
            SamplingDefaults {
                repeat_penalty: Some(2.0),
                ..SamplingDefaults::default()
            }
        );
        assert_eq!(
            SamplingDefaults::from_generation_config(&json!({})),
            SamplingDefaults::default()
        );
        let hot = json!({"do_sample": true, "temperature": 5.0, "top_k": 100000});
        let hot = SamplingDefaults::from_generation_config(&hot);
        assert_eq!((hot.temperature, hot.top_k), (Some(2.0), Some(1000)));
    }
}

//! What a GGUF's metadata says about serving it, everything but the weights: the architecture,
//! the tokenizer, the chat template, the BOS token a prompt begins with and the tokens that end
//! a generation. Read at load and, alone, when the tool is checked at start-up.

use std::path::Path;

use candle_core::quantized::gguf_file;
use tokenizers::Tokenizer;

use super::LoadError;
use super::architecture::Architecture;
use super::chat_template::ChatTemplate;
use super::gguf::{load_error, tokenizer_from_gguf};

/// Tokens that end a turn in the families served, besides those the GGUF names.
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
    /// The model's own chat template, when its GGUF has one.
    pub template: Option<ChatTemplate>,
    /// The token a prompt begins with, when the GGUF asks for one (`add_bos_token`).
    pub bos: Option<(u32, String)>,
    /// Token ids that end a generation.
    pub stop: Vec<u32>,
}

impl Metadata {
    pub fn read(path: &Path, ct: &gguf_file::Content) -> Result<Self, LoadError> {
        let tokenizer = tokenizer_from_gguf(ct).map_err(|e| load_error(path, e))?;
        let arch = Architecture::read(ct).map_err(|e| load_error(path, e))?;
        let token = |key: &str| -> Result<Option<(u32, String)>, LoadError> {
            let Some(id) = ct.metadata.get(key) else {
                return Ok(None);
            };
            let id = id
                .to_u32()
                .map_err(|e| load_error(path, format!("{key}: {e}")))?;
            let text = tokenizer.id_to_token(id).ok_or_else(|| {
                load_error(path, format!("{key} = {id} is not in the vocabulary"))
            })?;
            Ok(Some((id, text)))
        };
        let eos = token("tokenizer.ggml.eos_token_id")?
            .ok_or_else(|| load_error(path, "the GGUF lacks tokenizer.ggml.eos_token_id"))?;
        let bos = token("tokenizer.ggml.bos_token_id")?;
        let mut stop = vec![eos.0];
        for key in ["tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id"] {
            stop.extend(token(key)?.map(|(id, _)| id));
        }
        stop.extend(END_OF_TURN.iter().filter_map(|t| tokenizer.token_to_id(t)));
        stop.sort_unstable();
        stop.dedup();
        let template = match ct.metadata.get("tokenizer.chat_template") {
            Some(source) => {
                let source = source.to_string().map_err(|e| load_error(path, e))?;
                let bos_text = bos.as_ref().map_or("", |(_, t)| t.as_str());
                Some(ChatTemplate::new(source, bos_text, &eos.1).map_err(|e| load_error(path, e))?)
            }
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
        tracing::info!(
            model = %path.display(),
            family = ?arch.family,
            pre_tokenizer = pre,
            chat_template = template.is_some(),
            layers = arch.layers,
            hidden = arch.hidden,
            heads = arch.heads,
            kv_heads = arch.kv_heads,
            head_dim = arch.head_dim,
            context = arch.context_length,
            "generation model"
        );
        Ok(Self {
            arch,
            tokenizer,
            template,
            bos: bos.filter(|_| add_bos),
            stop,
        })
    }
}

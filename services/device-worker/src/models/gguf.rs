//! Reading GGUF files: finding the file, its metadata, the tokenizer it describes, and
//! re-quantizing its tensors in memory.
//!
//! The tokenizer is built here rather than with `Tokenizer::from_gguf`, which gets SmolLM's
//! pre-tokenizer wrong (it adds a leading space, so "user" becomes "Ġuser"). SmolLM's
//! pre-tokenizer (`tokenizer.ggml.pre = smollm`) splits every digit on its own and then applies
//! the GPT-2 byte-level split without a prefix space.

use std::path::{Path, PathBuf};

use candle_core::Device;
use candle_core::quantized::{GgmlDType, QTensor, gguf_file};
use tokenizers::models::bpe::BPE;
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::pre_tokenizers::digits::Digits;
use tokenizers::pre_tokenizers::sequence::Sequence;
use tokenizers::{AddedToken, Tokenizer};

use super::LoadError;

pub fn load_error(path: &Path, reason: impl std::fmt::Display) -> LoadError {
    LoadError::Invalid {
        path: path.to_owned(),
        reason: reason.to_string(),
    }
}

/// The `.gguf` file: `path` itself, or the only one in the directory `path`.
pub fn gguf_path(path: &Path) -> Result<PathBuf, LoadError> {
    if path.is_file() {
        return Ok(path.to_owned());
    }
    let mut found: Vec<PathBuf> = std::fs::read_dir(path)
        .map_err(|e| load_error(path, e))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "gguf"))
        .collect();
    match found.len() {
        1 => Ok(found.remove(0)),
        0 => Err(load_error(
            path,
            "no .gguf file here (fetch the models with scripts/fetch-models)",
        )),
        n => Err(load_error(
            path,
            format!("{n} .gguf files here; point `source` at one"),
        )),
    }
}

pub fn metadata<'a>(ct: &'a gguf_file::Content, key: &str) -> Result<&'a gguf_file::Value, String> {
    ct.metadata
        .get(key)
        .ok_or_else(|| format!("the GGUF lacks {key}"))
}

fn strings(ct: &gguf_file::Content, key: &str) -> Result<Vec<String>, String> {
    metadata(ct, key)?
        .to_vec()
        .map_err(|e| format!("{key}: {e}"))?
        .iter()
        .map(|v| v.to_string().cloned().map_err(|e| format!("{key}: {e}")))
        .collect()
}

/// The tokenizer a GGUF describes (`gpt2` byte-level BPE with the `smollm` pre-tokenizer).
pub fn tokenizer_from_gguf(ct: &gguf_file::Content) -> Result<Tokenizer, String> {
    let model = metadata(ct, "tokenizer.ggml.model")?
        .to_string()
        .map_err(|e| e.to_string())?;
    if model != "gpt2" {
        return Err(format!(
            "tokenizer model {model:?} is not supported (only gpt2 BPE)"
        ));
    }
    let tokens = strings(ct, "tokenizer.ggml.tokens")?;
    let merges = strings(ct, "tokenizer.ggml.merges")?
        .into_iter()
        .map(|m| {
            m.split_once(' ')
                .map(|(a, b)| (a.to_owned(), b.to_owned()))
                .ok_or_else(|| format!("malformed merge {m:?}"))
        })
        .collect::<Result<Vec<_>, _>>()?;
    let types: Vec<i32> = metadata(ct, "tokenizer.ggml.token_type")?
        .to_vec()
        .map_err(|e| e.to_string())?
        .iter()
        .map(|v| v.to_i32().unwrap_or(1))
        .collect();
    let vocab: tokenizers::models::bpe::Vocab = tokens
        .iter()
        .enumerate()
        .map(|(i, t)| (t.clone(), i as u32))
        .collect();
    let bpe = BPE::builder()
        .vocab_and_merges(vocab, merges)
        .build()
        .map_err(|e| format!("building the BPE model: {e}"))?;
    let mut tokenizer = Tokenizer::new(bpe);
    tokenizer.with_pre_tokenizer(Some(Sequence::new(vec![
        Digits::new(true).into(),
        ByteLevel::new(false, true, true).into(),
    ])));
    tokenizer.with_decoder(Some(ByteLevel::default()));
    // Control tokens (type 3) match whole, never split into bytes.
    let special: Vec<AddedToken> = tokens
        .iter()
        .zip(&types)
        .filter(|(_, t)| **t == 3)
        .map(|(tok, _)| AddedToken::from(tok.clone(), true))
        .collect();
    tokenizer
        .add_special_tokens(special)
        .map_err(|e| format!("adding the control tokens: {e}"))?;
    Ok(tokenizer)
}

/// Rewrites every `from` tensor as `to`, in memory; returns the new GGUF's content and bytes.
pub fn requantized(
    ct: &gguf_file::Content,
    file: &mut std::fs::File,
    from: GgmlDType,
    to: GgmlDType,
) -> candle_core::Result<(gguf_file::Content, std::io::Cursor<Vec<u8>>)> {
    let mut tensors = Vec::with_capacity(ct.tensor_infos.len());
    for name in ct.tensor_infos.keys() {
        let tensor = ct.tensor(file, name, &Device::Cpu)?;
        let tensor = if tensor.dtype() == from {
            QTensor::quantize(&tensor.dequantize(&Device::Cpu)?, to)?
        } else {
            tensor
        };
        tensors.push((name.as_str(), tensor));
    }
    let metadata: Vec<(&str, &gguf_file::Value)> =
        ct.metadata.iter().map(|(k, v)| (k.as_str(), v)).collect();
    let refs: Vec<(&str, &QTensor)> = tensors.iter().map(|(n, t)| (*n, t)).collect();
    let mut buffer = std::io::Cursor::new(Vec::new());
    gguf_file::write(&mut buffer, &metadata, &refs)?;
    buffer.set_position(0);
    let content = gguf_file::Content::read(&mut buffer)?;
    Ok((content, buffer))
}

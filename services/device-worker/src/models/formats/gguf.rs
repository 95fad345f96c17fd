//! Reading GGUF files: finding the file, its metadata, the tokenizer it describes, and
//! re-quantizing its tensors in memory.
//!
//! The tokenizer is built here from the GGUF's vocabulary: byte-level BPE with its merges and the
//! pre-tokenizer `tokenizer.ggml.pre` names (`Pre`: how text is split before BPE differs between
//! families, and a wrong split tokenizes every prompt differently from the model's training), or
//! SentencePiece pieces with their scores.

use std::path::{Path, PathBuf};

use candle_core::Device;
use candle_core::quantized::{GgmlDType, QTensor, gguf_file};
use tokenizers::models::bpe::BPE;
use tokenizers::pre_tokenizers::PreTokenizerWrapper;
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::pre_tokenizers::digits::Digits;
use tokenizers::pre_tokenizers::sequence::Sequence;
use tokenizers::pre_tokenizers::split::{Split, SplitPattern};
use tokenizers::{AddedToken, SplitDelimiterBehavior, Tokenizer};

use crate::models::model::LoadError;

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

/// Llama 3's split: contractions, letters with one leading non-letter, digits in threes,
/// punctuation runs, newlines, spaces (not the last before a word).
const LLAMA3_SPLIT: &str = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// Qwen2's split: Llama 3's with every digit on its own.
const QWEN2_SPLIT: &str = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// The pre-tokenizers served, by the names `tokenizer.ggml.pre` gives them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Pre {
    /// GPT-2's own split.
    Gpt2,
    /// Every digit on its own, then GPT-2's split (SmolLM).
    SmolLm,
    Llama3,
    Qwen2,
}

const PRE_NAMES: &[(&str, Pre)] = &[
    ("gpt-2", Pre::Gpt2),
    ("smollm", Pre::SmolLm),
    ("llama-bpe", Pre::Llama3),
    ("llama3", Pre::Llama3),
    ("llama-v3", Pre::Llama3),
    ("qwen2", Pre::Qwen2),
    ("deepseek-r1-qwen", Pre::Qwen2),
];

impl Pre {
    fn from_gguf(ct: &gguf_file::Content) -> Result<Self, String> {
        // A GGUF written before the key existed used GPT-2's split.
        let Some(name) = ct.metadata.get("tokenizer.ggml.pre") else {
            return Ok(Self::Gpt2);
        };
        let name = name.to_string().map_err(|e| e.to_string())?;
        PRE_NAMES
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, pre)| *pre)
            .ok_or_else(|| {
                let names: Vec<&str> = PRE_NAMES.iter().map(|(n, _)| *n).collect();
                format!(
                    "tokenizer.ggml.pre = {name:?} is not a pre-tokenizer this worker knows \
                     (it knows {})",
                    names.join(", ")
                )
            })
    }

    fn build(self) -> Result<PreTokenizerWrapper, String> {
        let split = |pattern: &str| -> Result<PreTokenizerWrapper, String> {
            let split = Split::new(
                SplitPattern::Regex(pattern.to_owned()),
                SplitDelimiterBehavior::Isolated,
                false,
            )
            .map_err(|e| format!("the split pattern: {e}"))?;
            Ok(Sequence::new(vec![
                split.into(),
                ByteLevel::new(false, true, false).into(),
            ])
            .into())
        };
        Ok(match self {
            Self::Gpt2 => ByteLevel::new(false, true, true).into(),
            Self::SmolLm => Sequence::new(vec![
                Digits::new(true).into(),
                ByteLevel::new(false, true, true).into(),
            ])
            .into(),
            Self::Llama3 => split(LLAMA3_SPLIT)?,
            Self::Qwen2 => split(QWEN2_SPLIT)?,
        })
    }
}

/// The tokenizer a GGUF describes: byte-level BPE (`gpt2`) with its pre-tokenizer, or a
/// SentencePiece vocabulary (`llama`: Llama 2, Mistral).
pub fn tokenizer_from_gguf(ct: &gguf_file::Content) -> Result<Tokenizer, String> {
    let model = metadata(ct, "tokenizer.ggml.model")?
        .to_string()
        .map_err(|e| e.to_string())?;
    let tokens = strings(ct, "tokenizer.ggml.tokens")?;
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
    let mut tokenizer = match model.as_str() {
        "gpt2" => byte_level(ct, vocab)?,
        "llama" => sentencepiece(ct, &tokens, vocab)?,
        _ => {
            return Err(format!(
                "tokenizer.ggml.model = {model:?} is not served (served: gpt2 byte-level BPE, \
                 llama SentencePiece)"
            ));
        }
    };
    // Control tokens (type 3) match whole, never split into pieces.
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

fn byte_level(
    ct: &gguf_file::Content,
    vocab: tokenizers::models::bpe::Vocab,
) -> Result<Tokenizer, String> {
    let pre = Pre::from_gguf(ct)?;
    let merges = strings(ct, "tokenizer.ggml.merges")?
        .into_iter()
        .map(|m| {
            m.split_once(' ')
                .map(|(a, b)| (a.to_owned(), b.to_owned()))
                .ok_or_else(|| format!("malformed merge {m:?}"))
        })
        .collect::<Result<Vec<_>, _>>()?;
    let bpe = BPE::builder()
        .vocab_and_merges(vocab, merges)
        .build()
        .map_err(|e| format!("building the BPE model: {e}"))?;
    let mut tokenizer = Tokenizer::new(bpe);
    tokenizer.with_pre_tokenizer(Some(pre.build()?));
    tokenizer.with_decoder(Some(ByteLevel::default()));
    Ok(tokenizer)
}

/// SentencePiece's BPE as a BPE over its pieces: two pieces merge where their concatenation
/// is a piece, the merge ranked by that piece's score (SentencePiece merges the best-scoring
/// pair first); text that no piece covers falls back to `<0xNN>` byte pieces; words carry `▁`
/// for the space before them, and a leading one unless `add_space_prefix` is false.
fn sentencepiece(
    ct: &gguf_file::Content,
    tokens: &[String],
    vocab: tokenizers::models::bpe::Vocab,
) -> Result<Tokenizer, String> {
    use tokenizers::decoders::{byte_fallback::ByteFallback, fuse::Fuse, strip::Strip};
    use tokenizers::normalizers::{Prepend, Replace};

    let scores: Vec<f32> = metadata(ct, "tokenizer.ggml.scores")?
        .to_vec()
        .map_err(|e| e.to_string())?
        .iter()
        .map(|v| {
            v.to_f32()
                .map_err(|e| format!("tokenizer.ggml.scores: {e}"))
        })
        .collect::<Result<_, _>>()?;
    if scores.len() != tokens.len() {
        return Err(format!(
            "{} scores for {} tokens",
            scores.len(),
            tokens.len()
        ));
    }
    let mut merges: Vec<(f32, usize, u32, u32)> = Vec::new();
    for (id, (piece, &score)) in tokens.iter().zip(&scores).enumerate() {
        for (at, _) in piece.char_indices().skip(1) {
            if let (Some(&left), Some(&right)) = (vocab.get(&piece[..at]), vocab.get(&piece[at..]))
            {
                merges.push((score, id, left, right));
            }
        }
    }
    // Best score first; equal scores by the merged piece's id, then the halves' ids.
    merges.sort_by(|a, b| {
        b.0.total_cmp(&a.0)
            .then((a.1, a.2, a.3).cmp(&(b.1, b.2, b.3)))
    });
    let merges = merges
        .into_iter()
        .map(|(_, _, l, r)| (tokens[l as usize].clone(), tokens[r as usize].clone()))
        .collect();
    let unknown = ct
        .metadata
        .get("tokenizer.ggml.unknown_token_id")
        .and_then(|v| v.to_u32().ok())
        .and_then(|id| tokens.get(id as usize))
        .cloned()
        .unwrap_or_else(|| "<unk>".to_owned());
    let bpe = BPE::builder()
        .vocab_and_merges(vocab, merges)
        .unk_token(unknown)
        .fuse_unk(true)
        .byte_fallback(true)
        .build()
        .map_err(|e| format!("building the SentencePiece model: {e}"))?;
    let prefix = ct
        .metadata
        .get("tokenizer.ggml.add_space_prefix")
        .and_then(|v| v.to_bool().ok())
        .unwrap_or(true);
    let mut tokenizer = Tokenizer::new(bpe);
    let mut normalizers: Vec<tokenizers::NormalizerWrapper> = Vec::new();
    if prefix {
        normalizers.push(Prepend::new("\u{2581}".into()).into());
    }
    normalizers.push(
        Replace::new(" ", "\u{2581}")
            .map_err(|e| e.to_string())?
            .into(),
    );
    tokenizer
        .with_normalizer(Some(tokenizers::normalizers::Sequence::new(normalizers)))
        .map_err(|e| format!("the normalizer: {e}"))?;
    let mut decoders: Vec<tokenizers::DecoderWrapper> = vec![
        Replace::new("\u{2581}", " ")
            .map_err(|e| e.to_string())?
            .into(),
        ByteFallback::default().into(),
        Fuse::default().into(),
    ];
    if prefix {
        decoders.push(Strip::new(' ', 1, 0).into());
    }
    tokenizer.with_decoder(Some(tokenizers::decoders::sequence::Sequence::new(
        decoders,
    )));
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

//! The encoder families `embed`, `rerank` and `classify` run, chosen by `config.json`'s
//! `model_type` (BERT, DistilBERT, XLM-RoBERTa with RoBERTa and CamemBERT, ModernBERT; on the
//! CPU all but ModernBERT by Nomad's own forward pass in `families/bert.rs`, otherwise by
//! candle-transformers), with
//! the classification head a `*ForSequenceClassification` checkpoint carries. A family or head
//! Nomad does not run is refused at load, naming it and what is supported.

use std::collections::BTreeMap;
use std::path::Path;

use candle_core::{DType, Device, IndexOp as _, Module as _, Tensor};
use candle_nn::{Linear, VarBuilder, linear};
use candle_transformers::models::{bert, distilbert, modernbert, xlm_roberta};
use serde::Deserialize;

use crate::models::families::bert::BertCpu;
use crate::models::formats::row::Row;

/// The families, as `model_type` names them.
pub const FAMILIES: &[&str] = &[
    "bert",
    "distilbert",
    "xlm-roberta",
    "roberta",
    "camembert",
    "modernbert",
];

/// The architecture a family runs as: RoBERTa and CamemBERT are XLM-RoBERTa's (transformers'
/// classes for the three are copies of one another, the same tensor names and positions).
fn architecture(family: &'static str) -> &'static str {
    match family {
        "roberta" | "camembert" => "xlm-roberta",
        other => other,
    }
}

/// `config.json` with the keys newer transformers leave out at their defaults, where candle's
/// config types require them.
fn with_defaults(family: &str, text: &str) -> Result<String, String> {
    let mut config: serde_json::Value =
        serde_json::from_str(text).map_err(|e| format!("config.json: {e}"))?;
    let defaults: &[(&str, serde_json::Value)] = match family {
        "xlm-roberta" | "bert" => &[
            ("position_embedding_type", serde_json::json!("absolute")),
            ("attention_probs_dropout_prob", serde_json::json!(0.1)),
            ("hidden_dropout_prob", serde_json::json!(0.1)),
            ("initializer_range", serde_json::json!(0.02)),
        ],
        _ => &[],
    };
    if let Some(map) = config.as_object_mut() {
        for (key, value) in defaults {
            map.entry(key.to_string()).or_insert_with(|| value.clone());
        }
        if family == "modernbert" {
            // transformers 5 names these differently from the keys candle reads.
            let theta = |kind: &str| {
                map.get("rope_parameters")
                    .and_then(|p| p.get(kind))
                    .and_then(|p| p.get("rope_theta"))
                    .cloned()
            };
            let (global, local) = (theta("full_attention"), theta("sliding_attention"));
            if let Some(eps) = map.get("norm_eps").cloned() {
                map.entry("layer_norm_eps").or_insert(eps);
            }
            if let Some(global) = global {
                map.entry("global_rope_theta").or_insert(global);
            }
            if let Some(local) = local {
                map.entry("local_rope_theta").or_insert(local);
            }
        }
    }
    Ok(config.to_string())
}

/// Whether candle reads `config.json` as `family`'s config (found at describe time, not at the
/// first call).
fn parse_family(family: &str, text: &str) -> Result<(), String> {
    let text = with_defaults(family, text)?;
    // candle's XLM-RoBERTa reads any value here and computes absolute positions whatever it says.
    let config: serde_json::Value = serde_json::from_str(&text).map_err(|e| e.to_string())?;
    if let Some(kind) = config["position_embedding_type"].as_str()
        && kind != "absolute"
    {
        return Err(format!(
            "config.json: position_embedding_type {kind:?} is not served (absolute is)"
        ));
    }
    let parsed = match family {
        "bert" => serde_json::from_str::<bert::Config>(&text).map(|_| ()),
        "distilbert" => serde_json::from_str::<distilbert::Config>(&text).map(|_| ()),
        "xlm-roberta" => serde_json::from_str::<xlm_roberta::Config>(&text).map(|_| ()),
        "modernbert" => serde_json::from_str::<modernbert::Config>(&text).map(|_| ()),
        _ => Ok(()),
    };
    parsed.map_err(|e| format!("config.json as a {family} config: {e}"))
}

/// What every family's `config.json` says that Nomad needs beside its own loader.
#[derive(Debug, Clone, Deserialize)]
pub struct Shape {
    pub model_type: Option<String>,
    #[serde(alias = "dim")]
    pub hidden_size: usize,
    #[serde(alias = "n_heads")]
    pub num_attention_heads: usize,
    #[serde(alias = "hidden_dim", default)]
    pub intermediate_size: usize,
    pub max_position_embeddings: usize,
    #[serde(default)]
    pub pad_token_id: Option<u32>,
    #[serde(default)]
    pub id2label: BTreeMap<String, String>,
}

impl Shape {
    /// `dir`'s `config.json`, its family one that Nomad runs (refused naming the families
    /// otherwise), and the text it was read from.
    pub fn read(dir: &Path) -> Result<(&'static str, Self, String), String> {
        let text = std::fs::read_to_string(dir.join("config.json"))
            .map_err(|e| format!("reading config.json: {e}"))?;
        let shape: Shape = serde_json::from_str(&text).map_err(|e| format!("config.json: {e}"))?;
        let family = match shape.model_type.as_deref() {
            Some(t) => FAMILIES.iter().copied().find(|f| *f == t).ok_or_else(|| {
                format!(
                    "config.json: model_type {t:?} is not an encoder family Nomad runs ({})",
                    FAMILIES.join(", ")
                )
            })?,
            None => "bert",
        };
        let family = architecture(family);
        parse_family(family, &text)?;
        Ok((family, shape, text))
    }

    /// The family's longest input, in tokens (XLM-RoBERTa's positions start after its padding
    /// index).
    pub fn max_tokens(&self) -> usize {
        match self.model_type.as_deref() {
            Some("xlm-roberta" | "roberta" | "camembert") => {
                self.max_position_embeddings - self.pad_token_id.unwrap_or(1) as usize - 1
            }
            _ => self.max_position_embeddings,
        }
    }

    /// The labels of a classification head, in index order.
    pub fn labels(&self) -> Vec<String> {
        let mut labels: Vec<(usize, String)> = self
            .id2label
            .iter()
            .filter_map(|(k, v)| k.parse().ok().map(|i| (i, v.clone())))
            .collect();
        labels.sort();
        labels.into_iter().map(|(_, v)| v).collect()
    }
}

enum Body {
    /// BERT, XLM-RoBERTa or DistilBERT on the CPU, by Nomad's own forward pass.
    Cpu(BertCpu),
    Bert(bert::BertModel),
    DistilBert(distilbert::DistilBertModel),
    XlmRoberta(xlm_roberta::XLMRobertaModel),
    ModernBert(modernbert::ModernBert),
}

/// A `*ForSequenceClassification` head: the logits of the first token's (or the mean's) vector.
enum Head {
    /// BERT: the pooler (dense + tanh on `[CLS]`), then the classifier.
    Bert { pooler: Linear, classifier: Linear },
    /// DistilBERT: pre_classifier + ReLU on `[CLS]`, then the classifier.
    DistilBert {
        pre_classifier: Linear,
        classifier: Linear,
    },
    /// XLM-RoBERTa: dense + tanh on `<s>`, then out_proj.
    XlmRoberta { dense: Linear, out_proj: Linear },
    /// ModernBERT: dense, activation and norm on `[CLS]` or the mean, then the classifier.
    ModernBert {
        dense: Linear,
        norm: candle_nn::LayerNorm,
        classifier: Linear,
        mean: bool,
    },
}

pub struct Encoder {
    pub family: &'static str,
    pub shape: Shape,
    body: Body,
    head: Option<Head>,
    pub pad_id: u32,
}

fn text(e: impl std::fmt::Display) -> String {
    e.to_string()
}

impl Encoder {
    /// Reads `dir`'s `config.json` and `model.safetensors`; with `head`, the sequence
    /// classification head too (`num_labels` outputs).
    pub fn load(dir: &Path, device: &Device, head: bool) -> Result<Self, String> {
        let (family, shape, config_text) = Shape::read(dir)?;
        let config_text = with_defaults(family, &config_text)?;
        let weights = dir.join("model.safetensors");
        // SAFETY: the weights file is mapped read-only and not modified while the model lives.
        let vb = unsafe { VarBuilder::from_mmaped_safetensors(&[&weights], DType::F32, device) }
            .map_err(|e| format!("model.safetensors: {e}"))?;
        // A task checkpoint nests the encoder under its family's name.
        let nested = |prefix: &str| {
            if vb.contains_tensor(&format!("{prefix}.embeddings.word_embeddings.weight"))
                || vb.contains_tensor(&format!("{prefix}.embeddings.tok_embeddings.weight"))
            {
                vb.pp(prefix)
            } else {
                vb.clone()
            }
        };
        let parse = |what| format!("config.json for {what}");
        let pad_id = shape.pad_token_id.unwrap_or(match family {
            "xlm-roberta" => 1,
            _ => 0,
        });
        let prefix = match family {
            "xlm-roberta" => "roberta",
            other => other,
        };
        let cpu = if device.is_cpu() {
            BertCpu::load(family, &config_text, &nested(prefix), pad_id)?
        } else {
            None
        };
        let body = match family {
            _ if cpu.is_some() => Body::Cpu(cpu.expect("checked")),
            "bert" => {
                let config: bert::Config = serde_json::from_str(&config_text)
                    .map_err(|e| format!("{}: {e}", parse("BERT")))?;
                Body::Bert(bert::BertModel::load(nested("bert"), &config).map_err(text)?)
            }
            "distilbert" => {
                let config: distilbert::Config = serde_json::from_str(&config_text)
                    .map_err(|e| format!("{}: {e}", parse("DistilBERT")))?;
                Body::DistilBert(
                    distilbert::DistilBertModel::load(nested("distilbert"), &config)
                        .map_err(text)?,
                )
            }
            "xlm-roberta" => {
                let config: xlm_roberta::Config = serde_json::from_str(&config_text)
                    .map_err(|e| format!("{}: {e}", parse("XLM-RoBERTa")))?;
                Body::XlmRoberta(
                    xlm_roberta::XLMRobertaModel::new(&config, nested("roberta")).map_err(text)?,
                )
            }
            "modernbert" => {
                let config: modernbert::Config = serde_json::from_str(&config_text)
                    .map_err(|e| format!("{}: {e}", parse("ModernBERT")))?;
                // candle reads the encoder under `model.`; a bare model's tensors have none.
                let vb = if vb.contains_tensor("model.embeddings.tok_embeddings.weight") {
                    vb.clone()
                } else {
                    vb.clone()
                        .rename_f(|name| name.strip_prefix("model.").unwrap_or(name).to_owned())
                };
                Body::ModernBert(modernbert::ModernBert::load(vb, &config).map_err(text)?)
            }
            _ => unreachable!("one of FAMILIES"),
        };
        let head = if head {
            Some(Self::head(family, &shape, &config_text, &vb)?)
        } else {
            None
        };
        Ok(Self {
            family,
            shape,
            body,
            head,
            pad_id,
        })
    }

    fn head(family: &str, shape: &Shape, config: &str, vb: &VarBuilder) -> Result<Head, String> {
        let labels = shape.labels().len().max(1);
        let h = shape.hidden_size;
        let missing = |e: candle_core::Error| {
            format!(
                "no sequence classification head in model.safetensors ({e}); a rerank or classify \
                 tool needs a *ForSequenceClassification checkpoint"
            )
        };
        Ok(match family {
            "bert" => Head::Bert {
                pooler: linear(h, h, vb.pp("bert.pooler.dense")).map_err(missing)?,
                classifier: linear(h, labels, vb.pp("classifier")).map_err(missing)?,
            },
            "distilbert" => Head::DistilBert {
                pre_classifier: linear(h, h, vb.pp("pre_classifier")).map_err(missing)?,
                classifier: linear(h, labels, vb.pp("classifier")).map_err(missing)?,
            },
            "xlm-roberta" => Head::XlmRoberta {
                dense: linear(h, h, vb.pp("classifier.dense")).map_err(missing)?,
                out_proj: linear(h, labels, vb.pp("classifier.out_proj")).map_err(missing)?,
            },
            "modernbert" => {
                #[derive(Deserialize)]
                struct Pooling {
                    #[serde(default)]
                    classifier_pooling: Option<String>,
                    #[serde(default)]
                    norm_eps: Option<f64>,
                    #[serde(default)]
                    classifier_bias: Option<bool>,
                }
                let p: Pooling = serde_json::from_str(config).map_err(text)?;
                let mean = match p.classifier_pooling.as_deref() {
                    None | Some("cls") => false,
                    Some("mean") => true,
                    Some(other) => {
                        return Err(format!(
                            "config.json: classifier_pooling {other:?} (supported: cls, mean)"
                        ));
                    }
                };
                let bias = p.classifier_bias.unwrap_or(false);
                let dense = if bias {
                    linear(h, h, vb.pp("head.dense"))
                } else {
                    candle_nn::linear_no_bias(h, h, vb.pp("head.dense"))
                }
                .map_err(missing)?;
                Head::ModernBert {
                    dense,
                    norm: candle_nn::layer_norm_no_bias(
                        h,
                        p.norm_eps.unwrap_or(1e-5),
                        vb.pp("head.norm"),
                    )
                    .map_err(missing)?,
                    classifier: linear(h, labels, vb.pp("classifier")).map_err(missing)?,
                    mean,
                }
            }
            _ => unreachable!("one of FAMILIES"),
        })
    }

    /// The last hidden states `[n, len, hidden]` of `rows` (padded to the longest) and the mask
    /// of their real tokens (`[n, len]`, 1 or 0).
    pub fn hidden(&self, rows: &[Row], device: &Device) -> candle_core::Result<(Tensor, Tensor)> {
        let (ids, types, mask) = padded(rows, self.pad_id, device)?;
        let hidden = match &self.body {
            Body::Cpu(m) => m.hidden_states(rows)?,
            Body::Bert(m) => m.forward(&ids, &types, Some(&mask))?,
            // candle's DistilBERT masks where its mask is 1: the padding.
            Body::DistilBert(m) => {
                let padding = mask.eq(0u32)?.unsqueeze(1)?.unsqueeze(1)?;
                m.forward(&ids, &padding)?
            }
            Body::XlmRoberta(m) => m.forward(&ids, &mask, &types, None, None, None)?,
            Body::ModernBert(m) => m.forward(&ids, &mask)?,
        };
        Ok((hidden, mask))
    }

    /// The classification head's logits `[n, labels]` from the hidden states.
    pub fn logits(&self, hidden: &Tensor, mask: &Tensor) -> candle_core::Result<Tensor> {
        let first = hidden.i((.., 0, ..))?.contiguous()?;
        match self.head.as_ref().expect("loaded with a head") {
            Head::Bert { pooler, classifier } => {
                classifier.forward(&pooler.forward(&first)?.tanh()?)
            }
            Head::DistilBert {
                pre_classifier,
                classifier,
            } => classifier.forward(&pre_classifier.forward(&first)?.relu()?),
            Head::XlmRoberta { dense, out_proj } => {
                out_proj.forward(&dense.forward(&first)?.tanh()?)
            }
            Head::ModernBert {
                dense,
                norm,
                classifier,
                mean,
            } => {
                let pooled = if *mean {
                    let m = mask.to_dtype(DType::F32)?.unsqueeze(2)?;
                    hidden
                        .broadcast_mul(&m)?
                        .sum(1)?
                        .broadcast_div(&m.sum(1)?)?
                } else {
                    first
                };
                classifier.forward(&norm.forward(&dense.forward(&pooled)?.gelu_erf()?)?)
            }
        }
    }
}

/// The rows' ids padded with `pad` to the longest, their types, and the mask of real tokens
/// (`[n, len]` each).
fn padded(
    rows: &[Row],
    pad: u32,
    device: &Device,
) -> candle_core::Result<(Tensor, Tensor, Tensor)> {
    let n = rows.len();
    let len = rows.iter().map(Row::len).max().unwrap_or(0);
    let mut ids = Vec::with_capacity(n * len);
    let mut types = Vec::with_capacity(n * len);
    let mut mask = Vec::with_capacity(n * len);
    for row in rows {
        let fill = len - row.len();
        ids.extend(
            row.ids
                .iter()
                .copied()
                .chain(std::iter::repeat_n(pad, fill)),
        );
        types.extend(
            row.types
                .iter()
                .copied()
                .chain(std::iter::repeat_n(0, fill)),
        );
        mask.extend((0..len).map(|i| u32::from(i < row.len())));
    }
    Ok((
        Tensor::from_vec(ids, (n, len), device)?,
        Tensor::from_vec(types, (n, len), device)?,
        Tensor::from_vec(mask, (n, len), device)?,
    ))
}

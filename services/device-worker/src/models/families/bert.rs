//! The BERT-shaped encoders (BERT, XLM-RoBERTa, DistilBERT: embeddings, then post-norm layers
//! of attention and a two-layer MLP) on the CPU, in Nomad's own forward pass. The sequences of a
//! pass are packed one after another, never padded: each linear layer is one matrix product
//! over every token of the pass (query, key and value weights joined into one), a bias or a
//! residual joins its product in the same pass over memory, and attention runs per sequence and
//! head over that sequence's tokens alone. candle's own models serve the other families and
//! every accelerator.

use candle_core::{DType, Device, Tensor};
use candle_nn::VarBuilder;
use gemm::Parallelism;
use rayon::prelude::*;
use serde::Deserialize;

pub use crate::models::kernels::bert::Activation;
use crate::models::kernels::bert::{layer_norm, matmul, product, softmax_rows};

use crate::models::formats::row::Row;

/// A linear layer: its weights transposed (`[in][out]`, so that `gemm` reads them as they lie
/// whatever the number of tokens; as checkpoints store them, `[out][in]`, it copied all of them
/// into its own layout on every call, as long as the product itself for a short text), and a
/// bias.
struct Dense {
    transposed: Vec<f32>,
    bias: Vec<f32>,
}

impl Dense {
    /// The layers under `vbs` (`[out][in]` weights and biases) joined as one: their outputs side
    /// by side.
    fn load(vbs: &[VarBuilder], outputs: usize, inputs: usize) -> candle_core::Result<Self> {
        let mut weights = Vec::with_capacity(vbs.len());
        let mut bias = Vec::with_capacity(vbs.len() * outputs);
        for vb in vbs {
            weights.push(floats(vb.get((outputs, inputs), "weight")?)?);
            bias.extend(floats(vb.get(outputs, "bias")?)?);
        }
        let width = bias.len();
        let mut transposed = vec![0f32; inputs * width];
        for (part, weight) in weights.iter().enumerate() {
            for (o, row) in weight.chunks_exact(inputs).enumerate() {
                for (i, &w) in row.iter().enumerate() {
                    transposed[i * width + part * outputs + o] = w;
                }
            }
        }
        Ok(Self { transposed, bias })
    }

    fn outputs(&self) -> usize {
        self.bias.len()
    }

    /// `out[t] = (residual[t] +) bias + x[t] · W` for the `tokens` rows of `x` (`inputs` wide).
    fn forward(&self, x: &[f32], tokens: usize, residual: Option<&[f32]>, out: &mut [f32]) {
        let (n, k) = (self.outputs(), self.transposed.len() / self.outputs());
        let out = &mut out[..tokens * n];
        for (t, row) in out.chunks_exact_mut(n).enumerate() {
            match residual {
                Some(r) => {
                    for ((o, r), b) in row.iter_mut().zip(&r[t * n..]).zip(&self.bias) {
                        *o = r + b;
                    }
                }
                None => row.copy_from_slice(&self.bias),
            }
        }
        matmul(tokens, n, k, x, k, &self.transposed, out, n, true);
    }
}

/// PyTorch's `LayerNorm` weights and epsilon.
struct Norm {
    weight: Vec<f32>,
    bias: Vec<f32>,
    eps: f32,
}

impl Norm {
    /// The norm under `vb` (`weight`/`bias`, or the `gamma`/`beta` of older checkpoints).
    fn load(vb: &VarBuilder, width: usize, eps: f64) -> candle_core::Result<Self> {
        let (weight, bias) = if vb.contains_tensor("weight") {
            ("weight", "bias")
        } else {
            ("gamma", "beta")
        };
        Ok(Self {
            weight: floats(vb.get(width, weight)?)?,
            bias: floats(vb.get(width, bias)?)?,
            eps: eps as f32,
        })
    }

    fn apply(&self, rows: &mut [f32]) {
        let width = self.weight.len();
        rows.par_chunks_mut(width * 16)
            .for_each(|rows| layer_norm(rows, &self.weight, &self.bias, self.eps));
    }
}

struct Layer {
    /// Query, key and value projections joined: a token's row is `[q | k | v]`.
    qkv: Dense,
    output: Dense,
    attention_norm: Norm,
    up: Dense,
    down: Dense,
    output_norm: Norm,
}

/// Where a token's position embedding comes from.
#[derive(Debug, Clone, Copy)]
enum Positions {
    /// BERT, DistilBERT: `0, 1, 2, ...`.
    FromZero,
    /// XLM-RoBERTa: after the padding index, counting only tokens that are not padding (as
    /// transformers' `create_position_ids_from_input_ids`).
    AfterPadding(u32),
}

pub struct BertCpu {
    hidden: usize,
    heads: usize,
    activation: Activation,
    positions: Positions,
    words: Vec<f32>,
    position_table: Vec<f32>,
    /// Token type embeddings (none in DistilBERT).
    types: Option<Vec<f32>>,
    embedding_norm: Norm,
    layers: Vec<Layer>,
}

fn floats(t: Tensor) -> candle_core::Result<Vec<f32>> {
    t.to_dtype(DType::F32)?.flatten_all()?.to_vec1()
}

/// What a BERT or XLM-RoBERTa `config.json` says of the shape.
#[derive(Deserialize)]
struct BertConfig {
    hidden_size: usize,
    num_hidden_layers: usize,
    num_attention_heads: usize,
    intermediate_size: usize,
    hidden_act: String,
    layer_norm_eps: f64,
    max_position_embeddings: usize,
    type_vocab_size: usize,
    vocab_size: usize,
}

/// DistilBERT's names for the same.
#[derive(Deserialize)]
struct DistilBertConfig {
    dim: usize,
    n_layers: usize,
    n_heads: usize,
    hidden_dim: usize,
    activation: String,
    max_position_embeddings: usize,
    vocab_size: usize,
}

/// A family's shape and where it keeps each tensor (below the encoder's own prefix).
struct Layout {
    hidden: usize,
    heads: usize,
    inner: usize,
    layers: usize,
    eps: f64,
    activation: String,
    vocab: usize,
    max_positions: usize,
    /// Rows of the token type table; none in DistilBERT.
    type_vocab: Option<usize>,
    /// A layer's prefix, followed by its index.
    layer: &'static str,
    /// Query, key and value, below the layer's prefix.
    qkv: [&'static str; 3],
    output: &'static str,
    attention_norm: &'static str,
    up: &'static str,
    down: &'static str,
    output_norm: &'static str,
}

impl Layout {
    /// `family`'s layout from its `config.json`; `None` for a family this pass does not run.
    fn read(family: &str, config: &str) -> Result<Option<Self>, String> {
        let parse = |e: serde_json::Error| format!("config.json: {e}");
        Ok(Some(match family {
            "bert" | "xlm-roberta" => {
                let c: BertConfig = serde_json::from_str(config).map_err(parse)?;
                Self {
                    hidden: c.hidden_size,
                    heads: c.num_attention_heads,
                    inner: c.intermediate_size,
                    layers: c.num_hidden_layers,
                    eps: c.layer_norm_eps,
                    activation: c.hidden_act,
                    vocab: c.vocab_size,
                    max_positions: c.max_position_embeddings,
                    type_vocab: Some(c.type_vocab_size),
                    layer: "encoder.layer",
                    qkv: [
                        "attention.self.query",
                        "attention.self.key",
                        "attention.self.value",
                    ],
                    output: "attention.output.dense",
                    attention_norm: "attention.output.LayerNorm",
                    up: "intermediate.dense",
                    down: "output.dense",
                    output_norm: "output.LayerNorm",
                }
            }
            "distilbert" => {
                let c: DistilBertConfig = serde_json::from_str(config).map_err(parse)?;
                Self {
                    hidden: c.dim,
                    heads: c.n_heads,
                    inner: c.hidden_dim,
                    layers: c.n_layers,
                    // transformers' DistilBERT norms have a fixed epsilon.
                    eps: 1e-12,
                    activation: c.activation,
                    vocab: c.vocab_size,
                    max_positions: c.max_position_embeddings,
                    type_vocab: None,
                    layer: "transformer.layer",
                    qkv: ["attention.q_lin", "attention.k_lin", "attention.v_lin"],
                    output: "attention.out_lin",
                    attention_norm: "sa_layer_norm",
                    up: "ffn.lin1",
                    down: "ffn.lin2",
                    output_norm: "output_layer_norm",
                }
            }
            _ => return Ok(None),
        }))
    }

    fn layer(&self, vb: &VarBuilder, i: usize) -> candle_core::Result<Layer> {
        let l = vb.pp(format!("{}.{i}", self.layer));
        let (h, m, eps) = (self.hidden, self.inner, self.eps);
        Ok(Layer {
            qkv: Dense::load(&self.qkv.map(|name| l.pp(name)), h, h)?,
            output: Dense::load(&[l.pp(self.output)], h, h)?,
            attention_norm: Norm::load(&l.pp(self.attention_norm), h, eps)?,
            up: Dense::load(&[l.pp(self.up)], m, h)?,
            down: Dense::load(&[l.pp(self.down)], h, m)?,
            output_norm: Norm::load(&l.pp(self.output_norm), h, eps)?,
        })
    }
}

impl BertCpu {
    /// The encoder of `family` (`bert`, `xlm-roberta` or `distilbert`) from `config` and the
    /// weights under `vb` (the encoder's own prefix); `None` for any other family, or an
    /// activation this pass does not compute (candle's model serves those).
    pub fn load(
        family: &str,
        config: &str,
        vb: &VarBuilder,
        pad_id: u32,
    ) -> Result<Option<Self>, String> {
        let Some(layout) = Layout::read(family, config)? else {
            return Ok(None);
        };
        if layout.heads == 0 || layout.hidden % layout.heads != 0 {
            return Err(format!(
                "config.json: {} attention heads do not divide a hidden size of {}",
                layout.heads, layout.hidden
            ));
        }
        let Some(activation) = Activation::named(&layout.activation) else {
            return Ok(None);
        };
        let e = vb.pp("embeddings");
        let h = layout.hidden;
        let table = |rows: usize, name: &str| floats(e.get((rows, h), name)?);
        let load = || -> candle_core::Result<Self> {
            Ok(Self {
                hidden: h,
                heads: layout.heads,
                activation,
                positions: if family == "xlm-roberta" {
                    Positions::AfterPadding(pad_id)
                } else {
                    Positions::FromZero
                },
                words: table(layout.vocab, "word_embeddings.weight")?,
                position_table: table(layout.max_positions, "position_embeddings.weight")?,
                types: match layout.type_vocab {
                    Some(rows) => Some(table(rows, "token_type_embeddings.weight")?),
                    None => None,
                },
                embedding_norm: Norm::load(&e.pp("LayerNorm"), h, layout.eps)?,
                layers: (0..layout.layers)
                    .map(|i| layout.layer(vb, i))
                    .collect::<candle_core::Result<_>>()?,
            })
        };
        load().map(Some).map_err(|e| e.to_string())
    }

    /// The last hidden states of `rows`, `[n, longest, hidden]` with zeros past each row's end.
    pub fn hidden_states(&self, rows: &[Row]) -> candle_core::Result<Tensor> {
        let h = self.hidden;
        let longest = rows.iter().map(Row::len).max().unwrap_or(0);
        let packed = self.forward(rows)?;
        let mut padded = vec![0f32; rows.len() * longest * h];
        let mut at = 0;
        for (i, row) in rows.iter().enumerate() {
            let len = row.len() * h;
            padded[i * longest * h..][..len].copy_from_slice(&packed[at..at + len]);
            at += len;
        }
        Tensor::from_vec(padded, (rows.len(), longest, h), &Device::Cpu)
    }

    /// The last hidden states of every token of `rows`, one row after another (`[tokens,
    /// hidden]`).
    fn forward(&self, rows: &[Row]) -> candle_core::Result<Vec<f32>> {
        let h = self.hidden;
        let tokens: usize = rows.iter().map(Row::len).sum();
        let mut x = self.embed(rows)?;
        let widest = self
            .layers
            .first()
            .map_or(0, |l| l.qkv.outputs().max(l.up.outputs()));
        // One scratch buffer for the joined projections and the MLP's inner layer, one for
        // attention's output and one for the layer's result.
        let mut wide = vec![0f32; tokens * widest];
        let mut context = vec![0f32; tokens * h];
        let mut next = vec![0f32; tokens * h];
        for layer in &self.layers {
            let qkv = &mut wide[..tokens * 3 * h];
            layer.qkv.forward(&x, tokens, None, qkv);
            self.attention(rows, qkv, &mut context);
            layer.output.forward(&context, tokens, Some(&x), &mut next);
            layer.attention_norm.apply(&mut next);
            std::mem::swap(&mut x, &mut next);
            let inner = &mut wide[..tokens * layer.up.outputs()];
            layer.up.forward(&x, tokens, None, inner);
            let activation = self.activation;
            inner
                .par_chunks_mut(4096)
                .for_each(|chunk| activation.apply(chunk));
            layer.down.forward(inner, tokens, Some(&x), &mut next);
            layer.output_norm.apply(&mut next);
            std::mem::swap(&mut x, &mut next);
        }
        Ok(x)
    }

    /// Word, position and token type embeddings summed and normalized (`[tokens, hidden]`).
    fn embed<'a>(&'a self, rows: &[Row]) -> candle_core::Result<Vec<f32>> {
        let h = self.hidden;
        let tokens: usize = rows.iter().map(Row::len).sum();
        let mut x = Vec::with_capacity(tokens * h);
        let table_row =
            |table: &'a [f32], what: &str, i: usize| -> candle_core::Result<&'a [f32]> {
                table.get(i * h..(i + 1) * h).ok_or_else(|| {
                    candle_core::Error::Msg(format!("{what} {i} is outside the model's table"))
                })
            };
        for row in rows {
            let mut counted = 0u32;
            for (i, (&id, &kind)) in row.ids.iter().zip(&row.types).enumerate() {
                let position = match self.positions {
                    Positions::FromZero => i,
                    Positions::AfterPadding(pad) if id == pad => pad as usize,
                    Positions::AfterPadding(pad) => {
                        counted += 1;
                        (pad + counted) as usize
                    }
                };
                let start = x.len();
                x.extend_from_slice(table_row(&self.words, "token id", id as usize)?);
                let v = &mut x[start..];
                let p = table_row(&self.position_table, "position", position)?;
                v.iter_mut().zip(p).for_each(|(v, p)| *v += p);
                if let Some(types) = &self.types {
                    let t = table_row(types, "token type", kind as usize)?;
                    v.iter_mut().zip(t).for_each(|(v, t)| *v += t);
                }
            }
        }
        self.embedding_norm.apply(&mut x);
        Ok(x)
    }

    /// Each sequence's attention over its own tokens, head by head, from the joined
    /// projections `qkv` (`[tokens, 3 hidden]`) into `context` (`[tokens, hidden]`).
    fn attention(&self, rows: &[Row], qkv: &[f32], context: &mut [f32]) {
        let (h, heads) = (self.hidden, self.heads);
        let d = h / heads;
        let scale = 1.0 / (d as f32).sqrt();
        let mut starts = Vec::with_capacity(rows.len());
        let mut at = 0;
        for row in rows {
            starts.push((at, row.len()));
            at += row.len();
        }
        let jobs: Vec<(usize, usize, usize)> = starts
            .iter()
            .flat_map(|&(start, len)| (0..heads).map(move |head| (start, len, head)))
            .collect();
        let out = SharedOut(context.as_mut_ptr());
        let (qkv_len, out_len) = (qkv.len(), context.len());
        jobs.par_iter()
            .for_each_init(Vec::new, |scores, &(start, len, head)| {
                assert!((start + len) * 3 * h <= qkv_len && (start + len) * h <= out_len);
                scores.resize(len * len, 0.0);
                let q = qkv[start * 3 * h + head * d..].as_ptr();
                let k = qkv[start * 3 * h + h + head * d..].as_ptr();
                let v = qkv[start * 3 * h + 2 * h + head * d..].as_ptr();
                let row = (3 * h) as isize;
                // SAFETY: the rows `start..start + len` of `qkv` and `context` are in bounds
                // (asserted above); each job writes only its sequence's rows of its head's
                // columns of `context`, so no two jobs write the same element, and nothing reads
                // `context` until every job is done.
                unsafe {
                    product(
                        (len, len, d),
                        scores.as_mut_ptr(),
                        len,
                        false,
                        (q, row, 1),
                        (k, 1, row),
                        scale,
                        Parallelism::None,
                    );
                    softmax_rows(scores, len);
                    let out = out.at(start * h + head * d);
                    product(
                        (len, d, len),
                        out,
                        h,
                        false,
                        (scores.as_ptr(), len as isize, 1),
                        (v, row, 1),
                        1.0,
                        Parallelism::None,
                    );
                }
            });
    }
}

/// `context` shared by the attention jobs, each writing its own elements.
#[derive(Clone, Copy)]
struct SharedOut(*mut f32);
// SAFETY: the jobs write disjoint elements (see `attention`).
unsafe impl Send for SharedOut {}
unsafe impl Sync for SharedOut {}

impl SharedOut {
    /// # Safety
    /// `offset` must be within the buffer.
    unsafe fn at(self, offset: usize) -> *mut f32 {
        // SAFETY: as the caller promises.
        unsafe { self.0.add(offset) }
    }
}

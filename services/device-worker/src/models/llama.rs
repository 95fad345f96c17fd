//! A quantized llama (GGUF) whose forward pass runs many sequences at once, each with its own
//! KV cache and position: the new tokens of every sequence (a prompt chunk or one decoded token)
//! are packed into one matrix, so each weight matrix is read once per step for all of them;
//! attention runs per sequence against that sequence's cache.
//!
//! Every row is computed as it would be alone: the quantized matmuls, norms and activations are
//! row by row, and attention never mixes sequences, so batching does not change any result. On
//! the CPU, rotation, the KV cache and attention are the worker's own and run row by row too
//! (`host_attention.rs`, `attention.rs`), so a token's keys and values are the same bits however
//! its sequence was split into passes: what lets a kept prefix be copied.
//!
//! With dense prefill, each linear weight is also kept as f32 and the rows of prompt chunks
//! (several tokens of one sequence) go through an f32 matmul, which is faster for many rows
//! than the quantized kernel; decode rows (one token) stay quantized. Which path a row takes
//! depends on its own sequence only, never on what else is in the step.

use candle_core::quantized::{QMatMul, QTensor, gguf_file};
use candle_core::{D, DType, Device, Module, Result, Tensor};
use candle_nn::Embedding;
use candle_nn::kv_cache::KvCache;
use candle_transformers::quantized_nn::RmsNorm;

use nomad_q8::QuantMatrix;

use super::attention::Heads;
use super::host_attention::{self, HostKv, Rotary};
use super::swiglu::swiglu;

/// A quantized weight: Q8_0 or Q4_1 on an x86 CPU with AVX2 (or AVX-512 VNNI) through
/// `nomad_q8`, anything else through candle.
enum Quantized {
    Ours(QuantMatrix),
    Candle(QMatMul),
}

impl Quantized {
    fn new(q: QTensor) -> Result<Self> {
        Ok(match QuantMatrix::from_qtensor(&q)? {
            Some(m) => Self::Ours(m),
            None => Self::Candle(QMatMul::from_qtensor(q)?),
        })
    }

    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        match self {
            Self::Ours(m) => m.forward(x),
            Self::Candle(m) => m.forward(x),
        }
    }

    /// Whether a row's result is independent of the rows beside it: a quantized dot product
    /// per row (not a dequantized weight through a shape-dependent matmul).
    fn row_exact(&self) -> bool {
        matches!(self, Self::Ours(_) | Self::Candle(QMatMul::QTensor(_)))
    }
}

/// A linear weight: quantized, and with dense prefill also f32 (`[in, out]`).
struct Linear {
    quantized: Quantized,
    dense: Option<Tensor>,
}

/// Which rows of a step take the dense path.
enum Rows {
    Quantized,
    Dense,
    /// Decode rows, prompt rows, and the order that puts `[decode; prompt]` back.
    Mixed {
        decode: Tensor,
        prompt: Tensor,
        back: Tensor,
    },
}

impl Linear {
    fn new(weight: QTensor, dense: bool) -> Result<Self> {
        let dense = if dense {
            let w = weight.dequantize(&weight.device())?;
            Some(w.t()?.contiguous()?)
        } else {
            None
        };
        Ok(Self {
            quantized: Quantized::new(weight)?,
            dense,
        })
    }

    fn forward(&self, x: &Tensor, rows: &Rows) -> Result<Tensor> {
        match (&self.dense, rows) {
            (Some(w), Rows::Dense) => x.matmul(w),
            (
                Some(w),
                Rows::Mixed {
                    decode,
                    prompt,
                    back,
                },
            ) => {
                let a = self.quantized.forward(&x.index_select(decode, 0)?)?;
                let b = x.index_select(prompt, 0)?.matmul(w)?;
                Tensor::cat(&[a, b], 0)?.index_select(back, 0)
            }
            _ => self.quantized.forward(x),
        }
    }

    fn dense_bytes(&self) -> u64 {
        self.dense
            .as_ref()
            .map_or(0, |t| (t.elem_count() * 4) as u64)
    }
}

/// Linear weights over one input, stacked into one matrix where their types agree: the input
/// is quantized once and the thread pool runs once for all of them. A quantized matrix's
/// output rows never depend on the rows beside them, so stacking changes no result.
struct Stacked {
    /// Each linear and the output widths of the weights it holds, in order.
    groups: Vec<(Linear, Vec<usize>)>,
}

impl Stacked {
    fn new(weights: Vec<QTensor>, dense: bool) -> Result<Self> {
        let mut runs: Vec<Vec<QTensor>> = Vec::new();
        for w in weights {
            match runs.last_mut() {
                Some(run)
                    if run[0].dtype() == w.dtype()
                        && run[0].shape().dims2()?.1 == w.shape().dims2()?.1 =>
                {
                    run.push(w)
                }
                _ => runs.push(vec![w]),
            }
        }
        let groups = runs
            .into_iter()
            .map(|run| {
                let widths = run
                    .iter()
                    .map(|w| w.shape().dims2().map(|(rows, _)| rows))
                    .collect::<Result<Vec<_>>>()?;
                Ok((Linear::new(stack(run)?, dense)?, widths))
            })
            .collect::<Result<_>>()?;
        Ok(Self { groups })
    }

    /// Every weight's output side by side, in order.
    fn forward(&self, x: &Tensor, rows: &Rows) -> Result<Tensor> {
        let outputs = self
            .groups
            .iter()
            .map(|(linear, _)| linear.forward(x, rows))
            .collect::<Result<Vec<_>>>()?;
        match <[Tensor; 1]>::try_from(outputs) {
            Ok([y]) => Ok(y),
            Err(outputs) => Tensor::cat(&outputs, 1),
        }
    }

    /// The outputs of `forward` one weight at a time: `N` of them.
    fn split<const N: usize>(&self, y: &Tensor) -> Result<[Tensor; N]> {
        let mut outputs = Vec::with_capacity(N);
        let mut at = 0;
        for &width in self.groups.iter().flat_map(|(_, widths)| widths) {
            outputs.push(y.narrow(1, at, width)?);
            at += width;
        }
        <[Tensor; N]>::try_from(outputs)
            .map_err(|o| candle_core::Error::Msg(format!("{} stacked outputs, not {N}", o.len())))
    }

    fn linears(&self) -> impl Iterator<Item = &Linear> {
        self.groups.iter().map(|(linear, _)| linear)
    }
}

/// Weights of one type over the same inputs as one: their rows one after another (each row is
/// whole blocks, so the bytes simply follow each other).
fn stack(mut run: Vec<QTensor>) -> Result<QTensor> {
    if run.len() == 1 {
        return Ok(run.remove(0));
    }
    let (dtype, device, inputs) = (run[0].dtype(), run[0].device(), run[0].shape().dims2()?.1);
    let mut rows = 0;
    let mut bytes = Vec::new();
    for w in &run {
        rows += w.shape().dims2()?.0;
        bytes.extend_from_slice(&w.data()?);
    }
    candle_core::quantized::ggml_file::qtensor_from_ggml(dtype, &bytes, vec![rows, inputs], &device)
}

struct Layer {
    attention_norm: RmsNorm,
    /// q, k and v.
    qkv: Stacked,
    o: Linear,
    ffn_norm: RmsNorm,
    /// gate and up.
    gate_up: Stacked,
    down: Linear,
}

impl Layer {
    fn linears(&self) -> impl Iterator<Item = &Linear> {
        self.qkv
            .linears()
            .chain(self.gate_up.linears())
            .chain([&self.o, &self.down])
    }
}

/// Rotary tables, one row per position up to the context length: in host memory on the CPU
/// (`host_attention`), as tensors for candle's operations on accelerators.
enum Rotation {
    Host(Rotary),
    Device { cos: Tensor, sin: Tensor },
}

pub struct Llama {
    embeddings: Embedding,
    layers: Vec<Layer>,
    norm: RmsNorm,
    output: Quantized,
    rotation: Rotation,
    heads: usize,
    kv_heads: usize,
    head_dim: usize,
    device: Device,
}

/// The keys and values one sequence has produced, every layer.
pub struct Cache {
    layers: Layers,
    /// Tokens the cache holds (the position of the next token).
    len: usize,
    /// Tokens it has room for.
    capacity: usize,
}

/// Each layer's keys and values: in host memory on the CPU (`host_attention`), as candle's
/// caches on accelerators.
enum Layers {
    Host(Vec<HostKv>),
    Device(Vec<KvCache>),
}

impl Cache {
    /// Tokens the cache holds.
    pub fn len(&self) -> usize {
        self.len
    }

    /// A new cache of `capacity` tokens holding a copy of the first `len` tokens of `self`:
    /// the keys and values of a prompt that starts the same way. `len` is clamped to what
    /// `self` holds.
    pub fn prefix(&self, len: usize, capacity: usize) -> Result<Cache> {
        let len = len.min(self.len);
        let layers = match &self.layers {
            Layers::Host(layers) => Layers::Host(
                layers
                    .iter()
                    .map(|kv| kv.prefix(len, capacity.max(1)))
                    .collect(),
            ),
            Layers::Device(layers) => {
                let mut copies = Vec::with_capacity(layers.len());
                for layer in layers {
                    let mut copy = KvCache::new(2, capacity.max(len).max(1));
                    if let (Some(k), Some(v)) = (layer.k()?, layer.v()?)
                        && len > 0
                    {
                        copy.append(
                            &k.narrow(2, 0, len)?.contiguous()?,
                            &v.narrow(2, 0, len)?.contiguous()?,
                        )?;
                    }
                    copies.push(copy);
                }
                Layers::Device(copies)
            }
        };
        Ok(Cache {
            layers,
            len,
            capacity: capacity.max(len).max(1),
        })
    }

    /// Tokens it has room for.
    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// This cache made into what `from.prefix(len, capacity)` gives, in its own memory where
    /// it can (host caches of as many layers; an accelerator's are made anew).
    pub fn reuse(&mut self, from: &Cache, len: usize, capacity: usize) -> Result<()> {
        match (&mut self.layers, &from.layers) {
            (Layers::Host(to), Layers::Host(layers)) if to.len() == layers.len() => {
                let len = len.min(from.len);
                let capacity = capacity.max(len).max(1);
                for (to, from) in to.iter_mut().zip(layers) {
                    to.reuse(from, len, capacity);
                }
                (self.len, self.capacity) = (len, capacity);
            }
            _ => *self = from.prefix(len, capacity)?,
        }
        Ok(())
    }

    /// This cache emptied for a sequence of at most `capacity` tokens, in its own memory on
    /// the host.
    pub fn reset(&mut self, capacity: usize) {
        let capacity = capacity.max(1);
        match &mut self.layers {
            Layers::Host(layers) => layers.iter_mut().for_each(|kv| kv.reset(capacity)),
            Layers::Device(layers) => layers
                .iter_mut()
                .for_each(|kv| *kv = KvCache::new(2, capacity)),
        }
        (self.len, self.capacity) = (0, capacity);
    }
}

/// One sequence's share of a step: its new tokens and its cache.
pub struct Step<'a> {
    pub tokens: &'a [u32],
    pub cache: &'a mut Cache,
}

fn md<'a>(ct: &'a gguf_file::Content, key: &str) -> Result<&'a gguf_file::Value> {
    ct.metadata
        .get(key)
        .ok_or_else(|| candle_core::Error::Msg(format!("the GGUF lacks {key}")))
}

impl Llama {
    /// The weights of a `general.architecture = llama` GGUF; with `dense_prefill`, the linear
    /// weights also as f32 for prompt rows.
    pub fn from_gguf<R: std::io::Read + std::io::Seek>(
        ct: &gguf_file::Content,
        reader: &mut R,
        device: &Device,
        context_length: usize,
        dense_prefill: bool,
    ) -> Result<Self> {
        let arch = md(ct, "general.architecture")?.to_string()?;
        if arch != "llama" {
            candle_core::bail!("architecture {arch:?}: only llama GGUFs are served");
        }
        let number = |key: &str| md(ct, key).and_then(|v| v.to_u32()).map(|v| v as usize);
        let heads = number("llama.attention.head_count")?;
        let kv_heads = number("llama.attention.head_count_kv")?;
        let layers = number("llama.block_count")?;
        let hidden = number("llama.embedding_length")?;
        let rope_dim = number("llama.rope.dimension_count")?;
        let eps = md(ct, "llama.attention.layer_norm_rms_epsilon")?.to_f32()? as f64;
        let freq_base = md(ct, "llama.rope.freq_base")
            .and_then(|v| v.to_f32())
            .unwrap_or(10_000.0);
        let head_dim = hidden / heads;
        if rope_dim != head_dim || heads % kv_heads != 0 {
            candle_core::bail!(
                "rope over {rope_dim} of {head_dim} dims or {heads} heads over {kv_heads} kv heads"
            );
        }
        let tensor = |name: &str, reader: &mut R| ct.tensor(reader, name, device);
        let embeddings_q = tensor("token_embd.weight", reader)?;
        let embeddings = Embedding::new(embeddings_q.dequantize(device)?, hidden);
        let norm = RmsNorm::from_qtensor(tensor("output_norm.weight", reader)?, eps)?;
        let output = match tensor("output.weight", reader) {
            Ok(t) => t,
            Err(_) => embeddings_q, // tied embeddings
        };
        let mut blocks = Vec::with_capacity(layers);
        for i in 0..layers {
            let mut weight = |name: &str| tensor(&format!("blk.{i}.{name}.weight"), reader);
            let qkv = vec![weight("attn_q")?, weight("attn_k")?, weight("attn_v")?];
            let gate_up = vec![weight("ffn_gate")?, weight("ffn_up")?];
            let (o, down) = (weight("attn_output")?, weight("ffn_down")?);
            let attention_norm =
                RmsNorm::from_qtensor(tensor(&format!("blk.{i}.attn_norm.weight"), reader)?, eps)?;
            let ffn_norm =
                RmsNorm::from_qtensor(tensor(&format!("blk.{i}.ffn_norm.weight"), reader)?, eps)?;
            blocks.push(Layer {
                attention_norm,
                qkv: Stacked::new(qkv, dense_prefill)?,
                o: Linear::new(o, dense_prefill)?,
                ffn_norm,
                gate_up: Stacked::new(gate_up, dense_prefill)?,
                down: Linear::new(down, dense_prefill)?,
            });
        }
        let (cos, sin) = rope_tables(head_dim, freq_base, context_length, device)?;
        let rotation = if device.is_cpu() {
            Rotation::Host(Rotary::new(&cos, &sin)?)
        } else {
            Rotation::Device { cos, sin }
        };
        Ok(Self {
            embeddings,
            layers: blocks,
            norm,
            output: Quantized::new(output)?,
            rotation,
            heads,
            kv_heads,
            head_dim,
            device: device.clone(),
        })
    }

    /// Whether every token's keys and values are the same bits however its sequence is split
    /// into passes (a copied prefix then answers as a computed one): on the CPU, without dense
    /// prefill (its f32 matmul's last bits depend on the rows beside), with quantized weights.
    pub fn split_exact(&self) -> bool {
        self.device.is_cpu()
            && self.dense_bytes() == 0
            && self.output.row_exact()
            && self
                .layers
                .iter()
                .flat_map(Layer::linears)
                .all(|w| w.quantized.row_exact())
    }

    /// Bytes the f32 copies of dense prefill take (0 without it).
    pub fn dense_bytes(&self) -> u64 {
        self.layers
            .iter()
            .flat_map(Layer::linears)
            .map(Linear::dense_bytes)
            .sum()
    }

    /// How the rows of `steps` split between the quantized and the dense path.
    fn rows(&self, steps: &[Step<'_>]) -> Result<Rows> {
        let dense = self.layers.first().is_some_and(|l| l.o.dense.is_some());
        if !dense {
            return Ok(Rows::Quantized);
        }
        let (mut decode, mut prompt) = (Vec::new(), Vec::new());
        let mut row = 0u32;
        for step in steps {
            let n = step.tokens.len() as u32;
            let to = if n > 1 { &mut prompt } else { &mut decode };
            to.extend(row..row + n);
            row += n;
        }
        Ok(match (decode.is_empty(), prompt.is_empty()) {
            (_, true) => Rows::Quantized,
            (true, false) => Rows::Dense,
            (false, false) => {
                let mut back = vec![0u32; row as usize];
                for (at, &r) in decode.iter().chain(&prompt).enumerate() {
                    back[r as usize] = at as u32;
                }
                Rows::Mixed {
                    decode: Tensor::new(decode.as_slice(), &self.device)?,
                    prompt: Tensor::new(prompt.as_slice(), &self.device)?,
                    back: Tensor::new(back.as_slice(), &self.device)?,
                }
            }
        })
    }

    /// An empty cache for a sequence of at most `capacity` tokens.
    pub fn cache(&self, capacity: usize) -> Cache {
        let capacity = capacity.max(1);
        let count = self.layers.len();
        let layers = if let Rotation::Host(_) = self.rotation {
            Layers::Host(
                (0..count)
                    .map(|_| HostKv::new(self.shape(), capacity))
                    .collect(),
            )
        } else {
            Layers::Device((0..count).map(|_| KvCache::new(2, capacity)).collect())
        };
        Cache {
            layers,
            len: 0,
            capacity,
        }
    }

    /// Runs every sequence's new tokens in one pass, appending them to its cache; returns each
    /// sequence's logits after its last new token (`[sequences, vocab]`).
    pub fn forward(&self, steps: &mut [Step<'_>]) -> Result<Tensor> {
        // On the CPU, inside candle's thread pool: its parallel operations (softmax, the
        // element-wise ones) then run on the pool's threads directly instead of each one
        // handing its work to the pool and sleeping until it is done.
        self.device.with_context(|| self.forward_in_context(steps))
    }

    fn forward_in_context(&self, steps: &mut [Step<'_>]) -> Result<Tensor> {
        let ids: Vec<u32> = steps
            .iter()
            .flat_map(|s| s.tokens.iter().copied())
            .collect();
        if ids.is_empty() || steps.iter().any(|s| s.tokens.is_empty()) {
            candle_core::bail!("every sequence of a step needs a token");
        }
        let rows = self.rows(steps)?;
        let mut x = self
            .embeddings
            .forward(&Tensor::new(ids.as_slice(), &self.device)?)?;
        for (l, layer) in self.layers.iter().enumerate() {
            let h = layer.attention_norm.forward(&x)?;
            let qkv = layer.qkv.forward(&h, &rows)?;
            let y = match &self.rotation {
                Rotation::Host(rotary) => self.host_attention(&qkv, steps, l, rotary)?,
                Rotation::Device { cos, sin } => {
                    self.accelerator_attention(layer.qkv.split(&qkv)?, steps, l, [cos, sin])?
                }
            };
            let x1 = (layer.o.forward(&y, &rows)? + &x)?;
            let h = layer.ffn_norm.forward(&x1)?;
            let [gate, up] = layer.gate_up.split(&layer.gate_up.forward(&h, &rows)?)?;
            let gated = swiglu(&gate, &up)?;
            x = (layer.down.forward(&gated, &rows)? + x1)?;
        }
        let mut last = Vec::with_capacity(steps.len());
        let mut end = 0u32;
        for step in steps.iter_mut() {
            end += step.tokens.len() as u32;
            last.push(end - 1);
            step.cache.len += step.tokens.len();
        }
        let x = x.index_select(&Tensor::new(last.as_slice(), &self.device)?, 0)?;
        self.output.forward(&self.norm.forward(&x)?)
    }

    fn shape(&self) -> Heads {
        Heads {
            heads: self.heads,
            kv_heads: self.kv_heads,
            head_dim: self.head_dim,
        }
    }

    /// Layer `l`'s attention of every sequence, on the host (see `host_attention`).
    fn host_attention(
        &self,
        qkv: &Tensor,
        steps: &mut [Step<'_>],
        l: usize,
        rotary: &Rotary,
    ) -> Result<Tensor> {
        let mut sequences = Vec::with_capacity(steps.len());
        let mut row = 0;
        for step in steps.iter_mut() {
            let (n, at) = (step.tokens.len(), step.cache.len);
            let Layers::Host(layers) = &mut step.cache.layers else {
                candle_core::bail!("a cache made for an accelerator in a host step")
            };
            sequences.push(host_attention::Sequence {
                row,
                n,
                at,
                kv: &mut layers[l],
            });
            row += n;
        }
        host_attention::layer(qkv, &mut sequences, rotary, self.shape())
    }

    /// Layer `l`'s attention of every sequence by candle's operations (accelerators), as
    /// `host_attention` returns it: each sequence's rows rotated, appended to its cache, and
    /// attended.
    fn accelerator_attention(
        &self,
        [q, k, v]: [Tensor; 3],
        steps: &mut [Step<'_>],
        l: usize,
        [cos, sin]: [&Tensor; 2],
    ) -> Result<Tensor> {
        let mut outputs = Vec::with_capacity(steps.len());
        let mut row = 0;
        for step in steps.iter_mut() {
            let (n, at) = (step.tokens.len(), step.cache.len);
            let part = |t: &Tensor, heads: usize| -> Result<Tensor> {
                t.narrow(0, row, n)?
                    .reshape((1, n, heads, self.head_dim))?
                    .transpose(1, 2)?
                    .contiguous()
            };
            let rope = |x: &Tensor| -> Result<Tensor> {
                let n = x.dim(2)?;
                candle_nn::rotary_emb::rope_i(x, &cos.narrow(0, at, n)?, &sin.narrow(0, at, n)?)
            };
            let q = rope(&part(&q, self.heads)?)?;
            let k = rope(&part(&k, self.kv_heads)?)?;
            let v = part(&v, self.kv_heads)?;
            let Layers::Device(layers) = &mut step.cache.layers else {
                candle_core::bail!("a host cache in an accelerator step")
            };
            let (k, v) = layers[l].append(&k, &v)?;
            outputs.push(
                self.attention(&q, &k, &v, at)?
                    .transpose(1, 2)?
                    .reshape((n, self.heads * self.head_dim))?,
            );
            row += n;
        }
        Tensor::cat(&outputs, 0)
    }

    /// Causal attention of `q` (`[1, heads, n, d]`, positions `at..at + n`) over the cache's
    /// keys and values (`[1, kv_heads, at + n, d]`), by candle's operations (accelerators).
    fn attention(&self, q: &Tensor, k: &Tensor, v: &Tensor, at: usize) -> Result<Tensor> {
        let n = q.dim(2)?;
        let repeat = self.heads / self.kv_heads;
        let k = candle_transformers::utils::repeat_kv(k.contiguous()?, repeat)?;
        let v = candle_transformers::utils::repeat_kv(v.contiguous()?, repeat)?;
        let scores = (q.matmul(&k.t()?)? / (self.head_dim as f64).sqrt())?;
        let scores = if n > 1 {
            let mask = candle_transformers::utils::build_causal_mask(n, at, &self.device)?;
            let mask = mask.broadcast_as(scores.shape())?;
            let minus =
                Tensor::new(f32::NEG_INFINITY, &self.device)?.broadcast_as(scores.shape())?;
            mask.where_cond(&minus, &scores)?
        } else {
            scores
        };
        candle_nn::ops::softmax_last_dim(&scores)?.matmul(&v.contiguous()?)
    }
}

fn rope_tables(
    head_dim: usize,
    freq_base: f32,
    positions: usize,
    device: &Device,
) -> Result<(Tensor, Tensor)> {
    let theta: Vec<f32> = (0..head_dim)
        .step_by(2)
        .map(|i| 1.0 / freq_base.powf(i as f32 / head_dim as f32))
        .collect();
    let theta = Tensor::new(theta.as_slice(), device)?;
    let angles = Tensor::arange(0, positions.max(1) as u32, device)?
        .to_dtype(DType::F32)?
        .reshape((positions.max(1), 1))?
        .matmul(&theta.reshape((1, ()))?)?;
    Ok((angles.cos()?, angles.sin()?))
}

/// The greedy token of each row of `logits` (`[sequences, vocab]`).
pub fn argmax_rows(logits: &Tensor) -> Result<Vec<u32>> {
    logits.argmax(D::Minus1)?.to_vec1::<u32>()
}

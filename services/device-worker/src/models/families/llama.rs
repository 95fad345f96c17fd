//! A quantized llama (GGUF) whose forward pass runs many sequences at once, each with its own
//! KV cache and position: the new tokens of every sequence (a prompt chunk or one decoded token)
//! are packed into one matrix, so each weight matrix is read once per step for all of them;
//! attention runs per sequence against that sequence's cache.
//!
//! Every row is computed as it would be alone: the quantized matmuls, norms and activations are
//! row by row, and attention never mixes sequences, so batching does not change any result. On
//! the CPU, rotation, the KV cache and attention are the worker's own and run row by row too
//! (`kernels/host_attention.rs`, `kernels/attention.rs`), so a token's keys and values are the same bits however
//! its sequence was split into passes: what lets a kept prefix be copied.
//!
//! With dense prefill, each linear weight is also kept as f32 and the rows of prompt chunks
//! (several tokens of one sequence) go through an f32 matmul, which is faster for many rows
//! than the quantized kernel; decode rows (one token) stay quantized. Which path a row takes
//! depends on its own sequence only, never on what else is in the step.

use candle_core::{D, DType, Device, Module, Result, Tensor};
use candle_nn::Embedding;
use candle_nn::kv_cache::KvCache;
use candle_transformers::quantized_nn::RmsNorm;

use crate::models::formats::architecture::Architecture;
use crate::models::formats::weights::Weights;
use crate::models::kernels::attention::Heads;
use crate::models::kernels::host_attention::{self, HostKv, RopeStyle, Rotary};
use crate::models::kernels::linear::{Linear, Quantized, Rows, Stacked};
use crate::models::kernels::swiglu::swiglu;

struct Layer {
    attention_norm: RmsNorm,
    /// q, k and v.
    qkv: Stacked,
    /// q, k and v's biases side by side (Qwen2).
    qkv_bias: Option<Tensor>,
    /// Norms over each head of q and of k, before rotation (Qwen3).
    qk_norm: Option<[RmsNorm; 2]>,
    o: Linear,
    ffn_norm: RmsNorm,
    /// gate and up.
    gate_up: Stacked,
    down: Linear,
}

impl Layer {
    /// q, k and v of the rows of `h` side by side, with the family's biases and norms.
    fn qkv(&self, h: &Tensor, rows: &Rows, shape: Heads) -> Result<Tensor> {
        let mut qkv = self.qkv.forward(h, rows)?;
        if let Some(bias) = &self.qkv_bias {
            qkv = qkv.broadcast_add(bias)?;
        }
        if let Some([q_norm, k_norm]) = &self.qk_norm {
            let n = qkv.dim(0)?;
            let d = shape.head_dim;
            let (q_width, kv_width) = (shape.heads * d, shape.kv_heads * d);
            let per_head = |norm: &RmsNorm, at: usize, heads: usize| -> Result<Tensor> {
                let part = qkv.narrow(1, at, heads * d)?.contiguous()?;
                norm.forward(&part.reshape((n * heads, d))?)?
                    .reshape((n, heads * d))
            };
            let q = per_head(q_norm, 0, shape.heads)?;
            let k = per_head(k_norm, q_width, shape.kv_heads)?;
            let v = qkv.narrow(1, q_width + kv_width, kv_width)?;
            qkv = Tensor::cat(&[q, k, v], 1)?;
        }
        Ok(qkv)
    }

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
    rope_style: RopeStyle,
    heads: usize,
    kv_heads: usize,
    head_dim: usize,
    /// The sliding window of the host's attention (`Architecture::sliding_window`).
    window: Option<usize>,
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

impl Llama {
    /// The weights of a decoder of a served family (`formats/architecture.rs`), by llama.cpp's names
    /// from `weights` (a GGUF or a transformers directory); with `dense_prefill`, the linear
    /// weights also as f32 for prompt rows.
    pub fn load(
        arch: &Architecture,
        weights: &mut dyn Weights,
        device: &Device,
        dense_prefill: bool,
    ) -> Result<Self> {
        let embeddings_q = weights.need("token_embd.weight")?;
        let embeddings = Embedding::new(embeddings_q.dequantize(device)?, arch.hidden);
        let norm = RmsNorm::from_qtensor(weights.need("output_norm.weight")?, arch.eps)?;
        let output = match weights.get("output.weight")? {
            Some(t) => t,
            None => embeddings_q, // tied embeddings
        };
        for unserved in ["attn_output.bias", "ffn_up.bias", "ffn_down.bias"] {
            let name = format!("blk.0.{unserved}");
            if weights.get(&name)?.is_some() {
                candle_core::bail!(
                    "the model has {}, which is not served",
                    weights.own_name(&name)
                );
            }
        }
        let mut blocks = Vec::with_capacity(arch.layers);
        for i in 0..arch.layers {
            let mut weight = |name: &str| weights.need(&format!("blk.{i}.{name}"));
            let qkv = vec![
                weight("attn_q.weight")?,
                weight("attn_k.weight")?,
                weight("attn_v.weight")?,
            ];
            let gate_up = vec![weight("ffn_gate.weight")?, weight("ffn_up.weight")?];
            let (o, down) = (weight("attn_output.weight")?, weight("ffn_down.weight")?);
            let attention_norm = RmsNorm::from_qtensor(weight("attn_norm.weight")?, arch.eps)?;
            let ffn_norm = RmsNorm::from_qtensor(weight("ffn_norm.weight")?, arch.eps)?;
            let qk_norm = if arch.family.qk_norm() {
                Some([
                    RmsNorm::from_qtensor(weight("attn_q_norm.weight")?, arch.eps)?,
                    RmsNorm::from_qtensor(weight("attn_k_norm.weight")?, arch.eps)?,
                ])
            } else {
                None
            };
            // Biases on q, k and v where the model has them (Qwen2's always).
            let qkv_bias = match weights.get(&format!("blk.{i}.attn_q.bias"))? {
                Some(q) => {
                    let mut bias = |name: &str| weights.need(&format!("blk.{i}.{name}"));
                    let biases = [q, bias("attn_k.bias")?, bias("attn_v.bias")?]
                        .iter()
                        .map(|b| b.dequantize(device))
                        .collect::<Result<Vec<_>>>()?;
                    Some(Tensor::cat(&biases, 0)?.unsqueeze(0)?)
                }
                None => None,
            };
            blocks.push(Layer {
                attention_norm,
                qkv: Stacked::new(qkv, dense_prefill)?,
                qkv_bias,
                qk_norm,
                o: Linear::new(o, dense_prefill)?,
                ffn_norm,
                gate_up: Stacked::new(gate_up, dense_prefill)?,
                down: Linear::new(down, dense_prefill)?,
            });
        }
        // Llama 3.1's GGUF stores its rope scaling as a divisor per frequency; other files
        // name theirs (`Architecture::rope_divisors`). Never both.
        let factors = match (weights.get("rope_freqs.weight")?, &arch.rope_divisors) {
            (Some(_), Some(_)) => candle_core::bail!(
                "the model has both rope_freqs and a rope scaling type; one or the other is served"
            ),
            (Some(t), None) => Some(t.dequantize(&Device::Cpu)?.to_vec1::<f32>()?),
            (None, divisors) => divisors.clone(),
        };
        let (cos, sin) = rope_tables(
            arch.head_dim,
            arch.freq_base,
            factors.as_deref(),
            arch.context_length,
            device,
        )?;
        let rope_style = arch.rope;
        let rotation = if device.is_cpu() {
            Rotation::Host(Rotary::new(&cos, &sin, rope_style)?)
        } else {
            Rotation::Device { cos, sin }
        };
        Ok(Self {
            embeddings,
            layers: blocks,
            norm,
            output: Quantized::new(output)?,
            rotation,
            rope_style,
            heads: arch.heads,
            kv_heads: arch.kv_heads,
            head_dim: arch.head_dim,
            window: arch.sliding_window,
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
            let qkv = layer.qkv(&h, &rows, self.shape())?;
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
            window: self.window,
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
                let (cos, sin) = (cos.narrow(0, at, n)?, sin.narrow(0, at, n)?);
                match self.rope_style {
                    RopeStyle::Interleaved => candle_nn::rotary_emb::rope_i(x, &cos, &sin),
                    RopeStyle::Halves => candle_nn::rotary_emb::rope(x, &cos, &sin),
                }
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

/// Each position's angle per frequency; `factors` (one per frequency) divide the frequencies.
fn rope_tables(
    head_dim: usize,
    freq_base: f32,
    factors: Option<&[f32]>,
    positions: usize,
    device: &Device,
) -> Result<(Tensor, Tensor)> {
    if let Some(f) = factors
        && f.len() != head_dim / 2
    {
        candle_core::bail!(
            "rope_freqs has {} factors for {} frequencies",
            f.len(),
            head_dim / 2
        );
    }
    let theta: Vec<f32> = (0..head_dim)
        .step_by(2)
        .enumerate()
        .map(|(k, i)| {
            1.0 / freq_base.powf(i as f32 / head_dim as f32) / factors.map_or(1.0, |f| f[k])
        })
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

#[cfg(test)]
mod tests {
    use super::*;

    /// A factor divides its frequency: with factor 2 the angle at position 2p is the plain
    /// angle at p; factor 1 leaves the table as it is.
    #[test]
    fn rope_factors_divide_their_frequencies() {
        let (d, base) = (8, 10_000.0);
        let plain = rope_tables(d, base, None, 16, &Device::Cpu).unwrap().0;
        let factors = [1.0, 2.0, 1.0, 2.0];
        let scaled = rope_tables(d, base, Some(&factors), 16, &Device::Cpu)
            .unwrap()
            .0;
        let (plain, scaled) = (
            plain.to_vec2::<f32>().unwrap(),
            scaled.to_vec2::<f32>().unwrap(),
        );
        for p in 0..8 {
            for (k, f) in factors.iter().enumerate() {
                let want = if *f == 1.0 {
                    plain[2 * p][k]
                } else {
                    plain[p][k]
                };
                assert!(
                    (scaled[2 * p][k] - want).abs() < 1e-5,
                    "position {p} pair {k}"
                );
            }
        }
        assert!(rope_tables(d, base, Some(&[1.0; 3]), 16, &Device::Cpu).is_err());
    }
}

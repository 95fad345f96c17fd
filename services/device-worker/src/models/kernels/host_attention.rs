//! A layer's attention for every sequence of a step on the CPU, in one pass over candle's
//! matmul threads: each work item is one sequence's kv head, which rotates its new keys,
//! appends them and the values to the sequence's cache, then rotates the queries of the heads
//! that share it and attends (`attention::attend`). Where these were candle operations per
//! sequence (a narrow, a copy, a rotation, a cache append each), a step ran them one after
//! another on the decode thread while the other matmul threads waited.
//!
//! The rotation is candle's `rope_i` per element (the same operations, so the same bits), and a
//! token's rotated key depends on its position only: the cache holds the same bits however its
//! sequence was split into passes, so a kept prefix can be copied.

use std::sync::Mutex;

use candle_core::{Device, Result, Storage, Tensor};

use crate::models::kernels::attention::{Heads, attend};

/// How pairs of a head's dimensions are rotated.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RopeStyle {
    /// Dimensions `2i` and `2i + 1` (llama.cpp's "normal" rope: its llama conversion permutes
    /// q and k into this order).
    Interleaved,
    /// Dimensions `i` and `i + d/2` ("neox" rope: Qwen).
    Halves,
}

/// One layer's keys and values of one sequence: per kv head, rows of `d` from position 0.
/// Room for `capacity` positions is reserved up front but filled as tokens come (never
/// cleared first: a new sequence's cache costs no pass over memory it has not used yet).
pub struct HostKv {
    heads: Vec<HeadKv>,
    capacity: usize,
    shape: Heads,
}

/// One kv head's keys and values, `[len][d]` each.
struct HeadKv {
    keys: Vec<f32>,
    values: Vec<f32>,
}

impl HostKv {
    /// Room for `capacity` positions.
    pub fn new(shape: Heads, capacity: usize) -> Self {
        let mut kv = Self {
            heads: Vec::new(),
            capacity: 0,
            shape,
        };
        kv.reset(capacity);
        kv
    }

    /// Positions held.
    fn len(&self) -> usize {
        self.heads
            .first()
            .map_or(0, |h| h.keys.len() / self.shape.head_dim.max(1))
    }

    /// A copy of positions `0..len` in room for `capacity` (at least `len`).
    pub fn prefix(&self, len: usize, capacity: usize) -> Self {
        let mut copy = Self::new(self.shape, 0);
        copy.reuse(self, len, capacity);
        copy
    }

    /// This cache's memory holding a copy of positions `0..len` of `from`, with room for
    /// `capacity` (at least `len`): a new sequence's cache without allocating (fresh memory
    /// costs page faults, and with transparent huge pages, milliseconds).
    pub fn reuse(&mut self, from: &HostKv, len: usize, capacity: usize) {
        let len = len.min(from.len());
        self.shape = from.shape;
        self.reset(capacity.max(len));
        let kept = len * from.shape.head_dim;
        for (to, from) in self.heads.iter_mut().zip(&from.heads) {
            to.keys.extend_from_slice(&from.keys[..kept]);
            to.values.extend_from_slice(&from.values[..kept]);
        }
    }

    /// Empty, in this cache's memory, with room for `capacity` positions.
    pub fn reset(&mut self, capacity: usize) {
        let shape = self.shape;
        let room = capacity * shape.head_dim;
        self.heads.resize_with(shape.kv_heads, || HeadKv {
            keys: Vec::new(),
            values: Vec::new(),
        });
        for head in &mut self.heads {
            for v in [&mut head.keys, &mut head.values] {
                v.clear();
                // Room beyond `capacity` (a longer sequence's) goes back: a cache holds what the
                // KV budget counts for it.
                v.shrink_to(room);
                v.reserve_exact(room);
            }
        }
        self.capacity = capacity;
    }
}

/// Rotary embedding tables, `[position][d / 2]`, as candle's `rope_i` and `rope` read them.
pub struct Rotary {
    cos: Vec<f32>,
    sin: Vec<f32>,
    half: usize,
    style: RopeStyle,
}

impl Rotary {
    /// From `[positions, d / 2]` tables.
    pub fn new(cos: &Tensor, sin: &Tensor, style: RopeStyle) -> Result<Self> {
        let half = cos.dim(1)?;
        Ok(Self {
            cos: cos.flatten_all()?.to_vec1()?,
            sin: sin.flatten_all()?.to_vec1()?,
            half,
            style,
        })
    }

    fn positions(&self) -> usize {
        self.cos.len() / self.half.max(1)
    }

    /// `x` (`d` values) rotated for `position`, into `out`: candle's `rope_i` (pairs side by
    /// side) or `rope` (pairs half a head apart), element for element.
    fn rotate(&self, x: &[f32], position: usize, out: &mut [f32]) {
        let cos = &self.cos[position * self.half..][..self.half];
        let sin = &self.sin[position * self.half..][..self.half];
        match self.style {
            RopeStyle::Interleaved => {
                for (((pair, out), &c), &s) in x
                    .chunks_exact(2)
                    .zip(out.chunks_exact_mut(2))
                    .zip(cos)
                    .zip(sin)
                {
                    out[0] = pair[0] * c - pair[1] * s;
                    out[1] = pair[0] * s + pair[1] * c;
                }
            }
            RopeStyle::Halves => {
                let (x1, x2) = x.split_at(self.half);
                let (out1, out2) = out.split_at_mut(self.half);
                for i in 0..self.half {
                    out1[i] = x1[i] * cos[i] - x2[i] * sin[i];
                    out2[i] = x1[i] * sin[i] + x2[i] * cos[i];
                }
            }
        }
    }
}

/// One sequence's share of a layer's step.
pub struct Sequence<'a> {
    /// Its first row in the step, and how many rows (new tokens) it has.
    pub row: usize,
    pub n: usize,
    /// The position of its first new token (the tokens its cache holds).
    pub at: usize,
    pub kv: &'a mut HostKv,
}

/// One sequence's kv head: where its rows are, and its part of the cache.
struct Item<'a> {
    row: usize,
    n: usize,
    at: usize,
    kv_head: usize,
    /// Its cache, holding positions `0..at`.
    kv: &'a mut HeadKv,
}

/// The attention of every sequence of a step for one layer, appending each new token's key and
/// value to its sequence's cache. `qkv` holds each row's q, k and v side by side
/// (`[rows, (heads + 2 kv_heads) * d]`, the stacked projections' output). Returns
/// `[rows, heads * d]`: each row's heads side by side, as the output projection takes them.
pub fn layer(
    qkv: &Tensor,
    sequences: &mut [Sequence<'_>],
    rotary: &Rotary,
    shape: Heads,
) -> Result<Tensor> {
    let d = shape.head_dim;
    let (rows, width) = qkv.dims2()?;
    if width != (shape.heads + 2 * shape.kv_heads) * d {
        candle_core::bail!("attention got rows of {width} values for {shape:?}");
    }
    for s in sequences.iter_mut() {
        if s.row + s.n > rows || s.at + s.n > s.kv.capacity.min(rotary.positions()) {
            candle_core::bail!(
                "a sequence's tokens {}..{} do not fit its cache of {} positions or the \
                 model's context of {}",
                s.at,
                s.at + s.n,
                s.kv.capacity,
                rotary.positions()
            );
        }
        if s.kv.len() < s.at {
            candle_core::bail!(
                "a sequence's step starts at position {} but its cache holds {}",
                s.at,
                s.kv.len()
            );
        }
        // A step the cache has gone past (one that failed part way) is computed again.
        for h in &mut s.kv.heads {
            h.keys.truncate(s.at * d);
            h.values.truncate(s.at * d);
        }
    }
    let qkv = qkv.contiguous()?;
    let (storage, layout) = qkv.storage_and_layout();
    let Storage::Cpu(cpu) = &*storage else {
        candle_core::bail!("host attention runs on CPU tensors only")
    };
    let data = &cpu.as_slice::<f32>()?[layout.start_offset()..][..rows * width];
    let mut items = Vec::with_capacity(sequences.len() * shape.kv_heads);
    for s in sequences.iter_mut() {
        for (kv_head, kv) in s.kv.heads.iter_mut().enumerate() {
            items.push(Some(Item {
                row: s.row,
                n: s.n,
                at: s.at,
                kv_head,
                kv,
            }));
        }
    }
    let count = items.len();
    let items = Mutex::new(items);
    // Each item's heads' rows (`[n][d]`), put in place after.
    let parts = Mutex::new(Vec::with_capacity(count * shape.heads / shape.kv_heads));
    candle_core::utils::barrier_pool().execute_chunked(count, |range| {
        for i in range {
            let taken = items.lock().unwrap_or_else(|e| e.into_inner())[i].take();
            if let Some(item) = taken {
                for part in run(item, data, width, rotary, shape) {
                    parts.lock().unwrap_or_else(|e| e.into_inner()).push(part);
                }
            }
        }
    });
    let out_width = shape.heads * d;
    let mut out = vec![0f32; rows * out_width];
    for (row, h, part) in parts.into_inner().unwrap_or_else(|e| e.into_inner()) {
        for (i, values) in part.chunks_exact(d).enumerate() {
            out[(row + i) * out_width + h * d..][..d].copy_from_slice(values);
        }
    }
    Tensor::from_vec(out, (rows, out_width), &Device::Cpu)
}

/// One item: its new keys (rotated) and values into the cache, then the attention of each head
/// that reads them. Returns (first row, head, `[n][d]`) for each of those heads.
fn run(
    item: Item<'_>,
    data: &[f32],
    width: usize,
    rotary: &Rotary,
    shape: Heads,
) -> Vec<(usize, usize, Vec<f32>)> {
    let d = shape.head_dim;
    let Item {
        row,
        n,
        at,
        kv_head,
        kv,
    } = item;
    let k_at = (shape.heads + kv_head) * d;
    let v_at = (shape.heads + shape.kv_heads + kv_head) * d;
    // Within the room reserved: `layer` checked that these positions fit.
    for i in 0..n {
        let source = &data[(row + i) * width..][..width];
        let position = at + i;
        kv.keys.resize((position + 1) * d, 0.0);
        rotary.rotate(
            &source[k_at..][..d],
            position,
            &mut kv.keys[position * d..][..d],
        );
        kv.values.extend_from_slice(&source[v_at..][..d]);
    }
    let (keys, values) = (&kv.keys, &kv.values);
    let per_kv = shape.heads / shape.kv_heads;
    (kv_head * per_kv..(kv_head + 1) * per_kv)
        .map(|h| {
            let mut queries = vec![0f32; n * d];
            for (i, query) in queries.chunks_exact_mut(d).enumerate() {
                let source = &data[(row + i) * width + h * d..][..d];
                rotary.rotate(source, at + i, query);
            }
            let mut part = vec![0f32; n * d];
            attend(&queries, keys, values, (at, shape.window), d, &mut part);
            (row, h, part)
        })
        .collect()
}

#[cfg(test)]
mod tests;

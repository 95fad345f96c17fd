//! Causal attention on the CPU, one query row at a time and always in the same order: a row's
//! result depends on its query and the keys and values up to its position, never on how many
//! rows share the pass. candle's matmul picks its kernel by shape (one row, a few, many), which
//! changes the last bits of a row with the rows beside it; then keys and values copied from a
//! kept prefix would not be the ones computing that prefix afresh gives, and greedy answers
//! would depend on what ran before.

use candle_core::{DType, Device, Layout, Result, Storage, Tensor};

/// Heads of a model's attention.
#[derive(Debug, Clone, Copy)]
pub struct Heads {
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
}

/// One sequence's share of a step: `q` (`[1, heads, n, d]`, positions `at..at + n`) and the
/// keys and values of its cache (`[1, kv_heads, at + n, d]`).
pub struct Sequence {
    pub q: Tensor,
    pub k: Tensor,
    pub v: Tensor,
    pub at: usize,
}

/// Every sequence's attention, its heads spread over candle's matmul threads. Returns
/// `[rows, heads * d]`: the sequences' positions in order, each position's heads side by side,
/// as the output projection takes them.
pub fn causal(sequences: &[Sequence], shape: Heads) -> Result<Tensor> {
    let d = shape.head_dim;
    let tensors = sequences
        .iter()
        .map(|s| Ok([f32_rows(&s.q)?, f32_rows(&s.k)?, f32_rows(&s.v)?]))
        .collect::<Result<Vec<_>>>()?;
    let guards: Vec<_> = tensors
        .iter()
        .map(|t| t.each_ref().map(Tensor::storage_and_layout))
        .collect();
    let mut inputs = Vec::with_capacity(sequences.len());
    let mut row = 0;
    for (s, [(q, q_layout), (k, k_layout), (v, v_layout)]) in sequences.iter().zip(&guards) {
        let n = s.q.dim(2)?;
        inputs.push(Inputs {
            q: host_f32(q, q_layout)?,
            k: host_f32(k, k_layout)?,
            v: host_f32(v, v_layout)?,
            k_stride: k_layout.stride()[1],
            v_stride: v_layout.stride()[1],
            n,
            at: s.at,
            row,
        });
        row += n;
    }
    // Work items are (sequence, head) pairs; each computes its rows into a part of its own
    // (`[n][d]`), put in place after.
    let parts = std::sync::Mutex::new(Vec::new());
    candle_core::utils::barrier_pool().execute_chunked(inputs.len() * shape.heads, |items| {
        for item in items {
            let (x, h) = (&inputs[item / shape.heads], item % shape.heads);
            let mut part = vec![0f32; x.n * d];
            head(x, h, shape, &mut part);
            parts
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .push((x.row, h, part));
        }
    });
    let width = shape.heads * d;
    let mut out = vec![0f32; row * width];
    for (first, h, part) in parts.into_inner().unwrap_or_else(|e| e.into_inner()) {
        for (i, values) in part.chunks_exact(d).enumerate() {
            out[(first + i) * width + h * d..][..d].copy_from_slice(values);
        }
    }
    Tensor::from_vec(out, (row, width), &Device::Cpu)
}

/// `t` (`[1, heads, len, d]`) as f32 with contiguous rows of `d`: itself, or a copy.
fn f32_rows(t: &Tensor) -> Result<Tensor> {
    let t = t.to_dtype(DType::F32)?;
    let stride = t.stride();
    if t.rank() != 4 || stride[3] != 1 || stride[2] != t.dim(3)? {
        return t.contiguous();
    }
    Ok(t)
}

/// A CPU tensor's f32 data from where the tensor starts.
fn host_f32<'a>(storage: &'a Storage, layout: &Layout) -> Result<&'a [f32]> {
    let Storage::Cpu(cpu) = storage else {
        candle_core::bail!("host attention runs on CPU tensors only")
    };
    Ok(&cpu.as_slice::<f32>()?[layout.start_offset()..])
}

struct Inputs<'a> {
    /// `[heads][n][d]`.
    q: &'a [f32],
    /// Kv head `h`'s row `j` at `h * stride + j * d`.
    k: &'a [f32],
    v: &'a [f32],
    k_stride: usize,
    v_stride: usize,
    /// Query rows, the position of the first, and its row in the step's output.
    n: usize,
    at: usize,
    row: usize,
}

/// Head `h`'s rows into `out` (`[n][d]`): [`head_with`] compiled for AVX2 where the CPU has it,
/// the same operations in the same order (no fused multiply-adds), so the same bits, on vectors
/// twice as wide.
fn head(x: &Inputs<'_>, h: usize, shape: Heads, out: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    if is_x86_feature_detected!("avx2") {
        // SAFETY: the CPU has AVX2 (checked just above).
        return unsafe { head_avx2(x, h, shape, out) };
    }
    head_with(x, h, shape, out, dot, weighted_sum)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
fn head_avx2(x: &Inputs<'_>, h: usize, shape: Heads, out: &mut [f32]) {
    head_with(
        x,
        h,
        shape,
        out,
        |a, b| dot_avx2(a, b),
        |w, v, d, y| weighted_sum_avx2(w, v, d, y),
    )
}

#[inline(always)]
fn head_with(
    x: &Inputs<'_>,
    h: usize,
    shape: Heads,
    out: &mut [f32],
    dot: impl Fn(&[f32], &[f32]) -> f32,
    weighted_sum: impl Fn(&[f32], &[f32], usize, &mut [f32]),
) {
    let (d, n, at) = (shape.head_dim, x.n, x.at);
    let kv = h / (shape.heads / shape.kv_heads);
    let scale = 1.0 / (d as f32).sqrt();
    let mut weights = vec![0f32; at + n];
    let keys = &x.k[kv * x.k_stride..];
    let values = &x.v[kv * x.v_stride..];
    for i in 0..n {
        let query = &x.q[(h * n + i) * d..][..d];
        let visible = &mut weights[..at + i + 1];
        let mut max = f32::NEG_INFINITY;
        for (j, w) in visible.iter_mut().enumerate() {
            *w = dot(query, &keys[j * d..][..d]) * scale;
            max = max.max(*w);
        }
        let mut sum = 0f32;
        for w in visible.iter_mut() {
            *w = (*w - max).exp();
            sum += *w;
        }
        let y = &mut out[i * d..][..d];
        weighted_sum(visible, values, d, y);
        let inverse = 1.0 / sum;
        y.iter_mut().for_each(|e| *e *= inverse);
    }
}

/// Eight running sums, each over every eighth element (vectorizes without reordering a sum).
fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut lanes = [0f32; 8];
    let (a8, b8) = (a.chunks_exact(8), b.chunks_exact(8));
    let tail = tail_dot(a8.remainder(), b8.remainder());
    for (x, y) in a8.zip(b8) {
        for l in 0..8 {
            lanes[l] += x[l] * y[l];
        }
    }
    sum_lanes(lanes, tail)
}

/// [`dot`] on one AVX register: the same products and sums, so the same bits.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
fn dot_avx2(a: &[f32], b: &[f32]) -> f32 {
    use std::arch::x86_64::*;
    let (a8, b8) = (a.chunks_exact(8), b.chunks_exact(8));
    let tail = tail_dot(a8.remainder(), b8.remainder());
    let mut acc = _mm256_setzero_ps();
    for (x, y) in a8.zip(b8) {
        // SAFETY: each chunk holds 8 floats; unaligned loads.
        let (x, y) = unsafe { (_mm256_loadu_ps(x.as_ptr()), _mm256_loadu_ps(y.as_ptr())) };
        acc = _mm256_add_ps(acc, _mm256_mul_ps(x, y));
    }
    // `sum_lanes` in registers: the four pairs (lane i + lane i + 4), then pairs 0 + 2 and 1 + 3,
    // then those two, then the tail.
    let pairs = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
    let halves = _mm_add_ps(pairs, _mm_movehl_ps(pairs, pairs));
    _mm_cvtss_f32(_mm_add_ss(halves, _mm_movehdup_ps(halves))) + tail
}

#[inline(always)]
fn tail_dot(a: &[f32], b: &[f32]) -> f32 {
    a.iter().zip(b).map(|(x, y)| x * y).sum()
}

#[inline(always)]
fn sum_lanes(lanes: [f32; 8], tail: f32) -> f32 {
    let pairs = [
        lanes[0] + lanes[4],
        lanes[1] + lanes[5],
        lanes[2] + lanes[6],
        lanes[3] + lanes[7],
    ];
    (pairs[0] + pairs[2]) + (pairs[1] + pairs[3]) + tail
}

/// `y += sum over j of weights[j] * values[j]` (rows of `d`), one row after another.
#[inline(always)]
fn weighted_sum(weights: &[f32], values: &[f32], d: usize, y: &mut [f32]) {
    for (j, &w) in weights.iter().enumerate() {
        axpy(w, &values[j * d..][..d], y);
    }
}

/// [`weighted_sum`] with 64 of `y`'s elements held in registers across all rows: the same
/// multiply and add per element in the same order, so the same bits.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
fn weighted_sum_avx2(weights: &[f32], values: &[f32], d: usize, y: &mut [f32]) {
    use std::arch::x86_64::*;
    const HELD: usize = 64;
    if !d.is_multiple_of(HELD) {
        return weighted_sum(weights, values, d, y);
    }
    for (block, y) in y[..d].chunks_exact_mut(HELD).enumerate() {
        // SAFETY (every load and store here): each chunk of 8 lies inside a slice of HELD
        // floats (`y`, `row`); unaligned accesses.
        let mut acc: [__m256; HELD / 8] =
            std::array::from_fn(|c| unsafe { _mm256_loadu_ps(y.as_ptr().add(c * 8)) });
        for (j, &w) in weights.iter().enumerate() {
            let row = &values[j * d + block * HELD..][..HELD];
            let w = _mm256_set1_ps(w);
            for (c, acc) in acc.iter_mut().enumerate() {
                let x = unsafe { _mm256_loadu_ps(row.as_ptr().add(c * 8)) };
                *acc = _mm256_add_ps(*acc, _mm256_mul_ps(w, x));
            }
        }
        for (c, acc) in acc.into_iter().enumerate() {
            unsafe { _mm256_storeu_ps(y.as_mut_ptr().add(c * 8), acc) };
        }
    }
}

#[inline(always)]
fn axpy(w: f32, x: &[f32], y: &mut [f32]) {
    for (y, x) in y.iter_mut().zip(x) {
        *y += w * x;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const SHAPE: Heads = Heads {
        heads: 6,
        kv_heads: 2,
        head_dim: 20,
    };

    /// Attention the plain way: repeated kv heads, a masked softmax, matmuls.
    fn reference(q: &Tensor, k: &Tensor, v: &Tensor, at: usize) -> Tensor {
        let n = q.dim(2).unwrap();
        let repeat = SHAPE.heads / SHAPE.kv_heads;
        let k = candle_transformers::utils::repeat_kv(k.contiguous().unwrap(), repeat).unwrap();
        let v = candle_transformers::utils::repeat_kv(v.contiguous().unwrap(), repeat).unwrap();
        let scores = (q.matmul(&k.t().unwrap()).unwrap() / (SHAPE.head_dim as f64).sqrt()).unwrap();
        let mask = candle_transformers::utils::build_causal_mask(n, at, &Device::Cpu).unwrap();
        let mask = mask.broadcast_as(scores.shape()).unwrap();
        let minus = Tensor::new(f32::NEG_INFINITY, &Device::Cpu)
            .unwrap()
            .broadcast_as(scores.shape())
            .unwrap();
        let scores = mask.where_cond(&minus, &scores).unwrap();
        candle_nn::ops::softmax_last_dim(&scores)
            .unwrap()
            .matmul(&v)
            .unwrap()
            .transpose(1, 2)
            .unwrap()
            .reshape((n, SHAPE.heads * SHAPE.head_dim))
            .unwrap()
    }

    fn one(q: &Tensor, k: &Tensor, v: &Tensor, at: usize) -> Tensor {
        let (q, k, v) = (q.clone(), k.clone(), v.clone());
        causal(&[Sequence { q, k, v, at }], SHAPE).unwrap()
    }

    fn random(shape: (usize, usize, usize, usize)) -> Tensor {
        Tensor::randn(0f32, 1.0, shape, &Device::Cpu).unwrap()
    }

    /// The AVX2 dot product is the portable one's bits, so a CPU's path does not move results.
    #[test]
    #[cfg(target_arch = "x86_64")]
    fn the_avx2_dot_product_is_the_portable_ones_bits() {
        if !is_x86_feature_detected!("avx2") {
            return;
        }
        for len in [64, 20, 7, 128] {
            let a = random((1, 1, 1, len))
                .flatten_all()
                .unwrap()
                .to_vec1::<f32>()
                .unwrap();
            let b = random((1, 1, 1, len))
                .flatten_all()
                .unwrap()
                .to_vec1::<f32>()
                .unwrap();
            // SAFETY: AVX2 checked above.
            let vector = unsafe { dot_avx2(&a, &b) };
            assert_eq!(dot(&a, &b).to_bits(), vector.to_bits(), "length {len}");
        }
    }

    /// The AVX2 weighted sum is the portable one's bits.
    #[test]
    #[cfg(target_arch = "x86_64")]
    fn the_avx2_weighted_sum_is_the_portable_ones_bits() {
        if !is_x86_feature_detected!("avx2") {
            return;
        }
        let flat = |t: Tensor| t.flatten_all().unwrap().to_vec1::<f32>().unwrap();
        for (rows, d) in [(1, 64), (37, 64), (9, 128), (5, 20)] {
            let weights = flat(random((1, 1, 1, rows)));
            let values = flat(random((1, 1, rows, d)));
            let start = flat(random((1, 1, 1, d)));
            let (mut a, mut b) = (start.clone(), start);
            weighted_sum(&weights, &values, d, &mut a);
            // SAFETY: AVX2 checked above.
            unsafe { weighted_sum_avx2(&weights, &values, d, &mut b) };
            let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(&a), bits(&b), "{rows} rows of {d}");
        }
    }

    #[test]
    fn matches_masked_softmax_attention() {
        let (at, n, d) = (7, 5, SHAPE.head_dim);
        let q = random((1, SHAPE.heads, n, d));
        // Keys and values as a cache holds them: a narrowed view of room for more.
        let k = random((1, SHAPE.kv_heads, 40, d))
            .narrow(2, 0, at + n)
            .unwrap();
        let v = random((1, SHAPE.kv_heads, 40, d))
            .narrow(2, 0, at + n)
            .unwrap();
        let ours = one(&q, &k, &v, at);
        let theirs = reference(&q, &k, &v, at);
        let diff = (ours - theirs)
            .unwrap()
            .abs()
            .unwrap()
            .flatten_all()
            .unwrap()
            .max(0)
            .unwrap()
            .to_scalar::<f32>()
            .unwrap();
        assert!(diff < 1e-5, "max difference {diff}");
    }

    #[test]
    fn a_row_is_the_same_bits_whatever_rows_share_its_pass() {
        let (len, d) = (90, SHAPE.head_dim);
        let q = random((1, SHAPE.heads, len, d));
        let k = random((1, SHAPE.kv_heads, len, d));
        let v = random((1, SHAPE.kv_heads, len, d));
        let all = one(&q, &k, &v, 0).to_vec2::<f32>().unwrap();
        // The same positions as chunks of 1, 2, 3 ... rows after a prefix.
        let (mut at, mut n) = (0, 1);
        while at < len {
            n = n.min(len - at);
            let part = |t: &Tensor| t.narrow(2, 0, at + n).unwrap();
            let q = q.narrow(2, at, n).unwrap().contiguous().unwrap();
            let rows = one(&q, &part(&k), &part(&v), at).to_vec2::<f32>().unwrap();
            for (i, row) in rows.iter().enumerate() {
                let bits = |r: &[f32]| r.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                assert_eq!(bits(row), bits(&all[at + i]), "position {}", at + i);
            }
            at += n;
            n += 1;
        }
    }
}

//! Causal attention on the CPU, one query row at a time and always in the same order: a row's
//! result depends on its query and the keys and values up to its position, never on how many
//! rows share the pass. candle's matmul picks its kernel by shape (one row, a few, many), which
//! changes the last bits of a row with the rows beside it; then keys and values copied from a
//! kept prefix would not be the ones computing that prefix afresh gives, and greedy answers
//! would depend on what ran before.

use crate::models::kernels::exp::exp_shifted;

/// Heads of a model's attention.
#[derive(Debug, Clone, Copy)]
pub struct Heads {
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    /// A sliding window: each position attends to the last `window` positions (itself
    /// included) only; `None` attends to all before it.
    pub window: Option<usize>,
}

/// Causal attention of query rows `queries` (`[n][d]`, positions `at..at + n`) over the keys
/// and values of positions `0..at + n` (rows of `d` from position 0; within a sliding `window`,
/// only the last `window` of those each row sees), into `out` (`[n][d]`):
/// compiled for AVX2 where the CPU has it, the same operations in the same order (no fused
/// multiply-adds), so the same bits, on vectors twice as wide.
pub fn attend(
    queries: &[f32],
    keys: &[f32],
    values: &[f32],
    (at, window): (usize, Option<usize>),
    d: usize,
    out: &mut [f32],
) {
    #[cfg(target_arch = "x86_64")]
    if is_x86_feature_detected!("avx2") {
        // SAFETY: the CPU has AVX2 (checked just above).
        return unsafe { attend_avx2(queries, keys, values, (at, window), d, out) };
    }
    attend_with(
        queries,
        keys,
        values,
        (at, window),
        d,
        out,
        |q, (k, _), d, s| dots(q, k, d, s),
        weighted_sum,
    )
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
fn attend_avx2(
    queries: &[f32],
    keys: &[f32],
    values: &[f32],
    (at, window): (usize, Option<usize>),
    d: usize,
    out: &mut [f32],
) {
    attend_with(
        queries,
        keys,
        values,
        (at, window),
        d,
        out,
        |q, (k, v), d, s| dots_avx2(q, k, v, d, s),
        |w, v, d, y| weighted_sum_avx2(w, v, d, y),
    )
}

#[inline(always)]
#[allow(clippy::too_many_arguments)]
fn attend_with(
    queries: &[f32],
    keys: &[f32],
    values: &[f32],
    (at, window): (usize, Option<usize>),
    d: usize,
    out: &mut [f32],
    dots: impl Fn(&[f32], (&[f32], &[f32]), usize, &mut [f32]),
    weighted_sum: impl Fn(&[f32], &[f32], usize, &mut [f32]),
) {
    let n = queries.len() / d;
    let scale = 1.0 / (d as f32).sqrt();
    let mut weights = vec![0f32; at + n];
    for i in 0..n {
        let query = &queries[i * d..][..d];
        let end = at + i + 1;
        let first = window.map_or(0, |w| end.saturating_sub(w));
        let (keys, values) = (&keys[first * d..], &values[first * d..]);
        let visible = &mut weights[first..end];
        dots(query, (keys, values), d, visible);
        visible.iter_mut().for_each(|w| *w *= scale);
        let max = max_of(visible);
        exp_shifted(visible, max);
        let sum = visible.iter().fold(0f32, |sum, w| sum + w);
        let y = &mut out[i * d..][..d];
        weighted_sum(visible, values, d, y);
        let inverse = 1.0 / sum;
        y.iter_mut().for_each(|e| *e *= inverse);
    }
}

/// The largest of `values` (NaNs aside), from eight running maxima: a maximum does not depend
/// on the order it is taken in, and eight lanes vectorize where one chain would not.
#[inline(always)]
fn max_of(values: &[f32]) -> f32 {
    let mut lanes = [f32::NEG_INFINITY; 8];
    let chunks = values.chunks_exact(8);
    let tail = chunks
        .remainder()
        .iter()
        .fold(f32::NEG_INFINITY, |m, &v| m.max(v));
    for chunk in chunks {
        for (lane, &v) in lanes.iter_mut().zip(chunk) {
            *lane = lane.max(v);
        }
    }
    lanes.into_iter().fold(tail, f32::max)
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

/// `scores[j]` = [`dot`] of `query` and key row j (rows of `d`), for each of `scores`.
fn dots(query: &[f32], keys: &[f32], d: usize, scores: &mut [f32]) {
    for (j, score) in scores.iter_mut().enumerate() {
        *score = dot(query, &keys[j * d..][..d]);
    }
}

/// [`dots`] on AVX registers, eight keys at a time: each key's products and sums are [`dot`]'s
/// (one register of eight running sums, then the same pairing), so the same bits, with eight
/// independent chains of adds where one would wait on itself (at four, the adds' latency still
/// set the pace).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
fn dots_avx2(query: &[f32], keys: &[f32], values: &[f32], d: usize, scores: &mut [f32]) {
    use std::arch::x86_64::*;
    const KEYS: usize = 8;
    /// How far ahead keys are asked for (floats: 8 KiB): four groups' time covers a trip to
    /// memory where one did not.
    const KEYS_AHEAD: usize = 2048;
    assert!(query.len() == d);
    let full = d - d % 8;
    let mut groups = scores.chunks_exact_mut(KEYS);
    let mut first = 0;
    for group in &mut groups {
        // Bounds checked here, once a group, not at every load of the loop below.
        let rows: [&[f32]; KEYS] = std::array::from_fn(|k| &keys[(first + k) * d..][..d]);
        // A cache's first read in a step comes from memory: ask for keys well ahead, and for
        // these keys' values, which the weighted sum reads after the scores.
        let at = first * d;
        nomad_q8::prefetch(
            keys.as_ptr().wrapping_add(at + KEYS_AHEAD).cast(),
            KEYS * d * 4,
        );
        nomad_q8::prefetch(values.as_ptr().wrapping_add(at).cast(), KEYS * d * 4);
        let mut acc = [_mm256_setzero_ps(); KEYS];
        for c in (0..full).step_by(8) {
            // SAFETY: c + 8 <= full <= d, the length of the query and of every row; unaligned.
            let q = unsafe { _mm256_loadu_ps(query.as_ptr().add(c)) };
            for (acc, row) in acc.iter_mut().zip(rows) {
                // SAFETY: as above.
                let key = unsafe { _mm256_loadu_ps(row.as_ptr().add(c)) };
                *acc = _mm256_add_ps(*acc, _mm256_mul_ps(q, key));
            }
        }
        for (k, score) in group.iter_mut().enumerate() {
            let key = &keys[(first + k) * d..][..d];
            *score = sum_register(acc[k]) + tail_dot(&query[full..], &key[full..]);
        }
        first += KEYS;
    }
    for (k, score) in groups.into_remainder().iter_mut().enumerate() {
        *score = dot_avx2(query, &keys[(first + k) * d..][..d]);
    }
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
    sum_register(acc) + tail
}

/// `sum_lanes` of a register without its tail, in registers: the four pairs (lane i + lane
/// i + 4), then pairs 0 + 2 and 1 + 3, then those two.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
fn sum_register(acc: std::arch::x86_64::__m256) -> f32 {
    use std::arch::x86_64::*;
    let pairs = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
    let halves = _mm_add_ps(pairs, _mm_movehl_ps(pairs, pairs));
    _mm_cvtss_f32(_mm_add_ss(halves, _mm_movehdup_ps(halves)))
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
    use candle_core::{Device, Tensor};

    fn random(shape: (usize, usize, usize, usize)) -> Tensor {
        Tensor::randn(0f32, 1.0, shape, &Device::Cpu).unwrap()
    }

    fn floats(n: usize) -> Vec<f32> {
        random((1, 1, 1, n))
            .flatten_all()
            .unwrap()
            .to_vec1()
            .unwrap()
    }

    /// Within a sliding window each row is the attention over its last `window` positions
    /// alone (and the same bits), and a window wider than the sequence changes nothing.
    #[test]
    fn a_window_attends_to_the_last_positions_alone() {
        let (d, at, n, window) = (16, 9, 5, 4);
        let (queries, keys, values) = (floats(n * d), floats((at + n) * d), floats((at + n) * d));
        let mut windowed = vec![0f32; n * d];
        attend(
            &queries,
            &keys,
            &values,
            (at, Some(window)),
            d,
            &mut windowed,
        );
        for i in 0..n {
            let end = at + i + 1;
            let first = end - window;
            let mut alone = vec![0f32; d];
            attend(
                &queries[i * d..][..d],
                &keys[first * d..end * d],
                &values[first * d..end * d],
                (window - 1, None),
                d,
                &mut alone,
            );
            assert_eq!(alone, windowed[i * d..][..d], "row {i}");
        }
        let mut full = vec![0f32; n * d];
        attend(&queries, &keys, &values, (at, None), d, &mut full);
        let mut wide = vec![0f32; n * d];
        attend(&queries, &keys, &values, (at, Some(at + n)), d, &mut wide);
        assert_eq!(full, wide);
        assert_ne!(full, windowed);
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

    /// Eight keys at a time (and the keys left over) are the portable scores' bits.
    #[test]
    #[cfg(target_arch = "x86_64")]
    fn the_avx2_scores_are_the_portable_ones_bits() {
        if !is_x86_feature_detected!("avx2") {
            return;
        }
        let flat = |t: Tensor| t.flatten_all().unwrap().to_vec1::<f32>().unwrap();
        for d in [64, 20, 7] {
            for keys in 1..=19 {
                let query = flat(random((1, 1, 1, d)));
                let rows = flat(random((1, 1, keys, d)));
                let (mut a, mut b) = (vec![0f32; keys], vec![0f32; keys]);
                dots(&query, &rows, d, &mut a);
                // SAFETY: AVX2 checked above.
                unsafe { dots_avx2(&query, &rows, &rows, d, &mut b) };
                let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                assert_eq!(bits(&a), bits(&b), "{keys} keys of {d}");
            }
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
}

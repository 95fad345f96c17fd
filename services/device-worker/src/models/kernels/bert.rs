//! The row-wise steps of a BERT-shaped encoder layer on the CPU: layer norm, the activations,
//! softmax, and the matrix products through `gemm`. candle runs each as a tensor op of its own
//! (a fresh buffer each, broadcasts for biases and masks) and its exact GELU calls libm's `erf`
//! once per value: with `exp`, a quarter of a cross-encoder's time went to those two.

use gemm::Parallelism;

use crate::models::kernels::exp::{exp, exp_shifted};

/// `out[m][n] = a[m][k] · w[k][n]`, added to what `out` holds when `accumulate` (how a bias or
/// a residual put there first joins the product). `a` and `out` are rows `a_stride` and
/// `out_stride` floats apart. The work is shared by the current rayon pool's threads.
#[allow(clippy::too_many_arguments)]
pub fn matmul(
    m: usize,
    n: usize,
    k: usize,
    a: &[f32],
    a_stride: usize,
    w: &[f32],
    out: &mut [f32],
    out_stride: usize,
    accumulate: bool,
) {
    assert!(m == 0 || (a.len() >= (m - 1) * a_stride + k && out.len() >= (m - 1) * out_stride + n));
    assert!(w.len() >= n * k);
    // SAFETY: the bounds of every row of `a`, `w` and `out` are checked above; `out` does not
    // overlap the inputs (a `&mut` beside two `&`).
    unsafe {
        product(
            (m, n, k),
            out.as_mut_ptr(),
            out_stride,
            accumulate,
            (a.as_ptr(), a_stride as isize, 1),
            (w.as_ptr(), n as isize, 1),
            1.0,
            pool_parallelism(),
        )
    }
}

/// The current rayon pool's threads, for `gemm`.
fn pool_parallelism() -> Parallelism {
    match rayon::current_num_threads() {
        0 | 1 => Parallelism::None,
        threads => Parallelism::Rayon(threads),
    }
}

/// A matrix: its first element, its row stride and its column stride (in floats).
pub type Strided = (*const f32, isize, isize);

/// `out[m][n] (+)= scale · lhs[m][k] · rhs[k][n]`, each operand given by its strides, on
/// `parallelism`'s threads.
///
/// # Safety
/// Every element the shapes and strides reach must be in bounds; `out` must not overlap
/// `lhs` or `rhs`.
#[allow(clippy::too_many_arguments)]
pub unsafe fn product(
    (m, n, k): (usize, usize, usize),
    out: *mut f32,
    out_stride: usize,
    accumulate: bool,
    (lhs, lhs_rs, lhs_cs): Strided,
    (rhs, rhs_rs, rhs_cs): Strided,
    scale: f32,
    parallelism: Parallelism,
) {
    // SAFETY: as the caller promises.
    unsafe {
        gemm::gemm(
            m,
            n,
            k,
            out,
            1,
            out_stride as isize,
            accumulate,
            lhs,
            lhs_cs,
            lhs_rs,
            rhs,
            rhs_cs,
            rhs_rs,
            1.0,
            scale,
            false,
            false,
            false,
            parallelism,
        )
    }
}

/// Each row of `rows` (`width` floats) normalized to zero mean and unit variance, then scaled by
/// `weight` and shifted by `bias`, as PyTorch's `LayerNorm` (biased variance, `eps` inside the
/// root).
pub fn layer_norm(rows: &mut [f32], weight: &[f32], bias: &[f32], eps: f32) {
    let width = weight.len();
    for row in rows.chunks_exact_mut(width) {
        let mean = sum(row) / width as f32;
        let mut squares = [0f32; 8];
        let mut chunks = row.chunks_exact(8);
        for chunk in &mut chunks {
            for (s, x) in squares.iter_mut().zip(chunk) {
                *s += (x - mean) * (x - mean);
            }
        }
        let tail: f32 = chunks
            .remainder()
            .iter()
            .map(|x| (x - mean) * (x - mean))
            .sum();
        let variance = (squares.iter().sum::<f32>() + tail) / width as f32;
        let inverse = 1.0 / (variance + eps).sqrt();
        for ((x, w), b) in row.iter_mut().zip(weight).zip(bias) {
            *x = (*x - mean) * inverse * w + b;
        }
    }
}

/// The sum of `xs` in eight running sums (which the compiler keeps in vector registers).
fn sum(xs: &[f32]) -> f32 {
    let mut sums = [0f32; 8];
    let mut chunks = xs.chunks_exact(8);
    for chunk in &mut chunks {
        for (s, x) in sums.iter_mut().zip(chunk) {
            *s += x;
        }
    }
    sums.iter().sum::<f32>() + chunks.remainder().iter().sum::<f32>()
}

/// Each row of `rows` (`width` floats) replaced by its softmax.
pub fn softmax_rows(rows: &mut [f32], width: usize) {
    for row in rows.chunks_exact_mut(width) {
        let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        exp_shifted(row, max);
        let scale = 1.0 / sum(row);
        row.iter_mut().for_each(|x| *x *= scale);
    }
}

/// The activations BERT-shaped checkpoints name in their `hidden_act`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Activation {
    /// `gelu`: `x Φ(x)` with the exact normal CDF.
    GeluErf,
    /// `gelu_new`, `gelu_pytorch_tanh`: the tanh approximation.
    GeluTanh,
    Relu,
}

impl Activation {
    /// The activation a config's `hidden_act` (or DistilBERT's `activation`) names, if it is
    /// one of these.
    pub fn named(name: &str) -> Option<Self> {
        match name {
            "gelu" => Some(Self::GeluErf),
            "gelu_new" | "gelu_pytorch_tanh" | "geluapproximate" => Some(Self::GeluTanh),
            "relu" => Some(Self::Relu),
            _ => None,
        }
    }

    /// Applies the activation to every value.
    pub fn apply(self, xs: &mut [f32]) {
        match self {
            Self::GeluErf => gelu_erf(xs),
            Self::GeluTanh => xs.iter_mut().for_each(|x| *x = gelu_tanh(*x)),
            Self::Relu => xs.iter_mut().for_each(|x| *x = x.max(0.0)),
        }
    }
}

// `erfc(z) ≈ t (A1 + t (A2 + ...)) e^(-z²)` with `t = 1 / (1 + P z)` for `z >= 0`
// (Abramowitz and Stegun 7.1.26: within 1.5e-7 of erf).
const ERF_P: f32 = 0.327_591_1;
const ERF_A: [f32; 5] = [
    1.061_405_4,
    -1.453_152,
    1.421_413_8,
    -0.284_496_74,
    0.254_829_6,
];
const FRAC_1_SQRT_2: f32 = std::f32::consts::FRAC_1_SQRT_2;

/// `x Φ(x) = x (1 + erf(x / √2)) / 2`: from `erfc(|x| / √2)` on both sides of 0, so a very
/// negative `x` keeps its small value rather than losing it to `1 - 1`.
#[inline(always)]
pub fn gelu(x: f32) -> f32 {
    let z = x.abs() * FRAC_1_SQRT_2;
    let t = 1.0 / (1.0 + ERF_P * z);
    let mut p = ERF_A[0];
    for a in &ERF_A[1..] {
        p = p * t + a;
    }
    let erfc = p * t * exp(-(z * z));
    let one_plus_erf = if x < 0.0 { erfc } else { 2.0 - erfc };
    0.5 * x * one_plus_erf
}

/// [`gelu`] on every value: eight at a time where the CPU has AVX2, the same operations in the
/// same order (so the same bits) either way.
pub fn gelu_erf(xs: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    if is_x86_feature_detected!("avx2") {
        // SAFETY: the CPU has AVX2 (checked just above).
        return unsafe { gelu_avx2(xs) };
    }
    xs.iter_mut().for_each(|x| *x = gelu(*x));
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
fn gelu_avx2(xs: &mut [f32]) {
    use crate::models::kernels::exp::exp8;
    use std::arch::x86_64::*;
    let sign = _mm256_set1_ps(-0.0);
    let mut chunks = xs.chunks_exact_mut(8);
    for chunk in &mut chunks {
        // SAFETY: a chunk holds 8 floats; unaligned accesses.
        let x = unsafe { _mm256_loadu_ps(chunk.as_ptr()) };
        let z = _mm256_mul_ps(_mm256_andnot_ps(sign, x), _mm256_set1_ps(FRAC_1_SQRT_2));
        let t = _mm256_div_ps(
            _mm256_set1_ps(1.0),
            _mm256_add_ps(_mm256_set1_ps(1.0), _mm256_mul_ps(_mm256_set1_ps(ERF_P), z)),
        );
        let mut p = _mm256_set1_ps(ERF_A[0]);
        for &a in &ERF_A[1..] {
            p = _mm256_add_ps(_mm256_mul_ps(p, t), _mm256_set1_ps(a));
        }
        let e = exp8(_mm256_xor_ps(_mm256_mul_ps(z, z), sign));
        let erfc = _mm256_mul_ps(_mm256_mul_ps(p, t), e);
        let negative = _mm256_cmp_ps::<_CMP_LT_OQ>(x, _mm256_setzero_ps());
        let one_plus_erf =
            _mm256_blendv_ps(_mm256_sub_ps(_mm256_set1_ps(2.0), erfc), erfc, negative);
        let y = _mm256_mul_ps(_mm256_mul_ps(_mm256_set1_ps(0.5), x), one_plus_erf);
        // SAFETY: as the load.
        unsafe { _mm256_storeu_ps(chunk.as_mut_ptr(), y) };
    }
    for x in chunks.into_remainder() {
        *x = gelu(*x);
    }
}

/// `x (1 + tanh(√(2/π) (x + 0.044715 x³))) / 2`, with `tanh(u) = 1 - 2 / (e^(2u) + 1)`.
#[inline(always)]
fn gelu_tanh(x: f32) -> f32 {
    const SQRT_2_OVER_PI: f32 = 0.797_884_6;
    let u = SQRT_2_OVER_PI * (x + 0.044_715 * x * x * x);
    let tanh = 1.0 - 2.0 / (exp(2.0 * u) + 1.0);
    0.5 * x * (1.0 + tanh)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn inputs() -> Vec<f32> {
        let mut xs: Vec<f32> = (-4000..=4000).map(|i| i as f32 * 0.0025).collect();
        xs.extend([-30.0, -12.0, 12.0, 30.0, 0.0, -0.0, 1e-8, -1e-8]);
        xs
    }

    #[test]
    fn gelu_is_within_2e7_of_the_exact_value_and_small_where_x_is_very_negative() {
        for x in inputs() {
            let exact = 0.5 * x as f64 * libm::erfc(-x as f64 / 2f64.sqrt());
            let ours = gelu(x) as f64;
            let error = (ours - exact).abs();
            assert!(
                error <= 2e-7 * (1.0 + x.abs() as f64),
                "gelu({x}) = {ours}, exactly {exact}"
            );
        }
        // Φ(-12) is about 2e-33: the answer is tiny and negative, not 0 from `1 - 1`.
        assert!(gelu(-5.0) < 0.0 && gelu(-5.0) > -1.5e-5, "{}", gelu(-5.0));
    }

    #[test]
    #[cfg(target_arch = "x86_64")]
    fn the_avx2_gelu_is_the_scalar_ones_bits() {
        if !is_x86_feature_detected!("avx2") {
            return;
        }
        let xs = inputs();
        let mut vector = xs.clone();
        // SAFETY: AVX2 checked above.
        unsafe { gelu_avx2(&mut vector) };
        for (x, v) in xs.iter().zip(&vector) {
            assert_eq!(gelu(*x).to_bits(), v.to_bits(), "gelu({x})");
        }
    }

    #[test]
    fn gelu_tanh_matches_its_formula_in_f64() {
        for x in inputs() {
            let x64 = x as f64;
            let exact = 0.5
                * x64
                * (1.0
                    + ((2.0 / std::f64::consts::PI).sqrt() * (x64 + 0.044715 * x64.powi(3)))
                        .tanh());
            let ours = gelu_tanh(x) as f64;
            assert!(
                (ours - exact).abs() <= 1e-6 * (1.0 + x64.abs()),
                "gelu_tanh({x}) = {ours}, {exact}"
            );
        }
    }

    #[test]
    fn layer_norm_and_softmax_match_their_definitions() {
        let width = 13;
        let rows: Vec<f32> = (0..3 * width)
            .map(|i| ((i * 37 % 11) as f32 - 4.0) * 0.7)
            .collect();
        let weight: Vec<f32> = (0..width).map(|i| 1.0 + i as f32 * 0.1).collect();
        let bias: Vec<f32> = (0..width).map(|i| i as f32 * -0.05).collect();
        let mut normed = rows.clone();
        layer_norm(&mut normed, &weight, &bias, 1e-12);
        let mut soft = rows.clone();
        softmax_rows(&mut soft, width);
        for (r, row) in rows.chunks(width).enumerate() {
            let mean = row.iter().map(|&x| x as f64).sum::<f64>() / width as f64;
            let var = row.iter().map(|&x| (x as f64 - mean).powi(2)).sum::<f64>() / width as f64;
            let max = row.iter().copied().fold(f32::MIN, f32::max) as f64;
            let total: f64 = row.iter().map(|&x| (x as f64 - max).exp()).sum();
            for (i, &x) in row.iter().enumerate() {
                let expected =
                    (x as f64 - mean) / (var + 1e-12).sqrt() * weight[i] as f64 + bias[i] as f64;
                assert!(
                    (normed[r * width + i] as f64 - expected).abs() < 1e-5,
                    "row {r} column {i}"
                );
                let expected = (x as f64 - max).exp() / total;
                assert!(
                    (soft[r * width + i] as f64 - expected).abs() < 1e-6,
                    "row {r} column {i}"
                );
            }
        }
    }

    #[test]
    fn the_product_of_a_row_block_and_a_weight_adds_to_what_was_there() {
        let (m, n, k) = (5, 7, 9);
        // `a` rows 12 apart (a column block of a wider matrix), `out` rows 10 apart.
        let a: Vec<f32> = (0..m * 12).map(|i| (i % 13) as f32 * 0.25 - 1.0).collect();
        let w: Vec<f32> = (0..k * n).map(|i| (i % 7) as f32 * 0.5 - 1.5).collect();
        let mut out = vec![1.0f32; m * 10];
        matmul(m, n, k, &a, 12, &w, &mut out, 10, true);
        for i in 0..m {
            for j in 0..10 {
                let expected = if j < n {
                    1.0 + (0..k).map(|x| a[i * 12 + x] * w[x * n + j]).sum::<f32>()
                } else {
                    1.0
                };
                assert!((out[i * 10 + j] - expected).abs() < 1e-4, "({i}, {j})");
            }
        }
    }
}

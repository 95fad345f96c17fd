//! `e^x` for f32 by one polynomial, on one value or eight AVX2 lanes with the same operations
//! in the same order (no fused multiply-adds), so the same bits on every path and CPU. libm's
//! `expf` is one call per value; the gated activation and attention's softmax take one per
//! element, and with the activation around them that was about 7 % of an eight-sequence decode
//! step.
//!
//! The method: `x = n ln 2 + r` with `n` the nearest integer to `x / ln 2` and `ln 2` split in
//! two so `r` keeps its low bits; `e^r` by a degree-7 polynomial on `|r| <= ln 2 / 2` (the
//! classic single-precision coefficients); `2^n` put into the exponent bits. Within 2 ulp of
//! the exact value (tested against f64); inputs are clamped to `[-87, 88]`, where the result is
//! a normal float, so a very negative `x` gives about 1.6e-38, not 0, and NaN gives that too.

/// Inputs are clamped to `[LOWEST, HIGHEST]`: `2^n` stays a normal float.
const LOWEST: f32 = -87.0;
const HIGHEST: f32 = 88.0;
const LOG2E: f32 = std::f32::consts::LOG2_E;
/// `ln 2` as a part exact in few bits and the rest.
const LN2_HIGH: f32 = 0.693_359_4;
const LN2_LOW: f32 = -2.121_944_4e-4;
/// `e^r ~ 1 + r + r^2 (P0 + P1 r + ... + P5 r^5)`, highest power first.
const P: [f32; 6] = [
    1.987_569_1e-4,
    1.398_199_9e-3,
    8.333_452e-3,
    4.166_579_6e-2,
    1.666_666_5e-1,
    0.5,
];

/// `e^x`.
#[inline(always)]
pub fn exp(x: f32) -> f32 {
    // The comparisons as `maxps`/`minps` make them (the second operand where either is NaN).
    let x = if x > LOWEST { x } else { LOWEST };
    let x = if x < HIGHEST { x } else { HIGHEST };
    let n = (x * LOG2E).round_ties_even();
    let r = x - n * LN2_HIGH - n * LN2_LOW;
    let mut p = P[0];
    for c in &P[1..] {
        p = p * r + c;
    }
    let y = p * (r * r) + r + 1.0;
    y * f32::from_bits(((n as i32 + 127) as u32) << 23)
}

/// [`exp`] of eight lanes.
///
/// # Safety
/// The CPU must have AVX2.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
#[inline]
pub fn exp8(x: std::arch::x86_64::__m256) -> std::arch::x86_64::__m256 {
    use std::arch::x86_64::*;
    let x = _mm256_max_ps(x, _mm256_set1_ps(LOWEST));
    let x = _mm256_min_ps(x, _mm256_set1_ps(HIGHEST));
    let n = _mm256_round_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(_mm256_mul_ps(
        x,
        _mm256_set1_ps(LOG2E),
    ));
    let r = _mm256_sub_ps(
        _mm256_sub_ps(x, _mm256_mul_ps(n, _mm256_set1_ps(LN2_HIGH))),
        _mm256_mul_ps(n, _mm256_set1_ps(LN2_LOW)),
    );
    let mut p = _mm256_set1_ps(P[0]);
    for &c in &P[1..] {
        p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(c));
    }
    let y = _mm256_add_ps(
        _mm256_add_ps(_mm256_mul_ps(p, _mm256_mul_ps(r, r)), r),
        _mm256_set1_ps(1.0),
    );
    let scale = _mm256_slli_epi32::<23>(_mm256_add_epi32(
        _mm256_cvtps_epi32(n),
        _mm256_set1_epi32(127),
    ));
    _mm256_mul_ps(y, _mm256_castsi256_ps(scale))
}

/// `values[i] = e^(values[i] - shift)` for each value: eight at a time where the CPU has AVX2,
/// the same bits either way.
pub fn exp_shifted(values: &mut [f32], shift: f32) {
    #[cfg(target_arch = "x86_64")]
    if is_x86_feature_detected!("avx2") {
        // SAFETY: the CPU has AVX2 (checked just above).
        return unsafe { exp_shifted_avx2(values, shift) };
    }
    values.iter_mut().for_each(|v| *v = exp(*v - shift));
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
fn exp_shifted_avx2(values: &mut [f32], shift: f32) {
    use std::arch::x86_64::*;
    let mut chunks = values.chunks_exact_mut(8);
    let s = _mm256_set1_ps(shift);
    for chunk in &mut chunks {
        // SAFETY: a chunk holds 8 floats; unaligned accesses.
        unsafe {
            let x = _mm256_sub_ps(_mm256_loadu_ps(chunk.as_ptr()), s);
            _mm256_storeu_ps(chunk.as_mut_ptr(), exp8(x));
        }
    }
    for v in chunks.into_remainder() {
        *v = exp(*v - shift);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Inputs across the range a softmax and an activation meet, and the edges.
    fn inputs() -> Vec<f32> {
        let mut xs: Vec<f32> = (-19_700..=20_000).map(|i| i as f32 * 0.0044).collect();
        xs.extend([
            0.0, -0.0, 1e-8, -1e-8, 0.5, -0.5, 1.0, -1.0, 80.0, -80.0, 88.0, -87.0,
        ]);
        xs
    }

    /// Units in the last place between `ours` and the exact value.
    fn ulps(ours: f32, exact: f64) -> f64 {
        let exact_f32 = exact as f32;
        let ulp = (f32::from_bits(exact_f32.to_bits() + 1) - exact_f32) as f64;
        (ours as f64 - exact).abs() / ulp
    }

    #[test]
    fn is_within_two_ulp_of_the_exact_value() {
        for x in inputs() {
            let ours = exp(x);
            let u = ulps(ours, (x as f64).exp());
            assert!(
                u <= 2.0,
                "exp({x}) = {ours}: {u} ulp from {}",
                (x as f64).exp()
            );
        }
    }

    #[test]
    fn clamps_where_the_result_would_not_be_a_normal_float() {
        assert_eq!(exp(-1000.0), exp(LOWEST));
        assert!(
            exp(LOWEST) > 0.0 && exp(LOWEST).is_normal(),
            "{}",
            exp(LOWEST)
        );
        assert!(exp(1000.0).is_finite() && exp(1000.0) > 1e38);
        assert_eq!(exp(f32::NEG_INFINITY), exp(LOWEST));
    }

    /// Eight lanes, and the values left over, are the one-value path's bits.
    #[test]
    #[cfg(target_arch = "x86_64")]
    fn the_avx2_path_is_the_scalar_ones_bits() {
        if !is_x86_feature_detected!("avx2") {
            return;
        }
        let xs = inputs();
        for shift in [0.0, 3.5, -2.25] {
            let mut vector = xs.clone();
            // SAFETY: AVX2 checked above.
            unsafe { exp_shifted_avx2(&mut vector, shift) };
            for (x, v) in xs.iter().zip(&vector) {
                assert_eq!(exp(x - shift).to_bits(), v.to_bits(), "exp({x} - {shift})");
            }
        }
    }
}

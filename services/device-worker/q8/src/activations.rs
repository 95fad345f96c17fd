//! Activation rows quantized to Q8_0 as candle quantizes them, once per matmul.

use half::f16;

use crate::{ActivationBlocks, BLOCK, JUST_BELOW_HALF};

/// Activation rows quantized to Q8_0 the way candle quantizes them.
pub(crate) struct Activations {
    pub(crate) rows: usize,
    pub(crate) quants: Vec<i8>,
    pub(crate) scales: Vec<f32>,
    /// Each block's quants added up (what the VNNI tile kernel takes off again, times 128).
    pub(crate) sums: Vec<i32>,
    /// Each block's scale times that sum: the activations' sum that Q4_1's minimums multiply.
    pub(crate) scaled_sums: Vec<f32>,
    /// The quants widened to 16 bit, for the AVX2 tile kernel (empty for the others).
    pub(crate) wide: Vec<i16>,
}

impl Activations {
    /// Each row's blocks: scale = max |x| / 127 rounded to f16, quants = round(x / scale), as
    /// candle's `BlockQ8_0::from_float` does (its dot products are what the row kernel
    /// reproduces).
    /// `wide`: also keep the quants widened to 16 bit.
    pub(crate) fn quantize(x: &[f32], rows: usize, blocks: usize, wide: bool) -> Self {
        let mut quants = vec![0i8; x.len()];
        let mut scales = Vec::with_capacity(rows * blocks);
        let mut sums = Vec::with_capacity(rows * blocks);
        let mut scaled_sums = Vec::with_capacity(rows * blocks);
        #[cfg(target_arch = "x86_64")]
        let vectors = is_x86_feature_detected!("avx2");
        for (block, q) in x.chunks_exact(BLOCK).zip(quants.chunks_exact_mut(BLOCK)) {
            #[cfg(target_arch = "x86_64")]
            let (d, sum) = if vectors {
                // SAFETY: the CPU has AVX2 (checked above).
                unsafe { crate::avx2::quantize_block(block, q) }
            } else {
                quantize_block(block, q)
            };
            #[cfg(not(target_arch = "x86_64"))]
            let (d, sum) = quantize_block(block, q);
            let d = f16::from_f32(d).to_f32();
            scales.push(d);
            sums.push(sum);
            scaled_sums.push(d * sum as f32);
        }
        let wide = if wide {
            quants.iter().map(|&q| i16::from(q)).collect()
        } else {
            Vec::new()
        };
        Self {
            rows,
            quants,
            scales,
            sums,
            scaled_sums,
            wide,
        }
    }

    /// Rows `r..r + tall` of `k` blocks each.
    pub(crate) fn blocks(&self, r: usize, tall: usize, k: usize) -> ActivationBlocks<'_> {
        ActivationBlocks {
            quants: &self.quants[r * k * BLOCK..(r + tall) * k * BLOCK],
            scales: &self.scales[r * k..(r + tall) * k],
            sums: &self.sums[r * k..(r + tall) * k],
            scaled_sums: &self.scaled_sums[r * k..(r + tall) * k],
            wide: self
                .wide
                .get(r * k * BLOCK..(r + tall) * k * BLOCK)
                .unwrap_or(&[]),
        }
    }
}

/// One block: scale = max |x| / 127 (returned before its rounding to f16), quants =
/// round(x / scale) (into `quants`), and their sum.
pub(crate) fn quantize_block(x: &[f32], quants: &mut [i8]) -> (f32, i32) {
    let amax = x.iter().fold(0f32, |a, v| a.max(v.abs()));
    let d = amax / 127.0;
    let id = if d != 0.0 { 1.0 / d } else { 0.0 };
    let mut sum = 0;
    for (q, v) in quants.iter_mut().zip(x) {
        *q = round_half_away(v * id);
        sum += *q as i32;
    }
    (d, sum)
}

/// `v.round() as i8` for |v| <= 127.5 without a call into libm per value (the hot part of
/// quantizing activations): adding the float just below one half and truncating rounds
/// halves away from zero as `round` does, and nothing else up (a value just below n + 0.5 plus
/// that float stays below n + 1 in single precision at these magnitudes).
pub(crate) fn round_half_away(v: f32) -> i8 {
    (v + JUST_BELOW_HALF.copysign(v)) as i8
}

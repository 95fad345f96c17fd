//! Q8_0 weight matrices multiplied on x86 CPUs with AVX2 and FMA, one weight row against up to
//! eight activation rows per pass.
//!
//! candle's CPU kernel computes each (activation row, weight row) dot product on its own: one
//! accumulator, whose multiply-add chain the CPU must wait on every block, two half-float scale
//! conversions per block, and each weight block loaded again for every activation row. Here a
//! pass keeps one accumulator per activation row (independent chains), loads and prepares each
//! weight block once for all of them, and reads scales converted once at load.
//!
//! Each output is still the same sequence of operations as candle's `vec_dot_q8_0_q8_0` (the
//! activation row quantized the same way, the same integer block dot products, one multiply-add
//! per block in order, the same final horizontal sum), so results are bit for bit those of
//! candle's kernel, and no row depends on what else shares the step.

use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::{Result, Tensor};
use half::f16;

const BLOCK: usize = 32;
/// Bytes of one Q8_0 block as stored: an f16 scale, then 32 signed bytes.
const BLOCK_BYTES: usize = 2 + BLOCK;

/// A Q8_0 matrix of `rows` weight rows (output features) by `blocks * 32` inputs.
pub struct Q8Matrix {
    rows: usize,
    blocks: usize,
    quants: Vec<i8>,
    scales: Vec<f32>,
}

/// Activation rows quantized to Q8_0 the way candle quantizes them.
struct Activations {
    rows: usize,
    quants: Vec<i8>,
    scales: Vec<f32>,
}

/// Whether this CPU runs the kernel (otherwise weights stay with candle's).
pub fn supported() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

impl Q8Matrix {
    /// The matrix of a Q8_0 tensor in host memory, `[rows, inputs]`; None for another type,
    /// device or CPU.
    pub fn from_qtensor(q: &QTensor) -> Result<Option<Self>> {
        if q.dtype() != GgmlDType::Q8_0 || !q.device().is_cpu() || !supported() {
            return Ok(None);
        }
        let (rows, inputs) = q.shape().dims2()?;
        if inputs % BLOCK != 0 {
            return Ok(None);
        }
        let blocks = inputs / BLOCK;
        let data = q.data()?;
        if data.len() != rows * blocks * BLOCK_BYTES {
            candle_core::bail!(
                "a Q8_0 tensor of {rows}x{inputs} holds {} bytes, not {}",
                data.len(),
                rows * blocks * BLOCK_BYTES
            );
        }
        let mut quants = Vec::with_capacity(rows * inputs);
        let mut scales = Vec::with_capacity(rows * blocks);
        for block in data.chunks_exact(BLOCK_BYTES) {
            scales.push(f16::from_le_bytes([block[0], block[1]]).to_f32());
            quants.extend(block[2..].iter().map(|&b| b as i8));
        }
        Ok(Some(Self {
            rows,
            blocks,
            quants,
            scales,
        }))
    }

    /// `x @ self^T` for `x` of shape `[m, inputs]` (f32): `[m, rows]`.
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let (m, inputs) = x.dims2()?;
        if inputs != self.blocks * BLOCK {
            candle_core::bail!(
                "a Q8_0 matmul over {} inputs got rows of {inputs}",
                self.blocks * BLOCK
            );
        }
        let x = x.flatten_all()?.to_vec1::<f32>()?;
        let acts = Activations::quantize(&x, m, self.blocks);
        // Work items are weight rows; each range computes its outputs for every activation row
        // into a part of its own (`[m][cols]`), and the parts' rows are copied into place after:
        // whole runs of an output row rather than one strided store per value.
        let parts = std::sync::Mutex::new(Vec::new());
        candle_core::utils::barrier_pool().execute_chunked(self.rows, |cols| {
            let mut part = vec![0f32; cols.len() * m];
            self.columns(&acts, cols.clone(), &mut part);
            parts
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .push((cols, part));
        });
        let mut out = vec![0f32; m * self.rows];
        for (cols, part) in parts.into_inner().unwrap_or_else(|e| e.into_inner()) {
            for (r, values) in part.chunks_exact(cols.len()).enumerate() {
                out[r * self.rows + cols.start..r * self.rows + cols.end].copy_from_slice(values);
            }
        }
        Tensor::from_vec(out, (m, self.rows), &candle_core::Device::Cpu)
    }

    /// Outputs of weight rows `cols` for every activation row into `dst` (`[m][cols]`).
    fn columns(&self, acts: &Activations, cols: std::ops::Range<usize>, dst: &mut [f32]) {
        let (m, k, width) = (acts.rows, self.blocks, cols.len());
        let mut values = [0f32; TALL];
        for (i, c) in cols.enumerate() {
            let w = Operand {
                quants: &self.quants[c * k * BLOCK..(c + 1) * k * BLOCK],
                scales: &self.scales[c * k..(c + 1) * k],
            };
            let mut r = 0;
            while r < m {
                let tall = (m - r).min(TALL);
                let x = Operand {
                    quants: &acts.quants[r * k * BLOCK..(r + tall) * k * BLOCK],
                    scales: &acts.scales[r * k..(r + tall) * k],
                };
                tile(k, &w, &x, &mut values[..tall]);
                for (j, &v) in values[..tall].iter().enumerate() {
                    dst[(r + j) * width + i] = v;
                }
                r += tall;
            }
        }
    }
}

impl Activations {
    /// Each row's blocks: scale = max |x| / 127 rounded to f16, quants = round(x / scale), as
    /// candle's `BlockQ8_0::from_float` does (its dot products are what we reproduce).
    fn quantize(x: &[f32], rows: usize, blocks: usize) -> Self {
        let mut quants = Vec::with_capacity(x.len());
        let mut scales = Vec::with_capacity(rows * blocks);
        for block in x.chunks_exact(BLOCK) {
            let amax = block.iter().fold(0f32, |a, v| a.max(v.abs()));
            let d = amax / 127.0;
            let id = if d != 0.0 { 1.0 / d } else { 0.0 };
            scales.push(f16::from_f32(d).to_f32());
            quants.extend(block.iter().map(|v| round_half_away(v * id)));
        }
        Self {
            rows,
            quants,
            scales,
        }
    }
}

/// `v.round() as i8` for |v| <= 127.5 without a call into libm per value (the hot part of
/// quantizing activations): adding the float just below one half and truncating rounds
/// halves away from zero as `round` does, and nothing else up (a value just below n + 0.5 plus
/// that float stays below n + 1 in single precision at these magnitudes).
fn round_half_away(v: f32) -> i8 {
    const JUST_BELOW_HALF: f32 = 0.5f32.next_down();
    (v + JUST_BELOW_HALF.copysign(v)) as i8
}

/// Activation rows one pass takes against a weight row.
const TALL: usize = 8;

/// Some rows of blocks: `quants[row][block][32]`, `scales[row][block]`.
struct Operand<'a> {
    quants: &'a [i8],
    scales: &'a [f32],
}

/// One weight row against up to `TALL` activation rows: `dst[r]` for activation row r.
fn tile(k: usize, w: &Operand<'_>, x: &Operand<'_>, dst: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: a Q8Matrix exists only where `supported()` held (AVX2 and FMA present); the
    // kernel checks the operands' lengths before reading.
    unsafe {
        match dst.len() {
            1 => avx2::tile::<1>(k, w, x, dst),
            2 => avx2::tile::<2>(k, w, x, dst),
            3 => avx2::tile::<3>(k, w, x, dst),
            4 => avx2::tile::<4>(k, w, x, dst),
            5 => avx2::tile::<5>(k, w, x, dst),
            6 => avx2::tile::<6>(k, w, x, dst),
            7 => avx2::tile::<7>(k, w, x, dst),
            _ => avx2::tile::<TALL>(k, w, x, dst),
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    unreachable!(
        "Q8Matrix is only built where its kernel runs ({k} {} {} {})",
        w.scales.len(),
        x.scales.len(),
        dst.len()
    );
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use super::{BLOCK, Operand};
    use std::arch::x86_64::*;

    /// One weight row against `R` activation rows over `k` blocks, into `dst[..R]`. One weight
    /// stream and `R` independent accumulators: on the machines measured, reading several
    /// weight rows at once was slower than reading one (BENCHMARKS.md).
    ///
    /// # Safety
    /// The CPU must have AVX2 and FMA.
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn tile<const R: usize>(
        k: usize,
        w: &Operand<'_>,
        x: &Operand<'_>,
        dst: &mut [f32],
    ) {
        assert!(w.quants.len() == k * BLOCK && w.scales.len() == k);
        assert!(x.quants.len() == R * k * BLOCK && x.scales.len() == R * k);
        assert!(dst.len() == R);
        let ones = _mm256_set1_epi16(1);
        let mut acc = [_mm256_setzero_ps(); R];
        let (wq, ws) = (w.quants.as_ptr(), w.scales.as_ptr());
        let (xq, xs) = (x.quants.as_ptr(), x.scales.as_ptr());
        for b in 0..k {
            // SAFETY: block b of the weight row and of each activation row r < R lies inside
            // the operands (lengths asserted above); unaligned loads.
            unsafe {
                let weights = _mm256_loadu_si256(wq.add(b * BLOCK).cast());
                let magnitudes = _mm256_sign_epi8(weights, weights);
                let dw = _mm256_broadcast_ss(&*ws.add(b));
                for (r, acc) in acc.iter_mut().enumerate() {
                    let a = _mm256_loadu_si256(xq.add((r * k + b) * BLOCK).cast());
                    let pairs = _mm256_maddubs_epi16(magnitudes, _mm256_sign_epi8(a, weights));
                    let sums = _mm256_cvtepi32_ps(_mm256_madd_epi16(ones, pairs));
                    // The same product as candle's scalar one, in every lane.
                    let d = _mm256_mul_ps(dw, _mm256_broadcast_ss(&*xs.add(r * k + b)));
                    *acc = _mm256_fmadd_ps(d, sums, *acc);
                }
            }
        }
        for (out, &v) in dst.iter_mut().zip(&acc) {
            *out = hsum(v);
        }
    }

    #[target_feature(enable = "avx2,fma")]
    fn hsum(x: __m256) -> f32 {
        let s = _mm_add_ps(_mm256_extractf128_ps(x, 1), _mm256_castps256_ps128(x));
        let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
        _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::quantized::QMatMul;
    use candle_core::{Device, Module};

    fn numbers(count: usize, seed: u32) -> Vec<f32> {
        let mut x = seed.wrapping_mul(2_654_435_761).max(1);
        (0..count)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 17;
                x ^= x << 5;
                (x % 20_000) as f32 / 10_000.0 - 1.0
            })
            .collect()
    }

    /// Bit for bit candle's own Q8_0 matmul, for every row count up to past two full passes
    /// (m = 1..=17 with passes of 8 rows).
    #[test]
    fn equals_candles_kernel_bit_for_bit() {
        if !supported() {
            eprintln!("no AVX2+FMA here: the kernel is not used, nothing to compare");
            return;
        }
        let (n, k) = (15, 96);
        let w = Tensor::from_vec(numbers(n * k, 7), (n, k), &Device::Cpu).unwrap();
        let q = QTensor::quantize(&w, GgmlDType::Q8_0).unwrap();
        let ours = Q8Matrix::from_qtensor(&q)
            .unwrap()
            .expect("a Q8_0 host tensor");
        let theirs = QMatMul::from_qtensor(q).unwrap();
        for m in 1..=17 {
            let mut x = numbers(m * k, 100 + m as u32);
            x[3] = 0.0; // a block with a zero is fine; so is a whole zero block:
            x[k - BLOCK..k].fill(0.0);
            let x = Tensor::from_vec(x, (m, k), &Device::Cpu).unwrap();
            let a = ours.forward(&x).unwrap().to_vec2::<f32>().unwrap();
            let b = theirs.forward(&x).unwrap().to_vec2::<f32>().unwrap();
            for (i, (ra, rb)) in a.iter().zip(&b).enumerate() {
                for (j, (va, vb)) in ra.iter().zip(rb).enumerate() {
                    assert_eq!(
                        va.to_bits(),
                        vb.to_bits(),
                        "m {m}, row {i}, col {j}: {va} vs {vb}"
                    );
                }
            }
        }
    }

    /// The quantizer's rounding is `round` on every half, its neighbours and a sweep between.
    #[test]
    fn rounds_halves_away_from_zero_like_round() {
        let mut values: Vec<f32> = (-255..=255).map(|h| h as f32 / 2.0).collect();
        for v in values.clone() {
            values.extend([
                v.next_up(),
                v.next_down(),
                v.next_up().next_up(),
                v.next_down().next_down(),
            ]);
        }
        values.extend(numbers(200_000, 9).iter().map(|v| v * 127.0));
        for v in values.into_iter().filter(|v| v.abs() <= 127.5) {
            assert_eq!(round_half_away(v), v.round() as i8, "{v:e}");
        }
    }

    #[test]
    fn refuses_rows_of_the_wrong_width_and_skips_other_types() {
        let w = Tensor::from_vec(numbers(4 * 64, 3), (4, 64), &Device::Cpu).unwrap();
        let q4 = QTensor::quantize(&w, GgmlDType::Q4_0).unwrap();
        assert!(Q8Matrix::from_qtensor(&q4).unwrap().is_none());
        if let Some(m) =
            Q8Matrix::from_qtensor(&QTensor::quantize(&w, GgmlDType::Q8_0).unwrap()).unwrap()
        {
            let x = Tensor::zeros((2, 32), candle_core::DType::F32, &Device::Cpu).unwrap();
            let e = m.forward(&x).unwrap_err().to_string();
            assert!(e.contains("over 64 inputs got rows of 32"), "{e}");
        }
    }
}

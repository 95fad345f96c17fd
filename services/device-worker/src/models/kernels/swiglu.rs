//! The gated activation of a llama feed-forward block, `silu(gate) * up`, on the CPU in one
//! pass split over candle's matmul threads: per element candle's `silu` followed by `mul`
//! (`g / (1 + e^-g) * u`) with the exponential of `exp.rs` (eight lanes at a time, within 2 ulp
//! of libm's), without the tensor between them, and on every matmul thread where candle's
//! element-wise operations run on one (the worker's rayon pool).

use std::mem::MaybeUninit;
use std::sync::Mutex;

use candle_core::{DType, Layout, Result, Storage, Tensor};

use crate::models::kernels::exp::exp;
#[cfg(target_arch = "x86_64")]
use crate::models::kernels::exp::exp8;

/// Elements one work item computes at most.
const PIECE: usize = 4096;

/// `silu(gate) * up`, both `[rows, width]`; their rows may be views into wider rows (the gate
/// and up projections stacked), read in place.
pub fn swiglu(gate: &Tensor, up: &Tensor) -> Result<Tensor> {
    let host = gate.device().is_cpu() && gate.dtype() == DType::F32 && up.dtype() == DType::F32;
    if !host || gate.shape() != up.shape() || gate.rank() != 2 {
        return candle_nn::ops::silu(gate)? * up;
    }
    let (rows, width) = gate.dims2()?;
    let (gate, up) = (unit_stride(gate)?, unit_stride(up)?);
    let (g_storage, g_layout) = gate.storage_and_layout();
    let (u_storage, u_layout) = up.storage_and_layout();
    let (Storage::Cpu(g), Storage::Cpu(u)) = (&*g_storage, &*u_storage) else {
        candle_core::bail!("swiglu runs on CPU tensors only")
    };
    let (g, u) = (g.as_slice::<f32>()?, u.as_slice::<f32>()?);
    // Not zeroed first: every element is written by one piece below.
    let mut out: Vec<f32> = Vec::with_capacity(rows * width);
    // Work items are pieces of rows: (output, gate, up), each the same elements.
    let mut pieces = Vec::new();
    let spare = &mut out.spare_capacity_mut()[..rows * width];
    for (r, out_row) in spare.chunks_mut(width.max(1)).enumerate() {
        let (g, u) = (row(g, g_layout, r, width)?, row(u, u_layout, r, width)?);
        for ((y, g), u) in out_row
            .chunks_mut(PIECE)
            .zip(g.chunks(PIECE))
            .zip(u.chunks(PIECE))
        {
            pieces.push((y, g, u));
        }
    }
    let count = pieces.len();
    let pieces = Mutex::new(pieces);
    candle_core::utils::barrier_pool().execute_chunked(count, |items| {
        for _ in items {
            let Some((y, g, u)) = pieces.lock().unwrap_or_else(|e| e.into_inner()).pop() else {
                return;
            };
            silu_mul(y, g, u);
        }
    });
    // SAFETY: the pass took every piece (one per item), and the pieces cover all of `out`.
    unsafe { out.set_len(rows * width) };
    Tensor::from_vec(out, (rows, width), gate.device())
}

/// `y = silu(g) * u = g / (1 + e^-g) * u` element by element: eight at a time where the CPU
/// has AVX2, the same operations (so the same bits) either way.
fn silu_mul(y: &mut [MaybeUninit<f32>], g: &[f32], u: &[f32]) {
    #[cfg(target_arch = "x86_64")]
    if is_x86_feature_detected!("avx2") {
        // SAFETY: the CPU has AVX2 (checked just above).
        return unsafe { silu_mul_avx2(y, g, u) };
    }
    silu_mul_portable(y, g, u)
}

fn silu_mul_portable(y: &mut [MaybeUninit<f32>], g: &[f32], u: &[f32]) {
    for ((y, &g), &u) in y.iter_mut().zip(g).zip(u) {
        y.write(g / (1.0 + exp(-g)) * u);
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
fn silu_mul_avx2(y: &mut [MaybeUninit<f32>], g: &[f32], u: &[f32]) {
    use std::arch::x86_64::*;
    let n = y.len().min(g.len()).min(u.len());
    let (y, g, u) = (&mut y[..n], &g[..n], &u[..n]);
    let full = n - n % 8;
    let (sign, one) = (_mm256_set1_ps(-0.0), _mm256_set1_ps(1.0));
    for at in (0..full).step_by(8) {
        // SAFETY: at + 8 <= full <= n, the length of all three; unaligned accesses.
        unsafe {
            let gv = _mm256_loadu_ps(g.as_ptr().add(at));
            let uv = _mm256_loadu_ps(u.as_ptr().add(at));
            let e = exp8(_mm256_xor_ps(gv, sign));
            let out = _mm256_mul_ps(_mm256_div_ps(gv, _mm256_add_ps(one, e)), uv);
            _mm256_storeu_ps(y.as_mut_ptr().add(at).cast(), out);
        }
    }
    silu_mul_portable(&mut y[full..], &g[full..], &u[full..]);
}

/// Row `r` (`width` values) of a tensor of unit stride along its rows.
fn row<'a>(data: &'a [f32], layout: &Layout, r: usize, width: usize) -> Result<&'a [f32]> {
    let at = layout.start_offset() + r * layout.stride()[0];
    data.get(at..at + width)
        .ok_or_else(|| candle_core::Error::Msg("swiglu: a row outside its storage".into()))
}

/// `t` with unit stride along its rows: itself, or a contiguous copy.
fn unit_stride(t: &Tensor) -> Result<Tensor> {
    if t.stride()[1] == 1 {
        Ok(t.clone())
    } else {
        t.contiguous()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    #[test]
    fn is_candles_silu_then_mul_within_float_rounding() {
        // Rows of a decode step and a prompt chunk; an odd size leaves a short last piece. Gate
        // and up as the stacked projection gives them: views into rows of both.
        for (rows, width) in [(1, 1536), (8, 1536), (3, 5000), (2, 13)] {
            let stacked = Tensor::randn(0f32, 2.0, (rows, 2 * width), &Device::Cpu).unwrap();
            let gate = stacked.narrow(1, 0, width).unwrap();
            let up = stacked.narrow(1, width, width).unwrap();
            let shape = (rows, width);
            let ours = swiglu(&gate, &up).unwrap().flatten_all().unwrap();
            let theirs = (candle_nn::ops::silu(&gate).unwrap() * &up)
                .unwrap()
                .flatten_all()
                .unwrap();
            let (ours, theirs) = (
                ours.to_vec1::<f32>().unwrap(),
                theirs.to_vec1::<f32>().unwrap(),
            );
            assert_eq!(ours.len(), rows * width);
            for (i, (a, b)) in ours.iter().zip(&theirs).enumerate() {
                // Two roundings of the exponential apart at most, through a division and a
                // product: a few parts in ten million.
                let bound = 4e-7 * b.abs().max(1e-30);
                assert!((a - b).abs() <= bound, "{shape:?} element {i}: {a} vs {b}");
            }
        }
    }

    /// Eight lanes at a time, and the elements left over, are the portable path's bits.
    #[test]
    #[cfg(target_arch = "x86_64")]
    fn the_avx2_path_is_the_portable_ones_bits() {
        if !is_x86_feature_detected!("avx2") {
            return;
        }
        let values =
            |seed: f32| -> Vec<f32> { (0..1003).map(|i| (i as f32 * seed).sin() * 9.0).collect() };
        let (g, u) = (values(0.37), values(1.91));
        let mut a = vec![MaybeUninit::new(0f32); g.len()];
        let mut b = a.clone();
        silu_mul_portable(&mut a, &g, &u);
        // SAFETY: AVX2 checked above.
        unsafe { silu_mul_avx2(&mut b, &g, &u) };
        // SAFETY: both were written whole just above.
        let bits = |v: &[MaybeUninit<f32>]| -> Vec<u32> {
            v.iter()
                .map(|x| unsafe { x.assume_init() }.to_bits())
                .collect()
        };
        assert_eq!(bits(&a), bits(&b));
    }
}

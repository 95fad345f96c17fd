//! The gated activation of a llama feed-forward block, `silu(gate) * up`, on the CPU in one
//! pass split over candle's matmul threads: per element the same operations as candle's `silu`
//! followed by `mul` (so the same bits), without the tensor between them, and on every matmul
//! thread where candle's element-wise operations run on one (the worker's rayon pool).

use std::sync::Mutex;

use candle_core::{DType, Result, Storage, Tensor};

/// Elements one work item computes.
const PIECE: usize = 4096;

/// `silu(gate) * up`, both of one shape.
pub fn swiglu(gate: &Tensor, up: &Tensor) -> Result<Tensor> {
    let host = gate.device().is_cpu() && gate.dtype() == DType::F32 && up.dtype() == DType::F32;
    if !host || gate.shape() != up.shape() {
        return candle_nn::ops::silu(gate)? * up;
    }
    let (gate, up) = (gate.contiguous()?, up.contiguous()?);
    let (g_storage, g_layout) = gate.storage_and_layout();
    let (u_storage, u_layout) = up.storage_and_layout();
    let (Storage::Cpu(g), Storage::Cpu(u)) = (&*g_storage, &*u_storage) else {
        candle_core::bail!("swiglu runs on CPU tensors only")
    };
    let len = gate.elem_count();
    let g = &g.as_slice::<f32>()?[g_layout.start_offset()..][..len];
    let u = &u.as_slice::<f32>()?[u_layout.start_offset()..][..len];
    let mut out = vec![0f32; len];
    let pieces = Mutex::new(out.chunks_mut(PIECE).enumerate().collect::<Vec<_>>());
    candle_core::utils::barrier_pool().execute_chunked(len.div_ceil(PIECE), |items| {
        for _ in items {
            let Some((i, piece)) = pieces.lock().unwrap_or_else(|e| e.into_inner()).pop() else {
                return;
            };
            let (g, u) = (&g[i * PIECE..], &u[i * PIECE..]);
            for ((y, &g), &u) in piece.iter_mut().zip(g).zip(u) {
                *y = g / (1.0 + (-g).exp()) * u;
            }
        }
    });
    Tensor::from_vec(out, gate.shape(), gate.device())
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    #[test]
    fn is_candles_silu_then_mul_bit_for_bit() {
        // Rows of a decode step and a prompt chunk; an odd size leaves a short last piece.
        for shape in [(1, 1536), (8, 1536), (3, 2731)] {
            let gate = Tensor::randn(0f32, 3.0, shape, &Device::Cpu).unwrap();
            let up = Tensor::randn(0f32, 1.0, shape, &Device::Cpu).unwrap();
            let ours = swiglu(&gate, &up).unwrap().flatten_all().unwrap();
            let theirs = (candle_nn::ops::silu(&gate).unwrap() * &up)
                .unwrap()
                .flatten_all()
                .unwrap();
            let bits = |t: &Tensor| {
                t.to_vec1::<f32>()
                    .unwrap()
                    .iter()
                    .map(|x| x.to_bits())
                    .collect::<Vec<_>>()
            };
            assert_eq!(bits(&ours), bits(&theirs), "{shape:?}");
        }
    }
}

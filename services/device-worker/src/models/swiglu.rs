//! The gated activation of a llama feed-forward block, `silu(gate) * up`, on the CPU in one
//! pass split over candle's matmul threads: per element the same operations as candle's `silu`
//! followed by `mul` (so the same bits), without the tensor between them, and on every matmul
//! thread where candle's element-wise operations run on one (the worker's rayon pool).

use std::sync::Mutex;

use candle_core::{DType, Layout, Result, Storage, Tensor};

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
            for ((y, &g), &u) in y.iter_mut().zip(g).zip(u) {
                y.write(g / (1.0 + (-g).exp()) * u);
            }
        }
    });
    // SAFETY: the pass took every piece (one per item), and the pieces cover all of `out`.
    unsafe { out.set_len(rows * width) };
    Tensor::from_vec(out, (rows, width), gate.device())
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
    fn is_candles_silu_then_mul_bit_for_bit() {
        // Rows of a decode step and a prompt chunk; an odd size leaves a short last piece. Gate
        // and up as the stacked projection gives them: views into rows of both.
        for (rows, width) in [(1, 1536), (8, 1536), (3, 5000)] {
            let stacked = Tensor::randn(0f32, 2.0, (rows, 2 * width), &Device::Cpu).unwrap();
            let gate = stacked.narrow(1, 0, width).unwrap();
            let up = stacked.narrow(1, width, width).unwrap();
            let shape = (rows, width);
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

//! The tile kernel on CPUs with AVX-512 VNNI: eight weight rows (a tile) against up to eight
//! activation rows per pass, each output its own vector lane.
//!
//! A tile stores its rows interleaved four bytes at a time, so one 32-byte load holds the same
//! four inputs of all eight rows, and one `vpdpbusd` adds four products of each into that row's
//! lane. A block's integer sums are then complete in their lanes: one conversion and one
//! multiply-add give eight outputs, where the row kernel spends them on one. `vpdpbusd` takes
//! its first operand unsigned, so weights are stored plus 128 and each activation block's sum
//! times 128 is taken off again (integers: exact).
//!
//! Every output is `sum over blocks b, in order, of (dw_b * dx_b) * isum_b` with one rounding per
//! multiply-add: the same operations whatever rows or tiles share the pass.
//!
//! The Q4_1 kernel (`q4_tile`) takes the AVX2 Q4_1 tiles as they are: their 4-bit values are
//! unsigned already, so no offset is added or taken off.

use super::{
    ActivationBlocks, BLOCK, Q4_TILE_BLOCK, Q4TileBlocks, TILE, TILE_BLOCK, TileBlocks,
    prefetch_ahead,
};
use std::arch::x86_64::*;

/// One tile against `R` activation rows over `k` blocks: `dst[r]` holds activation row r's
/// outputs for the tile's eight weight rows.
///
/// # Safety
/// The CPU must have AVX2, FMA, F16C, AVX-512F, AVX-512VL and AVX-512 VNNI.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512vl,avx512vnni")]
pub unsafe fn tile<const R: usize>(
    k: usize,
    w: &TileBlocks<'_>,
    x: &ActivationBlocks<'_>,
    dst: &mut [[f32; TILE]],
) {
    assert!(w.quants.len() == k * TILE_BLOCK && w.scales.len() == k * TILE);
    assert!(x.quants.len() == R * k * BLOCK && x.scales.len() == R * k && x.sums.len() == R * k);
    assert!(dst.len() == R);
    let mut acc = [_mm256_setzero_ps(); R];
    let (wq, ws) = (w.quants.as_ptr(), w.scales.as_ptr());
    let (xq, xs, xsum) = (x.quants.as_ptr(), x.scales.as_ptr(), x.sums.as_ptr());
    for b in 0..k {
        // SAFETY: block b of the tile and of each activation row r < R lies inside the
        // operands (lengths asserted above); unaligned loads.
        unsafe {
            let block = wq.add(b * TILE_BLOCK);
            prefetch_ahead(block, TILE_BLOCK);
            let weights: [__m256i; 8] =
                std::array::from_fn(|g| _mm256_loadu_si256(block.add(g * 32).cast()));
            let dw = _mm256_cvtph_ps(_mm_loadu_si128(ws.add(b * TILE).cast()));
            for (r, acc) in acc.iter_mut().enumerate() {
                let at = r * k + b;
                let inputs = xq.add(at * BLOCK).cast::<i32>();
                let four = |g: usize| _mm256_set1_epi32(inputs.add(g).read_unaligned());
                // Two chains of four, so the adds do not all wait on each other.
                let mut even = _mm256_set1_epi32(-128 * *xsum.add(at));
                let mut odd = _mm256_setzero_si256();
                for g in (0..8).step_by(2) {
                    even = _mm256_dpbusd_epi32(even, weights[g], four(g));
                    odd = _mm256_dpbusd_epi32(odd, weights[g + 1], four(g + 1));
                }
                let sums = _mm256_cvtepi32_ps(_mm256_add_epi32(even, odd));
                let d = _mm256_mul_ps(dw, _mm256_set1_ps(*xs.add(at)));
                *acc = _mm256_fmadd_ps(d, sums, *acc);
            }
        }
    }
    for (out, acc) in dst.iter_mut().zip(acc) {
        // SAFETY: `out` is 8 f32s; unaligned store.
        unsafe { _mm256_storeu_ps(out.as_mut_ptr(), acc) };
    }
}

/// One Q4_1 tile against `R` activation rows over `k` blocks, as `avx2::q4_tile` computes it
/// (the same bits): `vpdpbusd` takes the unsigned 4-bit values as they are, so a group of four
/// inputs of eight rows costs one instruction per activation row, whose broadcast operand
/// comes from memory.
///
/// # Safety
/// The CPU must have AVX2, FMA, F16C, AVX-512F, AVX-512VL and AVX-512 VNNI.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512vl,avx512vnni")]
pub unsafe fn q4_tile<const R: usize>(
    k: usize,
    w: &Q4TileBlocks<'_>,
    x: &ActivationBlocks<'_>,
    dst: &mut [[f32; TILE]],
) {
    let low = _mm256_set1_epi8(0x0f);
    let (wq, xq) = (w.quants.as_ptr(), x.quants.as_ptr());
    // SAFETY: the CPU has what this function enables (the caller's promise); `q4_tiles`
    // checks the operands' lengths before it asks for block b, and block b of the tile and of
    // each activation row r < R lies inside them; unaligned loads.
    unsafe {
        super::avx2::q4_tiles::<R>(k, w, x, dst, |b| {
            let block = wq.add(b * Q4_TILE_BLOCK);
            let four = |r: usize, at: usize| {
                let inputs = xq.add((r * k + b) * BLOCK + at);
                _mm256_set1_epi32(inputs.cast::<i32>().read_unaligned())
            };
            // Low halves (inputs 4g..) and high halves (16 + 4g..) in chains of their own.
            let mut lows = [_mm256_setzero_si256(); R];
            let mut highs = [_mm256_setzero_si256(); R];
            for g in 0..4 {
                let v = _mm256_loadu_si256(block.add(g * 32).cast());
                let (lo, hi) = (
                    _mm256_and_si256(v, low),
                    _mm256_and_si256(_mm256_srli_epi16(v, 4), low),
                );
                for r in 0..R {
                    lows[r] = _mm256_dpbusd_epi32(lows[r], lo, four(r, 4 * g));
                    highs[r] = _mm256_dpbusd_epi32(highs[r], hi, four(r, 16 + 4 * g));
                }
            }
            std::array::from_fn(|r| _mm256_add_epi32(lows[r], highs[r]))
        })
    }
}

//! Kernels for CPUs with AVX2 and FMA: the row kernel, one weight row against up to eight
//! activation rows per pass, each output the same sequence of operations as candle's
//! `vec_dot_q8_0_q8_0` (so bit for bit candle's); the tile kernel (eight weight rows, each
//! output a lane, as `vnni.rs` describes) on 16-bit products; and the activation quantizer.

use super::{
    ActivationBlocks, BLOCK, Q4_TILE_BLOCK, Q4TileBlocks, RowBlocks, TILE, TILE_BLOCK, TileBlocks,
    prefetch_ahead,
};
use std::arch::x86_64::*;

/// One weight row against `R` activation rows over `k` blocks, into `dst[..R]`. One weight
/// stream and `R` independent accumulators: on the machines measured, reading several
/// weight rows at once was slower than reading one (docs/perf-log.md).
///
/// # Safety
/// The CPU must have AVX2 and FMA.
#[target_feature(enable = "avx2,fma")]
pub unsafe fn row<const R: usize>(k: usize, w: &RowBlocks<'_>, x: &RowBlocks<'_>, dst: &mut [f32]) {
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
            prefetch_ahead(wq.add(b * BLOCK).cast(), BLOCK);
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

/// One tile against `R` activation rows over `k` blocks: `dst[r]` holds activation row r's
/// outputs for the tile's eight rows, the same bits as `vnni::tile`. Without `vpdpbusd`, the
/// weights are laid out two inputs at a time (`quants[block][pair][row][2]`, signed): a pair
/// of inputs of all eight rows is 16 bytes, which `vpmovsxbw` widens to 16 bit once for every
/// activation row of the pass, and one `vpmaddwd` against the activation pair (widened when
/// quantized) adds two products into each row's lane. That is two multiplying instructions per
/// four products, where the byte instructions take three (`vpsignb`, `vpmaddubsw`, `vpmaddwd`
/// share the same two pipes on the CPUs measured). A block's integer sums are exact either way.
///
/// # Safety
/// The CPU must have AVX2, FMA and F16C.
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn tile<const R: usize>(
    k: usize,
    w: &TileBlocks<'_>,
    x: &ActivationBlocks<'_>,
    dst: &mut [[f32; TILE]],
) {
    assert!(w.quants.len() == k * TILE_BLOCK && w.scales.len() == k * TILE);
    assert!(x.wide.len() == R * k * BLOCK && x.scales.len() == R * k);
    assert!(dst.len() == R);
    let mut acc = [_mm256_setzero_ps(); R];
    let (wq, ws) = (w.quants.as_ptr(), w.scales.as_ptr());
    let (xw, xs) = (x.wide.as_ptr(), x.scales.as_ptr());
    for b in 0..k {
        // SAFETY: block b of the tile and of each activation row r < R lies inside the
        // operands (lengths asserted above); unaligned loads.
        unsafe {
            let block = wq.add(b * TILE_BLOCK);
            prefetch_ahead(block.cast(), TILE_BLOCK);
            let pair = |p: usize| _mm256_cvtepi8_epi16(_mm_loadu_si128(block.add(p * 16).cast()));
            let two = |r: usize, p: usize| {
                _mm256_set1_epi32(
                    xw.add((r * k + b) * BLOCK + 2 * p)
                        .cast::<i32>()
                        .read_unaligned(),
                )
            };
            let mut sums = [_mm256_setzero_si256(); R];
            // Pairs two at a time: each row's chain takes one add per four products.
            for p in (0..BLOCK / 2).step_by(2) {
                let (w0, w1) = (pair(p), pair(p + 1));
                for (r, sum) in sums.iter_mut().enumerate() {
                    let four = _mm256_add_epi32(
                        _mm256_madd_epi16(w0, two(r, p)),
                        _mm256_madd_epi16(w1, two(r, p + 1)),
                    );
                    *sum = _mm256_add_epi32(*sum, four);
                }
            }
            let dw = _mm256_cvtph_ps(_mm_loadu_si128(ws.add(b * TILE).cast()));
            for (r, (acc, sum)) in acc.iter_mut().zip(sums).enumerate() {
                let d = _mm256_mul_ps(dw, _mm256_set1_ps(*xs.add(r * k + b)));
                *acc = _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(sum), *acc);
            }
        }
    }
    for (out, acc) in dst.iter_mut().zip(acc) {
        // SAFETY: `out` is 8 f32s; unaligned store.
        unsafe { _mm256_storeu_ps(out.as_mut_ptr(), acc) };
    }
}

/// One Q4_1 tile (eight weight rows, each output a lane) against `R` activation rows over `k`
/// blocks: `dst[r]` holds activation row r's outputs for the tile's eight rows. A weight is
/// `d * q + m` with q in 0..16, so a block's part is `(d * dx) * sum(q * a) + m * (dx * sum(a))`:
/// the first sum from `vpmaddubsw` on the unsigned values (no sign step), eight of whose 16-bit
/// pair sums add up without overflow (8 x 2 x 15 x 127 = 30480) before one `vpmaddwd`
/// widens them; the second is the activation block's scaled sum, kept when quantizing. Integer
/// sums are exact and each output's operations are the same whatever shares the pass.
///
/// # Safety
/// The CPU must have AVX2, FMA and F16C.
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn q4_tile<const R: usize>(
    k: usize,
    w: &Q4TileBlocks<'_>,
    x: &ActivationBlocks<'_>,
    dst: &mut [[f32; TILE]],
) {
    let (low, ones) = (_mm256_set1_epi8(0x0f), _mm256_set1_epi16(1));
    let (wq, xq) = (w.quants.as_ptr(), x.quants.as_ptr());
    // SAFETY: the CPU has AVX2, FMA and F16C (the caller's promise); `q4_tiles` checks the
    // operands' lengths before it asks for block b, and block b of the tile and of each
    // activation row r < R lies inside them; unaligned loads.
    unsafe {
        q4_tiles(k, w, x, dst, |b| {
            let block = wq.add(b * Q4_TILE_BLOCK);
            let four = |r: usize, at: usize| {
                let inputs = xq.add((r * k + b) * BLOCK + at);
                _mm256_set1_epi32(inputs.cast::<i32>().read_unaligned())
            };
            let mut sums = [_mm256_setzero_si256(); R];
            for g in 0..4 {
                let v = _mm256_loadu_si256(block.add(g * 32).cast());
                let (lo, hi) = (
                    _mm256_and_si256(v, low),
                    _mm256_and_si256(_mm256_srli_epi16(v, 4), low),
                );
                for (r, sum) in sums.iter_mut().enumerate() {
                    let pairs = _mm256_add_epi16(
                        _mm256_maddubs_epi16(lo, four(r, 4 * g)),
                        _mm256_maddubs_epi16(hi, four(r, 16 + 4 * g)),
                    );
                    *sum = _mm256_add_epi16(*sum, pairs);
                }
            }
            sums.map(|sum| _mm256_madd_epi16(sum, ones))
        })
    }
}

/// What both Q4_1 tile kernels share, one function so that they give the same bits: the
/// operands' checks, the walk over blocks with its prefetch, and each block's part
/// `(d * dx) * dots + m * (dx * sum)` added to each activation row's outputs. `block_dots(b)`
/// gives block b's exact integer dot products: for each activation row, one register of the
/// tile's eight rows.
///
/// # Safety
/// The CPU must have AVX2, FMA and F16C, and what `block_dots` uses.
#[inline(always)]
pub(super) unsafe fn q4_tiles<const R: usize>(
    k: usize,
    w: &Q4TileBlocks<'_>,
    x: &ActivationBlocks<'_>,
    dst: &mut [[f32; TILE]],
    block_dots: impl Fn(usize) -> [__m256i; R],
) {
    assert!(w.quants.len() == k * Q4_TILE_BLOCK);
    assert!(w.scales.len() == k * TILE && w.mins.len() == k * TILE);
    assert!(x.quants.len() == R * k * BLOCK && x.scales.len() == R * k);
    assert!(x.scaled_sums.len() == R * k && dst.len() == R);
    // SAFETY: the CPU has AVX (the caller's promise).
    let mut acc = [unsafe { _mm256_setzero_ps() }; R];
    let (wq, ws, wm) = (w.quants.as_ptr(), w.scales.as_ptr(), w.mins.as_ptr());
    let (xs, xsum) = (x.scales.as_ptr(), x.scaled_sums.as_ptr());
    for b in 0..k {
        // SAFETY: block b of the tile and of each activation row r < R lies inside the
        // operands (lengths asserted above); unaligned loads.
        unsafe {
            prefetch_ahead(wq.add(b * Q4_TILE_BLOCK), Q4_TILE_BLOCK);
            let dots = block_dots(b);
            let dw = _mm256_cvtph_ps(_mm_loadu_si128(ws.add(b * TILE).cast()));
            let mw = _mm256_cvtph_ps(_mm_loadu_si128(wm.add(b * TILE).cast()));
            for (r, (acc, dots)) in acc.iter_mut().zip(dots).enumerate() {
                let at = r * k + b;
                let d = _mm256_mul_ps(dw, _mm256_set1_ps(*xs.add(at)));
                *acc = _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(dots), *acc);
                *acc = _mm256_fmadd_ps(mw, _mm256_set1_ps(*xsum.add(at)), *acc);
            }
        }
    }
    for (out, acc) in dst.iter_mut().zip(acc) {
        // SAFETY: `out` is 8 f32s; unaligned store.
        unsafe { _mm256_storeu_ps(out.as_mut_ptr(), acc) };
    }
}

#[target_feature(enable = "avx2,fma")]
fn hsum(x: __m256) -> f32 {
    let s = _mm_add_ps(_mm256_extractf128_ps(x, 1), _mm256_castps256_ps128(x));
    let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)))
}

/// One block of 32 activations quantized as `Activations::quantize` describes, with the same
/// operations on eight lanes at a time (a maximum, one multiply and one add per value, a
/// truncation): the same quants. Returns the unrounded scale and the quants' sum.
///
/// # Safety
/// The CPU must have AVX2.
#[target_feature(enable = "avx2")]
pub unsafe fn quantize_block(x: &[f32], quants: &mut [i8]) -> (f32, i32) {
    assert!(x.len() == BLOCK && quants.len() == BLOCK);
    let sign = _mm256_set1_ps(-0.0);
    // SAFETY: `x` holds 32 floats (asserted); unaligned loads.
    let v: [__m256; 4] = std::array::from_fn(|i| unsafe { _mm256_loadu_ps(x.as_ptr().add(i * 8)) });
    let abs = v.map(|v| _mm256_andnot_ps(sign, v));
    let m = _mm256_max_ps(_mm256_max_ps(abs[0], abs[1]), _mm256_max_ps(abs[2], abs[3]));
    let m = _mm_max_ps(_mm256_extractf128_ps(m, 1), _mm256_castps256_ps128(m));
    let m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    let amax = _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
    let d = amax / 127.0;
    let id = _mm256_set1_ps(if d != 0.0 { 1.0 / d } else { 0.0 });
    let half = _mm256_set1_ps(super::JUST_BELOW_HALF);
    let mut ints = [0i32; BLOCK];
    let mut sum = _mm256_setzero_si256();
    for (i, v) in v.into_iter().enumerate() {
        let p = _mm256_mul_ps(v, id);
        let rounded = _mm256_add_ps(p, _mm256_or_ps(_mm256_and_ps(p, sign), half));
        let t = _mm256_cvttps_epi32(rounded);
        sum = _mm256_add_epi32(sum, t);
        // SAFETY: `ints` holds 32 i32s; unaligned store.
        unsafe { _mm256_storeu_si256(ints.as_mut_ptr().add(i * 8).cast(), t) };
    }
    for (q, i) in quants.iter_mut().zip(ints) {
        *q = i as i8;
    }
    let s = _mm_add_epi32(
        _mm256_extracti128_si256(sum, 1),
        _mm256_castsi256_si128(sum),
    );
    let s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0b01_00_11_10));
    let s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0b10_11_00_01));
    (d, _mm_cvtsi128_si32(s))
}

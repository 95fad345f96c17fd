//! Q8_0 and Q4_1 weight matrices multiplied on x86 CPUs, several activation rows per pass. Q8_0
//! takes one of two kernels:
//!
//! - **tiles** (AVX2, FMA and F16C; with AVX-512 VNNI where the CPU has it): eight weight rows
//!   interleaved so that each output is a vector lane of its own; a block costs one conversion
//!   and one multiply-add per eight outputs. The two instruction sets give the same bits
//!   (`avx2::tile` on 16-bit products, `vnni::tile` on bytes): each block's integer dot
//!   product is exact either way.
//! - **rows** (AVX2 and FMA): one weight row against up to eight activation rows, an
//!   accumulator per activation row, each output bit for bit candle's `vec_dot_q8_0_q8_0`
//!   (`avx2::row`).
//!
//! Q4_1 takes the tiles too, in the same two instruction sets with the same bits: its 4-bit
//! values are unsigned, so `vpmaddubsw` (`avx2::q4_tile`) or `vpdpbusd` (`vnni::q4_tile`)
//! multiplies them by the activations with no sign step or offset.
//!
//! Either way, activation rows are quantized to Q8_0 as candle quantizes them, scales are
//! read without a conversion per use, and an output depends on its activation row and weight
//! row only: never on what else shares the step, the pass or the thread.

use std::mem::MaybeUninit;

use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::{Result, Tensor};

mod activations;
#[cfg(target_arch = "x86_64")]
mod avx2;
#[cfg(target_arch = "x86_64")]
mod vnni;
mod weights;

use activations::Activations;
#[cfg(test)]
use activations::{quantize_block, round_half_away};
use weights::{Weights, q4_tile_weights, row_weights, tile_weights};

const BLOCK: usize = 32;
/// Bytes of one Q8_0 block as stored: an f16 scale, then 32 signed bytes.
const BLOCK_BYTES: usize = 2 + BLOCK;
/// Bytes of one Q4_1 block as stored: an f16 scale, an f16 minimum, then 16 bytes of two 4-bit
/// values each (value i in the low half of byte i, value i + 16 in the high half).
const Q4_BLOCK_BYTES: usize = 4 + BLOCK / 2;
/// Bytes of one Q4_1 tile's block: 16 bytes of each of its rows.
const Q4_TILE_BLOCK: usize = BLOCK / 2 * TILE;
/// Weight rows of a tile.
const TILE: usize = 8;
/// Bytes of one tile's block: 32 inputs of each of its rows.
const TILE_BLOCK: usize = BLOCK * TILE;
/// Activation rows one pass takes.
const TALL: usize = 8;

/// Which kernel a matrix is laid out for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kernel {
    /// AVX2 and FMA: bit for bit candle's results.
    Rows,
    /// AVX2, FMA and F16C: eight weight rows per pass.
    Tiles,
    /// The tiles with AVX-512 VNNI (and VL): four products per instruction, the same bits.
    TilesVnni,
}

impl Kernel {
    /// The fastest kernel this CPU runs; None where neither does (weights stay with candle's).
    pub fn detect() -> Option<Kernel> {
        [Kernel::TilesVnni, Kernel::Tiles, Kernel::Rows]
            .into_iter()
            .find(|k| k.supported())
    }

    /// The kernel's name in logs: `rows`, `tiles` or `tiles-vnni`.
    pub fn name(self) -> &'static str {
        match self {
            Kernel::Rows => "rows",
            Kernel::Tiles => "tiles",
            Kernel::TilesVnni => "tiles-vnni",
        }
    }

    /// Whether this CPU runs the kernel.
    pub fn supported(self) -> bool {
        #[cfg(target_arch = "x86_64")]
        {
            let rows = is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma");
            let tiles = rows && is_x86_feature_detected!("f16c");
            match self {
                Kernel::Rows => rows,
                Kernel::Tiles => tiles,
                Kernel::TilesVnni => {
                    tiles
                        && is_x86_feature_detected!("avx512f")
                        && is_x86_feature_detected!("avx512vl")
                        && is_x86_feature_detected!("avx512vnni")
                }
            }
        }
        #[cfg(not(target_arch = "x86_64"))]
        {
            let _ = self;
            false
        }
    }
}

/// A Q8_0 or Q4_1 matrix of `rows` weight rows (output features) by `blocks * 32` inputs.
pub struct QuantMatrix {
    rows: usize,
    blocks: usize,
    weights: Weights,
}

/// Some rows of blocks: `quants[row][block][32]`, `scales[row][block]`.
struct RowBlocks<'a> {
    quants: &'a [i8],
    scales: &'a [f32],
}

/// One tile of weight rows: `quants[block]` (each row's inputs interleaved four at a time plus
/// 128 for VNNI, two at a time as signed bytes for AVX2) and `scales[block][row]` (f16 bits).
#[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
struct TileBlocks<'a> {
    quants: &'a [u8],
    scales: &'a [u16],
}

/// One Q4_1 tile of weight rows: `quants[block][group][row][4]`, group j holding inputs
/// 4j..4j + 4 in its low halves and 16 + 4j.. in its high halves (each row's bytes 4j..4j + 4
/// as stored), `scales[block][row]` and `mins[block][row]` (f16 bits).
#[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
struct Q4TileBlocks<'a> {
    quants: &'a [u8],
    scales: &'a [u16],
    mins: &'a [u16],
}

/// Some activation rows: their blocks and each block's sum of quants.
struct ActivationBlocks<'a> {
    quants: &'a [i8],
    scales: &'a [f32],
    sums: &'a [i32],
    scaled_sums: &'a [f32],
    wide: &'a [i16],
}

/// Just below one half: added to a value and truncated, it rounds halves away from zero.
const JUST_BELOW_HALF: f32 = 0.5f32.next_down();

impl QuantMatrix {
    /// The matrix of a Q8_0 or Q4_1 tensor in host memory, `[rows, inputs]`, for the kernel
    /// `kernel_for` names; None for another type, device or CPU.
    pub fn from_qtensor(q: &QTensor) -> Result<Option<Self>> {
        match Self::kernel_for(q.dtype()) {
            Some(kernel) => Self::for_kernel(q, kernel),
            None => Ok(None),
        }
    }

    /// The matrix laid out for `kernel` (Q4_1 takes either tile kernel); None for another type
    /// or device, or where this CPU does not run `kernel`.
    pub fn for_kernel(q: &QTensor, kernel: Kernel) -> Result<Option<Self>> {
        let block_bytes = match (q.dtype(), kernel) {
            (GgmlDType::Q8_0, _) => BLOCK_BYTES,
            (GgmlDType::Q4_1, Kernel::Tiles | Kernel::TilesVnni) => Q4_BLOCK_BYTES,
            _ => return Ok(None),
        };
        if !q.device().is_cpu() || !kernel.supported() {
            return Ok(None);
        }
        let (rows, inputs) = q.shape().dims2()?;
        if inputs % BLOCK != 0 {
            return Ok(None);
        }
        let blocks = inputs / BLOCK;
        let data = q.data()?;
        if data.len() != rows * blocks * block_bytes {
            candle_core::bail!(
                "a {:?} tensor of {rows}x{inputs} holds {} bytes, not {}",
                q.dtype(),
                data.len(),
                rows * blocks * block_bytes
            );
        }
        let weights = match (q.dtype(), kernel) {
            (GgmlDType::Q4_1, _) => {
                q4_tile_weights(&data, rows, blocks, kernel == Kernel::TilesVnni)
            }
            (_, Kernel::Rows) => row_weights(&data),
            (_, Kernel::Tiles) => tile_weights(&data, rows, blocks, false),
            (_, Kernel::TilesVnni) => tile_weights(&data, rows, blocks, true),
        };
        Ok(Some(Self {
            rows,
            blocks,
            weights,
        }))
    }

    /// The fastest kernel this CPU runs for weights of `dtype`: any for Q8_0, a tile kernel for
    /// Q4_1; None for other types, or where this CPU runs none of them.
    pub fn kernel_for(dtype: GgmlDType) -> Option<Kernel> {
        let kernel = Kernel::detect()?;
        match dtype {
            GgmlDType::Q8_0 => Some(kernel),
            GgmlDType::Q4_1 => (kernel != Kernel::Rows).then_some(kernel),
            _ => None,
        }
    }

    /// `x @ self^T` for `x` of shape `[m, inputs]` (f32): `[m, rows]`.
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let (m, inputs) = x.dims2()?;
        if inputs != self.blocks * BLOCK {
            candle_core::bail!(
                "a quantized matmul over {} inputs got rows of {inputs}",
                self.blocks * BLOCK
            );
        }
        // Read in place (a copy only where `x` is not contiguous).
        let x = x.contiguous()?;
        let acts = {
            let (storage, layout) = x.storage_and_layout();
            let candle_core::Storage::Cpu(cpu) = &*storage else {
                candle_core::bail!("a quantized matmul takes host tensors")
            };
            let values = &cpu.as_slice::<f32>()?[layout.start_offset()..][..m * inputs];
            let wide = matches!(self.weights, Weights::Tiles { vnni: false, .. });
            Activations::quantize(values, m, self.blocks, wide)
        };
        // Work items are weight rows (or tiles of them); each range of them writes its
        // columns of every output row, in place: ranges never share a column.
        let per_item = match self.weights {
            Weights::Rows { .. } => 1,
            Weights::Tiles { .. } | Weights::Q4Tiles { .. } => TILE,
        };
        let k = self.blocks;
        // Not zeroed first: the pass writes every output (its ranges cover every column of
        // every row), and clearing first was 2-3 % of an eight-row step (`memset` in a profile).
        let mut out: Vec<f32> = Vec::with_capacity(m * self.rows);
        let base = OutputRows(out.spare_capacity_mut().as_mut_ptr());
        // One contiguous run of items per thread, so each streams its weights in order and
        // fetching ahead stays useful (the pool's default, eight interleaved grabs a thread,
        // broke both: the kernels took 15-20 % less time at one and eight rows on two threads
        // once it went). A thread that comes late finds its run taken by another.
        let items = self.rows.div_ceil(per_item);
        let runs = pool_threads().min(items);
        let per_run = items.div_ceil(runs);
        candle_core::utils::barrier_pool().execute_chunked(runs, |taken| {
            let items = taken.start * per_run..(taken.end * per_run).min(items);
            if items.is_empty() {
                return;
            }
            let cols = items.start * per_item..(items.end * per_item).min(self.rows);
            let mut dst: Vec<&mut [MaybeUninit<f32>]> = (0..m)
                // SAFETY: row r's columns `cols` lie inside `out` (m rows of self.rows), which
                // outlives the pool's pass; no other range writes or reads them.
                .map(|r| unsafe { base.columns(r * self.rows + cols.start, cols.len()) })
                .collect();
            match &self.weights {
                Weights::Rows { quants, scales } => {
                    self.row_columns(quants, scales, &acts, cols, &mut dst)
                }
                Weights::Tiles {
                    quants,
                    scales,
                    vnni,
                } => self.tile_columns(&acts, items, &mut dst, |t, x, out| {
                    let w = TileBlocks {
                        quants: &quants[t * k * TILE_BLOCK..(t + 1) * k * TILE_BLOCK],
                        scales: &scales[t * k * TILE..(t + 1) * k * TILE],
                    };
                    tile_pass(k, *vnni, &w, x, out)
                }),
                Weights::Q4Tiles {
                    quants,
                    scales,
                    mins,
                    vnni,
                } => self.tile_columns(&acts, items, &mut dst, |t, x, out| {
                    let w = Q4TileBlocks {
                        quants: &quants[t * k * Q4_TILE_BLOCK..(t + 1) * k * Q4_TILE_BLOCK],
                        scales: &scales[t * k * TILE..(t + 1) * k * TILE],
                        mins: &mins[t * k * TILE..(t + 1) * k * TILE],
                    };
                    q4_tile_pass(k, *vnni, &w, x, out)
                }),
            }
        });
        // SAFETY: the pass above initialized all m * rows outputs (see `row_columns` and
        // `tile_columns`: every column of every row).
        unsafe { out.set_len(m * self.rows) };
        Tensor::from_vec(out, (m, self.rows), &candle_core::Device::Cpu)
    }

    /// Outputs of weight rows `cols` for every activation row into `dst` (`[m]` slices of
    /// `cols.len()`).
    fn row_columns(
        &self,
        quants: &[i8],
        scales: &[f32],
        acts: &Activations,
        cols: std::ops::Range<usize>,
        dst: &mut [&mut [MaybeUninit<f32>]],
    ) {
        let (m, k) = (acts.rows, self.blocks);
        let mut values = [0f32; TALL];
        for (i, c) in cols.enumerate() {
            let w = RowBlocks {
                quants: &quants[c * k * BLOCK..(c + 1) * k * BLOCK],
                scales: &scales[c * k..(c + 1) * k],
            };
            let mut r = 0;
            while r < m {
                let tall = (m - r).min(TALL);
                let x = acts.blocks(r, tall, k);
                row_pass(
                    k,
                    &w,
                    &RowBlocks {
                        quants: x.quants,
                        scales: x.scales,
                    },
                    &mut values[..tall],
                );
                for (j, &v) in values[..tall].iter().enumerate() {
                    dst[r + j][i].write(v);
                }
                r += tall;
            }
        }
    }

    /// Outputs of the weight rows of `tiles` for every activation row into `dst` (`[m]` slices
    /// of the tiles' rows short of the padding); `pass(t, x, out)` multiplies tile t by up to
    /// `TALL` activation rows.
    fn tile_columns(
        &self,
        acts: &Activations,
        tiles: std::ops::Range<usize>,
        dst: &mut [&mut [MaybeUninit<f32>]],
        pass: impl Fn(usize, &ActivationBlocks<'_>, &mut [[f32; TILE]]),
    ) {
        let (m, k) = (acts.rows, self.blocks);
        let first = tiles.start * TILE;
        let mut values = [[0f32; TILE]; TALL];
        for t in tiles {
            let (at, n) = (t * TILE - first, (self.rows - t * TILE).min(TILE));
            let mut r = 0;
            while r < m {
                let tall = (m - r).min(TALL);
                pass(t, &acts.blocks(r, tall, k), &mut values[..tall]);
                for (j, v) in values[..tall].iter().enumerate() {
                    for (out, &v) in dst[r + j][at..][..n].iter_mut().zip(v) {
                        out.write(v);
                    }
                }
                r += tall;
            }
        }
    }
}

/// Threads a quantized matmul runs on: candle's barrier pool, its caller included, by candle's
/// own rule (`CANDLE_NUM_THREADS`, else its default).
pub fn pool_threads() -> usize {
    static THREADS: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *THREADS.get_or_init(|| {
        std::env::var("CANDLE_NUM_THREADS")
            .ok()
            .and_then(|s| s.parse().ok())
            .filter(|&n: &usize| n > 0)
            .unwrap_or_else(candle_core::utils::get_num_threads)
    })
}

/// Where a matmul's outputs go, shared by the ranges of a pass that each write columns of
/// their own.
#[derive(Clone, Copy)]
struct OutputRows(*mut MaybeUninit<f32>);

// SAFETY: ranges of a pass write disjoint columns (see `OutputRows::columns`).
unsafe impl Send for OutputRows {}
unsafe impl Sync for OutputRows {}

impl OutputRows {
    /// `len` outputs from `at`.
    ///
    /// # Safety
    /// They must lie inside the buffer, which must outlive the slice, and no other slice of
    /// them may exist meanwhile.
    #[allow(clippy::mut_from_ref)]
    unsafe fn columns(&self, at: usize, len: usize) -> &mut [MaybeUninit<f32>] {
        // SAFETY: as the caller promises.
        unsafe { std::slice::from_raw_parts_mut(self.0.add(at), len) }
    }
}

/// How far past the block it multiplies a kernel asks for weights: far enough that they arrive
/// from memory in time (16 Q4_1 tile blocks; at 4 the hint gained nothing).
const PREFETCH_AHEAD: usize = 2048;

/// Asks the CPU to bring the `bytes` from `at` into its caches: for a loop streaming through
/// memory once (weights here, a key/value cache in attention).
#[cfg(target_arch = "x86_64")]
#[inline(always)]
pub fn prefetch(at: *const u8, bytes: usize) {
    use std::arch::x86_64::{_MM_HINT_T0, _mm_prefetch};
    for line in (0..bytes).step_by(64) {
        // SAFETY: a prefetch is a hint: it reads nothing into the program and never faults,
        // wherever it points (past the weights at their end).
        unsafe { _mm_prefetch::<_MM_HINT_T0>(at.wrapping_add(line).cast()) };
    }
}

/// [`prefetch`] of the `bytes` of weights `PREFETCH_AHEAD` past `at`.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
fn prefetch_ahead(at: *const u8, bytes: usize) {
    prefetch(at.wrapping_add(PREFETCH_AHEAD), bytes)
}

/// `$body` with `$r` a constant: `$n` (1 to `TALL`) as a const generic for the kernels.
#[cfg(target_arch = "x86_64")]
macro_rules! by_rows {
    ($n:expr, $r:ident => $body:expr) => {
        by_rows!(@arms $n, $r, $body, [1, 2, 3, 4, 5, 6, 7])
    };
    (@arms $n:expr, $r:ident, $body:expr, [$($k:literal),*]) => {
        match $n {
            $($k => {
                const $r: usize = $k;
                $body
            })*
            _ => {
                const $r: usize = TALL;
                $body
            }
        }
    };
}

/// One weight row against up to `TALL` activation rows: `dst[r]` for activation row r.
#[cfg(target_arch = "x86_64")]
fn row_pass(k: usize, w: &RowBlocks<'_>, x: &RowBlocks<'_>, dst: &mut [f32]) {
    // SAFETY: a row-laid matrix exists only where `Kernel::Rows` is supported (AVX2 and FMA
    // present); the kernel checks the operands' lengths before reading.
    by_rows!(dst.len(), R => unsafe { avx2::row::<R>(k, w, x, dst) })
}

/// One tile against up to `TALL` activation rows: `dst[r]` for activation row r.
#[cfg(target_arch = "x86_64")]
fn tile_pass(
    k: usize,
    vnni: bool,
    w: &TileBlocks<'_>,
    x: &ActivationBlocks<'_>,
    dst: &mut [[f32; TILE]],
) {
    // SAFETY: a tiled matrix exists only where its kernel (`Kernel::Tiles` or
    // `Kernel::TilesVnni`, as `vnni` records) is supported; the kernels check the operands'
    // lengths before reading.
    by_rows!(dst.len(), R => unsafe {
        if vnni {
            vnni::tile::<R>(k, w, x, dst)
        } else {
            avx2::tile::<R>(k, w, x, dst)
        }
    })
}

/// One Q4_1 tile against up to `TALL` activation rows: `dst[r]` for activation row r.
#[cfg(target_arch = "x86_64")]
fn q4_tile_pass(
    k: usize,
    vnni: bool,
    w: &Q4TileBlocks<'_>,
    x: &ActivationBlocks<'_>,
    dst: &mut [[f32; TILE]],
) {
    // SAFETY: a Q4_1 matrix exists only where its kernel (`Kernel::Tiles` or
    // `Kernel::TilesVnni`, as `vnni` records) is supported; the kernels check the operands'
    // lengths before reading.
    by_rows!(dst.len(), R => unsafe {
        if vnni {
            vnni::q4_tile::<R>(k, w, x, dst)
        } else {
            avx2::q4_tile::<R>(k, w, x, dst)
        }
    })
}

#[cfg(not(target_arch = "x86_64"))]
fn row_pass(k: usize, _: &RowBlocks<'_>, _: &RowBlocks<'_>, _: &mut [f32]) {
    unreachable!("QuantMatrix is only built where its kernel runs ({k})");
}

#[cfg(not(target_arch = "x86_64"))]
fn tile_pass(
    k: usize,
    _: bool,
    _: &TileBlocks<'_>,
    _: &ActivationBlocks<'_>,
    _: &mut [[f32; TILE]],
) {
    unreachable!("QuantMatrix is only built where its kernel runs ({k})");
}

#[cfg(not(target_arch = "x86_64"))]
fn q4_tile_pass(
    k: usize,
    _: bool,
    _: &Q4TileBlocks<'_>,
    _: &ActivationBlocks<'_>,
    _: &mut [[f32; TILE]],
) {
    unreachable!("QuantMatrix is only built where its kernel runs ({k})");
}

#[cfg(test)]
mod tests;

//! The weights as each kernel reads them, laid out once when a matrix is made: rows of Q8_0
//! blocks, or tiles of eight rows interleaved for the tile kernels (Q8_0 and Q4_1).

use half::f16;

use crate::{BLOCK, BLOCK_BYTES, Q4_BLOCK_BYTES, Q4_TILE_BLOCK, TILE, TILE_BLOCK};

pub(crate) enum Weights {
    /// Row after row: `quants[row][block][32]`, `scales[row][block]`.
    Rows { quants: Vec<i8>, scales: Vec<f32> },
    /// Tiles of eight rows (the last one padded with zero rows), as [`TileBlocks`] holds
    /// them, `scales[tile][block][row]` as f16; `vnni` picks the instruction set that
    /// multiplies them and the layout of the quants: `quants[tile][block][group][row][4]` plus
    /// 128 for VNNI, `quants[tile][block][pair][row][2]` as signed bytes for AVX2.
    Tiles {
        quants: Vec<u8>,
        scales: Vec<u16>,
        vnni: bool,
    },
    /// Q4_1 in tiles of eight rows (the last one padded with zero rows), as [`Q4TileBlocks`]
    /// holds them; `vnni` picks the instruction set (the layout is the same).
    Q4Tiles {
        quants: Vec<u8>,
        scales: Vec<u16>,
        mins: Vec<u16>,
        vnni: bool,
    },
}

pub(crate) fn row_weights(data: &[u8]) -> Weights {
    let blocks = data.len() / BLOCK_BYTES;
    let mut quants = Vec::with_capacity(blocks * BLOCK);
    let mut scales = Vec::with_capacity(blocks);
    for block in data.chunks_exact(BLOCK_BYTES) {
        scales.push(f16::from_le_bytes([block[0], block[1]]).to_f32());
        quants.extend(block[2..].iter().map(|&b| b as i8));
    }
    Weights::Rows { quants, scales }
}

pub(crate) fn tile_weights(data: &[u8], rows: usize, blocks: usize, vnni: bool) -> Weights {
    let tiles = rows.div_ceil(TILE);
    // Inputs side by side per row: four for `vpdpbusd`, two for `vpmaddwd` (`avx2::tile`).
    let run = if vnni { 4 } else { 2 };
    // A zero weight (stored plus 128 for VNNI); a zero scale zeroes a padding row's outputs.
    let zero = if vnni { 128u8 } else { 0 };
    let mut quants = vec![zero; tiles * blocks * TILE_BLOCK];
    let mut scales = vec![0u16; tiles * blocks * TILE];
    for (c, row) in data.chunks_exact(blocks * BLOCK_BYTES).enumerate() {
        let (t, lane) = (c / TILE, c % TILE);
        for (b, block) in row.chunks_exact(BLOCK_BYTES).enumerate() {
            let at = t * blocks + b;
            scales[at * TILE + lane] = u16::from_le_bytes([block[0], block[1]]);
            for (g, inputs) in block[2..].chunks_exact(run).enumerate() {
                let to = &mut quants[at * TILE_BLOCK + g * run * TILE + lane * run..][..run];
                // For VNNI an i8 plus 128 as a u8: the sign bit flipped.
                for (to, &q) in to.iter_mut().zip(inputs) {
                    *to = if vnni { q ^ 0x80 } else { q };
                }
            }
        }
    }
    Weights::Tiles {
        quants,
        scales,
        vnni,
    }
}

pub(crate) fn q4_tile_weights(data: &[u8], rows: usize, blocks: usize, vnni: bool) -> Weights {
    let tiles = rows.div_ceil(TILE);
    // Zero scales and minimums zero a padding row's outputs.
    let mut quants = vec![0u8; tiles * blocks * Q4_TILE_BLOCK];
    let mut scales = vec![0u16; tiles * blocks * TILE];
    let mut mins = vec![0u16; tiles * blocks * TILE];
    for (c, row) in data.chunks_exact(blocks * Q4_BLOCK_BYTES).enumerate() {
        let (t, lane) = (c / TILE, c % TILE);
        for (b, block) in row.chunks_exact(Q4_BLOCK_BYTES).enumerate() {
            let at = t * blocks + b;
            scales[at * TILE + lane] = u16::from_le_bytes([block[0], block[1]]);
            mins[at * TILE + lane] = u16::from_le_bytes([block[2], block[3]]);
            for (g, four) in block[4..].chunks_exact(4).enumerate() {
                quants[at * Q4_TILE_BLOCK + g * 4 * TILE + lane * 4..][..4].copy_from_slice(four);
            }
        }
    }
    Weights::Q4Tiles {
        quants,
        scales,
        mins,
        vnni,
    }
}

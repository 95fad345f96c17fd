use super::*;
use candle_core::quantized::QMatMul;
use candle_core::{Device, Module};
use half::f16;

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

fn weights(n: usize, k: usize) -> QTensor {
    let w = Tensor::from_vec(numbers(n * k, 7), (n, k), &Device::Cpu).unwrap();
    QTensor::quantize(&w, GgmlDType::Q8_0).unwrap()
}

/// Q4_1 weights whose blocks include 4-bit values of 0 and 15 side by side in one byte.
fn q4_weights(n: usize, k: usize) -> QTensor {
    let w = Tensor::from_vec(numbers(n * k, 11), (n, k), &Device::Cpu).unwrap();
    let mut data = QTensor::quantize(&w, GgmlDType::Q4_1)
        .unwrap()
        .data()
        .unwrap()
        .into_owned();
    for (i, block) in data.chunks_exact_mut(Q4_BLOCK_BYTES).enumerate() {
        block[4 + i % 16] = 0xf0;
        block[4 + (i * 5 + 3) % 16] = 0x0f;
        block[4 + (i * 3 + 7) % 16] = 0xff;
    }
    candle_core::quantized::ggml_file::qtensor_from_ggml(
        GgmlDType::Q4_1,
        &data,
        vec![n, k],
        &Device::Cpu,
    )
    .unwrap()
}

/// `m` activation rows, with a zero value and a whole zero block.
fn activations(m: usize, k: usize) -> Tensor {
    let mut x = numbers(m * k, 100 + m as u32);
    x[3] = 0.0;
    x[k - BLOCK..k].fill(0.0);
    Tensor::from_vec(x, (m, k), &Device::Cpu).unwrap()
}

/// `x`'s rows quantized as the kernels quantize them.
fn quantized(x: &Tensor, blocks: usize) -> Activations {
    let rows = x.dim(0).unwrap();
    Activations::quantize(
        &x.flatten_all().unwrap().to_vec1().unwrap(),
        rows,
        blocks,
        false,
    )
}

fn matrix(q: &QTensor, kernel: Kernel) -> Option<QuantMatrix> {
    if !kernel.supported() {
        eprintln!("this CPU does not run the {kernel:?} kernel: nothing to check");
        return None;
    }
    Some(
        QuantMatrix::for_kernel(q, kernel)
            .unwrap()
            .expect("a Q8_0 or Q4_1 host tensor"),
    )
}

/// Bit for bit candle's own Q8_0 matmul, for every row count up to past two full passes
/// (m = 1..=17 with passes of 8 rows).
#[test]
fn the_row_kernel_equals_candles_bit_for_bit() {
    let (n, k) = (15, 96);
    let q = weights(n, k);
    let Some(ours) = matrix(&q, Kernel::Rows) else {
        return;
    };
    let theirs = QMatMul::from_qtensor(q).unwrap();
    for m in 1..=17 {
        let x = activations(m, k);
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

/// The tile kernels give the quantized dot products: each output within a few roundings of
/// the sum over blocks of (weight scale x activation scale x integer dot product), here in f64
/// from the same blocks, for weight rows that fill two tiles and part of a third, some weights
/// at the edge of the type's range (-128, which only a file gives, and 127).
#[test]
fn the_tile_kernels_compute_the_quantized_dot_products() {
    let (n, k) = (21, 96);
    let mut data = weights(n, k).data().unwrap().into_owned();
    for (i, block) in data.chunks_exact_mut(BLOCK_BYTES).enumerate() {
        block[2 + i % BLOCK] = 0x80;
        block[2 + (i * 7 + 3) % BLOCK] = 127;
    }
    let q = candle_core::quantized::ggml_file::qtensor_from_ggml(
        GgmlDType::Q8_0,
        &data,
        vec![n, k],
        &Device::Cpu,
    )
    .unwrap();
    let blocks = k / BLOCK;
    for kernel in [Kernel::Tiles, Kernel::TilesVnni] {
        let Some(ours) = matrix(&q, kernel) else {
            continue;
        };
        for m in 1..=17 {
            let x = activations(m, k);
            let acts = quantized(&x, blocks);
            let got = ours.forward(&x).unwrap().to_vec2::<f32>().unwrap();
            for (r, row) in got.iter().enumerate() {
                for (c, &value) in row.iter().enumerate() {
                    let (mut want, mut size) = (0f64, 0f64);
                    for b in 0..blocks {
                        let w = &data[(c * blocks + b) * BLOCK_BYTES..][..BLOCK_BYTES];
                        let dw = f16::from_le_bytes([w[0], w[1]]).to_f64();
                        let xq = &acts.quants[(r * blocks + b) * BLOCK..][..BLOCK];
                        let dot: i32 = w[2..]
                            .iter()
                            .zip(xq)
                            .map(|(&w, &x)| w as i8 as i32 * x as i32)
                            .sum();
                        let term = dw * acts.scales[r * blocks + b] as f64 * dot as f64;
                        want += term;
                        size += term.abs();
                    }
                    assert!(
                        (value as f64 - want).abs() <= 1e-6 * size + 1e-12,
                        "{kernel:?}: m {m}, row {r}, col {c}: {value} vs {want}"
                    );
                }
            }
        }
    }
}

/// The Q4_1 tile kernels give the quantized dot products of candle's own reading of the blocks:
/// each output within a few roundings of the sum of candle's dequantized weights times the
/// dequantized activation quants (f64), for weight rows that fill two tiles and part of a
/// third; and within the activations' rounding of candle's own Q4_1 matmul.
#[test]
fn the_q4_tile_kernels_compute_the_quantized_dot_products() {
    // An even number of blocks: candle's portable Q4_1 dot product (debug builds) takes pairs.
    let (n, k) = (21, 128);
    for kernel in [Kernel::Tiles, Kernel::TilesVnni] {
        let q = q4_weights(n, k);
        if let Some(ours) = matrix(&q, kernel) {
            check_q4_dot_products(q, &ours, k);
        }
    }
}

fn check_q4_dot_products(q: QTensor, ours: &QuantMatrix, k: usize) {
    let dequantized = q
        .dequantize(&Device::Cpu)
        .unwrap()
        .to_vec2::<f32>()
        .unwrap();
    let candle = QMatMul::from_qtensor(q).unwrap();
    let blocks = k / BLOCK;
    for m in 1..=17 {
        let x = activations(m, k);
        let acts = quantized(&x, blocks);
        let got = ours.forward(&x).unwrap().to_vec2::<f32>().unwrap();
        let theirs = candle.forward(&x).unwrap().to_vec2::<f32>().unwrap();
        for (r, row) in got.iter().enumerate() {
            for (c, &value) in row.iter().enumerate() {
                let (mut want, mut size) = (0f64, 0f64);
                for (i, &w) in dequantized[c].iter().enumerate() {
                    let a =
                        acts.scales[r * blocks + i / BLOCK] as f64 * acts.quants[r * k + i] as f64;
                    want += w as f64 * a;
                    size += (w as f64 * a).abs();
                }
                assert!(
                    (value as f64 - want).abs() <= 1e-5 * size + 1e-9,
                    "m {m}, row {r}, col {c}: {value} vs {want}"
                );
                assert!(
                    (value - theirs[r][c]).abs() <= 1e-2 * size as f32 + 1e-6,
                    "m {m}, row {r}, col {c}: {value} vs candle's {}",
                    theirs[r][c]
                );
            }
        }
    }
}

/// The tile kernels give the same bits with VNNI as without, for Q8_0 and Q4_1 (a CPU's
/// instruction set does not move an answer).
#[test]
fn the_tile_kernels_agree_bit_for_bit() {
    let (n, k) = (21, 96);
    for q in [weights(n, k), q4_weights(n, k)] {
        let (Some(plain), Some(vnni)) = (matrix(&q, Kernel::Tiles), matrix(&q, Kernel::TilesVnni))
        else {
            continue;
        };
        let x = activations(17, k);
        let bits = |m: &QuantMatrix| {
            m.forward(&x)
                .unwrap()
                .flatten_all()
                .unwrap()
                .to_vec1::<f32>()
                .unwrap()
                .iter()
                .map(|v| v.to_bits())
                .collect::<Vec<_>>()
        };
        assert_eq!(bits(&plain), bits(&vnni), "{:?}", q.dtype());
    }
}

/// Every kernel: an activation row's outputs are the same bits computed alone or beside 16
/// others (so batching never changes an answer).
#[test]
fn an_output_is_the_same_bits_whatever_rows_share_the_pass() {
    let (n, k) = (21, 64);
    let q4 = q4_weights(n, k);
    let q8 = weights(n, k);
    let cases = [
        (&q8, Kernel::Rows),
        (&q8, Kernel::Tiles),
        (&q8, Kernel::TilesVnni),
        (&q4, Kernel::Tiles),
        (&q4, Kernel::TilesVnni),
    ];
    for (q, kernel) in cases {
        let Some(ours) = matrix(q, kernel) else {
            continue;
        };
        let kernel = format!("{:?} {kernel:?}", q.dtype());
        let x = activations(17, k);
        let together = ours.forward(&x).unwrap().to_vec2::<f32>().unwrap();
        for (r, row) in together.iter().enumerate() {
            let alone = ours
                .forward(&x.narrow(0, r, 1).unwrap())
                .unwrap()
                .to_vec2::<f32>()
                .unwrap();
            let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(row), bits(&alone[0]), "{kernel}: row {r}");
        }
    }
}

/// The vector quantizer gives the scalar one's scale, quants and sum, on blocks of every scale,
/// with zeros, exact halves after scaling, and a zero block.
#[test]
fn the_vector_quantizer_equals_the_scalar_one() {
    #[cfg(target_arch = "x86_64")]
    if is_x86_feature_detected!("avx2") {
        let mut blocks: Vec<Vec<f32>> = (0..2000)
            .map(|i| {
                let scale = [1e-6f32, 0.01, 1.0, 300.0][i % 4];
                numbers(BLOCK, i as u32).iter().map(|v| v * scale).collect()
            })
            .collect();
        blocks.push(vec![0.0; BLOCK]);
        // 127 and steps of 0.5 after scaling by 127 / 127: halves to round.
        blocks.push(
            (0..BLOCK)
                .map(|i| if i == 0 { 127.0 } else { i as f32 - 15.5 })
                .collect(),
        );
        blocks[5][7] = -0.0;
        for x in blocks {
            let (mut a, mut b) = ([0i8; BLOCK], [0i8; BLOCK]);
            let scalar = quantize_block(&x, &mut a);
            // SAFETY: AVX2 checked above.
            let vector = unsafe { avx2::quantize_block(&x, &mut b) };
            assert_eq!(scalar.0.to_bits(), vector.0.to_bits(), "{x:?}");
            assert_eq!((a, scalar.1), (b, vector.1), "{x:?}");
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
    assert!(QuantMatrix::from_qtensor(&q4).unwrap().is_none());
    let q4_1 = QTensor::quantize(&w, GgmlDType::Q4_1).unwrap();
    assert!(
        QuantMatrix::for_kernel(&q4_1, Kernel::Rows)
            .unwrap()
            .is_none()
    );
    let q8 = QTensor::quantize(&w, GgmlDType::Q8_0).unwrap();
    for kernel in [Kernel::Rows, Kernel::Tiles, Kernel::TilesVnni] {
        if let Some(m) = QuantMatrix::for_kernel(&q8, kernel).unwrap() {
            let x = Tensor::zeros((2, 32), candle_core::DType::F32, &Device::Cpu).unwrap();
            let e = m.forward(&x).unwrap_err().to_string();
            assert!(
                e.contains("over 64 inputs got rows of 32"),
                "{kernel:?}: {e}"
            );
        }
    }
}

/// The kernel tests above check nothing where the CPU lacks a kernel (and say so on stderr). On
/// x86_64, where Nomad's CPU workers run, the row and tile kernels need only AVX2, FMA and F16C:
/// they must be here, so those tests did check something.
#[cfg(target_arch = "x86_64")]
#[test]
fn the_row_and_tile_kernels_were_checked_on_this_cpu() {
    assert!(
        Kernel::Rows.supported() && Kernel::Tiles.supported(),
        "this x86_64 CPU lacks AVX2, FMA or F16C: the kernel tests above checked nothing"
    );
    if !Kernel::TilesVnni.supported() {
        eprintln!("no AVX-512 VNNI here: the VNNI tile kernel was not checked");
    }
}

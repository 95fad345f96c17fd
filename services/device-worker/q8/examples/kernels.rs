//! The kernels side by side on SmolLM2-135M's weight shapes (random, as many matrices of each
//! shape as a token passes through, so they stream from memory as a model's do): candle's own
//! Q8_0 matmul, our Q8_0 row and tile kernels and the Q4_1 tile kernels (where this CPU runs
//! them), alternating so that noise hits each alike. Prints milliseconds per pass over all of
//! them, for each number of rows.
//!
//! `cargo run --release -p nomad-q8 --example kernels -- [rows,...] [seconds per row count]`
//! (`CANDLE_NUM_THREADS` sets the threads, as for the worker).

use std::time::{Duration, Instant};

use candle_core::quantized::{GgmlDType, QMatMul, QTensor};
use candle_core::{Device, Module, Tensor};
use nomad_q8::{Kernel, QuantMatrix};

/// (weight rows, inputs, how many a token passes through): one layer's projections times 30
/// layers, and the output layer.
const SHAPES: [(usize, usize, usize); 5] = [
    (576, 576, 60),
    (192, 576, 60),
    (1536, 576, 60),
    (576, 1536, 30),
    (49152, 576, 1),
];

fn main() -> candle_core::Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let rows: Vec<usize> = args.first().map_or(vec![1, 4, 8, 16, 64], |s| {
        s.split(',')
            .map(|r| r.parse().expect("rows: a list like 1,8,16"))
            .collect()
    });
    let seconds: f64 = args
        .get(1)
        .map_or(5.0, |s| s.parse().expect("seconds: a number"));
    // Each of our kernels with the weight type it runs: Q8_0 on all three, and Q4_1 (the same
    // weights quantized to 4 bits) on both tile kernels.
    let kernels: Vec<(GgmlDType, Kernel)> = [
        (GgmlDType::Q8_0, Kernel::Rows),
        (GgmlDType::Q8_0, Kernel::Tiles),
        (GgmlDType::Q8_0, Kernel::TilesVnni),
        (GgmlDType::Q4_1, Kernel::Tiles),
        (GgmlDType::Q4_1, Kernel::TilesVnni),
    ]
    .into_iter()
    .filter(|(_, k)| k.supported())
    .collect();
    let threads = std::env::var("CANDLE_NUM_THREADS").unwrap_or_else(|_| "candle's default".into());
    println!("CANDLE_NUM_THREADS: {threads}");
    println!(
        "| rows | candle Q8_0 ms |  {} |",
        kernels
            .iter()
            .map(|(t, k)| format!("{t:?} {k:?} ms (x candle)"))
            .collect::<Vec<_>>()
            .join(" | ")
    );
    let mut weights = Vec::new();
    for &(n, k, uses) in &SHAPES {
        for _ in 0..uses {
            let w = Tensor::randn(0f32, 0.05, (n, k), &Device::Cpu)?;
            let q = QTensor::quantize(&w, GgmlDType::Q8_0)?;
            let q4 = QTensor::quantize(&w, GgmlDType::Q4_1)?;
            let ours: Vec<QuantMatrix> = kernels
                .iter()
                .map(|&(dtype, kernel)| {
                    let q = if dtype == GgmlDType::Q4_1 { &q4 } else { &q };
                    QuantMatrix::for_kernel(q, kernel).map(|m| m.expect("supported"))
                })
                .collect::<candle_core::Result<_>>()?;
            weights.push((QMatMul::from_qtensor(q)?, ours, k));
        }
    }
    for &m in &rows {
        let inputs: Vec<Tensor> = [576, 1536]
            .iter()
            .map(|&k| Tensor::randn(0f32, 1.0, (m, k), &Device::Cpu))
            .collect::<candle_core::Result<_>>()?;
        let input = |k: usize| &inputs[usize::from(k != 576)];
        // Seconds of one pass over every matrix, each kernel; the best of `ROUNDS`, alternating.
        let pass = |kernel: Option<usize>| -> candle_core::Result<f64> {
            let start = Instant::now();
            for (candle, ours, k) in &weights {
                match kernel {
                    None => candle.forward(input(*k))?,
                    Some(i) => ours[i].forward(input(*k))?,
                };
            }
            Ok(start.elapsed().as_secs_f64())
        };
        let mut best = vec![f64::MAX; kernels.len() + 1];
        let start = Instant::now();
        while start.elapsed() < Duration::from_secs_f64(seconds) {
            best[0] = best[0].min(pass(None)?);
            for i in 0..kernels.len() {
                best[i + 1] = best[i + 1].min(pass(Some(i))?);
            }
        }
        let cells: Vec<String> = best[1..]
            .iter()
            .map(|t| format!("{:.2} ({:.2}x)", t * 1e3, best[0] / t))
            .collect();
        println!("| {m} | {:.2} | {} |", best[0] * 1e3, cells.join(" | "));
    }
    Ok(())
}

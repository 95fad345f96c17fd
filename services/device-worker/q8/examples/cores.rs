//! How much faster this machine runs work on N threads than on one: a dependent chain of
//! integer adds (one per cycle on any core) and a stream of independent AVX2 fused
//! multiply-adds (what bounds the kernels), each alone and then on N threads at once. On a
//! machine with N free cores both scale N-fold; virtual CPUs that share a physical core, or a
//! host that time-slices them, show here as less. Read the worker's scaling with threads
//! against this, not against N.
//!
//! `cargo run --release -p nomad-q8 --example cores -- [threads, default 2] [rounds, default 3]`

use std::time::Instant;

/// Iterations of each workload per thread.
const ITERATIONS: u64 = 2_000_000_000;

#[cfg(target_arch = "x86_64")]
fn add_chain() -> u64 {
    let mut x = std::hint::black_box(0u64);
    for _ in 0..ITERATIONS / 4 {
        // SAFETY: four adds to a register, nothing else.
        unsafe {
            std::arch::asm!("add {0}, 1", "add {0}, 1", "add {0}, 1", "add {0}, 1", inout(reg) x)
        };
    }
    x
}

/// # Safety
/// The CPU must have AVX2 and FMA.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn fma_stream() -> f32 {
    use std::arch::x86_64::*;
    let w = _mm256_set1_ps(std::hint::black_box(0.999));
    // Twelve independent chains: enough to fill both FMA pipes through their latency.
    let mut acc = [_mm256_set1_ps(1.0); 12];
    for _ in 0..ITERATIONS / 12 {
        for a in &mut acc {
            *a = _mm256_fmadd_ps(*a, w, w);
        }
    }
    let sum = acc
        .iter()
        .fold(_mm256_setzero_ps(), |s, &a| _mm256_add_ps(s, a));
    _mm256_cvtss_f32(sum)
}

/// A workload's name and one run of it.
type Workload = (&'static str, fn() -> f64);

/// Seconds `work` takes on one thread, and on `threads` threads at once (the slowest).
fn seconds(work: fn() -> f64, threads: usize) -> (f64, f64) {
    let timed = || {
        let start = Instant::now();
        std::hint::black_box(work());
        start.elapsed().as_secs_f64()
    };
    let alone = timed();
    let together = std::thread::scope(|s| {
        let handles: Vec<_> = (0..threads).map(|_| s.spawn(timed)).collect();
        handles
            .into_iter()
            .map(|h| h.join().expect("a timing thread"))
            .fold(0f64, f64::max)
    });
    (alone, together)
}

#[cfg(target_arch = "x86_64")]
fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let threads: usize = args
        .first()
        .map_or(2, |s| s.parse().expect("threads: a number"));
    let rounds: usize = args
        .get(1)
        .map_or(3, |s| s.parse().expect("rounds: a number"));
    let mut workloads: Vec<Workload> = vec![("integer add chain", || add_chain() as f64)];
    if is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") {
        // SAFETY: AVX2 and FMA checked just above.
        workloads.push(("AVX2 FMA stream", || f64::from(unsafe { fma_stream() })));
    }
    println!(
        "| workload | 1 thread s | {threads} threads at once s | speedup on {threads} threads |"
    );
    println!("|---|---|---|---|");
    for _ in 0..rounds {
        for &(name, work) in &workloads {
            let (alone, together) = seconds(work, threads);
            let speedup = threads as f64 * alone / together;
            println!("| {name} | {alone:.3} | {together:.3} | {speedup:.2}x |");
        }
    }
}

#[cfg(not(target_arch = "x86_64"))]
fn main() {
    eprintln!("cores: x86-64 only");
}

//! Throughput of the mixed-precision product (`cpu_gemm::gemm_bf16`) on the matrix shapes of
//! one GRPO step of gpt2-124m at 4 × 8 × (46 + 64): 2,200 rows through the blocks, 2,048
//! predicting rows through the LM head, each product as the forward pass, the input
//! gradient and the weight gradient run it (the last two through transposed strides).
//!
//! ```sh
//! cargo bench -p rookworld-lm --bench gemm_bf16 [-- REPEATS]
//! ```
//!
//! Prints GFLOP/s per shape (best of REPEATS, default 3) and over all of them. Only where
//! the CPU has AVX512-BF16; elsewhere it says so and exits. `gemm_bf16_torch.py` beside it
//! times PyTorch's products on the same shapes.

use std::time::Instant;

use rookworld_lm::cpu_gemm::{self, gemm_bf16};

fn main() {
    if !cpu_gemm::avx512().bf16 {
        println!("this CPU has no AVX512-BF16: the mixed-precision product is not used here");
        return;
    }
    let repeats: usize = std::env::args()
        .skip(1)
        .find(|a| !a.starts_with('-'))
        .and_then(|a| a.parse().ok())
        .unwrap_or(3);
    let rows = 2200;
    let head_rows = 2048;
    // (name, M, K, N, a's strides, b's strides): dst (M, N) = a (M, K) · b (K, N).
    let mut shapes = Vec::new();
    for (name, k, n) in [
        ("qkv", 768, 2304),
        ("attn proj", 768, 768),
        ("fc", 768, 3072),
        ("mlp proj", 3072, 768),
    ] {
        // forward: X (rows, K) · W (K, N)
        shapes.push((format!("{name} fwd"), rows, k, n, (k, 1), (n, 1)));
        // input gradient: dY (rows, N) · Wᵀ (N, K), W stored (K, N)
        shapes.push((format!("{name} dX"), rows, n, k, (n, 1), (1, n)));
        // weight gradient: Xᵀ (K, rows) · dY (rows, N)
        shapes.push((format!("{name} dW"), k, rows, n, (1, k), (n, 1)));
    }
    // the LM head: tied embedding E (V, 768) used as Eᵀ
    let vocab = 50257;
    shapes.push(("head fwd".into(), head_rows, 768, vocab, (768, 1), (1, 768)));
    shapes.push((
        "head dX".into(),
        head_rows,
        vocab,
        768,
        (vocab, 1),
        (768, 1),
    ));
    shapes.push((
        "head dW".into(),
        vocab,
        head_rows,
        768,
        (1, vocab),
        (768, 1),
    ));

    println!(
        "threads {}; kernels {}",
        rayon::current_num_threads(),
        cpu_gemm::kernels_line()
    );
    println!(
        "{:<16} {:>6} {:>6} {:>6} {:>9} {:>9} {:>11}",
        "product", "M", "K", "N", "ms", "GFLOP/s", "rhs pack ms"
    );
    let (mut flops, mut seconds) = (0.0, 0.0);
    for (name, m, k, n, (ars, acs), (brs, bcs)) in shapes {
        let a = values((m - 1) * ars + (k - 1) * acs + 1, 1);
        let b = values((k - 1) * brs + (n - 1) * bcs + 1, 2);
        let mut dst = vec![0f32; m * n];
        let (mut best, mut pack) = (f64::INFINITY, f64::INFINITY);
        for _ in 0..repeats {
            let start = Instant::now();
            gemm_bf16(&mut dst, (m, n, k), false, (&a, ars, acs), (&b, brs, bcs));
            best = best.min(start.elapsed().as_secs_f64());
            let start = Instant::now();
            drop(std::hint::black_box(cpu_gemm::PackedRhs::new(
                (&b, brs, bcs),
                k,
                n,
            )));
            pack = pack.min(start.elapsed().as_secs_f64());
        }
        let f = 2.0 * (m * n * k) as f64;
        flops += f;
        seconds += best;
        println!(
            "{name:<16} {m:>6} {k:>6} {n:>6} {:>9.2} {:>9.1} {:>11.2}",
            best * 1e3,
            f / best / 1e9,
            pack * 1e3
        );
    }
    println!(
        "{:<16} {:>6} {:>6} {:>6} {:>9.2} {:>9.1}",
        "all",
        "",
        "",
        "",
        seconds * 1e3,
        flops / seconds / 1e9
    );
}

/// Deterministic values in [-1, 1).
fn values(len: usize, seed: u32) -> Vec<f32> {
    let mut state = seed.wrapping_mul(2_654_435_761).wrapping_add(1);
    (0..len)
        .map(|_| {
            state ^= state << 13;
            state ^= state >> 17;
            state ^= state << 5;
            state as f32 / u32::MAX as f32 * 2.0 - 1.0
        })
        .collect()
}

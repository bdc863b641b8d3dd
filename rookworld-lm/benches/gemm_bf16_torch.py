"""PyTorch's BF16 matrix products on the shapes of `cargo bench --bench gemm_bf16` (one GRPO
step of gpt2-124m at 4 x 8 x (46 + 64)), on the same threads: operands already BF16
(oneDNN's product alone), and f32 operands under BF16 autocast (each cast again per call,
as a training step's forward does).

    python3 -m venv /tmp/mlenv && /tmp/mlenv/bin/pip install torch
    /tmp/mlenv/bin/python rookworld-lm/benches/gemm_bf16_torch.py [--threads 2] [--repeats 5]

Prints ms and GFLOP/s per shape (best of the repeats) and over all of them.
"""

import argparse
import time

import torch


def shapes():
    rows, head_rows, vocab = 2200, 2048, 50257
    out = []
    for name, k, n in [("qkv", 768, 2304), ("attn proj", 768, 768), ("fc", 768, 3072), ("mlp proj", 3072, 768)]:
        out += [(f"{name} fwd", rows, k, n), (f"{name} dX", rows, n, k), (f"{name} dW", k, rows, n)]
    out += [("head fwd", head_rows, 768, vocab), ("head dX", head_rows, vocab, 768), ("head dW", vocab, head_rows, 768)]
    return out


def best_of(repeats, f):
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        f()
        best = min(best, time.perf_counter() - start)
    return best


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    print(f"{'product':<16} {'M':>6} {'K':>6} {'N':>6} {'bf16 ms':>9} {'GFLOP/s':>9} {'autocast ms':>12} {'GFLOP/s':>9}")
    total = {"flop": 0.0, "bf16": 0.0, "autocast": 0.0}
    for name, m, k, n in shapes():
        a, b = torch.randn(m, k), torch.randn(k, n)
        ab, bb = a.bfloat16(), b.bfloat16()

        def autocast():
            with torch.autocast("cpu", dtype=torch.bfloat16):
                return a @ b

        pure = best_of(args.repeats, lambda: ab @ bb)
        cast = best_of(args.repeats, autocast)
        flop = 2.0 * m * n * k
        total["flop"] += flop
        total["bf16"] += pure
        total["autocast"] += cast
        print(f"{name:<16} {m:>6} {k:>6} {n:>6} {pure * 1e3:>9.2f} {flop / pure / 1e9:>9.1f} {cast * 1e3:>12.2f} {flop / cast / 1e9:>9.1f}")
    f = total["flop"]
    print(f"{'all':<16} {'':>6} {'':>6} {'':>6} {total['bf16'] * 1e3:>9.2f} {f / total['bf16'] / 1e9:>9.1f} {total['autocast'] * 1e3:>12.2f} {f / total['autocast'] / 1e9:>9.1f}")


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""rollout-worker generation speed against Hugging Face transformers, side by side.

    cargo build --release -p rollout-worker
    python3 -m pip install torch transformers tokenizers
    python3 rollout-worker/bench/compare_transformers.py

Shape (the rollout-worker issue's benchmark): a gpt2-124m-shaped model with random
weights, 4 prompts x 8 completions of the 46-token start-position policy prompt, 64 new
tokens each (end-of-text ignored, so every row runs full length), f32 on the CPU,
sampling at temperature 1 with the KV cache; and one stream alone. transformers runs
`generate(do_sample=True, top_k=0, num_return_sequences=8, min_new_tokens=max_new_tokens)`;
rollout-worker runs `rollout-worker bench --preset gpt2-124m` (the engine, and the
reference static-batch path of `rookworld_lm::generate` on candle's matmul). All in this one
run, on this machine, one after the other (run it on an idle machine).
"""
import argparse
import json
import os
import subprocess
import time

import torch
import transformers
from tokenizers import Tokenizer
from transformers import GPT2Config, GPT2LMHeadModel

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PROMPT = "P: rnbqkbnr/pppppppp/8/8/8/8/PPPPPPPP/RNBQKBNR w KQkq - 0 1    M:"


def hf_rate(model, ids, prompts, n, new_tokens, repeat):
    prompt = torch.tensor([ids] * prompts)
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        with torch.no_grad():
            out = model.generate(
                prompt,
                attention_mask=torch.ones_like(prompt),
                do_sample=True,
                top_k=0,
                temperature=1.0,
                num_return_sequences=n,
                max_new_tokens=new_tokens,
                min_new_tokens=new_tokens,
                pad_token_id=50256,
            )
        best = min(best, time.perf_counter() - start)
        assert out.shape == (prompts * n, len(ids) + new_tokens), out.shape
    return prompts * n * new_tokens / best


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--binary", default=os.path.join(ROOT, "target", "release", "rollout-worker"))
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("-n", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--repeat", type=int, default=2)
    args = ap.parse_args()

    ids = Tokenizer.from_file(os.path.join(ROOT, "rookworld-lm", "assets", "gpt2-tokenizer.json")).encode(
        PROMPT, add_special_tokens=False).ids
    assert len(ids) == 46

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config()).eval()  # gpt2-124m shape, random weights, f32
    hf_rate(model, ids, 1, 1, 4, 1)  # warm-up
    hf_batch = hf_rate(model, ids, args.prompts, args.n, args.max_new_tokens, args.repeat)
    hf_single = hf_rate(model, ids, 1, 1, args.max_new_tokens, args.repeat)

    out = subprocess.run(
        [args.binary, "bench", "--preset", "gpt2-124m", "--prompts", str(args.prompts), "-n", str(args.n),
         "--max-new-tokens", str(args.max_new_tokens), "--repeat", str(args.repeat)],
        check=True, capture_output=True, text=True, env={**os.environ, "RUST_LOG": "warn"},
    )
    ours = json.loads(out.stdout)
    print(f"torch {torch.__version__} ({torch.get_num_threads()} threads), transformers {transformers.__version__}; "
          f"{args.prompts} prompts x {args.n} completions, {len(ids)}-token prompt, {args.max_new_tokens} new tokens, "
          f"f32 CPU, best of {args.repeat}")
    print(f"{'shape':24} {'transformers tok/s':>19} {'rollout-worker tok/s':>21} {'ratio':>7}")
    for name, hf, r in [
        (f"{args.prompts} x {args.n} batch", hf_batch, ours["batch"]["tokens_per_second"]),
        ("1 stream", hf_single, ours["single"]["tokens_per_second"]),
        (f"{args.prompts} x {args.n} reference path", hf_batch, ours["reference_batch"]["tokens_per_second"]),
    ]:
        print(f"{name:24} {hf:19,.1f} {r:21,.1f} {r / hf:6.2f}x")


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""rollout-worker generation speed against transformers and CTranslate2, side by side.

    cargo build --release -p rollout-worker
    python3 -m pip install torch transformers tokenizers ctranslate2
    python3 rollout-worker/bench/compare_transformers.py [--precisions f32,bf16]

Shape (the rollout-worker issue's benchmark): one gpt2-124m-shaped checkpoint with seeded
random weights, written once as a Hugging Face directory that every side loads; 4 prompts
x 8 completions of the 46-token start-position policy prompt, 64 new tokens each, on the
CPU, sampling at temperature 1 over the whole vocabulary with a KV cache; and one stream
alone. Peers, each in its best configurations:
  transformers  `generate(do_sample=True, top_k=0, num_return_sequences=8)`, f32 and BF16
                (`torch_dtype=torch.bfloat16`) when the CPU has BF16 dot products
  CTranslate2   the same directory converted by its own converter, `generate_batch(
                sampling_topk=0, num_hypotheses=8)`, in every compute type this CPU supports
                of float32, int8, int8_float32, bfloat16, int8_bfloat16
Ours, in every `--precisions` value (`int8@avx2` is int8 kept to the AVX2 kernels): `rollout-worker bench` (generation only, best of
`--repeat`, as the peers are timed) and `rollout-worker generate` timed as a whole process
(start, checkpoint load, packing, generation, output). All in this one run, one after the
other, on `--threads` threads (run it on an idle machine). Prints one table with each
rate and its ratio to the best peer, then one JSON line.
"""
import argparse
import json
import os
import shutil
import subprocess
import tempfile
import time

import torch
import transformers
from tokenizers import Tokenizer
from transformers import GPT2Config, GPT2LMHeadModel

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PROMPT = "P: rnbqkbnr/pppppppp/8/8/8/8/PPPPPPPP/RNBQKBNR w KQkq - 0 1    M:"
TOKENIZER = os.path.join(ROOT, "rookworld-lm", "assets", "gpt2-tokenizer.json")
CT2_TYPES = ["float32", "int8", "int8_float32", "bfloat16", "int8_bfloat16"]


def best_of(repeat, run):
    """The fastest of `repeat` timed calls of `run`, which returns the tokens it made."""
    best, tokens = float("inf"), 0
    for _ in range(repeat):
        start = time.perf_counter()
        tokens = run()
        best = min(best, time.perf_counter() - start)
    return tokens / best


def hf_rate(model, ids, prompts, n, new_tokens, repeat):
    prompt = torch.tensor([ids] * prompts)

    def run():
        with torch.no_grad():
            out = model.generate(prompt, attention_mask=torch.ones_like(prompt), do_sample=True, top_k=0,
                                 temperature=1.0, num_return_sequences=n, max_new_tokens=new_tokens,
                                 min_new_tokens=new_tokens, pad_token_id=50256)
        assert out.shape == (prompts * n, len(ids) + new_tokens), out.shape
        return prompts * n * new_tokens

    return best_of(repeat, run)


def ct2_rate(generator, tokens, prompts, n, new_tokens, repeat):
    def run():
        results = generator.generate_batch([tokens] * prompts, max_length=new_tokens, min_length=new_tokens,
                                           sampling_topk=0, sampling_temperature=1.0, num_hypotheses=n,
                                           include_prompt_in_result=False)
        made = sum(len(seq) for r in results for seq in r.sequences_ids)
        assert made == prompts * n * new_tokens, made
        return made

    return best_of(repeat, run)


def ours_bench(args, model_dir, config):
    precision = config.split("@")[0]
    out = subprocess.run(
        [args.binary, "bench", "--model", model_dir, "--weight-dtype", precision, "--prompts", str(args.prompts),
         "-n", str(args.n), "--max-new-tokens", str(args.max_new_tokens), "--repeat", str(args.repeat)],
        check=True, capture_output=True, text=True, env=ours_env(args, config),
    )
    return json.loads(out.stdout)


def ours_generate(args, model_dir, config):
    """New tokens/s of `rollout-worker generate` as a whole process, best of `--repeat`."""
    precision = config.split("@")[0]
    cmd = [args.binary, "generate", "--model", model_dir, "--weight-dtype", precision, "-n", str(args.n),
           "--max-new-tokens", str(args.max_new_tokens), "--temperature", "1"]
    for _ in range(args.prompts):
        cmd += ["--prompt", PROMPT]

    def run():
        out = subprocess.run(cmd, check=True, capture_output=True, text=True, env=ours_env(args, config))
        return sum(len(c["ids"]) for line in out.stdout.splitlines() for c in json.loads(line)["completions"])

    return best_of(args.repeat, run)


def ours_env(args, config):
    """Our environment for `config`: a precision, with `@avx2` to keep the CPU kernels to AVX2,
    `@avx512` to keep them off AMX tiles."""
    env = {**os.environ, "RUST_LOG": "warn", "RAYON_NUM_THREADS": str(args.threads)}
    for kernels in ("avx2", "avx512"):
        if config.endswith("@" + kernels):
            env["ROOKWORLD_CPU_KERNELS"] = kernels
    return env


def cpu_features():
    try:
        flags = next(line for line in open("/proc/cpuinfo") if line.startswith("flags")).split()
        name = next(line for line in open("/proc/cpuinfo") if line.startswith("model name")).split(":", 1)[1]
    except (OSError, StopIteration):
        return "unknown CPU"
    wanted = ["avx2", "fma", "avx512f", "avx512_bf16", "avx512_vnni", "avx_vnni", "amx_tile", "amx_bf16", "amx_int8"]
    return f"{name.strip()}: {' '.join(f for f in wanted if f in flags)}"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--binary", default=os.path.join(ROOT, "target", "release", "rollout-worker"))
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("-n", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--precisions", default="f32,bf16",
                    help="rollout-worker --weight-dtype values to run; PRECISION@avx2 runs one with "
                         "ROOKWORLD_CPU_KERNELS=avx2 (no AVX-512 dot products), PRECISION@avx512 with "
                         "ROOKWORLD_CPU_KERNELS=avx512 (no AMX tiles), to compare in the same run")
    ap.add_argument("--skip-single", action="store_true", help="only the P x G batch")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    tok = Tokenizer.from_file(TOKENIZER)
    ids = tok.encode(PROMPT, add_special_tokens=False).ids
    assert len(ids) == 46
    work = tempfile.mkdtemp(prefix="rollout-compare-")
    try:
        model_dir = os.path.join(work, "hf")
        torch.manual_seed(0)
        model = GPT2LMHeadModel(GPT2Config()).eval()  # gpt2-124m shape, random weights, f32
        model.save_pretrained(model_dir)
        shutil.copy(TOKENIZER, os.path.join(model_dir, "tokenizer.json"))
        with open(os.path.join(model_dir, "tokenizer_config.json"), "w") as f:
            json.dump({"tokenizer_class": "GPT2Tokenizer", "model_max_length": 1024}, f)

        shapes = [("batch", args.prompts, args.n)] + ([] if args.skip_single else [("single", 1, 1)])
        rows = []  # (side, config, shape, tok/s)
        cpu_bf16 = "avx512_bf16" in cpu_features() or "amx_bf16" in cpu_features()
        hf_dtypes = [("f32", torch.float32)] + ([("bf16", torch.bfloat16)] if cpu_bf16 else [])
        for name, dtype in hf_dtypes:
            m = model.to(dtype)
            hf_rate(m, ids, 1, 1, 4, 1)  # warm-up
            for shape, p, n in shapes:
                rows.append(("transformers", name, shape, hf_rate(m, ids, p, n, args.max_new_tokens, args.repeat)))
        model = model.float()

        import ctranslate2
        from ctranslate2.converters import TransformersConverter

        supported = ctranslate2.get_supported_compute_types("cpu")
        ct2_dirs = {}
        for ct in [t for t in CT2_TYPES if t in supported]:
            weights = "int8" if ct.startswith("int8") else ("bfloat16" if ct == "bfloat16" else None)
            if weights not in ct2_dirs:
                ct2_dirs[weights] = os.path.join(work, f"ct2-{weights or 'float32'}")
                TransformersConverter(model_dir).convert(ct2_dirs[weights], quantization=weights, force=True)
            gen = ctranslate2.Generator(ct2_dirs[weights], device="cpu", compute_type=ct,
                                        intra_threads=args.threads, inter_threads=1)
            tokens = [tok.id_to_token(i) for i in ids]
            ct2_rate(gen, tokens, 1, 1, 4, 1)  # warm-up
            for shape, p, n in shapes:
                rows.append(("CTranslate2", ct, shape, ct2_rate(gen, tokens, p, n, args.max_new_tokens, args.repeat)))
            del gen

        peers = {shape: max((r for r in rows if r[2] == shape), key=lambda r: r[3]) for shape, _, _ in shapes}
        for precision in args.precisions.split(","):
            bench = ours_bench(args, model_dir, precision)
            for shape, _, _ in shapes:
                rows.append(("rollout-worker bench", precision, shape, bench[shape]["tokens_per_second"]))
            rows.append(("rollout-worker generate", precision, "batch", ours_generate(args, model_dir, precision)))
    finally:
        shutil.rmtree(work, ignore_errors=True)

    print(f"{cpu_features()}; {args.threads} threads; torch {torch.__version__}, transformers "
          f"{transformers.__version__}, ctranslate2 {ctranslate2.__version__}; {args.prompts} prompts x {args.n} "
          f"completions, {len(ids)}-token prompt, {args.max_new_tokens} new tokens, best of {args.repeat}")
    print(f"{'side':24} {'configuration':14} {'shape':7} {'new tok/s':>10} {'× best peer':>11}")
    for side, config, shape, rate in rows:
        print(f"{side:24} {config:14} {shape:7} {rate:10,.1f} {rate / peers[shape][3]:10.2f}x")
    peer_batch = [r for r in rows if r[2] == "batch" and not r[0].startswith("rollout-worker")]
    ours_batch = [r for r in rows if r[2] == "batch" and r[0].startswith("rollout-worker")]
    print(f"\n{'batch: ours / peer':34}" + "".join(f" {f'{r[0][:4]} {r[1]}':>18}" for r in peer_batch))
    for side, config, _, rate in ours_batch:
        print(f"{side + ' ' + config:34}" + "".join(f" {rate / r[3]:17.2f}x" for r in peer_batch))
    print(json.dumps({
        "cpu": cpu_features(),
        "best_peer": {s: {"side": r[0], "config": r[1], "tokens_per_second": r[3]} for s, r in peers.items()},
        "rows": [dict(side=s, config=c, shape=sh, tokens_per_second=r) for s, c, sh, r in rows],
    }))


if __name__ == "__main__":
    main()

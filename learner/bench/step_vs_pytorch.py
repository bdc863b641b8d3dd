#!/usr/bin/env python3
"""One GRPO step in PyTorch beside `learner bench`, same shapes, same machine, same run.

PyTorch's step: a GPT-2 (the given preset's shape, random weights) with f32 master weights
and `scaled_dot_product_attention`; the reference forward under no_grad; the policy forward
and backward over every completion's `prompt ++ completion` sequence (as GRPO trainers
run it), LM head on the completion positions only (the `head` option `all` puts every
position through it, as TRL does); the GRPO loss (clipped ratio against behaviour
log-probs, k3 KL, sequence aggregation); gradient clipping; `torch.optim.AdamW(fused=True)`.

PyTorch runs in each configuration of `--torch-configs`, each in a process of its own (so
each one's peak RSS is its own), one after the other in this run:
  f32           eager, f32
  bf16          eager, forward passes under `torch.autocast(dtype=torch.bfloat16)`
  compile-f32   `torch.compile` of the forward (and through it the backward), f32
  compile-bf16  `torch.compile` + BF16 autocast: what GPU tuning guides for GRPO recommend
The default on the CPU is `f32,bf16,compile-bf16`; on CUDA `bf16` (`f32` with
`--no-autocast`). The compile time is the warm-up step, reported apart and not timed.
`learner bench` runs with `--matmul-precision` (default auto). Both run on `--threads` threads
(default 2). With `--device cuda` both run on the GPU; times are taken after
`torch.cuda.synchronize()`, memory is `torch.cuda.max_memory_allocated`.

Usage:  python3 learner/bench/step_vs_pytorch.py [--learner target/release/learner]
        [--prompts 4] [--group 8] [--prompt-tokens 46] [--completion-tokens 64]
        [--steps 1] [--threads 2] [--head completions|all] [--skip-learner]
        [--device cpu|cuda] [--no-autocast] [--torch-configs f32,bf16,compile-bf16]
        [--precision auto|f32|bf16[,...]] [--paths auto|fused|autograd[,...]]
Needs torch (CPU is enough). Prints each side's JSON line, a table, then one JSON line
with the ratios: against each configuration and against PyTorch's best.
"""

import argparse
import contextlib
import importlib.util
import json
import math
import os
import resource
import subprocess
import sys
import time

PRESETS = {
    "gpt2-124m": dict(n_layer=12, n_head=12, n_embd=768, vocab=50257, n_positions=1024),
    "tiny": dict(n_layer=2, n_head=4, n_embd=64, vocab=50257, n_positions=256),
}


CONFIGS = {
    "f32": dict(autocast=False, compile=False),
    "bf16": dict(autocast=True, compile=False),
    "compile-f32": dict(autocast=False, compile=True),
    "compile-bf16": dict(autocast=True, compile=True),
}


def torch_step(args, config):
    import torch
    import torch.nn.functional as F

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    dev = torch.device(args.device)
    cuda = dev.type == "cuda"
    if cuda:
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True

    def sync():
        if cuda:
            torch.cuda.synchronize()

    mode = CONFIGS[config]

    def autocast():
        if mode["autocast"]:
            return torch.autocast(dev.type, dtype=torch.bfloat16)
        return contextlib.nullcontext()
    cfg = PRESETS[args.preset]
    E, H, L, V = cfg["n_embd"], cfg["n_head"], cfg["n_layer"], cfg["vocab"]

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.ln_1 = torch.nn.LayerNorm(E, eps=1e-5)
            self.c_attn = torch.nn.Linear(E, 3 * E)
            self.c_proj = torch.nn.Linear(E, E)
            self.ln_2 = torch.nn.LayerNorm(E, eps=1e-5)
            self.c_fc = torch.nn.Linear(E, 4 * E)
            self.mlp_proj = torch.nn.Linear(4 * E, E)

        def forward(self, x):
            B, T, _ = x.shape
            q, k, v = self.c_attn(self.ln_1(x)).split(E, dim=2)
            q, k, v = (t.view(B, T, H, E // H).transpose(1, 2) for t in (q, k, v))
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            x = x + self.c_proj(y.transpose(1, 2).reshape(B, T, E))
            return x + self.mlp_proj(F.gelu(self.c_fc(self.ln_2(x)), approximate="tanh"))

    class GPT(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.wte = torch.nn.Embedding(V, E)
            self.wpe = torch.nn.Embedding(cfg["n_positions"], E)
            self.h = torch.nn.ModuleList(Block() for _ in range(L))
            self.ln_f = torch.nn.LayerNorm(E, eps=1e-5)
            for p in self.parameters():
                torch.nn.init.normal_(p, std=0.02)

        def hidden(self, ids):
            pos = torch.arange(ids.shape[1], device=ids.device)
            x = self.wte(ids) + self.wpe(pos)
            for b in self.h:
                x = b(x)
            return self.ln_f(x)

    policy, reference = GPT().to(dev), GPT().to(dev)
    reference.load_state_dict(policy.state_dict())
    reference.requires_grad_(False)
    opt = torch.optim.AdamW(policy.parameters(), lr=1e-5, weight_decay=0.01, fused=True)

    P, G, Lp, Lc = args.prompts, args.group, args.prompt_tokens, args.completion_tokens
    gen = torch.Generator().manual_seed(args.seed)
    prompts = torch.randint(0, V, (P, Lp), generator=gen)
    comps = torch.randint(0, V, (P, G, Lc), generator=gen)
    ids = torch.cat([prompts[:, None, :].expand(P, G, Lp), comps], dim=2).reshape(P * G, Lp + Lc)
    rewards = torch.tensor([[((g + p) % G) / G for g in range(G)] for p in range(P)])
    adv = (rewards - rewards.mean(1, keepdim=True)) / (rewards.std(1, keepdim=True) + 1e-4)
    adv = adv.reshape(P * G, 1)
    old = -(9.0 + 3.0 * torch.rand(P * G, Lc, generator=gen))
    ids, adv, old = ids.to(dev), adv.to(dev), old.to(dev)
    targets = ids[:, Lp:]  # (C, Lc), predicted from positions Lp-1 .. Lp+Lc-2

    def logprobs(model, ids):
        with autocast():
            return head_logprobs(model, ids)

    if mode["compile"]:
        logprobs = torch.compile(logprobs)

    def head_logprobs(model, ids):
        h = model.hidden(ids[:, :-1])  # (C, T-1, E)
        if args.head == "all":
            logits = h @ model.wte.weight.T
            logits = logits[:, Lp - 1 :]
        else:
            logits = h[:, Lp - 1 :] @ model.wte.weight.T  # (C, Lc, V)
        return torch.log_softmax(logits.float(), -1).gather(-1, targets[..., None])[..., 0]

    def step():
        sync()
        t0 = time.perf_counter()
        with torch.no_grad():
            ref = logprobs(reference, ids)
        sync()
        t1 = time.perf_counter()
        logp = logprobs(policy, ids)
        ratio = torch.exp(torch.clamp(logp - old, -20, 20))
        surr = -torch.min(ratio * adv, torch.clamp(ratio, 0.8, 1.2) * adv)
        d = torch.clamp(ref - logp, -20, 20)
        kl = torch.exp(d) - d - 1
        loss = (surr.mean(1) + 0.04 * kl.mean(1)).mean()
        sync()
        t2 = time.perf_counter()
        loss.backward()
        sync()
        t3 = time.perf_counter()
        norm = torch.nn.utils.clip_grad_norm_(policy.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        sync()
        t4 = time.perf_counter()
        return dict(step=t4 - t0, reference=t1 - t0, forward=t2 - t1, backward=t3 - t2,
                    clip_optimizer=t4 - t3, loss=loss.item(), grad_norm=norm.item())

    warm = time.perf_counter()
    step()  # warm-up (and compilation), as `learner bench` warms up
    warm = time.perf_counter() - warm
    runs = [step() for _ in range(max(1, args.steps))]
    mean = {k: sum(r[k] for r in runs) / len(runs) for k in runs[0]}
    return {
        "side": "pytorch",
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "device": str(dev),
        "config": config,
        "autocast_bf16": mode["autocast"],
        "compiled": mode["compile"],
        "warm_up_seconds": warm,
        "head": args.head,
        "step_seconds": mean["step"],
        "phases": {k: mean[k] for k in ("reference", "forward", "backward", "clip_optimizer")},
        "tokens_per_second": P * G * (Lp + Lc) / mean["step"],
        "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "peak_device_memory_bytes": torch.cuda.max_memory_allocated() if cuda else None,
        "loss": mean["loss"],
    }


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--learner", default="target/release/learner")
    ap.add_argument("--preset", default="gpt2-124m", choices=sorted(PRESETS))
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--prompt-tokens", type=int, default=46)
    ap.add_argument("--completion-tokens", type=int, default=64)
    ap.add_argument("--micro-batch-groups", type=int, default=1)
    ap.add_argument("--steps", type=int, default=1)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--head", default="completions", choices=["completions", "all"])
    ap.add_argument("--skip-learner", action="store_true")
    ap.add_argument("--device", default="cpu", help="cpu or cuda (both sides)")
    ap.add_argument("--peak-tflops", type=float,
                    help="the device's dense peak for the learner's MFU (e.g. 989 for BF16 on an H100)")
    ap.add_argument("--no-autocast", dest="autocast", action="store_false",
                    help="on CUDA, run PyTorch's forward in f32 (TF32) instead of BF16 autocast")
    ap.add_argument("--torch-configs",
                    help="comma-separated PyTorch configurations: f32, bf16, compile-f32, compile-bf16 "
                         "(default: f32,bf16,compile-bf16 on the CPU; bf16 on CUDA, f32 with --no-autocast)")
    ap.add_argument("--precision",
                    help="learner bench's --matmul-precision: auto, f32 or bf16, or several comma-separated, each "
                         "its own row (the fastest is the one compared); PRECISION@avx512 keeps the CPU kernels "
                         "off AMX tiles, PRECISION@avx2 to AVX2 (ROOKWORLD_CPU_KERNELS); default: auto on the "
                         "CPU, on CUDA PyTorch's")
    ap.add_argument("--paths", default="auto",
                    help="learner bench's --path: auto, fused or autograd, or several comma-separated, each "
                         "its own row (the fastest is the one compared; one that fails is reported and left out)")
    ap.add_argument("--torch-only", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.torch_only:  # one configuration, in a process of its own
        print(json.dumps(torch_step(args, args.torch_only)))
        return
    if args.torch_configs:
        configs = args.torch_configs.split(",")
    elif args.device == "cpu":
        configs = ["f32", "bf16", "compile-bf16"]
    else:
        configs = ["bf16" if args.autocast else "f32"]
    unknown = [c for c in configs if c not in CONFIGS]
    if unknown:
        sys.exit(f"unknown --torch-configs {unknown}: use {', '.join(CONFIGS)}")

    ours, ours_all = None, []
    if not args.skip_learner:
        if args.precision:
            precisions = args.precision.split(",")
        elif args.device != "cpu":  # the same precision as PyTorch's side
            precisions = ["bf16" if args.autocast else "f32"]
        else:
            precisions = [None]
        bad = [p for p in precisions if p is not None and p.split("@")[0] not in ("auto", "f32", "bf16")
               or p is not None and p.split("@")[1:] not in ([], ["avx2"], ["avx512"])]
        if bad:
            sys.exit(f"unknown --precision {bad}: use auto, f32, bf16 (each with @avx512 or @avx2 to keep the "
                     "CPU kernels off AMX tiles or to AVX2)")
        paths = args.paths.split(",")
        bad = [p for p in paths if p not in ("auto", "fused", "autograd")]
        if bad:
            sys.exit(f"unknown --paths {bad}: use auto, fused, autograd")
        for precision in precisions:
            for path in paths:
                cmd = [args.learner, "bench", "--preset", args.preset, "--prompts-per-step", str(args.prompts),
                       "--group-size", str(args.group), "--prompt-tokens", str(args.prompt_tokens),
                       "--completion-tokens", str(args.completion_tokens),
                       "--micro-batch-groups", str(args.micro_batch_groups), "--steps", str(args.steps),
                       "--device", args.device, "--path", path]
                if args.peak_tflops:
                    cmd += ["--peak-tflops", str(args.peak_tflops)]
                env = dict(os.environ, RAYON_NUM_THREADS=str(args.threads))
                if precision:
                    cmd += ["--matmul-precision", precision.split("@")[0]]
                    if "@" in precision:
                        env["ROOKWORLD_CPU_KERNELS"] = precision.split("@")[1]
                out = subprocess.run(cmd, env=env, capture_output=True, text=True)
                label = f"{precision or 'auto'} {path}"
                if out.returncode != 0:
                    tail = out.stderr.strip().splitlines()[-3:]
                    print(json.dumps({"side": "learner", "run": label, "failed": " | ".join(tail)}))
                    continue
                run = json.loads(out.stdout.strip().splitlines()[-1])
                run["precision"] = precision or "auto"
                run["run"] = label
                ours_all.append(run)
                print(json.dumps(run))
        if not ours_all:
            sys.exit("learner bench failed on every --paths and --precision")
        ours = min(ours_all, key=lambda r: r["step_seconds"])
    if importlib.util.find_spec("torch") is None:
        # The learner's side ran; PyTorch's cannot (the GPU check's CPU dry run in CI).
        print(json.dumps({"skipped": "no torch: PyTorch's side not run",
                          "learner_step_seconds": ours["step_seconds"] if ours else None}))
        return
    runs = {}
    for config in configs:
        cmd = [sys.executable, os.path.abspath(__file__), "--torch-only", config]
        cmd += [a for a in sys.argv[1:] if a != "--skip-learner"] + ["--skip-learner"]
        out = subprocess.run(cmd, capture_output=True, text=True)
        if out.returncode != 0:
            tail = out.stderr.strip().splitlines()[-3:]
            print(json.dumps({"side": "pytorch", "config": config, "failed": " | ".join(tail)}))
            continue
        runs[config] = json.loads(out.stdout.strip().splitlines()[-1])
        print(json.dumps(runs[config]))
    if not runs:
        sys.exit("no PyTorch configuration ran")
    best = min(runs, key=lambda c: runs[c]["step_seconds"])
    theirs = runs[best]
    print(f"{'':32} {'step (s)':>9} {'reference':>9} {'forward':>8} {'backward':>8} {'clip+AdamW':>10} "
          f"{'peak RSS':>9} {'learner ×':>9}")
    rows = [(f"PyTorch {c}", r) for c, r in runs.items()]
    for run in ours_all:
        rows.append((f"learner {run['run']} ({run.get('matmul_dtype') or 'f32'})", run))
    for name, r in rows:
        ph = r["phases"]
        clip = ph.get("clip_optimizer", ph.get("clip", 0) + ph.get("optimizer", 0))
        ratio = f"{r['step_seconds'] / ours['step_seconds']:8.2f}x" if ours and r is not ours else ""
        print(f"{name:32} {r['step_seconds']:9.2f} {ph['reference']:9.2f} {ph['forward']:8.2f} "
              f"{ph['backward']:8.2f} {clip:10.2f} {r['peak_rss_bytes'] / 2**30:8.1f}G {ratio:>9}")
    if ours:
        print(json.dumps({
            "speedup_vs_pytorch": theirs["step_seconds"] / ours["step_seconds"],
            "pytorch_best_config": best,
            "speedup_vs_each": {c: r["step_seconds"] / ours["step_seconds"] for c, r in runs.items()},
            "learner_step_seconds": ours["step_seconds"],
            "pytorch_step_seconds": theirs["step_seconds"],
            "learner_peak_rss_gib": ours["peak_rss_bytes"] / 2**30,
            "pytorch_peak_rss_gib": theirs["peak_rss_bytes"] / 2**30,
            "shape": f"{args.prompts} x {args.group} x ({args.prompt_tokens} + {args.completion_tokens})",
            "threads": args.threads,
            "device": args.device,
            "learner_mfu": ours.get("mfu"),
            "learner_peak_tflops": ours.get("peak_tflops"),
            "learner_phases": ours.get("phases"),
            "pytorch_phases": theirs["phases"],
            "pytorch_peak_device_memory_bytes": theirs["peak_device_memory_bytes"],
            "learner_device_memory_bytes": ours.get("device_memory_bytes"),
            "learner_matmul_dtype": ours.get("matmul_dtype"),
            "learner_train_ops": ours.get("train_ops"),
            "learner_run": ours["run"],
            "learner_step_seconds_by_run": {r["run"]: r["step_seconds"] for r in ours_all},
        }))


if __name__ == "__main__":
    main()

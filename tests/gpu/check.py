#!/usr/bin/env python3
"""Helpers of `tests/gpu-check.sh`: the GPU's description, its copy bandwidth, transformers'
`generate` on the bench shape, a scrape of the worker's NVML gauges, and the final table.

    python3 tests/gpu/check.py device OUT.json [--device cuda]
    python3 tests/gpu/check.py copy-bandwidth OUT.json [--device cuda]
    python3 tests/gpu/check.py hf-generate OUT.json --prompts 32 -n 8 --max-new-tokens 64
            [--device cuda] [--dtype bf16] [--preset gpt2-124m]
    python3 tests/gpu/check.py scrape URL OUT.json --while-pid PID
    python3 tests/gpu/check.py train-summary RUN.jsonl OUT.json
    python3 tests/gpu/check.py table OUT_DIR

`OUT.json` may be `-`: the JSON line goes to stdout only.

Every command writes one JSON object; `table` reads the directory's and prints one table
(and writes `summary.json` beside them). The sections that need PyTorch record
`{"skipped": ...}` where it is not installed, so the script's flow runs on any machine.
"""

import argparse
import glob
import json
import os
import re
import subprocess
import sys
import time
import urllib.request

PROMPT = "P: rnbqkbnr/pppppppp/8/8/8/8/PPPPPPPP/RNBQKBNR w KQkq - 0 1    M:"
PRESETS = {
    "gpt2-124m": dict(n_layer=12, n_head=12, n_embd=768, n_positions=1024),
    "tiny": dict(n_layer=2, n_head=4, n_embd=64, n_positions=256),
}
VOCAB = 50257
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def write(path, obj):
    """`obj` as one JSON line on stdout, and into `path` unless it is `-`."""
    if path != "-":
        write_quiet(path, obj)
    print(json.dumps(obj))


def torch_or_none():
    try:
        import torch

        return torch
    except ImportError:
        return None


def cmd_device(args):
    out = {"requested": args.device}
    try:
        smi = subprocess.run(
            ["nvidia-smi", "--query-gpu=name,driver_version,memory.total,power.limit,compute_cap",
             "--format=csv,noheader"], capture_output=True, text=True, timeout=30)
        out["nvidia_smi"] = smi.stdout.strip() or smi.stderr.strip()
    except (OSError, subprocess.TimeoutExpired) as e:
        out["nvidia_smi"] = f"unavailable: {e}"
    torch = torch_or_none()
    if torch is not None:
        out["torch"] = torch.__version__
        out["torch_cuda"] = torch.version.cuda
        if torch.cuda.is_available():
            p = torch.cuda.get_device_properties(0)
            out.update(name=p.name, capability=f"{p.major}.{p.minor}",
                       memory_bytes=p.total_memory, multiprocessors=p.multi_processor_count)
    write(args.out, out)


def cmd_copy_bandwidth(args):
    torch = torch_or_none()
    if torch is None:
        return write(args.out, {"skipped": "no torch"})
    dev = torch.device(args.device)
    n = (1 << 30) if dev.type == "cuda" else (256 << 20)
    src = torch.empty(n, dtype=torch.uint8, device=dev)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(10):
        if dev.type == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        dst.copy_(src)
        if dev.type == "cuda":
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t)
    out = {"device": str(dev), "bytes": n, "seconds": best,
           "gb_per_second": 2 * n / best / 1e9}  # a copy reads and writes every byte
    if dev.type == "cuda":
        # The other ceiling: a dense BF16 matrix product on random data (the MFU's peak is
        # the datasheet's; this is what the card gives here), the median of 10 by events.
        k = 8192
        a, b = (torch.randn(k, k, device=dev, dtype=torch.bfloat16) for _ in range(2))
        for _ in range(3):
            a @ b
        times = []
        for _ in range(10):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            a @ b
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        times.sort()
        out["bf16_matmul_tflops"] = 2 * k**3 / times[len(times) // 2] / 1e12
    write(args.out, out)


def cmd_hf_generate(args):
    torch = torch_or_none()
    if torch is None:
        return write(args.out, {"skipped": "no torch"})
    import transformers
    from tokenizers import Tokenizer

    cfg = PRESETS[args.preset]
    dtype = {"bf16": torch.bfloat16, "f32": torch.float32, "f16": torch.float16}[args.dtype]
    dev = torch.device(args.device)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=VOCAB, n_positions=cfg["n_positions"], n_embd=cfg["n_embd"],
        n_layer=cfg["n_layer"], n_head=cfg["n_head"])).to(dev, dtype).eval()
    tok = Tokenizer.from_file(os.path.join(ROOT, "rookworld-lm", "assets", "gpt2-tokenizer.json"))
    ids = tok.encode(PROMPT).ids
    prompt = torch.tensor([ids] * args.prompts, device=dev)

    def run():
        if dev.type == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        with torch.no_grad():
            out = model.generate(prompt, attention_mask=torch.ones_like(prompt), do_sample=True,
                                 top_k=0, temperature=1.0, num_return_sequences=args.n,
                                 max_new_tokens=args.max_new_tokens,
                                 min_new_tokens=args.max_new_tokens, pad_token_id=50256)
        if dev.type == "cuda":
            torch.cuda.synchronize()
        assert out.shape == (args.prompts * args.n, len(ids) + args.max_new_tokens), out.shape
        return time.perf_counter() - t

    run()  # warm-up
    best = min(run() for _ in range(max(1, args.repeat)))
    tokens = args.prompts * args.n * args.max_new_tokens
    write(args.out, {"side": "transformers", "transformers": transformers.__version__,
                     "device": str(dev), "dtype": args.dtype, "prompts": args.prompts,
                     "completions_per_prompt": args.n, "prompt_tokens": len(ids),
                     "new_tokens": tokens, "seconds": best, "tokens_per_second": tokens / best})


GAUGES = ("rollout_gpu_utilization_ratio", "rollout_gpu_memory_busy_ratio",
          "rollout_gpu_power_watts", "rollout_gpu_memory_used_bytes",
          "rollout_gpu_memory_total_bytes")


def cmd_scrape(args):
    peak, scrapes, errors = {}, 0, 0
    while True:
        alive = args.while_pid is None or os.path.exists(f"/proc/{args.while_pid}")
        try:
            text = urllib.request.urlopen(args.url, timeout=2).read().decode()
            scrapes += 1
            for line in text.splitlines():
                m = re.match(r"^(\w+)(?:\{[^}]*\})? ([0-9.eE+-]+)$", line)
                if m and m.group(1) in GAUGES:
                    peak[m.group(1)] = max(peak.get(m.group(1), float("-inf")), float(m.group(2)))
        except OSError:
            errors += 1
        if not alive or (args.seconds and scrapes + errors >= args.seconds):
            break
        time.sleep(1)
    write(args.out, {"url": args.url, "scrapes": scrapes, "failed_scrapes": errors,
                     "peak": peak})


def cmd_train_summary(args):
    steps, finite, last = 0, 0, None
    with open(args.jsonl) as f:
        for line in f:
            rec = json.loads(line)
            if "loss" not in rec:
                continue
            steps += 1
            finite += all(isinstance(rec.get(k), (int, float)) and abs(rec[k]) < float("inf")
                          for k in ("loss", "policy_loss", "kl", "grad_norm"))
            last = rec
    write(args.out, {"steps": steps, "finite_losses": finite, "last": last})


def load(out_dir):
    data = {}
    for path in sorted(glob.glob(os.path.join(out_dir, "*.json"))):
        name = os.path.basename(path)[:-5]
        if name == "summary":
            continue
        try:
            with open(path) as f:
                lines = [l for l in f.read().splitlines() if l.strip()]
            data[name] = json.loads(lines[-1]) if lines else {"error": "empty"}
        except (OSError, ValueError) as e:
            data[name] = {"error": f"unreadable: {e}"}
    return data


def problem(section):
    """A section's error or reason for being skipped, or ''."""
    return section.get("error") or section.get("skipped") or ""


def kv_bytes_per_step(cfg, prompts, rows, prompt_tokens, new_tokens):
    """BF16 bytes of K and V a decode step reads on average: each group's prompt once, each
    row's own suffix (half the new tokens on average)."""
    per_token = cfg["n_layer"] * 2 * cfg["n_embd"] * 2
    return per_token * (prompts * prompt_tokens + rows * new_tokens / 2)


def weight_bytes(cfg):
    e, l = cfg["n_embd"], cfg["n_layer"]
    return 2 * (VOCAB * e + l * (12 * e * e + 13 * e) + 2 * e)


def cmd_table(args):
    d = load(args.out_dir)
    rows, summary = [], {}

    def add(section, figure, value, note=""):
        rows.append((section, figure, value, note))
        summary.setdefault(section, {})[figure] = value

    def fmt(x, digits=3):
        return "–" if x is None else (f"{x:.{digits}g}" if isinstance(x, float) else str(x))

    dev = d.get("device", {})
    add("device", "GPU", dev.get("name") or dev.get("nvidia_smi") or "none")
    add("device", "driver / torch CUDA", f"{dev.get('nvidia_smi', '?').split(',')[1].strip() if ',' in dev.get('nvidia_smi', '') else '?'} / {dev.get('torch_cuda')}")
    par = d.get("parity", {})
    for r in par.get("results", []):
        add("parity vs CPU f32", f"{r['dtype']} logits rel. error", fmt(r["logits_rel_error"]),
            f"max |Δ| {fmt(r['logits_max_abs_error'])}")
        add("parity vs CPU f32", f"{r['dtype']} greedy tokens equal",
            "/".join(str(m) for m in r["greedy_matching"]), f"of {par.get('new_tokens')} each")
        if "engine_greedy_matching" in r:
            add("parity vs CPU f32", f"{r['dtype']} engine greedy tokens equal",
                "/".join(str(m) for m in r["engine_greedy_matching"]),
                "grouped cache, fused attention, device sampling")
        if r.get("pushed_logits_max_abs_error") is not None:
            add("parity vs CPU f32", f"{r['dtype']} pushed vs loaded max |Δ|",
                fmt(r["pushed_logits_max_abs_error"]), "model built from a push payload")
    kern = par.get("kernels") or {}
    if kern:
        add("decode kernels vs CPU reference", "attention f32 / bf16 max |Δ|",
            f"{fmt(kern['attention_f32_max_abs_error'])} / {fmt(kern['attention_bf16_max_abs_error'])}")
        add("decode kernels vs CPU reference", "sampled tokens equal",
            f"{kern['sampling_tokens_equal']}/{kern['sampling_rows']}",
            f"log-prob max |Δ| {fmt(kern['sampling_max_logprob_error'])}")
        if "empty_rows" in kern:
            add("decode kernels vs CPU reference", "training ops on zero rows", kern["empty_rows"])
        add("decode kernels vs CPU reference", "result", "pass" if kern.get("passed") else "FAIL")
    if problem(par):
        add("parity vs CPU f32", "result", problem(par))
    copy = d.get("copy_bandwidth", {}).get("gb_per_second")
    add("memory", "device copy GB/s", fmt(copy), problem(d.get("copy_bandwidth", {})))
    mm = d.get("copy_bandwidth", {}).get("bf16_matmul_tflops")
    if mm:
        add("memory", "BF16 matmul TFLOP/s", fmt(mm), "8192³, random data (torch)")
    for name in sorted(k for k in d if k.startswith("worker_")):
        w, shape = d[name], name[len("worker_"):]
        hf = d.get("hf_" + shape, {})
        batch = w.get("batch", {})
        if not batch:
            add("rollout " + shape, "result", w.get("error", "missing"))
            continue
        p, n = batch["prompts"], batch["completions_per_prompt"]
        new = int(shape.split("_")[-1])
        cfg = PRESETS[d.get("config", {}).get("preset", "gpt2-124m")]
        step = batch["seconds"] / new
        bytes_step = weight_bytes(cfg) + kv_bytes_per_step(cfg, p, p * n, 46, new)
        achieved = bytes_step / step / 1e9
        add("rollout " + shape, "tokens/s", fmt(batch["tokens_per_second"], 4))
        add("rollout " + shape, "step ms", fmt(step * 1e3))
        ph = batch.get("phases") or {}
        if ph.get("decode_seconds"):
            add("rollout " + shape, "decode: launch / sample+wait ms",
                f"{fmt(ph['decode_forward_seconds'] / new * 1e3)} / "
                f"{fmt(ph['decode_sample_seconds'] / new * 1e3)}",
                f"per step (host clock); prefill {fmt(ph['prefill_seconds'] * 1e3)} ms")
        add("rollout " + shape, "achieved GB/s", fmt(achieved),
            f"{achieved / copy:.0%} of copy" if copy else "")
        if "tokens_per_second" not in hf:
            add("rollout " + shape, "transformers generate", problem(hf) or "missing")
        if "tokens_per_second" in hf:
            add("rollout " + shape, "× transformers generate",
                fmt(batch["tokens_per_second"] / hf["tokens_per_second"]),
                f"transformers {fmt(hf['tokens_per_second'], 4)} tok/s")
    lb = d.get("learner_step", {})
    if problem(lb):
        add("learner step", "result", problem(lb))
    elif lb:
        add("learner step", "step s", fmt(lb.get("learner_step_seconds")),
            f"PyTorch {fmt(lb.get('pytorch_step_seconds'))} s")
        add("learner step", "× PyTorch", fmt(lb.get("speedup_vs_pytorch")))
    if lb.get("learner_mfu") is not None:
        add("learner step", "MFU", fmt(lb["learner_mfu"]),
            f"of {fmt(lb.get('learner_peak_tflops'))} TFLOP/s; {lb.get('shape', '')}; "
            f"{lb.get('learner_matmul_dtype', '?')} matmuls")
    if lb.get("learner_device_memory_bytes") is not None:
        theirs = lb.get("pytorch_peak_device_memory_bytes")
        add("learner step", "device memory GiB", fmt(lb["learner_device_memory_bytes"] / 2**30),
            f"PyTorch peak {fmt(theirs / 2**30) if theirs else '–'}")
    lc = d.get("learner_composed", {})
    if problem(lc):
        add("learner step", "composed ops", problem(lc))
    elif lc.get("step_seconds") and lb.get("learner_step_seconds"):
        add("learner step", "× composed ops", fmt(lc["step_seconds"] / lb["learner_step_seconds"]),
            f"training ops {'on' if lb.get('learner_train_ops') else 'off'}; with them off "
            f"{fmt(lc['step_seconds'])} s, MFU {fmt(lc.get('mfu'))}, "
            f"{lc.get('micro_batch_groups', '?')} groups per micro-batch")
    push = d.get("push", {})
    if push.get("shared"):
        add("weight push", "gRPC idle s", fmt(push["idle"][0]["seconds"]) if push.get("idle") else "–")
        add("weight push", "same-host s", fmt(push["shared"]["seconds"]),
            f"convert+upload {fmt(push['shared']['convert_seconds'])} s")
    elif push:
        add("weight push", "result", problem(push) or "missing")
    nv = d.get("nvml", {}).get("peak", {})
    if not nv:
        add("worker NVML (peak)", "result", "no GPU gauges scraped")
    for g in GAUGES:
        if g in nv:
            add("worker NVML (peak)", g.replace("rollout_gpu_", ""), fmt(nv[g]))
    tr = d.get("train", {})
    if tr:
        add("learner train on the device", "steps / finite losses",
            f"{tr.get('steps', 0)} / {tr.get('finite_losses', 0)}", tr.get("error", ""))
    width = [max(len(str(r[i])) for r in rows) for i in range(4)]
    for r in rows:
        print("  ".join(str(c).ljust(w) for c, w in zip(r, width)).rstrip())
    write_quiet(os.path.join(args.out_dir, "summary.json"), summary)


def write_quiet(path, obj):
    with open(path, "w") as f:
        json.dump(obj, f)
        f.write("\n")


def main():
    ap = argparse.ArgumentParser()
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("device")
    p.add_argument("out")
    p.add_argument("--device", default="cuda")
    p = sub.add_parser("copy-bandwidth")
    p.add_argument("out")
    p.add_argument("--device", default="cuda")
    p = sub.add_parser("hf-generate")
    p.add_argument("out")
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="bf16")
    p.add_argument("--preset", default="gpt2-124m", choices=sorted(PRESETS))
    p.add_argument("--prompts", type=int, default=32)
    p.add_argument("-n", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--repeat", type=int, default=2)
    p = sub.add_parser("scrape")
    p.add_argument("url")
    p.add_argument("out")
    p.add_argument("--while-pid", type=int)
    p.add_argument("--seconds", type=int, default=0)
    p = sub.add_parser("train-summary")
    p.add_argument("jsonl")
    p.add_argument("out")
    p = sub.add_parser("table")
    p.add_argument("out_dir")
    args = ap.parse_args()
    {"device": cmd_device, "copy-bandwidth": cmd_copy_bandwidth, "hf-generate": cmd_hf_generate,
     "scrape": cmd_scrape, "train-summary": cmd_train_summary,
     "table": cmd_table}[args.cmd](args)


if __name__ == "__main__":
    sys.exit(main())

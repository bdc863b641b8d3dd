#!/usr/bin/env python3
"""Helpers of `tests/gpu-check.sh`: the GPU's description, its copy bandwidth, transformers'
`generate` and a static-cache decode step captured as a CUDA graph on the bench shape, a scrape of the worker's NVML gauges, and the final table.

    python3 tests/gpu/check.py device OUT.json [--device cuda]
    python3 tests/gpu/check.py copy-bandwidth OUT.json [--device cuda]
    python3 tests/gpu/check.py hf-generate OUT.json --prompts 32 -n 8 --max-new-tokens 64
            [--device cuda] [--dtype bf16] [--preset gpt2-124m]
    python3 tests/gpu/check.py graph-decode OUT.json --prompts 32 -n 8 --max-new-tokens 64
            [--device cuda] [--dtype bf16] [--preset gpt2-124m]
    python3 tests/gpu/check.py scrape URL OUT.json --while-pid PID
    python3 tests/gpu/check.py train-summary RUN.jsonl OUT.json
    python3 tests/gpu/check.py ncu-profile OUT.json [--launch-skip N] [--launch-count N] -- CMD...
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


def prompt_ids():
    """The bench's prompt (the start position's `P:` task) as GPT-2 token ids."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(os.path.join(ROOT, "rookworld-lm", "assets", "gpt2-tokenizer.json"))
    return tok.encode(PROMPT).ids


def torch_dtype(torch, name):
    return {"bf16": torch.bfloat16, "f32": torch.float32, "f16": torch.float16}[name]


def torch_or_none():
    try:
        import torch

        return torch
    except ImportError:
        return None


# Ops that copy a device value to the host and wait for it: not allowed while a CUDA
# stream is capturing a graph (and a value read then would be frozen into the graph).
HOST_SYNC_OPS = ("_local_scalar_dense", "item", "is_nonzero", "nonzero", "nonzero_static",
                 "masked_select", "unique", "_unique2", "unique_consecutive",
                 "repeat_interleave", "equal", "allclose", "_assert_async")


class HostSync(RuntimeError):
    """An op of a step meant to be captured synchronised with the host."""


def refuse_host_sync(torch):
    """A dispatch mode under which an op in HOST_SYNC_OPS raises `HostSync` naming it: a
    step run under it on the CPU is checked for what would break its CUDA-graph capture."""
    from torch.utils._python_dispatch import TorchDispatchMode

    refused = {getattr(torch.ops.aten, name) for name in HOST_SYNC_OPS
               if hasattr(torch.ops.aten, name)}

    class RefuseHostSync(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.overloadpacket in refused:
                raise HostSync(f"{func} synchronises with the host")
            return func(*args, **(kwargs or {}))

    return RefuseHostSync()


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


def cmd_health(args):
    """Whether the device still works after a failed section: what `nvidia-smi` says of it
    (temperature, use, memory, uncorrected ECC errors, throttling) and a tiny PyTorch op on
    it checked against its known sum. `healthy` is false when either fails, so a sticky
    fault or a lost GPU is told apart from a failing command."""
    out = {"device": args.device, "healthy": True}
    if args.device != "cpu":
        try:
            smi = subprocess.run(
                ["nvidia-smi", "--query-gpu=name,temperature.gpu,utilization.gpu,memory.used,"
                 "memory.total,ecc.errors.uncorrected.volatile.total,"
                 "clocks_throttle_reasons.active", "--format=csv,noheader"],
                capture_output=True, text=True, timeout=args.timeout)
            out["nvidia_smi"] = smi.stdout.strip() or smi.stderr.strip()
            if smi.returncode != 0:
                out.update(healthy=False, problem=f"nvidia-smi exit {smi.returncode}")
        except (OSError, subprocess.TimeoutExpired) as e:
            out.update(nvidia_smi=f"unavailable: {e}", healthy=False,
                       problem="nvidia-smi did not answer")
    torch = torch_or_none()
    if torch is None:
        out["torch_op"] = "skipped: no torch"
    else:
        try:
            started = time.perf_counter()
            x = torch.arange(1024, dtype=torch.float32, device=args.device)
            got = float((x * 2).sum().cpu())
            out["torch_op_seconds"] = time.perf_counter() - started
            out["torch_op"] = "ok" if got == 1023 * 1024 else f"wrong sum {got}"
        except RuntimeError as e:
            out["torch_op"] = f"failed: {str(e).splitlines()[0][:200]}"
        if out["torch_op"] != "ok":
            out.update(healthy=False, problem=out.get("problem") or out["torch_op"])
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
    try:
        import transformers
    except ImportError:
        return write(args.out, {"skipped": "no transformers"})

    cfg = PRESETS[args.preset]
    dtype = torch_dtype(torch, args.dtype)
    dev = torch.device(args.device)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=VOCAB, n_positions=cfg["n_positions"], n_embd=cfg["n_embd"],
        n_layer=cfg["n_layer"], n_head=cfg["n_head"])).to(dev, dtype).eval()
    ids = prompt_ids()
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


def cmd_graph_decode(args):
    """The decode peer a PyTorch user would write for speed: GPT-2 by hand over a static KV
    cache (rows, heads, prompt + new tokens, head width) that every step writes at its
    position and attends to under a mask, sampling inside the step (Gumbel-max on uniforms
    drawn there), the whole step captured once as a CUDA graph and replayed (on the CPU,
    run eagerly: a dry run). Each row has its own copy of the prompt, prefilled once.
    Checked before it is timed: its logits at the first two decode steps equal a full
    forward of the same sequences, and those steps run under `refuse_host_sync` (on every
    device), so a host synchronisation fails the CPU's dry run, not the GPU's capture."""
    torch = torch_or_none()
    if torch is None:
        return write(args.out, {"skipped": "no torch"})
    import torch.nn.functional as F

    cfg = PRESETS[args.preset]
    dtype = torch_dtype(torch, args.dtype)
    dev = torch.device(args.device)
    cuda = dev.type == "cuda"
    L, H, E = cfg["n_layer"], cfg["n_head"], cfg["n_embd"]
    D = E // H
    torch.manual_seed(0)

    def param(*shape, std=0.02):
        return (torch.randn(*shape) * std).to(dev, dtype)

    wte, wpe = param(VOCAB, E), param(cfg["n_positions"], E, std=0.01)
    blocks = [dict(ln1=(1 + param(E), param(E)), attn=(param(E, 3 * E), param(3 * E)),
                   proj=(param(E, E), param(E)), ln2=(1 + param(E), param(E)),
                   fc=(param(E, 4 * E), param(4 * E)), mlp=(param(4 * E, E), param(E)))
              for _ in range(L)]
    lnf = (1 + param(E), param(E))
    ids = prompt_ids()
    P, T, rows = len(ids), args.max_new_tokens, args.prompts * args.n
    S = P + T
    k_cache = torch.zeros(L, rows, H, S, D, device=dev, dtype=dtype)
    v_cache = torch.zeros_like(k_cache)

    def ln(x, wb):
        return F.layer_norm(x, (E,), wb[0], wb[1], 1e-5)

    def mlp(x, b):
        h = F.gelu(torch.addmm(b["fc"][1], x.reshape(-1, E), b["fc"][0]), approximate="tanh")
        return torch.addmm(b["mlp"][1], h, b["mlp"][0]).reshape(x.shape)

    def full(seq):
        """(rows, len) tokens → (rows, len, V) logits, no cache: the reference."""
        n = seq.shape[1]
        x = wte[seq] + wpe[:n]
        for b in blocks:
            q, k, v = (ln(x, b["ln1"]).reshape(-1, E) @ b["attn"][0] + b["attn"][1]).reshape(
                seq.shape[0], n, 3, H, D).permute(2, 0, 3, 1, 4)
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            y = y.transpose(1, 2).reshape(-1, E)
            x = x + torch.addmm(b["proj"][1], y, b["proj"][0]).reshape(x.shape)
            x = x + mlp(ln(x, b["ln2"]), b)
        return ln(x, lnf) @ wte.T

    def prefill(prompt):
        """Every row's prompt into the cache; the last position's logits."""
        x = wte[prompt] + wpe[:P]
        for l, b in enumerate(blocks):
            q, k, v = (ln(x, b["ln1"]).reshape(-1, E) @ b["attn"][0] + b["attn"][1]).reshape(
                rows, P, 3, H, D).permute(2, 0, 3, 1, 4)
            k_cache[l, :, :, :P], v_cache[l, :, :, :P] = k, v
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            x = x + torch.addmm(b["proj"][1], y.transpose(1, 2).reshape(-1, E),
                                b["proj"][0]).reshape(x.shape)
            x = x + mlp(ln(x, b["ln2"]), b)
        return ln(x[:, -1], lnf) @ wte.T

    # The step's fixed inputs and outputs: the token fed, its position, the sampled token.
    cur = torch.zeros(rows, dtype=torch.long, device=dev)
    pos = torch.zeros((), dtype=torch.long, device=dev)
    logits_out = torch.zeros(rows, VOCAB, device=dev, dtype=dtype)
    steps = torch.arange(S, device=dev)

    def step():
        # The position by index_select: `wpe[pos]` would read it on the host.
        x = wte[cur] + wpe.index_select(0, pos.view(1))  # (rows, E)
        visible = (steps <= pos).view(1, 1, 1, S)
        for l, b in enumerate(blocks):
            q, k, v = (ln(x, b["ln1"]) @ b["attn"][0] + b["attn"][1]).view(rows, 3, H, 1, D).unbind(1)
            k_cache[l].index_copy_(2, pos.view(1), k)
            v_cache[l].index_copy_(2, pos.view(1), v)
            y = F.scaled_dot_product_attention(q, k_cache[l], v_cache[l], attn_mask=visible)
            x = x + torch.addmm(b["proj"][1], y.reshape(rows, E), b["proj"][0])
            x = x + mlp(ln(x, b["ln2"]), b)
        logits = ln(x, lnf) @ wte.T
        logits_out.copy_(logits)
        # Gumbel-max: argmax(z − log(−log u)) samples softmax(z).
        u = torch.rand(rows, VOCAB, device=dev, dtype=torch.float32).clamp_(1e-20, 1.0)
        cur.copy_(torch.argmax(logits.float() - torch.log(-torch.log(u)), dim=-1))
        pos.add_(1)

    prompt = torch.tensor([ids] * rows, device=dev)

    def sync():
        if cuda:
            torch.cuda.synchronize()

    def start():
        """Prefill and the first token sampled; the step then feeds it at position P."""
        first = prefill(prompt)
        u = torch.rand(rows, VOCAB, device=dev).clamp_(1e-20, 1.0)
        cur.copy_(torch.argmax(first.float() - torch.log(-torch.log(u)), dim=-1))
        pos.fill_(P)
        return first

    with torch.no_grad():
        # The check: the cached steps' logits against a full forward of the same tokens,
        # each step run where an op that synchronises with the host is refused.
        first = start()
        fed, got = [cur.clone()], []
        for _ in range(2):
            try:
                with refuse_host_sync(torch):
                    step()
            except HostSync as e:
                return write(args.out, {"error": f"the step to be captured reads the device "
                                                 f"on the host: {e}"})
            got.append(logits_out.clone())
            fed.append(cur.clone())
        seq = torch.cat([prompt, torch.stack(fed[:2], 1)], 1)
        ref = full(seq)
        scale = ref.float().abs().max().item()
        err = max((ref[:, P - 1].float() - first.float()).abs().max().item(),
                  *((ref[:, P + i].float() - g.float()).abs().max().item() for i, g in enumerate(got)))
        tol = 2e-2 if dtype != torch.float32 else 1e-4
        if not err <= tol * max(scale, 1.0):
            return write(args.out, {"error": f"static-cache logits differ from a full forward by "
                                             f"{err:.3g} (scale {scale:.3g})"})

        graph = None
        if cuda:
            # Warm-up on a side stream, then one capture; replays reuse its memory.
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                start()
                for _ in range(3):
                    step()
            torch.cuda.current_stream().wait_stream(side)
            start()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                step()

        def run():
            sync()
            t0 = time.perf_counter()
            start()
            sync()
            t1 = time.perf_counter()
            for _ in range(T - 1):  # the first token came from the prefill
                graph.replay() if graph is not None else step()
            sync()
            t2 = time.perf_counter()
            return t2 - t0, (t2 - t1) / max(T - 1, 1)

        run()  # warm-up
        best = min((run() for _ in range(max(1, args.repeat))), key=lambda r: r[0])
    tokens = rows * T
    write(args.out, {"side": "pytorch static cache" + (" + CUDA graph" if graph is not None else ""),
                     "torch": torch.__version__, "device": str(dev), "dtype": args.dtype,
                     "prompts": args.prompts, "completions_per_prompt": args.n,
                     "prompt_tokens": P, "new_tokens": tokens, "seconds": best[0],
                     "decode_step_seconds": best[1], "tokens_per_second": tokens / best[0],
                     "check_max_abs_error": err, "check_scale": scale,
                     "cuda_graph": graph is not None})


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


def generated_tokens(rec):
    """Completion tokens the workers generated for a step's groups (trained on or not);
    from the rate and the time where the record predates the count."""
    if "generated_tokens" in rec:
        return rec["generated_tokens"]
    return round(rec.get("tokens_per_second", 0) * rec["step_seconds"]["total"])


def cmd_train_summary(args):
    """Steps and finite losses of a `learner train` run's JSONL, with the groups kept (those
    whose rewards differ: the learner skips the backward of a group whose rewards are all
    alike) and the completion tokens trained on over the whole run; past its first `--skip`
    steps (the warm-up of the device's kernels and buffers), the mean seconds a step, the
    completion tokens generated and trained on a second and each phase's share of the
    step."""
    steps, finite, last, timed = 0, 0, None, []
    groups = kept = trained = 0
    with open(args.jsonl) as f:
        for line in f:
            rec = json.loads(line)
            if "loss" not in rec:
                continue
            steps += 1
            finite += all(isinstance(rec.get(k), (int, float)) and abs(rec[k]) < float("inf")
                          for k in ("loss", "policy_loss", "kl", "grad_norm"))
            groups += rec.get("groups", 0)
            kept += rec.get("groups", 0) - rec.get("skipped_groups", 0)
            trained += rec.get("tokens", 0)
            last = rec
            if steps > args.skip and isinstance(rec.get("step_seconds"), dict):
                timed.append(rec)
    out = {"steps": steps, "finite_losses": finite, "groups": groups, "kept_groups": kept,
           "trained_tokens": trained, "last": last}
    if timed:
        total = sum(r["step_seconds"]["total"] for r in timed)
        phases = {}
        for r in timed:
            for k, v in r["step_seconds"].items():
                if k != "total":
                    phases[k] = phases.get(k, 0.0) + v
        out.update(steps_skipped=args.skip, steps_timed=len(timed),
                   seconds_per_step=total / len(timed),
                   generated_tokens_per_second=sum(map(generated_tokens, timed)) / total,
                   trained_tokens_per_second=sum(r.get("tokens", 0) for r in timed) / total,
                   timed_groups=sum(r.get("groups", 0) for r in timed),
                   timed_kept_groups=sum(r.get("groups", 0) - r.get("skipped_groups", 0)
                                         for r in timed),
                   phase_share={k: v / total for k, v in phases.items()})
    write(args.out, out)


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

    check_rows(d, add, fmt)
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
    for fam in par.get("kernel_families") or []:
        add("decode kernel families", fam["family"], fam["status"],
            "; ".join(fam.get("problems", []))[:160])
    if par.get("kernel_check_error"):
        add("decode kernel families", "check", "incomplete", str(par["kernel_check_error"])[:160])
    kern = par.get("kernels") or {}
    if kern:
        add("decode kernels vs CPU reference", "attention f32 / bf16 max |Δ|",
            f"{fmt(kern['attention_f32_max_abs_error'])} / {fmt(kern['attention_bf16_max_abs_error'])}")
        if "attention_split_f32_max_abs_error" in kern:
            add("decode kernels vs CPU reference", "split attention f32 / bf16 max |Δ|",
                f"{fmt(kern['attention_split_f32_max_abs_error'])} / "
                f"{fmt(kern['attention_split_bf16_max_abs_error'])}",
                "trial kernel grouped_attention_split")
        add("decode kernels vs CPU reference", "sampled tokens equal",
            f"{kern['sampling_tokens_equal']}/{kern['sampling_rows']}",
            f"log-prob max |Δ| {fmt(kern['sampling_max_logprob_error'])}")
        if "empty_rows" in kern:
            add("decode kernels vs CPU reference", "training ops on zero rows", kern["empty_rows"])
        if "decode_graph_f32_max_rel_error" in kern:
            add("decode kernels vs CPU reference", "captured step f32 / bf16 logits rel. |Δ|",
                f"{fmt(kern['decode_graph_f32_max_rel_error'])} / "
                f"{fmt(kern['decode_graph_bf16_max_rel_error'])}",
                f"against the step launched op by op; f32 greedy tokens "
                f"{kern['decode_graph_tokens_equal']}/{kern['decode_graph_rows']} "
                "(trial decode_graphs)")
        if "upload_mismatched" in kern:
            add("decode kernels vs CPU reference", "page-locked upload values differing",
                fmt(kern["upload_mismatched"]), "trial weights_in_place")
        add("decode kernels vs CPU reference", "result", "pass" if kern.get("passed") else "FAIL")
    if problem(par):
        add("parity vs CPU f32", "result", problem(par))
    copy = d.get("copy_bandwidth", {}).get("gb_per_second")
    add("memory", "device copy GB/s", fmt(copy), problem(d.get("copy_bandwidth", {})))
    mm = d.get("copy_bandwidth", {}).get("bf16_matmul_tflops")
    if mm:
        add("memory", "BF16 matmul TFLOP/s", fmt(mm), "8192³, random data (torch)")
    for name in sorted(k for k in d if k.startswith("split_")):
        # The worker with the trial split attention kernel turned on, beside its default.
        shape = name[len("split_"):]
        split, base = d[name].get("batch", {}), d.get("worker_" + shape, {}).get("batch", {})
        if split and base:
            add("rollout " + shape, "split attention tokens/s", fmt(split["tokens_per_second"], 4),
                f"{fmt(split['tokens_per_second'] / base['tokens_per_second'])}× the default kernel "
                "(ROOKWORLD_ENABLE_KERNELS=grouped_attention_split)")
        else:
            add("rollout " + shape, "split attention", problem(d[name]) or "missing")
    for name in sorted(k for k in d if k.startswith("graphs_")):
        # The worker with the trial captured decode step turned on, beside its default.
        shape = name[len("graphs_"):]
        graphs, base = d[name].get("batch", {}), d.get("worker_" + shape, {}).get("batch", {})
        if graphs and base:
            new = int(shape.split("_")[-1])
            add("rollout " + shape, "captured step tokens/s", fmt(graphs["tokens_per_second"], 4),
                f"{fmt(graphs['tokens_per_second'] / base['tokens_per_second'])}× the default step, "
                f"{fmt(graphs['seconds'] / new * 1e3)} ms a step "
                "(ROOKWORLD_ENABLE_KERNELS=decode_graphs)")
        else:
            add("rollout " + shape, "captured step", problem(d[name]) or "missing")
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
        graph = d.get("graph_" + shape, {})
        if "tokens_per_second" in graph:
            add("rollout " + shape, "× PyTorch static-cache step" +
                (" (CUDA graph)" if graph.get("cuda_graph") else ""),
                fmt(batch["tokens_per_second"] / graph["tokens_per_second"]),
                f"PyTorch {fmt(graph['tokens_per_second'], 4)} tok/s, step "
                f"{fmt(graph['decode_step_seconds'] * 1e3)} ms")
        elif name.replace("worker_", "graph_") in d:
            add("rollout " + shape, "PyTorch static-cache step", problem(graph) or "missing")
    lb = d.get("learner_step", {})
    if problem(lb):
        add("learner step", "result", problem(lb))
    elif lb:
        add("learner step", "step s", fmt(lb.get("learner_step_seconds")),
            f"PyTorch {fmt(lb.get('pytorch_step_seconds'))} s; learner {lb.get('learner_run', '')}")
        runs = lb.get("learner_step_seconds_by_run") or {}
        if len(runs) > 1:
            for run, seconds in sorted(runs.items()):
                add("learner step", f"step s, {run}", fmt(seconds))
        add("learner step", "× PyTorch (best)", fmt(lb.get("speedup_vs_pytorch")),
            lb.get("pytorch_best_config", ""))
        for config, ratio in sorted((lb.get("speedup_vs_each") or {}).items()):
            add("learner step", f"× PyTorch {config}", fmt(ratio))
    if lb.get("learner_mfu") is not None:
        add("learner step", "MFU", fmt(lb["learner_mfu"]),
            f"of {fmt(lb.get('learner_peak_tflops'))} TFLOP/s; {lb.get('shape', '')}; "
            f"{lb.get('learner_matmul_dtype', '?')} matmuls")
    if lb.get("learner_device_memory_bytes") is not None:
        theirs = lb.get("pytorch_peak_device_memory_bytes")
        add("learner step", "device memory GiB", fmt(lb["learner_device_memory_bytes"] / 2**30),
            f"PyTorch peak {fmt(theirs / 2**30) if theirs else '–'}")
    bc = d.get("backend_compare", {})
    if bc:
        first = bc.get("first_divergence")
        add("step backend vs CPU", "buffers matched",
            problem(bc) or (f"{bc['buffers_checked']} of {bc['buffers_checked']}" if bc.get("matched")
                            else f"FAIL at {first['name'] if first else '?'}"),
            f"{bc.get('shape', '')}; reference {bc.get('reference')}, tolerance "
            f"{bc.get('atol')} + {bc.get('rtol')}·scale")
        close = bc.get("closest_to_tolerance")
        if close:
            add("step backend vs CPU", "closest to tolerance", close["name"],
                f"max |Δ| {fmt(close['max_abs_diff'])} against {fmt(close['scale'])}")
    bp = d.get("backend_pass", {})
    if bp.get("pass_seconds"):
        ph = lb.get("pytorch_phases") or {}
        theirs = (ph.get("forward") or 0) + (ph.get("backward") or 0)
        add("step backend", "forward + backward s", fmt(bp["pass_seconds"]),
            f"{bp.get('shape', '')}; {fmt(bp.get('activation_bytes', 0) / 2**30)} GiB planned")
        if theirs:
            add("step backend", "× PyTorch forward + backward", fmt(theirs / bp["pass_seconds"]),
                f"PyTorch {lb.get('pytorch_best_config', '')} {fmt(theirs)} s")
    elif bp:
        add("step backend", "forward + backward", problem(bp) or "missing")
    # Where the device time goes: the fused step's kernels by device events, decode's by ncu.
    def bench_profile(key):  # `learner bench --profile`: its report's `kernels`
        p = d.get(key, {})
        return dict(p["kernels"], step_seconds=p.get("step_seconds")) if p.get("kernels") else p
    lp = bench_profile("learner_profile")
    # The step's trials, each with the kept head: its buffers against the CPU backend's
    # (*_compare) and its step against the step without trials (*_profile).
    trials = (("tiles", "step trials (tiled attention, kept head)"),
              ("mma", "step trials (tensor-core attention, kept head, epilogues)"))
    for prefix, label in trials:
        tp, tc = bench_profile(f"{prefix}_profile"), d.get(f"{prefix}_compare", {})
        if tc:
            first = tc.get("first_divergence")
            add(label, "buffers matched",
                problem(tc) or (f"{tc['buffers_checked']} of {tc['buffers_checked']}" if tc.get("matched")
                                else f"FAIL at {first['name'] if first else '?'}"),
                f"{tc.get('shape', '')}; against the CPU backend")
        if tp.get("step_seconds") and lp.get("step_seconds"):
            add(label, "× without them (step)",
                fmt(lp["step_seconds"] / tp["step_seconds"]),
                f"step {fmt(tp['step_seconds'] * 1e3)} ms against {fmt(lp['step_seconds'] * 1e3)} ms")
    for key, label, top, prof in (
            ("learner_profile", "learner kernels (per step)", 8, lp),
            ("tiles_profile", "learner kernels, step trials", 8, bench_profile("tiles_profile")),
            ("mma_profile", "learner kernels, tensor-core attention, epilogues", 8, bench_profile("mma_profile")),
            ("decode_profile", "decode kernels (ncu)", 6, d.get("decode_profile", {}))):
        if problem(prof) or (prof and not prof.get("by_kernel")):
            add(label, "result", problem(prof) or "no kernels")
            continue
        if not prof:
            continue
        total_ms = prof.get("seconds", 0) * 1e3
        if key in ("learner_profile", "tiles_profile", "mma_profile"):
            gap = (prof.get("step_seconds") or 0) * 1e3 - total_ms
            add(label, "all kernels ms", fmt(total_ms),
                f"{fmt(prof.get('launches'))} launches; step {fmt((prof.get('step_seconds') or 0) * 1e3)} ms, "
                f"{fmt(gap)} ms outside the pass's kernels")
        else:
            add(label, "kernels ms", fmt(total_ms),
                f"{prof.get('launches')} launches {prof.get('window')}")
        for k in prof["by_kernel"][:top]:
            add(label, k["name"][:60], f"{k['share']:.1%}",
                f"{fmt(k['ms'])} ms, {fmt(k['launches'])} launches")
    lc = d.get("learner_composed", {})
    if problem(lc):
        add("learner step", "composed ops", problem(lc))
    elif lc.get("step_seconds") and lb.get("learner_step_seconds"):
        add("learner step", "× composed ops", fmt(lc["step_seconds"] / lb["learner_step_seconds"]),
            f"training ops {'on' if lb.get('learner_train_ops') else 'off'}; with them off "
            f"{fmt(lc['step_seconds'])} s, MFU {fmt(lc.get('mfu'))}, "
            f"{lc.get('micro_batch_groups', '?')} groups per micro-batch")
    # push: each version a new model; push_in_place: written into the retired model's
    # device buffers from page-locked memory (the trial `weights_in_place`).
    for key, label in (("push", "weight push"), ("push_in_place", "weight push in place")):
        push = d.get(key, {})
        if push.get("shared"):
            add(label, "gRPC idle s", fmt(push["idle"][0]["seconds"]) if push.get("idle") else "–")
            add(label, "same-host s", fmt(push["shared"]["seconds"]),
                f"convert+upload {fmt(push['shared']['convert_seconds'])} s")
        elif push:
            add(label, "result", problem(push) or "missing")
    nv = d.get("nvml", {}).get("peak", {})
    if not nv:
        add("worker NVML (peak)", "result", "no GPU gauges scraped")
    for g in GAUGES:
        if g in nv:
            add("worker NVML (peak)", g.replace("rollout_gpu_", ""), fmt(nv[g]))
    train_rows(d, add, fmt)
    width = [max(len(str(r[i])) for r in rows) for i in range(4)]
    for r in rows:
        print("  ".join(str(c).ljust(w) for c, w in zip(r, width)).rstrip())
    write_quiet(os.path.join(args.out_dir, "summary.json"), summary)


def train_rows(d, add, fmt):
    """The whole loop (`learner train --local`) beside TRL's GRPOTrainer. The learner skips
    the backward of a group whose rewards are all alike; TRL trains every completion: so
    beside steps a second, generated tokens a second compare the sampling side and trained
    tokens a second the training side, like with like."""
    tr, label = d.get("train", {}), "learner train on the device"
    if not tr:
        return
    add(label, "steps / finite losses", f"{tr.get('steps', 0)} / {tr.get('finite_losses', 0)}",
        tr.get("error", ""))
    if "kept_groups" in tr:
        add(label, "kept groups / trained tokens",
            f"{tr['kept_groups']} of {tr['groups']} / {tr['trained_tokens']}",
            f"over all {tr.get('steps', 0)} steps; a group whose rewards are all alike is "
            "skipped")
    if not tr.get("seconds_per_step"):
        return
    shares = ", ".join(f"{k} {v:.0%}" for k, v in sorted(tr.get("phase_share", {}).items()))
    add(label, "s / step", fmt(tr["seconds_per_step"]),
        f"{tr['steps_timed']} steps after the first {tr.get('steps_skipped', 1)}; {shares}")
    add(label, "generated tokens/s", fmt(tr["generated_tokens_per_second"], 4),
        f"trained on {fmt(tr['trained_tokens_per_second'], 4)} tok/s; kept "
        f"{tr['timed_kept_groups']} of {tr['timed_groups']} groups")
    peer = d.get("trl", {})
    if not peer.get("seconds_per_step"):
        if peer:
            add(label, "TRL GRPOTrainer", problem(peer) or "missing")
        return
    theirs = peer["completion_tokens_per_second"]
    add(label, "× TRL GRPOTrainer (steps/s)", fmt(peer["seconds_per_step"] / tr["seconds_per_step"]),
        f"TRL {peer.get('trl')}: {fmt(peer['seconds_per_step'])} s/step, trains every "
        f"completion (gradient checkpointing {'on' if peer.get('gradient_checkpointing') else 'off'})")
    add(label, "× TRL GRPOTrainer (generated tok/s)",
        fmt(tr["generated_tokens_per_second"] / theirs), f"TRL {fmt(theirs, 4)} tok/s")
    add(label, "× TRL GRPOTrainer (trained tok/s)",
        fmt(tr["trained_tokens_per_second"] / theirs),
        "the learner's kept groups against TRL's every completion")


def check_rows(d, add, fmt):
    """The run itself: its time against its deadline and estimate, the sections the
    deadline cut, those that failed, and the device's health after each failure."""
    run = d.get("check", {})
    if run:
        add("check", "s / deadline s", f"{fmt(run.get('elapsed_seconds'))} / {fmt(run.get('deadline'))}",
            f"estimated {fmt(run.get('estimate_seconds'))} s for the sections selected")
    sections = {k: v for k, v in d.items() if k not in ("check", "config", "summary", "nvml")
                and not k.startswith("health_after_")}
    cut = sorted(k for k, v in sections.items() if str(v.get("error", "")).startswith("cut:"))
    failed = sorted(k for k, v in sections.items()
                    if v.get("error") and not str(v["error"]).startswith("cut:"))
    add("check", "cut by the deadline", " ".join(cut) or "none")
    add("check", "failed", " ".join(failed) or "none")
    for key in sorted(k for k in d if k.startswith("health_after_")):
        h = d[key]
        add("check", "device health after " + key[len("health_after_"):],
            "ok" if h.get("healthy") else "FAIL",
            h.get("problem") or h.get("nvidia_smi") or h.get("torch_op", ""))


def write_quiet(path, obj):
    with open(path, "w") as f:
        json.dump(obj, f)
        f.write("\n")


NCU_METRIC = "gpu__time_duration.sum"
NCU_UNITS = {"nsecond": 1e-9, "ns": 1e-9, "usecond": 1e-6, "us": 1e-6, "msecond": 1e-3,
             "ms": 1e-3, "second": 1.0, "s": 1.0}


def ncu_kernels(text):
    """Each kernel's launches and device seconds from what `ncu --csv --page raw --metrics
    gpu__time_duration.sum` prints: a header row of quoted column names (among them "Kernel
    Name" and the metric), then a row of units, then a row per profiled launch, amid the
    program's own output and ncu's `==PROF==` lines (or the details page's layout, a row
    per launch and metric). Returns {name: [launches, seconds]}."""
    import csv
    rows = [l for l in text.splitlines() if l.startswith('"')]
    table = list(csv.reader(rows))
    kernels = {}
    # Without `--page raw` (the details page): a row per launch and metric, with the
    # metric's name, unit and value in columns of their own.
    head = next((i for i, r in enumerate(table)
                 if {"Kernel Name", "Metric Name", "Metric Unit", "Metric Value"} <= set(r)), None)
    if head is not None:
        at = {c: table[head].index(c) for c in ("Kernel Name", "Metric Name", "Metric Unit",
                                                 "Metric Value")}
        for r in table[head + 1:]:
            if len(r) <= max(at.values()) or r[at["Metric Name"]] != NCU_METRIC:
                continue
            try:
                seconds = float(r[at["Metric Value"]].replace(",", "")) * NCU_UNITS[r[at["Metric Unit"]]]
            except (ValueError, KeyError):
                continue
            k = kernels.setdefault(r[at["Kernel Name"]], [0, 0.0])
            k[0] += 1
            k[1] += seconds
        return kernels
    head = next((i for i, r in enumerate(table) if "Kernel Name" in r and NCU_METRIC in r), None)
    if head is None:
        return {}
    name_at, value_at = table[head].index("Kernel Name"), table[head].index(NCU_METRIC)
    scale = 1e-9
    for r in table[head + 1:]:
        if len(r) <= max(name_at, value_at):
            continue
        value = r[value_at].replace(",", "")
        if value in NCU_UNITS:  # the units row
            scale = NCU_UNITS[value]
            continue
        try:
            seconds = float(value) * scale
        except ValueError:
            continue
        k = kernels.setdefault(r[name_at], [0, 0.0])
        k[0] += 1
        k[1] += seconds
    return kernels


def kernel_rows(kernels):
    """{name: [launches, seconds]} as rows longest first, each with its share."""
    total = sum(s for _, s in kernels.values()) or 1.0
    return [{"name": n, "launches": c, "ms": s * 1e3, "share": s / total}
            for n, (c, s) in sorted(kernels.items(), key=lambda kv: (-kv[1][1], kv[0]))]


def cmd_ncu_profile(args):
    """CMD under Nsight Compute: the device time of each kernel in a window of launches
    (`--launch-skip`, `--launch-count`: late in a decode run, where the cache is long), the
    clocks left as they are and L2 not flushed before each kernel (what decode reads from
    L2 between launches stays there, as it does outside the profiler). Skipped where `ncu` is not installed or cannot read the
    counters."""
    import shutil
    cmd = args.program[1:] if args.program[:1] == ["--"] else args.program
    ncu = shutil.which("ncu") or next(iter(glob.glob("/opt/nvidia/nsight-compute/*/ncu")), None)
    if not ncu:
        return write(args.out, {"skipped": "no ncu (Nsight Compute) on this machine"})
    run = subprocess.run(
        [ncu, "--clock-control", "none", "--cache-control", "none", "--metrics", NCU_METRIC,
         "--csv", "--page", "raw", "--print-units", "base", "--launch-skip", str(args.launch_skip),
         "--launch-count", str(args.launch_count), *cmd],
        capture_output=True, text=True)
    sys.stderr.write(run.stderr[-4000:])
    kernels = ncu_kernels(run.stdout)
    if not kernels:
        why = next((l for l in (run.stdout + run.stderr).splitlines() if "==ERROR==" in l),
                   f"exit {run.returncode}, no kernel in launches {args.launch_skip}.."
                   f"{args.launch_skip + args.launch_count}")
        return write(args.out, {"error": f"ncu: {why.strip()[:300]}"})
    write(args.out, {"tool": "ncu", "window": [args.launch_skip,
                                                args.launch_skip + args.launch_count],
                     "launches": sum(c for c, _ in kernels.values()),
                     "seconds": sum(s for _, s in kernels.values()),
                     "by_kernel": kernel_rows(kernels), "exit": run.returncode})


def main():
    ap = argparse.ArgumentParser()
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("device")
    p.add_argument("out")
    p.add_argument("--device", default="cuda")
    p = sub.add_parser("health")
    p.add_argument("out")
    p.add_argument("--device", default="cuda")
    p.add_argument("--timeout", type=float, default=10, help="seconds nvidia-smi may take")
    p = sub.add_parser("copy-bandwidth")
    p.add_argument("out")
    p.add_argument("--device", default="cuda")
    for name in ("hf-generate", "graph-decode"):  # the two decode peers, one shape
        p = sub.add_parser(name)
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
    p.add_argument("--skip", type=int, default=1, help="first steps left out of the timing")
    p = sub.add_parser("ncu-profile")
    p.add_argument("out")
    p.add_argument("--launch-skip", type=int, default=6000)
    p.add_argument("--launch-count", type=int, default=1000)
    p.add_argument("program", nargs=argparse.REMAINDER)
    p = sub.add_parser("table")
    p.add_argument("out_dir")
    args = ap.parse_args()
    {"device": cmd_device, "health": cmd_health, "copy-bandwidth": cmd_copy_bandwidth, "hf-generate": cmd_hf_generate,
     "graph-decode": cmd_graph_decode,
     "scrape": cmd_scrape, "train-summary": cmd_train_summary, "ncu-profile": cmd_ncu_profile,
     "table": cmd_table}[args.cmd](args)


if __name__ == "__main__":
    sys.exit(main())

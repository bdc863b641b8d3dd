#!/usr/bin/env python3
"""The whole-loop peer of `learner train --local`: TRL's `GRPOTrainer` on the same card with
the same batch (prompts per step × completions per prompt, new tokens per completion), a
GPT-2 of the same preset with random weights, BF16 autocast on a GPU, generation through
transformers (TRL's default), gradient checkpointing off (as the learner runs). Prints one
JSON line: seconds per step after the warm-up steps and completion tokens per second
(generated and trained on: TRL trains every completion, even of a group whose rewards are
all alike).

    python3 tests/gpu/trl_grpo.py [--device cuda] [--preset gpt2-124m] [--prompts 4] [-n 8]
        [--max-new-tokens 32] [--steps 6] [--warmup 2]

TRL and `datasets` are pure-Python wheels: on a machine without them, install the wheels
carried with the check (`pip install --no-deps --target DIR *.whl`, DIR on PYTHONPATH).
The reward is a cheap check of the completion's form (a move in UCI notation first), so
the reward's time is no part of either side's figure.
"""

import argparse
import json
import os
import re
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from check import PRESETS, PROMPT, VOCAB  # noqa: E402

MOVE = re.compile(r"\s*[a-h][1-8][a-h][1-8][qrbn]?\b")


def form_reward(completions, **_):
    return [1.0 if MOVE.match(c) else -1.0 for c in completions]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--preset", default="gpt2-124m", choices=sorted(PRESETS))
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("-n", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--steps", type=int, default=6, help="steps timed")
    ap.add_argument("--warmup", type=int, default=2, help="steps run first, not timed")
    args = ap.parse_args()
    try:
        import torch
        import transformers
        import trl
        from datasets import Dataset
    except ImportError as e:
        print(json.dumps({"skipped": f"not installed: {e.name}"}))
        return
    from transformers import TrainerCallback

    cuda = args.device == "cuda"
    cfg = PRESETS[args.preset]
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=VOCAB, n_positions=cfg["n_positions"], n_embd=cfg["n_embd"],
        n_layer=cfg["n_layer"], n_head=cfg["n_head"]))
    tok = transformers.PreTrainedTokenizerFast(
        tokenizer_file=os.path.join(ROOT, "rookworld-lm", "assets", "gpt2-tokenizer.json"),
        eos_token="<|endoftext|>", pad_token="<|endoftext|>", padding_side="left")
    # Distinct prompts of the same length as the learner's (the start position and its
    # first moves).
    moves = ["e2e4", "d2d4", "g1f3", "c2c4", "b1c3", "e2e3", "g2g3", "b2b3"]
    prompts = [f"{PROMPT} {m}" for m in moves] * 64
    data = Dataset.from_dict({"prompt": prompts})

    stamps = []

    class Clock(TrainerCallback):
        def on_step_end(self, *_a, **_k):
            if cuda:
                torch.cuda.synchronize()
            stamps.append(time.perf_counter())

    rows = args.prompts * args.n
    with tempfile.TemporaryDirectory() as out:
        # TRL loads its reference model (β > 0) from the policy's path: a local checkpoint.
        path = os.path.join(out, "model")
        model.save_pretrained(path)
        tok.save_pretrained(path)
        config = trl.GRPOConfig(
            output_dir=out, per_device_train_batch_size=rows, num_generations=args.n,
            gradient_accumulation_steps=1, max_completion_length=args.max_new_tokens,
            max_steps=args.warmup + args.steps, learning_rate=1e-5, beta=0.01,
            temperature=1.0, bf16=cuda, use_cpu=not cuda, logging_steps=1, report_to=[],
            save_strategy="no", seed=0, dataloader_num_workers=0,
            # TRL's default since 1.x is on: recomputing activations slows its step, which
            # would flatter the learner (which keeps them).
            gradient_checkpointing=False)
        trainer = trl.GRPOTrainer(model=path, reward_funcs=form_reward, args=config,
                                  train_dataset=data, processing_class=tok)
        start = time.perf_counter()
        trainer.add_callback(Clock())
        trainer.train()
    logs = [h for h in trainer.state.log_history if "completions/mean_length" in h]
    timed = stamps[args.warmup:]
    first = stamps[args.warmup - 1] if args.warmup > 0 else start
    seconds = (timed[-1] - first) / len(timed)
    lengths = [h["completions/mean_length"] for h in logs[args.warmup:]] or [args.max_new_tokens]
    mean_length = sum(lengths) / len(lengths)
    print(json.dumps({
        "side": "trl GRPOTrainer", "trl": trl.__version__, "transformers": transformers.__version__,
        "torch": torch.__version__, "device": args.device, "prompts": args.prompts,
        "completions_per_prompt": args.n, "max_new_tokens": args.max_new_tokens,
        "steps_timed": len(timed), "seconds_per_step": seconds,
        "completion_mean_length": mean_length,
        "completion_tokens_per_second": rows * mean_length / seconds,
        "bf16_autocast": cuda, "gradient_checkpointing": config.gradient_checkpointing,
    }))


if __name__ == "__main__":
    main()

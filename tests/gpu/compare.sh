#!/usr/bin/env bash
# Two builds of the `cuda` binaries side by side on one GPU, in one run, the builds
# alternating ROUNDS times (default 3) at each shape:
# - PROMPTSxG_NEW (e.g. 32x8_192): the engine's decode (`rollout-worker bench
#   --batch-only`, BF16, gpt2-124m), each run the best of 2 repetitions; tokens/s;
# - learnerP (e.g. learner8): the learner's GRPO step on one micro-batch of P groups of 8
#   (`learner bench -p P -n 8 --steps 3 --micro-batch-groups P`); seconds per step.
# Prints each run's figure and, per shape, both builds' best and how much faster B is.
#
#   A=DIR B=DIR tests/gpu/compare.sh OUT [SHAPE...]   # default 32x8_192
#
# A and B hold a `rollout-worker` and a `learner` each (deploy/cuda/build.sh's archive
# unpacked, say the commit before a change and the change). Every run's JSON line is kept in
# OUT/compare.jsonl. LD_LIBRARY_PATH gets PyTorch's CUDA 13 libraries as in
# tests/gpu-check.sh.
set -u
if [ $# -lt 1 ] || [ -z "${A:-}" ] || [ -z "${B:-}" ]; then
  echo "usage: A=DIR B=DIR $0 OUT [PROMPTSxG_NEW ...]" >&2
  exit 2
fi
OUT=$1
shift
SHAPES=("$@")
[ ${#SHAPES[@]} -gt 0 ] || SHAPES=(32x8_192)
ROUNDS=${ROUNDS:-3}
PY=${PYTHON:-python3}
mkdir -p "$OUT"
. "$(dirname "$0")/cuda-libs.sh"
: > "$OUT/compare.jsonl"
for shape in "${SHAPES[@]}"; do
  for round in $(seq "$ROUNDS"); do
    for side in A B; do
      dir=${!side}
      if [[ $shape == learner* ]]; then
        p=${shape#learner}
        cmd=("$dir/learner" bench --preset gpt2-124m --device cuda -p "$p" -n 8 --steps 3
          --micro-batch-groups "$p")
      else
        p=${shape%%x*} rest=${shape#*x}
        g=${rest%%_*} t=${shape##*_}
        cmd=("$dir/rollout-worker" bench --preset gpt2-124m --device cuda --weight-dtype bf16
          --prompts "$p" -n "$g" --max-new-tokens "$t" --repeat 2 --batch-only)
      fi
      line=$(timeout -k 5 120 "${cmd[@]}" 2> "$OUT/${side}_${shape}_$round.log" | tail -n 1)
      [ -n "$line" ] || line='{"error": "no output"}'
      echo "{\"side\": \"$side\", \"shape\": \"$shape\", \"round\": $round, \"run\": $line}" |
        tee -a "$OUT/compare.jsonl"
    done
  done
done
"$PY" - "$OUT/compare.jsonl" <<'EOF'
import json, sys
runs = {}
for line in open(sys.argv[1]):
    r = json.loads(line)
    step = r["shape"].startswith("learner")
    figure = r["run"].get("step_seconds") if step else (r["run"].get("batch") or {}).get("tokens_per_second")
    runs.setdefault((r["shape"], r["side"]), [])
    if figure:
        runs[(r["shape"], r["side"])].append(figure)
print(f"{'shape':<12} {'A (runs)':<34} {'B (runs)':<34} B faster by (best)")
for shape in dict.fromkeys(k[0] for k in runs):
    a, b = runs.get((shape, "A"), []), runs.get((shape, "B"), [])
    step = shape.startswith("learner")
    fmt = lambda xs: " ".join(f"{x:.3f} s" if step else f"{x:.0f} tok/s" for x in xs) or "failed"
    ratio = "-" if not (a and b) else f"{min(a) / min(b):.3f}" if step else f"{max(b) / max(a):.3f}"
    print(f"{shape:<12} {fmt(a):<34} {fmt(b):<34} {ratio}")
EOF

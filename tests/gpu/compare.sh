#!/usr/bin/env bash
# Two builds of the `cuda` rollout worker side by side on one GPU, in one run: the
# engine's decode (`rollout-worker bench --batch-only`, BF16, gpt2-124m) at each shape,
# the builds alternating ROUNDS times (default 3), each run the best of 2 repetitions.
# Prints each run's tokens/s and, per shape, both builds' best and B over A.
#
#   A=DIR B=DIR tests/gpu/compare.sh OUT [SHAPE...]   # SHAPE: PROMPTSxG_NEW, default 32x8_192
#
# A and B hold a `rollout-worker` each (deploy/cuda/build.sh's archive unpacked, say the
# commit before a change and the change). Every run's JSON line is kept in
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
  p=${shape%%x*} rest=${shape#*x}
  g=${rest%%_*} t=${shape##*_}
  for round in $(seq "$ROUNDS"); do
    for side in A B; do
      dir=${!side}
      line=$(timeout -k 5 120 "$dir/rollout-worker" bench --preset gpt2-124m --device cuda \
        --precision bf16 --prompts "$p" -n "$g" --max-new-tokens "$t" --repeat 2 --batch-only \
        2> "$OUT/${side}_${shape}_$round.log" | tail -n 1)
      [ -n "$line" ] || line='{"error": "no output"}'
      echo "{\"side\": \"$side\", \"shape\": \"$shape\", \"round\": $round, \"run\": $line}" |
        tee -a "$OUT/compare.jsonl"
    done
  done
done
"$PY" - "$OUT/compare.jsonl" <<'EOF'
import json, sys
best = {}
for line in open(sys.argv[1]):
    r = json.loads(line)
    tps = (r["run"].get("batch") or {}).get("tokens_per_second")
    key = (r["shape"], r["side"])
    best.setdefault(key, [])
    if tps:
        best[key].append(tps)
print(f"{'shape':<12} {'A tok/s (runs)':<34} {'B tok/s (runs)':<34} B/A (best)")
for shape in dict.fromkeys(k[0] for k in best):
    a, b = best.get((shape, "A"), []), best.get((shape, "B"), [])
    fmt = lambda xs: " ".join(f"{x:.0f}" for x in xs) or "failed"
    ratio = f"{max(b) / max(a):.3f}" if a and b else "-"
    print(f"{shape:<12} {fmt(a):<34} {fmt(b):<34} {ratio}")
EOF

#!/usr/bin/env bash
# Checks this project on a lent GPU in one command (< 10 minutes) and prints one table;
# every figure is also a JSON file under OUT (default gpu-check-out/), `summary.json` all.
#
#   BIN=DIR tests/gpu-check.sh [OUT]
#
# BIN holds `learner` and `rollout-worker` built with `--features cuda` elsewhere
# (`tools/cuda-build.sh target-cuda/dist`, or `CARGO_TARGET_DIR=target-cuda cargo build
# --release --features cuda -p learner -p rollout-worker` with a CUDA toolkit; default
# target-cuda/release).
# The GPU machine needs the driver and the CUDA 13 libraries: this script points
# LD_LIBRARY_PATH at PyTorch's nvidia cu13 wheels (nvidia/cu13/lib) when it finds them.
# PyTorch and transformers (PYTHON, default python3) run the side-by-side baselines.
#
# Sections: device and driver; CUDA vs CPU parity (logits in f32 and bf16, greedy tokens
# of 3 prompts); rollout-worker bench at 32×8 and 64×8 rows × 64 and 192 new tokens beside
# transformers' generate, with the achieved memory bandwidth against the device's copy
# bandwidth; the learner's GRPO step beside PyTorch's (BF16 autocast) with MFU; a 124M
# weight push to a worker on the GPU; a short `learner train --local` on the GPU, the
# in-process worker's NVML gauges scraped while it runs. A section that fails records its
# error and the script goes on.
#
# DEVICE=cpu QUICK=1 runs the same flow on the CPU with the tiny preset (a dry run of the
# script itself; tests/tests/gpu_check.rs does it).
set -u
OUT=${1:-gpu-check-out}
BIN=${BIN:-target-cuda/release}
LEARNER=${LEARNER:-$BIN/learner}
WORKER=${WORKER:-$BIN/rollout-worker}
DEVICE=${DEVICE:-cuda}
PY=${PYTHON:-python3}
PEAK_TFLOPS=${PEAK_TFLOPS:-989}
LIMIT=${SECTION_TIMEOUT:-240}
HERE=$(cd "$(dirname "$0")" && pwd)
ROOT=$(dirname "$HERE")
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
rm -f "$OUT"/*.json "$OUT"/*.log

if [ "${QUICK:-0}" = 1 ]; then
  PRESET=tiny DTYPE=f32 ROWS="2" NEWS="8" GROUP=2 STEP_PROMPTS=2 TRAIN_STEPS=2
else
  PRESET=gpt2-124m DTYPE=bf16 ROWS="32 64" NEWS="64 192" GROUP=8 STEP_PROMPTS=32 TRAIN_STEPS=5
fi
[ "$DEVICE" = cpu ] && DTYPE=f32
if [ "$DEVICE" != cpu ]; then
  LIB=$("$PY" -c 'import nvidia, os; print(os.path.join(nvidia.__path__[0], "cu13", "lib"))' 2>/dev/null)
  [ -n "$LIB" ] && [ -d "$LIB" ] && export LD_LIBRARY_PATH="$LIB${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
fi
echo "{\"preset\": \"$PRESET\", \"device\": \"$DEVICE\", \"dtype\": \"$DTYPE\", \"bin\": \"$BIN\"}" > "$OUT/config.json"

# section NAME CMD...: CMD's last stdout line is OUT/NAME.json, its stderr OUT/NAME.log.
section() {
  local name=$1 started=$SECONDS rc
  shift
  echo "== $name" >&2
  timeout "$LIMIT" "$@" > "$OUT/$name.stdout" 2> "$OUT/$name.log"
  rc=$?
  if [ $rc -eq 0 ] && [ -s "$OUT/$name.stdout" ]; then
    tail -n 1 "$OUT/$name.stdout" > "$OUT/$name.json"
  else
    local why
    why=$(tail -n 1 "$OUT/$name.log" | tr -d '"\\' | cut -c1-300)
    echo "{\"error\": \"exit $rc: $why\"}" > "$OUT/$name.json"
  fi
  rm -f "$OUT/$name.stdout"
  echo "   $((SECONDS - started)) s" >&2
}

section device "$PY" "$HERE/gpu/check.py" device - --device "$DEVICE"
section parity "$WORKER" parity --preset "$PRESET" --device "$DEVICE" --new-tokens 16
section copy_bandwidth "$PY" "$HERE/gpu/check.py" copy-bandwidth - --device "$DEVICE"
for p in $ROWS; do
  for t in $NEWS; do
    section "worker_${p}x${GROUP}_$t" "$WORKER" bench --preset "$PRESET" --device "$DEVICE" \
      --dtype "$DTYPE" --prompts "$p" -n "$GROUP" --max-new-tokens "$t" --repeat 2 --batch-only
    section "hf_${p}x${GROUP}_$t" "$PY" "$HERE/gpu/check.py" hf-generate - --device "$DEVICE" \
      --dtype "$DTYPE" --preset "$PRESET" --prompts "$p" -n "$GROUP" --max-new-tokens "$t"
  done
done
section learner_step "$PY" "$ROOT/learner/bench/step_vs_pytorch.py" --learner "$LEARNER" \
  --preset "$PRESET" --device "$DEVICE" --prompts "$STEP_PROMPTS" --group "$GROUP" --steps 3 \
  --peak-tflops "$PEAK_TFLOPS"
# The same step with the training ops off (candle's composed ops and their backwards):
# what the ops' kernels buy.
section learner_composed "$LEARNER" bench --preset "$PRESET" --device "$DEVICE" \
  -p "$STEP_PROMPTS" -n "$GROUP" --steps 2 --train-ops off --peak-tflops "$PEAK_TFLOPS"
section push "$LEARNER" bench-push --preset "$PRESET" --worker-device "$DEVICE" --pushes 3 \
  --chunk-kib 1024 --idle-only

# A short local run on the device (learner and its in-process worker share it); the
# worker's NVML gauges scraped from the learner's metrics endpoint while it runs.
METRICS_PORT=$(( 20000 + RANDOM % 20000 ))
echo "== train" >&2
timeout "$LIMIT" "$LEARNER" train --local --preset "$PRESET" --device "$DEVICE" \
  --steps "$TRAIN_STEPS" --sft-steps 20 --prompts-per-step 4 --group-size "$GROUP" \
  --max-new-tokens 32 \
  --run-dir "$OUT/run" --overwrite --metrics "127.0.0.1:$METRICS_PORT" --listen 127.0.0.1:0 \
  --log-jsonl "$OUT/train.jsonl" --no-progress > "$OUT/train.log" 2>&1 &
TRAIN_PID=$!
"$PY" "$HERE/gpu/check.py" scrape "http://127.0.0.1:$METRICS_PORT/metrics" "$OUT/nvml.json" \
  --while-pid "$TRAIN_PID" > /dev/null 2>> "$OUT/train.log"
wait "$TRAIN_PID"
TRAIN_RC=$?
if [ -s "$OUT/train.jsonl" ]; then
  "$PY" "$HERE/gpu/check.py" train-summary "$OUT/train.jsonl" "$OUT/train.json" > /dev/null
else
  echo "{\"error\": \"exit $TRAIN_RC: $(tail -n 1 "$OUT/train.log" | tr -d '"\\' | cut -c1-300)\"}" > "$OUT/train.json"
fi

"$PY" "$HERE/gpu/check.py" table "$OUT"

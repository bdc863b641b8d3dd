#!/usr/bin/env bash
# Checks this project on a GPU in one bounded command and prints one table; every figure
# is also a JSON file under OUT, `summary.json` all of them, `table.txt` the table.
#
#   BIN=DIR tests/gpu-check.sh OUT
#
# BIN holds `learner` and `rollout-worker` built with `--features cuda` (unpacked from
# `deploy/cuda/build.sh`'s archive, or `CARGO_TARGET_DIR=target-cuda cargo build --release
# --features cuda -p learner -p rollout-worker` with a CUDA toolkit; default
# target-cuda/release).
# The GPU machine needs the driver and the CUDA 13 libraries: this script points
# LD_LIBRARY_PATH at PyTorch's nvidia cu13 wheels (nvidia/cu13/lib) when it finds them.
# PyTorch and transformers (PYTHON, default python3) run the side-by-side baselines.
#
# Time: the whole run ends by DEADLINE seconds (default 540); each section gets at most
# SECTION_TIMEOUT seconds (default 60), the local training run TRAIN_TIMEOUT (default 150),
# both cut to what is left; a section with no time left is recorded as skipped for the
# deadline. Each section's JSON and the table so far are written as it ends, so a run
# killed from outside still leaves what finished. A section that fails records its error
# and the rest still run; the exit status is the number of failed sections.
#
# Sections, the headline shape (256 rows, 192 new tokens) first: device and driver; CUDA
# vs CPU parity (logits in f32 and bf16, greedy tokens of 3 prompts, the decode kernels
# against their CPU references); rollout-worker bench beside transformers' generate, with
# the achieved memory bandwidth against the device's copy bandwidth; the learner's GRPO
# step beside PyTorch's (BF16 autocast) with MFU, and with the training ops off; a 124M
# weight push to a worker on the GPU; a short `learner train --local` on the GPU, the
# in-process worker's NVML gauges scraped while it runs.
#
# ONLY="NAME ..." runs only the named sections (device, parity, copy_bandwidth,
# worker_PxG_T, hf_PxG_T, learner_step, push, train, learner_composed) and keeps the other
# sections' JSON already in OUT: a second run redoes what a first one left failed, and the
# table covers both.
#
# DEVICE=cpu QUICK=1 runs the same flow on the CPU with the tiny preset (a dry run of the
# script itself; tests/tests/integration/gpu_check.rs does it).
set -u
if [ $# -ne 1 ]; then
  echo "usage: BIN=DIR $0 OUT (the directory the figures go to)" >&2
  exit 2
fi
OUT=$1
BIN=${BIN:-target-cuda/release}
LEARNER=${LEARNER:-$BIN/learner}
WORKER=${WORKER:-$BIN/rollout-worker}
DEVICE=${DEVICE:-cuda}
PY=${PYTHON:-python3}
PEAK_TFLOPS=${PEAK_TFLOPS:-989}
LIMIT=${SECTION_TIMEOUT:-60}
TRAIN_LIMIT=${TRAIN_TIMEOUT:-150}
DEADLINE=${DEADLINE:-540}
HERE=$(cd "$(dirname "$0")" && pwd)
ROOT=$(dirname "$HERE")
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
ONLY=${ONLY:-}
[ -n "$ONLY" ] || rm -f "$OUT"/*.json "$OUT"/*.log "$OUT"/table.txt
FAILED=0

if [ "${QUICK:-0}" = 1 ]; then
  PRESET=tiny DTYPE=f32 ROWS="2" NEWS="8" GROUP=2 STEP_PROMPTS=2 TRAIN_STEPS=2 MICRO=1
  COMPOSED_MICRO=1
else
  # The learner's step in one micro-batch (all 32 groups): the batch that fills the GPU.
  PRESET=gpt2-124m DTYPE=bf16 ROWS="32 64" NEWS="192 64" GROUP=8 STEP_PROMPTS=32 TRAIN_STEPS=5
  MICRO=32
  # Composed ops keep every intermediate of the (rows, vocabulary) head: 32 groups in
  # one micro-batch are out of memory on an 80 GB card; 8 fit (and the step with the ops
  # on is the same at 8 as at 32).
  COMPOSED_MICRO=8
fi
[ "$DEVICE" = cpu ] && DTYPE=f32
if [ "$DEVICE" != cpu ]; then
  . "$HERE/gpu/cuda-libs.sh"
fi
# chosen NAME: whether this run runs section NAME.
chosen() {
  [ -z "$ONLY" ] || [[ " $ONLY " == *" $1 "* ]]
}

echo "{\"preset\": \"$PRESET\", \"device\": \"$DEVICE\", \"dtype\": \"$DTYPE\", \"bin\": \"$BIN\"}" > "$OUT/config.json"

# Seconds a section may run: its limit, cut to what is left before the deadline; 0 when
# less than 5 s are left (the section is skipped).
budget() {
  local left=$((DEADLINE - SECONDS))
  if [ "$left" -lt 5 ]; then echo 0
  elif [ "$left" -lt "$1" ]; then echo "$left"
  else echo "$1"
  fi
}

# The table so far (table.txt, summary.json); a run killed later still leaves it.
table() {
  "$PY" "$HERE/gpu/check.py" table "$OUT" > "$OUT/table.txt" 2>> "$OUT/table.log"
}

# Counts a failed section (a JSON with an error) and rewrites the table.
settle() {
  grep -q '"error"' "$OUT/$1.json" 2>/dev/null && FAILED=$((FAILED + 1))
  table
}

# failed NAME RC LIMIT LOG: NAME's JSON records the exit status and LOG's last line (and
# that the section was stopped at its LIMIT).
failed() {
  local why
  # The last error line (a backtrace may follow it), else the last line.
  why=$(grep -E '^(error|Error)' "$4" | tail -n 1)
  [ -n "$why" ] || why=$(tail -n 1 "$4")
  why=$(printf '%s' "$why" | tr -d '"\\' | cut -c1-300)
  [ "$2" -eq 124 ] || [ "$2" -eq 137 ] && why="stopped at its $3 s limit; $why"
  echo "{\"error\": \"exit $2: $why\"}" > "$OUT/$1.json"
}

# skipped NAME: NAME's JSON records that the deadline left it no time.
skipped() {
  echo "{\"error\": \"skipped: the ${DEADLINE} s deadline was reached\"}" > "$OUT/$1.json"
}

# section NAME CMD...: CMD's last stdout line is OUT/NAME.json, its stderr OUT/NAME.log.
section() {
  local name=$1 started=$SECONDS rc limit
  shift
  chosen "$name" || return 0
  limit=$(budget "$LIMIT")
  echo "== $name" >&2
  if [ "$limit" -eq 0 ]; then
    skipped "$name"
    settle "$name"
    return
  fi
  timeout -k 5 "$limit" "$@" > "$OUT/$name.stdout" 2> "$OUT/$name.log"
  rc=$?
  if [ $rc -eq 0 ] && [ -s "$OUT/$name.stdout" ]; then
    tail -n 1 "$OUT/$name.stdout" > "$OUT/$name.json"
  else
    failed "$name" "$rc" "$limit" "$OUT/$name.log"
  fi
  rm -f "$OUT/$name.stdout"
  settle "$name"
  echo "   $((SECONDS - started)) s" >&2
}

# A short local run on the device (learner and its in-process worker share it); the
# worker's NVML gauges scraped from the learner's metrics endpoint while it runs.
train_section() {
  chosen train || return 0
  METRICS_PORT=$(( 20000 + RANDOM % 20000 ))
  echo "== train" >&2
  local limit
  limit=$(budget "$TRAIN_LIMIT")
  if [ "$limit" -eq 0 ]; then
    skipped train
    echo '{"skipped": "no training run"}' > "$OUT/nvml.json"
  else
    timeout -k 5 "$limit" "$LEARNER" train --local --preset "$PRESET" --device "$DEVICE" \
      --steps "$TRAIN_STEPS" --sft-steps 20 --prompts-per-step 4 --group-size "$GROUP" \
      --max-new-tokens 32 \
      --run-dir "$OUT/run" --overwrite --metrics "127.0.0.1:$METRICS_PORT" --listen 127.0.0.1:0 \
      --log-jsonl "$OUT/train.jsonl" --no-progress > "$OUT/train.log" 2>&1 &
    TRAIN_PID=$!
    "$PY" "$HERE/gpu/check.py" scrape "http://127.0.0.1:$METRICS_PORT/metrics" "$OUT/nvml.json" \
      --while-pid "$TRAIN_PID" > /dev/null 2>> "$OUT/train.log"
    wait "$TRAIN_PID"
    TRAIN_RC=$?
    if [ $TRAIN_RC -eq 0 ] && [ -s "$OUT/train.jsonl" ]; then
      "$PY" "$HERE/gpu/check.py" train-summary "$OUT/train.jsonl" "$OUT/train.json" > /dev/null
    else
      failed train "$TRAIN_RC" "$limit" "$OUT/train.log"
    fi
  fi
  settle train
}

# rollout SHAPE...: the worker's bench and transformers' generate, PROMPTSxGROUP_NEW.
rollout() {
  local shape p t
  for shape in "$@"; do
    p=${shape%%x*} t=${shape##*_}
    section "worker_${p}x${GROUP}_$t" "$WORKER" bench --preset "$PRESET" --device "$DEVICE" \
      --weight-dtype "$DTYPE" --prompts "$p" -n "$GROUP" --max-new-tokens "$t" --repeat 2 --batch-only
    section "hf_${p}x${GROUP}_$t" "$PY" "$HERE/gpu/check.py" hf-generate - --device "$DEVICE" \
      --dtype "$DTYPE" --preset "$PRESET" --prompts "$p" -n "$GROUP" --max-new-tokens "$t"
  done
}
SHAPES=()
for p in $ROWS; do for t in $NEWS; do SHAPES+=("${p}x${GROUP}_$t"); done; done

# The headline figures first, so that a deadline cuts the extras.
section device "$PY" "$HERE/gpu/check.py" device - --device "$DEVICE"
section parity "$WORKER" parity --preset "$PRESET" --device "$DEVICE" --new-tokens 16
section copy_bandwidth "$PY" "$HERE/gpu/check.py" copy-bandwidth - --device "$DEVICE"
rollout "${SHAPES[0]}"
section learner_step "$PY" "$ROOT/learner/bench/step_vs_pytorch.py" --learner "$LEARNER" \
  --preset "$PRESET" --device "$DEVICE" --prompts "$STEP_PROMPTS" --group "$GROUP" --steps 3 \
  --micro-batch-groups "$MICRO" --peak-tflops "$PEAK_TFLOPS"
section push "$LEARNER" bench-push --preset "$PRESET" --worker-device "$DEVICE" --pushes 3 \
  --chunk-kib 1024 --idle-only
train_section
rollout "${SHAPES[@]:1}"
# The same step with the training ops off (candle's composed ops and their backwards),
# at COMPOSED_MICRO groups per micro-batch: what the ops' kernels buy.
section learner_composed "$LEARNER" bench --preset "$PRESET" --device "$DEVICE" \
  -p "$STEP_PROMPTS" -n "$GROUP" --steps 2 --micro-batch-groups "$COMPOSED_MICRO" --train-ops off \
  --peak-tflops "$PEAK_TFLOPS"

cat "$OUT/table.txt"
echo "gpu-check: $FAILED failed section(s), $SECONDS s" >&2
exit "$FAILED"

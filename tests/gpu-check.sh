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
# SECTION_TIMEOUT seconds (default 60), the learner's step beside PyTorch's STEP_TIMEOUT
# (default 150), the local training run TRAIN_TIMEOUT (default 150),
# both cut to what is left; a section with no time left is recorded as skipped for the
# deadline. Each section's JSON and the table so far are written as it ends, so a run
# killed from outside still leaves what finished. A section that fails records its error
# and the rest still run; the exit status is the number of failed sections.
#
# Sections, the headline shape (256 rows, 192 new tokens) first: device and driver; CUDA
# vs CPU parity (logits in f32 and bf16, greedy tokens of 3 prompts, the decode kernels
# against their CPU references); rollout-worker bench beside transformers' generate, with
# the achieved memory bandwidth against the device's copy bandwidth, and beside a PyTorch
# static-KV-cache step captured as a CUDA graph; the step's backend compared buffer by
# buffer with the CPU reference and its pass timed; the device time of the fused step's
# kernels (device events) and of decode's late in a run (Nsight Compute); the learner's GRPO step (candle's autograd
# and the fused pass on the CUDA backend) beside PyTorch's (BF16 autocast, eager and
# `torch.compile`) with MFU, and with the training ops off; a 124M
# weight push to a worker on the GPU (each version a new model, and written into the
# worker's own buffers: the trial weights_in_place); a short `learner train --local` on the GPU, the
# in-process worker's NVML gauges scraped while it runs, beside TRL's GRPOTrainer with the
# same batch.
#
# ONLY="NAME ..." runs only the named sections (device, parity, copy_bandwidth,
# worker_PxG_T, split_PxG_T, graphs_PxG_T, hf_PxG_T, graph_PxG_T, backend_compare, backend_pass,
# learner_profile, tiles_compare, tiles_profile, decode_profile, learner_step, push,
# push_in_place, train, trl, learner_composed) and keeps the other
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
STEP_LIMIT=${STEP_TIMEOUT:-150}
DEADLINE=${DEADLINE:-540}
HERE=$(cd "$(dirname "$0")" && pwd)
ROOT=$(dirname "$HERE")
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
ONLY=${ONLY:-}
[ -n "$ONLY" ] || rm -f "$OUT"/*.json "$OUT"/*.log "$OUT"/table.txt
FAILED=0

if [ "${QUICK:-0}" = 1 ]; then
  PRESET=tiny DTYPE=f32 ROWS="2" NEWS="8" GROUP=2 STEP_PROMPTS=2 TRAIN_STEPS=2 TRAIN_SKIP=1 MICRO=1
  COMPOSED_MICRO=1
else
  # The learner's step in one micro-batch (all 32 groups): the batch that fills the GPU.
  PRESET=gpt2-124m DTYPE=bf16 ROWS="32 64" NEWS="192 64" GROUP=8 STEP_PROMPTS=32 TRAIN_STEPS=8
  TRAIN_SKIP=2
  MICRO=32
  # Composed ops keep every intermediate of the (rows, vocabulary) head: 32 groups in
  # one micro-batch are out of memory on an 80 GB card; 8 fit (and the step with the ops
  # on is the same at 8 as at 32).
  COMPOSED_MICRO=8
fi
[ "$DEVICE" = cpu ] && DTYPE=f32
# The backend of `learner compare-backends`: the CUDA one on a GPU, the CPU one with the
# same BF16 products in the dry run; the reference is the CPU backend with those products;
# the comparison at a shape the CPU reference runs in seconds.
if [ "$DEVICE" = cpu ]; then PASS_BACKEND=cpu-bf16 COMPARE_PROMPTS=2 COMPARE_TOKENS=8
else PASS_BACKEND=cuda COMPARE_PROMPTS=4 COMPARE_TOKENS=64; fi
# PyTorch's learner step: eager and `torch.compile`, both under BF16 autocast on a GPU (the
# compiled one is what a user tuning for speed runs); f32 eager in the CPU dry run.
if [ "$DEVICE" = cpu ]; then TORCH_CONFIGS=${TORCH_CONFIGS:-f32}; else TORCH_CONFIGS=${TORCH_CONFIGS:-bf16,compile-bf16}; fi
# The learner's step on each of STEP_PATHS (`learner bench --path`): on a GPU candle's
# autograd (auto) and the fused pass on the CUDA backend (fused), each its own row.
# TRAIN_STEP_PATH: the local training run's `--step-path` (default auto).
if [ "$DEVICE" = cpu ]; then STEP_PATHS=${STEP_PATHS:-auto}; else STEP_PATHS=${STEP_PATHS:-auto,fused}; fi
TRAIN_STEP_PATH=${TRAIN_STEP_PATH:-auto}
if [ "$DEVICE" != cpu ]; then
  . "$HERE/gpu/cuda-libs.sh"
fi
# PEER_WHEELS=DIR: Python wheels the peers need and the machine lacks (TRL and `datasets`,
# fetched by tests/gpu/peer-wheels.sh), installed for this run only.
if [ -n "${PEER_WHEELS:-}" ]; then
  SITE=$(mktemp -d)
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$SITE" \
    "$PEER_WHEELS"/*.whl >&2 && export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
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

# not_here NAME WHY: NAME's JSON records why it does not run on this device.
not_here() {
  chosen "$1" || return 0
  echo "{\"skipped\": \"$2\"}" > "$OUT/$1.json"
  table
}

# section NAME CMD...: CMD's last stdout line is OUT/NAME.json, its stderr OUT/NAME.log.
# SECTION_LIMIT=S before it gives that section S seconds instead of SECTION_TIMEOUT.
section() {
  local name=$1 started=$SECONDS rc limit
  shift
  chosen "$name" || return 0
  limit=$(budget "${SECTION_LIMIT:-$LIMIT}")
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
      --max-new-tokens 32 --step-path "$TRAIN_STEP_PATH" \
      --run-dir "$OUT/run" --overwrite --metrics "127.0.0.1:$METRICS_PORT" --listen 127.0.0.1:0 \
      --log-jsonl "$OUT/train.jsonl" --no-progress > "$OUT/train.log" 2>&1 &
    TRAIN_PID=$!
    "$PY" "$HERE/gpu/check.py" scrape "http://127.0.0.1:$METRICS_PORT/metrics" "$OUT/nvml.json" \
      --while-pid "$TRAIN_PID" > /dev/null 2>> "$OUT/train.log"
    wait "$TRAIN_PID"
    TRAIN_RC=$?
    if [ $TRAIN_RC -eq 0 ] && [ -s "$OUT/train.jsonl" ]; then
      "$PY" "$HERE/gpu/check.py" train-summary "$OUT/train.jsonl" "$OUT/train.json" --skip "$TRAIN_SKIP" > /dev/null
    else
      failed train "$TRAIN_RC" "$limit" "$OUT/train.log"
    fi
  fi
  settle train
}

# rollout SHAPE...: the worker's bench (with its defaults, then with the trial split
# kernel turned on, then with the trial captured decode step), transformers' generate and PyTorch's static-cache step
# captured as a CUDA graph, PROMPTSxGROUP_NEW.
rollout() {
  local shape p t
  for shape in "$@"; do
    p=${shape%%x*} t=${shape##*_}
    section "worker_${p}x${GROUP}_$t" "$WORKER" bench --preset "$PRESET" --device "$DEVICE" \
      --weight-dtype "$DTYPE" --prompts "$p" -n "$GROUP" --max-new-tokens "$t" --repeat 2 --batch-only
    section "split_${p}x${GROUP}_$t" env ROOKWORLD_ENABLE_KERNELS=grouped_attention_split \
      "$WORKER" bench --preset "$PRESET" --device "$DEVICE" \
      --weight-dtype "$DTYPE" --prompts "$p" -n "$GROUP" --max-new-tokens "$t" --repeat 2 --batch-only
    section "graphs_${p}x${GROUP}_$t" env ROOKWORLD_ENABLE_KERNELS=decode_graphs \
      "$WORKER" bench --preset "$PRESET" --device "$DEVICE" \
      --weight-dtype "$DTYPE" --prompts "$p" -n "$GROUP" --max-new-tokens "$t" --repeat 2 --batch-only
    section "hf_${p}x${GROUP}_$t" "$PY" "$HERE/gpu/check.py" hf-generate - --device "$DEVICE" \
      --dtype "$DTYPE" --preset "$PRESET" --prompts "$p" -n "$GROUP" --max-new-tokens "$t"
    section "graph_${p}x${GROUP}_$t" "$PY" "$HERE/gpu/check.py" graph-decode - --device "$DEVICE" \
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
# The step's backend in the debug mode: every buffer of a micro-batch against the CPU
# backend with the same products (the first one beyond tolerance named), then its forward + backward timed at
# the learner step's shape.
section backend_compare "$LEARNER" compare-backends --backend "$PASS_BACKEND" --preset "$PRESET" \
  --prompts "$COMPARE_PROMPTS" --group-size "$GROUP" --prompt-tokens 46 --completion-tokens "$COMPARE_TOKENS"
section backend_pass "$LEARNER" compare-backends --backend "$PASS_BACKEND" --preset "$PRESET" \
  --prompts "$STEP_PROMPTS" --group-size "$GROUP" --prompt-tokens 46 --completion-tokens 64 \
  --no-compare --time-passes 3
# Where the fused step's device time goes: every kernel of one step timed by device events
# (`learner bench --profile`), and where decode's goes: Nsight Compute over a window of
# launches late in the headline run (NCU_SKIP, NCU_COUNT), the clocks left alone.
# tiles_compare and tiles_profile: the same with the step's trials, the tiled attention
# (step_attention_tiles) and the kept head (step_head_kept), their buffers against the CPU
# backend's first (each trial's kernels are named apart in the profile).
if [ "$DEVICE" = cpu ]; then
  not_here learner_profile "the kernel profile is of the CUDA backend (perf samples the CPU)"
  not_here tiles_compare "the step's trials are CUDA kernels"
  not_here tiles_profile "the step's trials are CUDA kernels"
  not_here decode_profile "Nsight Compute profiles GPU kernels"
else
  section learner_profile "$LEARNER" bench --preset "$PRESET" --device "$DEVICE" --path fused \
    -p "$STEP_PROMPTS" -n "$GROUP" --steps 1 --micro-batch-groups "$MICRO" --profile \
    --peak-tflops "$PEAK_TFLOPS"
  section tiles_compare env ROOKWORLD_ENABLE_KERNELS=step_attention_tiles,step_head_kept "$LEARNER" \
    compare-backends --backend "$PASS_BACKEND" --preset "$PRESET" --prompts "$COMPARE_PROMPTS" \
    --group-size "$GROUP" --prompt-tokens 46 --completion-tokens "$COMPARE_TOKENS"
  section tiles_profile env ROOKWORLD_ENABLE_KERNELS=step_attention_tiles,step_head_kept "$LEARNER" bench \
    --preset "$PRESET" --device "$DEVICE" --path fused -p "$STEP_PROMPTS" -n "$GROUP" --steps 1 \
    --micro-batch-groups "$MICRO" --profile --peak-tflops "$PEAK_TFLOPS"
  section decode_profile "$PY" "$HERE/gpu/check.py" ncu-profile - --launch-skip "${NCU_SKIP:-6000}" \
    --launch-count "${NCU_COUNT:-1000}" -- "$WORKER" bench --preset "$PRESET" --device "$DEVICE" \
    --weight-dtype "$DTYPE" --prompts "${ROWS%% *}" -n "$GROUP" --max-new-tokens "${NEWS%% *}" \
    --repeat 1 --batch-only
fi
# `torch.compile` spends most of a minute compiling the step before it is timed.
SECTION_LIMIT=$STEP_LIMIT section learner_step "$PY" "$ROOT/learner/bench/step_vs_pytorch.py" --learner "$LEARNER" \
  --preset "$PRESET" --device "$DEVICE" --prompts "$STEP_PROMPTS" --group "$GROUP" --steps 3 \
  --micro-batch-groups "$MICRO" --peak-tflops "$PEAK_TFLOPS" --torch-configs "$TORCH_CONFIGS" \
  --paths "$STEP_PATHS"
section push "$LEARNER" bench-push --preset "$PRESET" --worker-device "$DEVICE" --pushes 3 \
  --chunk-kib 1024 --idle-only
# The same with each version written into the worker's retired model from page-locked memory.
section push_in_place env ROOKWORLD_ENABLE_KERNELS=weights_in_place "$LEARNER" bench-push \
  --preset "$PRESET" --worker-device "$DEVICE" --pushes 3 --chunk-kib 1024 --idle-only
train_section
# The whole loop's peer: TRL's GRPOTrainer with the same batch, steps and new tokens.
SECTION_LIMIT=$TRAIN_LIMIT section trl "$PY" "$HERE/gpu/trl_grpo.py" --device "$DEVICE" \
  --preset "$PRESET" --prompts 4 -n "$GROUP" --max-new-tokens 32 \
  --steps "$((TRAIN_STEPS - TRAIN_SKIP))" --warmup "$TRAIN_SKIP"
rollout "${SHAPES[@]:1}"
# The same step with the training ops off (candle's composed ops and their backwards),
# at COMPOSED_MICRO groups per micro-batch: what the ops' kernels buy.
section learner_composed "$LEARNER" bench --preset "$PRESET" --device "$DEVICE" \
  -p "$STEP_PROMPTS" -n "$GROUP" --steps 2 --micro-batch-groups "$COMPOSED_MICRO" --train-ops off \
  --peak-tflops "$PEAK_TFLOPS"

cat "$OUT/table.txt"
echo "gpu-check: $FAILED failed section(s), $SECONDS s" >&2
exit "$FAILED"

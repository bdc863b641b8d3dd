#!/usr/bin/env bash
# Checks this project on a GPU in one bounded command made for a short slot: the headline
# sections first, one archive of everything it writes, one table.
#
#   BIN=DIR tests/gpu-check.sh OUT
#
# OUT receives three files: `check.tar.gz` (every section's JSON and log, the table, the
# device's health after each failed section), `table.txt` and `summary.json` (the table's
# figures). The archive and the table are rewritten as each section ends, so a run killed
# from outside still leaves what finished.
#
# BIN holds `learner` and `rollout-worker` built with `--features cuda` (unpacked from
# `deploy/cuda/build.sh`'s archive, or `CARGO_TARGET_DIR=target-cuda cargo build --release
# --features cuda -p learner -p rollout-worker` with a CUDA toolkit; default
# target-cuda/release).
# The GPU machine needs the driver and the CUDA 13 libraries: this script points
# LD_LIBRARY_PATH at PyTorch's nvidia cu13 wheels (nvidia/cu13/lib) when it finds them.
# PyTorch and transformers (PYTHON, default python3) run the side-by-side baselines.
#
# Time: the whole run ends by DEADLINE seconds (default 420: a second run still fits in a
# 15-minute slot). Each section has an estimate (ESTIMATES below); the estimate of the
# sections selected is printed first, and a section whose estimate is more than the time
# left is not started: it is recorded as cut by the deadline, and the table says so. A
# section runs at most SECTION_TIMEOUT seconds (default 60), the learner's step beside
# PyTorch's STEP_TIMEOUT (default 150), the local training run and TRL's TRAIN_TIMEOUT
# (default 150), each cut to what is left. A section that fails records its error, the
# device's health is probed (`nvidia-smi` and a tiny PyTorch op, at most 20 s) and the rest
# still run; the exit status is the number of sections failed or cut.
#
# The headline sections run first, in this order, each deciding one thing:
#   device           which card, driver and PyTorch the figures are of;
#   parity           CUDA against the CPU: logits, greedy tokens, each decode kernel;
#   worker_PxG_T     the engine's decode at the headline shape (256 rows, 192 new tokens),
#   graph_PxG_T      beside a PyTorch static-cache step captured as one CUDA graph;
#   backend_compare  the step's CUDA backend, buffer by buffer against the CPU backend;
#   learner_step     the learner's GRPO step beside PyTorch's (BF16 autocast, eager and
#                    `torch.compile`), each of STEP_PATHS its own row, with MFU;
#   push             a 124M weight push to a worker on the GPU (gRPC and same host).
# Then the rest, a deadline cutting from the end: the copy bandwidth; transformers'
# `generate` at the headline shape; a short `learner train --local` (the in-process
# worker's NVML gauges scraped while it runs) beside TRL's GRPOTrainer with the same batch;
# the worker's trials (captured decode step, split attention) at the headline shape; the
# backend's pass timed; where the device time goes (the fused step's kernels by device
# events, decode's by Nsight Compute, and the fused step's with its attention on tensor
# cores between them); the push into the worker's own buffers; the step's trials checked
# and the tiles timed; the other rollout shapes; the learner's step with the training ops
# off.
#
# ONLY="NAME ..." runs only the named sections (device, parity, copy_bandwidth,
# worker_PxG_T, split_PxG_T, graphs_PxG_T, hf_PxG_T, graph_PxG_T, backend_compare,
# backend_pass, learner_profile, mma_profile, mma_compare, tiles_compare, tiles_profile,
# decode_profile, learner_step,
# push, push_in_place, train, trl, learner_composed) and keeps the other sections of an
# earlier run's archive (PREVIOUS, default OUT/check.tar.gz): a second run redoes what a
# first one left failed or cut, and the table and the new archive cover both.
#
# DEVICE=cpu QUICK=1 runs the same flow on the CPU with the tiny preset (a dry run of the
# script itself; tests/tests/integration/gpu_check.rs does it).
set -u
if [ $# -ne 1 ]; then
  echo "usage: BIN=DIR $0 OUT (the directory the archive and the table go to)" >&2
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
DEADLINE=${DEADLINE:-420}
# The learner's rows of the step comparison (and PyTorch's on the CPU) use every core.
THREADS=${THREADS:-$(nproc)}
HERE=$(cd "$(dirname "$0")" && pwd)
ROOT=$(dirname "$HERE")
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
ARCHIVE=$OUT/check.tar.gz
ONLY=${ONLY:-}
# Every file a section writes goes to WORK, packed into ARCHIVE after each section.
WORK=$(mktemp -d "${TMPDIR:-/tmp}/gpu-check.XXXXXX")
trap 'rm -rf "$WORK"' EXIT
trap 'exit 143' TERM INT
if [ -n "$ONLY" ] && [ -s "${PREVIOUS:-$ARCHIVE}" ]; then
  tar -xzf "${PREVIOUS:-$ARCHIVE}" -C "$WORK"
fi
rm -f "$OUT/table.txt" "$OUT/summary.json"
FAILED=0

# The local training run (and TRL's): TRAIN_STEPS steps of 4 prompts × TRAIN_GROUP
# completions of up to TRAIN_NEW tokens after TRAIN_SFT warm-up steps, the first
# TRAIN_SKIP steps left out of the timing.
if [ "${QUICK:-0}" = 1 ]; then
  PRESET=tiny DTYPE=f32 ROWS="2" NEWS="8" GROUP=2 STEP_PROMPTS=2 MICRO=1 COMPOSED_MICRO=1
  # Enough warm-up (20 steps at a learning rate of 0.01: 35 s of a debug build on two
  # cores) that some completions are well formed, so that a group's rewards differ and
  # every step trains (a group whose rewards are all alike is skipped).
  TRAIN_STEPS=3 TRAIN_SKIP=1 TRAIN_GROUP=8 TRAIN_NEW=64 TRAIN_SFT=20 TRAIN_SFT_LR=0.01
else
  # The learner's step in one micro-batch (all 32 groups): the batch that fills the GPU.
  PRESET=gpt2-124m DTYPE=bf16 ROWS="32 64" NEWS="192 64" GROUP=8 STEP_PROMPTS=32
  TRAIN_STEPS=8 TRAIN_SKIP=2 TRAIN_GROUP=8 TRAIN_NEW=32 TRAIN_SFT=20 TRAIN_SFT_LR=0.003
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
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$WORK/site" \
    "$PEER_WHEELS"/*.whl >&2 && export PYTHONPATH="$WORK/site${PYTHONPATH:+:$PYTHONPATH}"
fi

SHAPES=()
for p in $ROWS; do for t in $NEWS; do SHAPES+=("${p}x${GROUP}_$t"); done; done
HEAD=${SHAPES[0]}
# The headline sections, in the order they run.
HEADLINE=(device parity "worker_$HEAD" "graph_$HEAD" backend_compare learner_step push)
# The rest, the most telling first: a deadline cuts from the end.
EXTRAS=(copy_bandwidth "hf_$HEAD" train trl "graphs_$HEAD" "split_$HEAD" backend_pass
  learner_profile mma_profile decode_profile push_in_place mma_compare tiles_compare
  tiles_profile)
for shape in "${SHAPES[@]:1}"; do
  EXTRAS+=("worker_$shape" "graph_$shape" "hf_$shape" "graphs_$shape" "split_$shape")
done
EXTRAS+=(learner_composed)

# Seconds each kind of section is expected to take, a process's start and the device's
# set-up included: on one H100/H200 (from the runs on docs/performance/gpu.md, rounded
# up; the learner's step is mostly `torch.compile`'s minute), and in the CPU dry run.
ESTIMATES="
kind             gpu  cpu
device             5    1
parity            20   10
worker             8    2
graph             15    3
hf                15    3
split              8    2
graphs             8    2
copy_bandwidth     8    1
backend_compare   30    5
backend_pass      15    3
learner_profile   15    0
tiles_compare     30    0
tiles_profile     15    0
mma_compare       30    0
mma_profile       15    0
decode_profile    45    0
learner_step     110   10
push              10    5
push_in_place     10    5
train             50   60
trl               60    3
learner_composed  20    5
"

# estimate NAME: NAME's expected seconds on this device (worker_32x8_192 is a `worker`).
estimate() {
  local column=gpu
  [ "$DEVICE" = cpu ] && column=cpu
  awk -v kind="${1%%_[0-9]*}" -v column="$column" '
    $1 == "kind" { for (i = 1; i <= NF; i++) at[$i] = i }
    $1 == kind { print $at[column]; found = 1 }
    END { if (!found) print 60 }' <<< "$ESTIMATES"
}

# chosen NAME: whether this run runs section NAME.
chosen() {
  [ -z "$ONLY" ] || [[ " $ONLY " == *" $1 "* ]]
}

# gpu_only NAME: whether NAME profiles or tries CUDA kernels (recorded as not run on the CPU).
gpu_only() {
  case $1 in learner_profile | tiles_* | mma_* | decode_profile) return 0 ;; esac
  return 1
}

# Prints the estimated time of the selected sections, and which the deadline would cut.
announce() {
  local name est total=0 headline=0 count=0 run=0 cut=()
  for name in "${HEADLINE[@]}" "${EXTRAS[@]}"; do
    chosen "$name" || continue
    [ "$DEVICE" = cpu ] && gpu_only "$name" && continue
    est=$(estimate "$name")
    count=$((count + 1))
    # As `section` decides: a section that does not fit in what is left is cut, and the
    # next one may still fit.
    if [ $((run + est)) -gt "$DEADLINE" ]; then cut+=("$name"); else run=$((run + est)); fi
    total=$((total + est))
    [[ " ${HEADLINE[*]} " == *" $name "* ]] && headline=$((headline + est))
  done
  ESTIMATE=$total
  echo "gpu-check: $count sections selected, estimated $total s (headline $headline s);" \
    "deadline $DEADLINE s" >&2
  [ ${#cut[@]} -eq 0 ] || echo "gpu-check: expected to be cut by the deadline: ${cut[*]}" >&2
}

# The table so far (table.txt, summary.json) and the archive of everything; a run killed
# later still leaves them.
table() {
  echo "{\"deadline\": $DEADLINE, \"estimate_seconds\": $ESTIMATE, \"elapsed_seconds\": $SECONDS}" \
    > "$WORK/check.json"
  "$PY" "$HERE/gpu/check.py" table "$WORK" > "$WORK/table.txt" 2>> "$WORK/table.log"
  cp "$WORK/table.txt" "$OUT/table.txt"
  [ -f "$WORK/summary.json" ] && cp "$WORK/summary.json" "$OUT/summary.json"
  # The training run's checkpoints and the peers' wheels stay out.
  tar -czf "$ARCHIVE.part" -C "$WORK" --exclude=./run --exclude=./site . 2> /dev/null
  [ -f "$ARCHIVE.part" ] && mv -f "$ARCHIVE.part" "$ARCHIVE"
}

# health NAME: the device's health after NAME failed, as health_after_NAME.json.
health() {
  local file=$WORK/health_after_$1.json limit=20 rc
  [ $((DEADLINE - SECONDS)) -lt "$limit" ] && limit=$((DEADLINE - SECONDS))
  if [ "$limit" -lt 3 ]; then
    echo '{"healthy": null, "problem": "not probed: no time left"}' > "$file"
    return
  fi
  timeout -k 2 "$limit" "$PY" "$HERE/gpu/check.py" health "$file" --device "$DEVICE" \
    --timeout $((limit / 2)) > /dev/null 2>> "$WORK/health.log"
  rc=$?
  [ "$rc" -eq 0 ] && [ -s "$file" ] ||
    echo "{\"healthy\": false, \"problem\": \"the probe failed or hung (exit $rc)\"}" > "$file"
}

# Counts a failed or cut section (a JSON with an error), probes the device after a
# failure, and rewrites the table and the archive (after a cut the final table does).
settle() {
  rm -f "$WORK/health_after_$1.json"
  if grep -q '"error": "cut:' "$WORK/$1.json" 2> /dev/null; then
    FAILED=$((FAILED + 1))
    return
  fi
  if grep -q '"error"' "$WORK/$1.json" 2> /dev/null; then
    FAILED=$((FAILED + 1))
    health "$1"
  fi
  table
}

# failed NAME RC LIMIT LOG [STDOUT]: NAME's JSON records the exit status and LOG's last
# line (and that the section was stopped at its LIMIT); where the command still wrote its
# JSON report (STDOUT's last line: `rollout-worker parity` reports every family before it
# exits non-zero for one that failed), the report is kept with the error added to it.
failed() {
  local why
  # The last error line (a backtrace may follow it), else the last line.
  why=$(grep -E '^(error|Error)' "$4" | tail -n 1)
  [ -n "$why" ] || why=$(tail -n 1 "$4")
  why=$(printf '%s' "$why" | tr -d '"\\' | cut -c1-300)
  [ "$2" -eq 124 ] || [ "$2" -eq 137 ] && why="stopped at its $3 s limit; $why"
  if [ -n "${5:-}" ] && [ -s "$5" ] && tail -n 1 "$5" | "$PY" -c '
import json, sys
report = json.loads(sys.stdin.read())
assert isinstance(report, dict)
report["error"] = sys.argv[1]
print(json.dumps(report))' "exit $2: $why" > "$WORK/$1.json" 2> /dev/null; then
    return
  fi
  echo "{\"error\": \"exit $2: $why\"}" > "$WORK/$1.json"
}

# cut_section NAME EST: NAME's JSON records that the deadline left less than its estimate.
cut_section() {
  local left=$((DEADLINE - SECONDS))
  [ "$left" -lt 0 ] && left=0
  echo "{\"error\": \"cut: estimated $2 s, $left s left of the ${DEADLINE} s deadline\"}" \
    > "$WORK/$1.json"
}

# rollout NAME: sets CMD for a rollout section KIND_PxG_T: the worker's bench with its
# defaults (worker), with the trial split kernel (split) or the trial captured decode step
# (graphs) turned on, transformers' generate (hf), PyTorch's static-cache step captured as
# a CUDA graph (graph).
rollout() {
  local kind=${1%%_*} shape=${1#*_}
  local p=${shape%%x*} t=${shape##*_}
  local bench=("$WORKER" bench --preset "$PRESET" --device "$DEVICE" --weight-dtype "$DTYPE"
    --prompts "$p" -n "$GROUP" --max-new-tokens "$t" --repeat 2 --batch-only)
  local peer=(--device "$DEVICE" --dtype "$DTYPE" --preset "$PRESET" --prompts "$p" -n "$GROUP"
    --max-new-tokens "$t")
  case $kind in
    worker) CMD=("${bench[@]}") ;;
    split) CMD=(env ROOKWORLD_ENABLE_KERNELS=grouped_attention_split "${bench[@]}") ;;
    graphs) CMD=(env ROOKWORLD_ENABLE_KERNELS=decode_graphs "${bench[@]}") ;;
    hf) CMD=("$PY" "$HERE/gpu/check.py" hf-generate - "${peer[@]}") ;;
    graph) CMD=("$PY" "$HERE/gpu/check.py" graph-decode - "${peer[@]}") ;;
  esac
}

# step_trials NAME: the step's trial families a tiles_* or mma_* section turns on.
step_trials() {
  case $1 in
    tiles_*) echo step_attention_tiles,step_head_kept ;;
    mma_*) echo step_attention_mma,step_head_kept,step_epilogues ;;
  esac
}

# section_command NAME: sets CMD, section NAME's command line (its last stdout line is its JSON),
# and CAP, its time limit.
section_command() {
  CAP=$LIMIT
  case $1 in
    device) CMD=("$PY" "$HERE/gpu/check.py" device - --device "$DEVICE") ;;
    parity) CMD=("$WORKER" parity --preset "$PRESET" --device "$DEVICE" --new-tokens 16) ;;
    copy_bandwidth) CMD=("$PY" "$HERE/gpu/check.py" copy-bandwidth - --device "$DEVICE") ;;
    worker_* | split_* | graphs_* | hf_* | graph_*) rollout "$1" ;;
    # The step's backend in the debug mode: every buffer of a micro-batch against the CPU
    # backend with the same products (the first one beyond tolerance named).
    backend_compare)
      CMD=("$LEARNER" compare-backends --backend "$PASS_BACKEND" --preset "$PRESET"
        --prompts "$COMPARE_PROMPTS" --group-size "$GROUP" --prompt-tokens 46
        --completion-tokens "$COMPARE_TOKENS") ;;
    # Its forward + backward timed at the learner step's shape.
    backend_pass)
      CMD=("$LEARNER" compare-backends --backend "$PASS_BACKEND" --preset "$PRESET"
        --prompts "$STEP_PROMPTS" --group-size "$GROUP" --prompt-tokens 46
        --completion-tokens 64 --no-compare --time-passes 3) ;;
    # Where the fused step's device time goes: every kernel of one step timed by device
    # events; tiles_*: the same (and the buffers against the CPU backend's first) with the
    # step's trials, the tiled attention and the kept head; mma_*: with the attention on
    # tensor cores, the kept head and the products' epilogues on cuBLASLt.
    learner_profile)
      CMD=("$LEARNER" bench --preset "$PRESET" --device "$DEVICE" --path fused
        -p "$STEP_PROMPTS" -n "$GROUP" --steps 1 --micro-batch-groups "$MICRO" --profile
        --peak-tflops "$PEAK_TFLOPS") ;;
    tiles_compare | mma_compare)
      CMD=(env ROOKWORLD_ENABLE_KERNELS="$(step_trials "$1")" "$LEARNER"
        compare-backends --backend "$PASS_BACKEND" --preset "$PRESET"
        --prompts "$COMPARE_PROMPTS" --group-size "$GROUP" --prompt-tokens 46
        --completion-tokens "$COMPARE_TOKENS") ;;
    tiles_profile | mma_profile)
      CMD=(env ROOKWORLD_ENABLE_KERNELS="$(step_trials "$1")" "$LEARNER" bench
        --preset "$PRESET" --device "$DEVICE" --path fused -p "$STEP_PROMPTS" -n "$GROUP"
        --steps 1 --micro-batch-groups "$MICRO" --profile --peak-tflops "$PEAK_TFLOPS") ;;
    # Decode's device time: Nsight Compute over a window of launches late in the headline
    # run (NCU_SKIP, NCU_COUNT), the clocks and L2 left alone.
    decode_profile)
      CMD=("$PY" "$HERE/gpu/check.py" ncu-profile - --launch-skip "${NCU_SKIP:-6000}"
        --launch-count "${NCU_COUNT:-1000}" -- "$WORKER" bench --preset "$PRESET"
        --device "$DEVICE" --weight-dtype "$DTYPE" --prompts "${ROWS%% *}" -n "$GROUP"
        --max-new-tokens "${NEWS%% *}" --repeat 1 --batch-only) ;;
    # `torch.compile` spends most of a minute compiling the step before it is timed.
    learner_step)
      CAP=$STEP_LIMIT
      CMD=("$PY" "$ROOT/learner/bench/step_vs_pytorch.py" --learner "$LEARNER"
        --preset "$PRESET" --device "$DEVICE" --prompts "$STEP_PROMPTS" --group "$GROUP"
        --steps 3 --threads "$THREADS" --micro-batch-groups "$MICRO"
        --peak-tflops "$PEAK_TFLOPS" --torch-configs "$TORCH_CONFIGS" --paths "$STEP_PATHS") ;;
    push)
      CMD=("$LEARNER" bench-push --preset "$PRESET" --worker-device "$DEVICE" --pushes 3
        --chunk-kib 1024 --idle-only) ;;
    # The same with each version written into the worker's retired model from page-locked
    # memory.
    push_in_place)
      CMD=(env ROOKWORLD_ENABLE_KERNELS=weights_in_place "$LEARNER" bench-push
        --preset "$PRESET" --worker-device "$DEVICE" --pushes 3 --chunk-kib 1024 --idle-only) ;;
    # The whole loop: `train` below, then its peer, TRL's GRPOTrainer with the same batch,
    # steps and new tokens.
    train) CAP=$TRAIN_LIMIT CMD=() ;;
    trl)
      CAP=$TRAIN_LIMIT
      CMD=("$PY" "$HERE/gpu/trl_grpo.py" --device "$DEVICE" --preset "$PRESET" --prompts 4
        -n "$TRAIN_GROUP" --max-new-tokens "$TRAIN_NEW" --steps "$((TRAIN_STEPS - TRAIN_SKIP))"
        --warmup "$TRAIN_SKIP") ;;
    # The step with the training ops off (candle's composed ops and their backwards), at
    # COMPOSED_MICRO groups per micro-batch: what the ops' kernels buy.
    learner_composed)
      CMD=("$LEARNER" bench --preset "$PRESET" --device "$DEVICE" -p "$STEP_PROMPTS"
        -n "$GROUP" --steps 2 --micro-batch-groups "$COMPOSED_MICRO" --train-ops off
        --peak-tflops "$PEAK_TFLOPS") ;;
  esac
}

# train LIMIT: a short local run on the device (learner and its in-process worker share
# it), the worker's NVML gauges scraped from the learner's metrics endpoint while it runs;
# train.json its summary.
train() {
  local port=$((20000 + RANDOM % 20000)) pid rc
  timeout -k 5 "$1" "$LEARNER" train --local --preset "$PRESET" --device "$DEVICE" \
    --steps "$TRAIN_STEPS" --sft-steps "$TRAIN_SFT" --sft-lr "$TRAIN_SFT_LR" --prompts-per-step 4 \
    --group-size "$TRAIN_GROUP" --max-new-tokens "$TRAIN_NEW" --step-path "$TRAIN_STEP_PATH" \
    --run-dir "$WORK/run" --overwrite --metrics "127.0.0.1:$port" --listen 127.0.0.1:0 \
    --log-jsonl "$WORK/train.jsonl" --no-progress > "$WORK/train.log" 2>&1 &
  pid=$!
  "$PY" "$HERE/gpu/check.py" scrape "http://127.0.0.1:$port/metrics" "$WORK/nvml.json" \
    --while-pid "$pid" > /dev/null 2>> "$WORK/train.log"
  wait "$pid"
  rc=$?
  if [ $rc -eq 0 ] && [ -s "$WORK/train.jsonl" ]; then
    "$PY" "$HERE/gpu/check.py" train-summary "$WORK/train.jsonl" "$WORK/train.json" \
      --skip "$TRAIN_SKIP" > /dev/null
  else
    failed train "$rc" "$1" "$WORK/train.log"
  fi
}

# section NAME: runs NAME within the deadline; its JSON is WORK/NAME.json (the command's
# last stdout line), its stderr WORK/NAME.log.
section() {
  local name=$1 started=$SECONDS est limit rc
  chosen "$name" || return 0
  echo "== $name" >&2
  if [ "$DEVICE" = cpu ] && gpu_only "$name"; then
    echo '{"skipped": "a GPU section: it profiles or tries CUDA kernels"}' > "$WORK/$name.json"
    settle "$name"
    return
  fi
  est=$(estimate "$name")
  limit=$((DEADLINE - SECONDS))
  if [ "$limit" -lt 5 ] || [ "$limit" -lt "$est" ]; then
    cut_section "$name" "$est"
    [ "$name" = train ] && echo '{"skipped": "no training run"}' > "$WORK/nvml.json"
    settle "$name"
    return
  fi
  section_command "$name"
  [ "$limit" -gt "$CAP" ] && limit=$CAP
  if [ "$name" = train ]; then
    train "$limit"
  else
    timeout -k 5 "$limit" "${CMD[@]}" > "$WORK/$name.stdout" 2> "$WORK/$name.log"
    rc=$?
    if [ $rc -eq 0 ] && [ -s "$WORK/$name.stdout" ]; then
      tail -n 1 "$WORK/$name.stdout" > "$WORK/$name.json"
    else
      failed "$name" "$rc" "$limit" "$WORK/$name.log" "$WORK/$name.stdout"
    fi
    rm -f "$WORK/$name.stdout"
  fi
  settle "$name"
  echo "   $((SECONDS - started)) s (estimated $est s)" >&2
}

echo "{\"preset\": \"$PRESET\", \"device\": \"$DEVICE\", \"dtype\": \"$DTYPE\", \"bin\": \"$BIN\"}" > "$WORK/config.json"
announce
for name in "${HEADLINE[@]}" "${EXTRAS[@]}"; do
  section "$name"
done
table
cat "$OUT/table.txt"
echo "gpu-check: $FAILED section(s) failed or cut, $SECONDS s; everything in $ARCHIVE" >&2
exit "$FAILED"

#!/usr/bin/env bash
# The CUDA code checked on a machine without a GPU or a system CUDA (nvcc from NVIDIA's
# PyPI wheels, deploy/cuda/toolchain.sh), as CI runs it:
#
#   deploy/cuda/check.sh          # the kernels: seconds
#   deploy/cuda/check.sh --rust   # and the Rust behind the `cuda` feature: minutes
#
# The kernels: every rookworld-lm/kernels/*.cu and rookworld-train/kernels/*.cu is compiled
# to PTX exactly as its crate's build.rs compiles it for the binaries, with every nvcc warning an error,
# then assembled by ptxas for sm_$CUDA_COMPUTE_CAP (what the driver does at load time:
# an error there is an error on the GPU); register spills are printed. A kernel file that
# build.rs does not embed fails too. With --rust: `cargo check --features cuda` of the
# crates that have the feature, in target-cuda-check (candle's own kernels written empty:
# deploy/cuda/nvcc-outputs-only).
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
. "$ROOT/deploy/cuda/toolchain.sh"
echo "cuda-check: $(nvcc --version | tail -1), compute capability $CUDA_COMPUTE_CAP" >&2

OUT=$(mktemp -d)
trap 'rm -rf "$OUT"' EXIT
failed=0
for src in "$ROOT"/rookworld-lm/kernels/*.cu "$ROOT"/rookworld-train/kernels/*.cu; do
  name=$(basename "$src" .cu)
  crate=$(basename "$(dirname "$(dirname "$src")")")
  if ! grep -q "\"$name\"" "$ROOT/$crate/build.rs"; then
    echo "cuda-check: $src is not in $crate/build.rs's KERNELS: the binaries would not embed it" >&2
    failed=1
    continue
  fi
  # The flags of the build scripts, and warnings as errors.
  if ! nvcc --ptx -O3 -std=c++17 "-arch=compute_$CUDA_COMPUTE_CAP" -Werror all-warnings \
    -o "$OUT/$name.ptx" "$src"; then
    echo "cuda-check: nvcc failed on $src" >&2
    failed=1
    continue
  fi
  if ! ptxas -O3 "-arch=sm_$CUDA_COMPUTE_CAP" --warn-on-spills -o "$OUT/$name.cubin" "$OUT/$name.ptx"; then
    echo "cuda-check: ptxas failed on $src (sm_$CUDA_COMPUTE_CAP)" >&2
    failed=1
    continue
  fi
  echo "cuda-check: $name: PTX $(stat -c %s "$OUT/$name.ptx") B, sm_$CUDA_COMPUTE_CAP code $(stat -c %s "$OUT/$name.cubin") B" >&2
done
[ "$failed" = 0 ] || exit 1

if [ "${1:-}" = --rust ]; then
  cd "$ROOT"
  # candle's build script compiles candle's own kernels with the nvcc NVCC names: for a
  # type-check that writes its outputs empty (nvcc-outputs-only), saving most of the
  # check's time. target-cuda-check holds those empty kernels: it is for checking only,
  # never for building binaries (build.sh builds in target-cuda).
  REAL_NVCC=$(command -v nvcc) NVCC="$ROOT/deploy/cuda/nvcc-outputs-only" \
    CARGO_TARGET_DIR=target-cuda-check cargo check --locked --features cuda \
    -p rookworld-lm -p rookworld-train -p rookworld-generation -p rollout-worker -p learner \
    --all-targets
  echo "cuda-check: the Rust behind the cuda feature type-checks" >&2
fi

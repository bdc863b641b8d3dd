#!/usr/bin/env bash
# Builds the `cuda` binaries (learner, rollout-worker) on a machine without a GPU or a
# system CUDA, and packs them into one archive to carry to a GPU machine that has no Rust
# toolchain: nvcc and the CUDA 13.0 libraries come from NVIDIA's PyPI wheels, and the
# driver library the linker wants is a stub made from the symbols cudarc binds. The
# binaries then run where a driver (580+, CUDA 13) is installed, with the CUDA libraries
# on LD_LIBRARY_PATH (PyTorch's `nvidia/cu13/lib` has them; tests/gpu-check.sh finds it).
#
#   deploy/cuda/build.sh [OUT]   # default OUT: target-cuda/dist
#
# OUT receives the stripped binaries and `rookworld-cuda.tar.xz` holding both; unpack it
# there with `tar -xJf rookworld-cuda.tar.xz -C DIR` and run `BIN=DIR tests/gpu-check.sh`.
# Environment: CUDA_DIR (the toolchain's directory, default $TMPDIR/rookworld-cuda13),
# CUDA_COMPUTE_CAP (default 90: H100/H200; 80 for A100). A clean build takes about 25
# minutes on 2 cores. Prints each binary's size and the archive's, and fails when the
# archive is over ARCHIVE_LIMIT_MIB (default 64).
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
OUT=${1:-$ROOT/target-cuda/dist}
# nvcc and the libraries, from the wheels (CUDA_HOME, PATH, CUDA_COMPUTE_CAP).
. "$ROOT/deploy/cuda/toolchain.sh" libraries
# The wheels carry versioned libraries only; the linker looks for the plain names.
(cd "$CUDA_HOME/lib" &&
  for lib in cudart cublas cublasLt nvrtc; do ln -sf "lib$lib.so.13" "lib$lib.so"; done &&
  ln -sf libcurand.so.10 libcurand.so)

# libcuda comes with the driver, not the wheels: link against a stub with the same
# symbols (the real library is loaded at run time), read from the driver bindings of the
# cudarc candle-core depends on. Cargo's resolution names it (`cargo metadata`, as locked):
# the registry may hold several cudarc versions, and their directories sort by name
# (cudarc-0.9 after cudarc-0.19). The stub is made again when that cudarc changes.
(cd "$ROOT" && cargo fetch -q --locked)
SYS=$(cd "$ROOT" && cargo metadata -q --format-version 1 --locked --features cuda | python3 -c '
import json, os, sys
meta = json.load(sys.stdin)
packages = {p["id"]: p for p in meta["packages"]}
candle = [n for n in meta["resolve"]["nodes"] if packages[n["id"]]["name"] == "candle-core"]
found = {d["pkg"] for n in candle for d in n["deps"] if d["name"] == "cudarc"}
if len(found) != 1:
    sys.exit(f"cuda-build: candle-core depends on {len(found)} cudarc packages, expected one")
manifest = packages[found.pop()]["manifest_path"]
print(os.path.join(os.path.dirname(manifest), "src", "driver", "sys", "mod.rs"))
')
[ -f "$SYS" ] || { echo "cuda-build: cudarc's driver bindings are not at $SYS" >&2; exit 1; }
STUBS="$CUDA_HOME/lib/stubs"
if [ ! -f "$STUBS/libcuda.so" ] || [ "$(cat "$STUBS/libcuda.from" 2>/dev/null)" != "$SYS" ]; then
  mkdir -p "$STUBS"
  grep -oE 'pub unsafe fn cu[A-Za-z0-9_]+' "$SYS" | awk '{print "void " $4 "(void) {}"}' |
    sort -u >"$STUBS/libcuda.c"
  cc -shared -fPIC -Wl,-soname,libcuda.so.1 -o "$STUBS/libcuda.so" "$STUBS/libcuda.c"
  echo "$SYS" >"$STUBS/libcuda.from"
fi

export LIBRARY_PATH="$CUDA_HOME/lib:$CUDA_HOME/lib/stubs${LIBRARY_PATH:+:$LIBRARY_PATH}"
echo "cuda-build: $(nvcc --version | tail -1), compute capability $CUDA_COMPUTE_CAP" >&2

cd "$ROOT"
CARGO_TARGET_DIR=target-cuda cargo build --release --features cuda -p rollout-worker -p learner
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
for bin in learner rollout-worker; do
  strip -o "$OUT/$bin" "target-cuda/release/$bin"
  echo "cuda-build: $OUT/$bin $(du -m "$OUT/$bin" | cut -f1) MiB stripped" >&2
done
# Most of each binary is PTX text (candle's kernels and ours): xz packs it tightly.
tar -C "$OUT" -cf - learner rollout-worker | xz -T0 -9 >"$OUT/rookworld-cuda.tar.xz"
MIB=$(( ($(stat -c %s "$OUT/rookworld-cuda.tar.xz") + 1048575) / 1048576 ))
echo "cuda-build: $OUT/rookworld-cuda.tar.xz ${MIB} MiB" >&2
if [ "$MIB" -gt "${ARCHIVE_LIMIT_MIB:-64}" ]; then
  echo "cuda-build: the archive is over ${ARCHIVE_LIMIT_MIB:-64} MiB" >&2
  exit 1
fi

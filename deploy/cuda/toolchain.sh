# Sourced by build.sh and check.sh: the CUDA 13.0 toolchain from NVIDIA's PyPI wheels (no
# system CUDA, no GPU), installed once under CUDA_DIR (default $TMPDIR/rookworld-cuda13).
# Sets CUDA_HOME, PATH and CUDA_COMPUTE_CAP (default 90: H100/H200; 80 for A100).
# With `libraries` as its argument it also installs the libraries the binaries link
# (cuBLAS, NVRTC, cuRAND), which compiling kernels alone does not need.
DIR=${CUDA_DIR:-${TMPDIR:-/tmp}/rookworld-cuda13}
CUDA_HOME=$DIR/nvidia/cu13
# One minor version for every piece: a newer nvcc writes PTX an older driver rejects.
cuda_wheels=(nvidia-cuda-nvcc==13.0.88 nvidia-cuda-runtime==13.0.96 nvidia-cuda-cccl==13.0.85
  nvidia-cuda-crt==13.0.88 nvidia-nvvm==13.0.88)
if [ "${1:-}" = libraries ]; then
  cuda_wheels+=(nvidia-cublas==13.0.2.14 nvidia-cuda-nvrtc==13.0.88 nvidia-curand==10.4.0.35)
fi
if [ ! -x "$CUDA_HOME/bin/nvcc" ] || { [ "${1:-}" = libraries ] && [ ! -e "$CUDA_HOME/lib/libcublas.so.13" ]; }; then
  # --upgrade: every wheel unpacks under one `nvidia/` directory, which a plain --target
  # install skips when it exists (the compiler's, from an earlier call without
  # `libraries`), leaving the libraries out; with it the directory is replaced by this
  # install's, which holds every wheel listed.
  python3 -m pip install -q --upgrade --target "$DIR" "${cuda_wheels[@]}"
fi
export CUDA_HOME PATH="$CUDA_HOME/bin:$PATH"
export CUDA_COMPUTE_CAP=${CUDA_COMPUTE_CAP:-90}

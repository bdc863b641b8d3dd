# Sourced by tests/gpu-check.sh and tests/gpu/compare.sh (PY, default python3): puts the CUDA 13
# libraries of PY's PyTorch (its nvidia cu13 wheels, nvidia/cu13/lib) first on
# LD_LIBRARY_PATH when that Python has them.
LIB=$("${PY:-python3}" -c 'import nvidia, os; print(os.path.join(list(nvidia.__path__)[0], "cu13", "lib"))' 2>/dev/null)
if [ -n "$LIB" ] && [ -d "$LIB" ]; then
  export LD_LIBRARY_PATH="$LIB${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
fi

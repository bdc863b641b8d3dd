#!/usr/bin/env bash
# Fetches the wheels of the GPU check's Python peers that a PyTorch machine usually lacks
# (TRL's GRPOTrainer and `datasets`, pure Python), for a GPU machine without network:
#
#   tests/gpu/peer-wheels.sh DIR        # then: PEER_WHEELS=DIR tests/gpu-check.sh OUT
#
# Pinned: the versions the check's figures were taken with. Their other needs (accelerate,
# pandas, pyarrow, xxhash, fsspec) come with the usual PyTorch images.
set -euo pipefail
DIR=${1:?usage: $0 DIR}
mkdir -p "$DIR"
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
  --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
  -d "$DIR" trl==1.16.0 datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19
ls "$DIR"

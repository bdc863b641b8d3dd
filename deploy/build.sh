#!/usr/bin/env bash
# Builds the three service binaries with cargo and stages them for the images
# (deploy/image/bin/), so that `docker compose build` needs no toolchain in the image.
#   deploy/build.sh [--profile release|dev] [--cuda]
#   deploy/build.sh --from DIR     stage binaries already built in DIR (e.g. target/debug
#                                  after `cargo test --workspace`, as CI does); no build
# --cuda also builds the worker with the `cuda` feature into deploy/image/bin-cuda/
# (for compose.gpu.yml; needs a CUDA toolkit: deploy/cuda/build.sh sets one up from PyPI).
set -euo pipefail
cd "$(dirname "$0")/.."
profile=release
cuda=0
from=""
while [ $# -gt 0 ]; do
  case "$1" in
    --profile) profile="$2"; shift 2 ;;
    --cuda) cuda=1; shift ;;
    --from) from="$2"; shift 2 ;;
    *) echo "deploy/build.sh: unknown option $1" >&2; exit 2 ;;
  esac
done
bins=(learner rollout-worker reward-server)
if [ -z "$from" ]; then
  cargo build --profile "$profile" -p learner -p rollout-worker -p reward-server --bins
  from="target/$([ "$profile" = dev ] && echo debug || echo "$profile")"
fi
mkdir -p deploy/image/bin
for b in "${bins[@]}"; do
  [ -x "$from/$b" ] || { echo "deploy/build.sh: no binary $from/$b" >&2; exit 1; }
  cp "$from/$b" deploy/image/bin/
done
if [ "$cuda" = 1 ]; then
  cargo build --profile "$profile" -p rollout-worker --features cuda --bins \
    --target-dir target/cuda
  mkdir -p deploy/image/bin-cuda
  cp "target/cuda/$([ "$profile" = dev ] && echo debug || echo "$profile")/rollout-worker" deploy/image/bin-cuda/
fi
ls -l deploy/image/bin

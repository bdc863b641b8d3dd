#!/usr/bin/env bash
# Builds every fuzz target with libFuzzer's coverage instrumentation and runs each for a
# bounded time (first argument, seconds; default 20) from its corpus in corpus/TARGET; a
# crash, a panic or a leak fails. The flags are those cargo-fuzz sets without a sanitizer,
# all of them stable rustc options, so no nightly toolchain is needed; a nightly one with
# `cargo fuzz run TARGET` also works (Cargo.toml).
set -euo pipefail
cd "$(dirname "$0")"
seconds="${1:-20}"
host=$(rustc -vV | sed -n 's/^host: //p')
# --target keeps the instrumentation off build scripts and procedural macros.
export RUSTFLAGS="-Cpasses=sancov-module -Cllvm-args=-sanitizer-coverage-level=4 \
-Cllvm-args=-sanitizer-coverage-inline-8bit-counters -Cllvm-args=-sanitizer-coverage-pc-table \
-Cllvm-args=-sanitizer-coverage-trace-compares --cfg fuzzing -Cdebug-assertions \
-Coverflow-checks"
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$PWD/target}"
cargo build --locked --release --bins --target "$host"
for source in fuzz_targets/*.rs; do
  target=$(basename "$source" .rs)
  mkdir -p "corpus/$target"
  echo "fuzz $target: ${seconds} s"
  "$CARGO_TARGET_DIR/$host/release/$target" -max_total_time="$seconds" -rss_limit_mb=2048 \
    -print_final_stats=1 "corpus/$target" 2>&1 | tail -n 12
done

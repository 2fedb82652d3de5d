#!/usr/bin/env bash
# Differential campaigns of crates/llama-kv-cache against real llama.cpp 0.1.103 (the source in
# the crates.io package llama-cpp-sys-2 0.1.103, built with cmake by crates/conformance/build.rs).
#
#   scripts/differential.sh build              build the oracle (once, cached in target/) and the runner
#   scripts/differential.sh [N] [--start SEED] [--jobs J] [--known-divergences]
#                                              N generated traces (default 2000) from seed SEED
#   scripts/differential.sh replay FILE        re-run a trace saved in target/differential-failures/
#   scripts/differential.sh print SEED         print the trace a seed generates
#
# Needs cmake and a C++ compiler (Debian: apt-get install -y cmake g++) and network access for
# the first `cargo fetch` of llama-cpp-sys-2.
set -euo pipefail
cd "$(dirname "$0")/.."

if ! command -v cmake >/dev/null 2>&1; then
    echo "differential: cmake is required to build llama.cpp: apt-get install -y cmake g++" >&2
    exit 1
fi
cargo build --release -p conformance --bin differential
bin="${CARGO_TARGET_DIR:-target}/release/differential"

case "${1:-}" in
    build) echo "built $bin" ;;
    replay | print | run) exec "$bin" "$@" ;;
    '') exec "$bin" run 2000 ;;
    [0-9]*) exec "$bin" run "$@" ;;
    *) exec "$bin" run 2000 "$@" ;;
esac

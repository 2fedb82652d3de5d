#!/usr/bin/env bash
# Runs the CUDA backend's tests against a fake driver (tests/fakecuda/fakecuda.c: "device" memory
# is host memory, every device access is bounds-checked, overlapping device copies abort, kernel
# launches of the RoPE kernel are executed on the CPU from their real arguments) and the real
# NVRTC from PyPI. This checks the backend's host-side logic and the kernels' compilation where
# there is no GPU; scripts/gpu-check.sh runs the same tests on a real one.
set -euo pipefail
cd "$(dirname "$0")/.."
dir=target/fakecuda
mkdir -p "$dir"
gcc -shared -fPIC -O1 -o "$dir/libcuda.so" crates/llama-kv-cache/tests/fakecuda/fakecuda.c
ln -sf libcuda.so "$dir/libcuda.so.1"
if [ ! -e "$dir/py/nvidia/cuda_nvrtc/lib/libnvrtc.so.12" ]; then
  python3 -m pip install --quiet --disable-pip-version-check --no-deps --target "$dir/py" \
    nvidia-cuda-nvrtc-cu12==12.0.140
fi
export LD_LIBRARY_PATH="$PWD/$dir:$PWD/$dir/py/nvidia/cuda_nvrtc/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
# the fake driver keeps one global allocation table: one test thread
cargo test -p llama-kv-cache --features cuda --test cuda -- --test-threads=1

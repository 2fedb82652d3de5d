#!/usr/bin/env bash
# GPU check of the core's CUDA backend (crates/llama-kv-cache, feature `cuda`).
#
# The GPU machine has the NVIDIA driver and the CUDA toolkit but no Rust or Node, so the test
# binary is built here and run there:
#
#   scripts/gpu-check.sh build      # here: builds tests/cuda.rs in release, copies it to .gpu/
#   scripts/gpu-check.sh run [ARGS] # there: runs .gpu/cuda-tests --nocapture --test-threads=1
#
# .gpu/ is git-ignored through .git/info/exclude (not .gitignore), so a tool that copies the
# working tree to the GPU machine must be told to carry it (e.g. carry: [".gpu"]); the one
# command to run there is:
#
#   bash scripts/gpu-check.sh run
#
# ARGS go to the test binary (a test-name filter such as `gpu_rope`, `--list`, ...).
# Without a GPU every GPU test prints "skipped: no GPU (<reason>)" and passes; on the GPU
# machine they check byte-for-byte parity with the host backend, the rope kernel against the
# host rotation, and print bandwidth figures (defrag moves and host<->device staging as ratios to
# a plain device memcpy / plain cuMemcpy, target >= 0.7). The run takes well under a minute.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
OUT="$ROOT/.gpu"
BIN="$OUT/cuda-tests"

usage() {
    sed -n '2,20p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'
    exit 2
}

build() {
    command -v cargo >/dev/null || { echo "gpu-check build: cargo not found (build on the dev machine)" >&2; exit 1; }
    # a target dir of its own, so the build does not wait on other cargo jobs
    export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$ROOT/target/gpu-check}"
    local json
    json="$(mktemp)"
    trap 'rm -f "$json"' RETURN
    (cd "$ROOT" && cargo test -p llama-kv-cache --features cuda --release --test cuda \
        --no-run --message-format=json) >"$json"
    local exe
    exe="$(python3 - "$json" <<'PY'
import json, sys
exe = None
for line in open(sys.argv[1]):
    try:
        m = json.loads(line)
    except ValueError:
        continue
    t = m.get("target") or {}
    if m.get("reason") == "compiler-artifact" and t.get("name") == "cuda" \
            and "test" in t.get("kind", []) and m.get("executable"):
        exe = m["executable"]
print(exe or "")
PY
)"
    if [[ -z "$exe" || ! -x "$exe" ]]; then
        echo "gpu-check build: could not find the cuda test executable in cargo's output" >&2
        exit 1
    fi
    mkdir -p "$OUT"
    cp "$exe" "$BIN"
    chmod +x "$BIN"
    {
        echo "built: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
        echo "commit: $(git -C "$ROOT" rev-parse --short HEAD 2>/dev/null || echo unknown)$(git -C "$ROOT" diff --quiet 2>/dev/null || echo ' (dirty)')"
        echo "from: $exe"
        echo "glibc: $(ldd --version 2>/dev/null | head -1)"
    } >"$OUT/BUILD_INFO"
    # keep .gpu/ out of git without touching .gitignore
    local exclude
    exclude="$(git -C "$ROOT" rev-parse --git-path info/exclude 2>/dev/null || true)"
    if [[ -n "$exclude" ]]; then
        [[ "$exclude" = /* ]] || exclude="$ROOT/$exclude"
        mkdir -p "$(dirname "$exclude")"
        grep -qxF '/.gpu/' "$exclude" 2>/dev/null || echo '/.gpu/' >>"$exclude"
    fi
    echo "gpu-check: $BIN ($(du -h "$BIN" | cut -f1)) ready"
    echo "on the GPU machine (carry .gpu): bash scripts/gpu-check.sh run"
}

run() {
    if [[ ! -x "$BIN" ]]; then
        echo "gpu-check run: $BIN missing: run 'scripts/gpu-check.sh build' on the dev machine and carry .gpu/" >&2
        exit 1
    fi
    [[ -f "$OUT/BUILD_INFO" ]] && cat "$OUT/BUILD_INFO"
    # libcuda comes from the driver; libnvrtc from the toolkit, often not on the loader path
    local extra=""
    for d in /usr/local/cuda/lib64 /usr/local/cuda/targets/*/lib /usr/local/cuda-*/lib64 /usr/lib/x86_64-linux-gnu; do
        [[ -d "$d" ]] && extra="${extra:+$extra:}$d"
    done
    export LD_LIBRARY_PATH="${LD_LIBRARY_PATH:+$LD_LIBRARY_PATH:}$extra"
    if command -v nvidia-smi >/dev/null; then
        nvidia-smi -L || true
    else
        echo "gpu-check: nvidia-smi not found"
    fi
    local args=("$@")
    [[ " ${args[*]-} " == *" --test-threads"* ]] || args+=(--test-threads=1)
    [[ " ${args[*]-} " == *" --nocapture "* ]] || args+=(--nocapture)
    exec "$BIN" "${args[@]}"
}

case "${1:-}" in
    build) shift; build "$@" ;;
    run) shift; run "$@" ;;
    *) usage ;;
esac

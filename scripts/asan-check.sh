#!/usr/bin/env bash
# The specs that hand JS memory to the addon, against an AddressSanitizer build of it: a read or
# write of freed memory (a buffer detached or collected during a call) aborts with ASan's report.
# Needs the nightly toolchain (-Zsanitizer) and GCC's libasan (Debian: libasan8), which is
# preloaded into node because node itself is not instrumented. Not part of `npm test`: the
# build takes minutes and the specs that measure RSS or use `ulimit -v` mean nothing under ASan
# (its shadow memory), so only the specs below run.
set -euo pipefail
cd "$(dirname "$0")/.."
target=target/asan
RUSTFLAGS="-Zsanitizer=address" CARGO_TARGET_DIR="$target" \
  cargo +nightly build -p llama-kv-cache-node --target x86_64-unknown-linux-gnu
addon=llama-kv-cache.linux-x64-gnu.node
saved="$(mktemp)"
[ -f "$addon" ] && cp "$addon" "$saved"
trap '[ -s "$saved" ] && cp "$saved" "$addon"; rm -f "$saved"' EXIT
cp "$target/x86_64-unknown-linux-gnu/debug/libllama_kv_cache_node.so" "$addon"
libasan="$(gcc -print-file-name=libasan.so)"
LD_PRELOAD="$libasan" ASAN_OPTIONS=detect_leaks=0:allocator_may_return_null=1 \
  npx ava __test__/borrows.spec.mjs __test__/state.spec.mjs __test__/find-slot-packed.spec.mjs \
  "$@"

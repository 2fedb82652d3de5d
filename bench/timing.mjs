// Timing helpers shared by the JS benchmarks.

/** The median of `xs` (the upper one for an even count). */
export function median(xs) {
  const s = [...xs].sort((a, b) => a - b)
  return s[s.length >> 1]
}

/** ns per call of `body(i)`, median of `loops` loops of `calls` calls (after one warm-up loop). */
export function perCall(calls, body, loops = 9) {
  let sink = 0
  const run = () => {
    const t0 = process.hrtime.bigint()
    for (let i = 0; i < calls; i++) sink ^= body(i) ? 1 : 0
    return Number(process.hrtime.bigint() - t0) / calls
  }
  run()
  const samples = []
  for (let k = 0; k < loops; k++) samples.push(run())
  globalThis.__sink = sink
  return median(samples)
}

/** Tokens of the 8B geometry: 8,000 in a cache of 8,192 cells. */
export const BIG_TOKENS = 8000

/**
 * A cache at the 8B geometry (32 layers, 1,024-wide f16 K/V, flash attention) holding
 * sequence 0 at positions 0..7,999 with non-constant f16 rows; `KvCache` is the class of the
 * addon under test (the benches also load older builds).
 */
export function bigCache(KvCache) {
  const c = new KvCache({ size: 8192, nLayer: 32, nEmbdKGqa: 1024, flashAttn: true, typeK: 'f16', typeV: 'f16' })
  for (let p = 0; p < BIG_TOKENS; p += 500) {
    c.findSlot({ pos: Int32Array.from({ length: 500 }, (_, i) => p + i), seqIds: new Array(500).fill(0) })
  }
  const rows = Buffer.alloc(BIG_TOKENS * 2048)
  for (let i = 0; i < rows.length; i += 2) rows.writeUInt16LE(0x3c00 ^ ((i * 2654435761) >>> 20) & 0x3ff, i)
  for (let il = 0; il < 32; il++) {
    c.writeK(il, 0, rows)
    c.writeV(il, 0, rows)
  }
  return c
}

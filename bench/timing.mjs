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

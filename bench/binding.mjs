// Overhead of the Node binding, measured against a no-op native call in the same run.
//
//   npm run build && node bench/binding.mjs
//
// Sync calls are timed in loops (median of several loops, ns per call) on a small cache, so the
// Rust work behind each call is negligible and what remains is the cost of crossing into the
// addon and converting arguments. The baseline is the cheapest native call there is, the
// `disposed` getter; a pure JS call is shown for reference. Then `update()` (async, libuv
// threadpool) is compared with `updateSync()`, for a real defrag and with nothing pending.

import { createRequire } from 'node:module'
import { fileURLToPath } from 'node:url'
import path from 'node:path'
import { median, perCall } from './timing.mjs'

const require = createRequire(import.meta.url)
const root = path.resolve(path.dirname(fileURLToPath(import.meta.url)), '..')
const { KvCache } = require(path.join(root, 'index.js'))

const LOOPS = 9

/** Fills `n` cells with `nSeq` sequences interleaved token by token, 512 tokens per findSlot. */
function fill(cache, n, nSeq) {
  const next = new Array(nSeq).fill(0)
  for (let b = 0; b < n; b += 512) {
    const pos = []
    const seqIds = []
    for (let i = b; i < Math.min(n, b + 512); i++) {
      const s = i % nSeq
      pos.push(next[s]++)
      seqIds.push(s)
    }
    if (!cache.findSlot({ pos, seqIds })) throw new Error('fill does not fit')
  }
}

const fmt = (x, d = 1) => x.toFixed(d)
const pad = (s, n) => String(s).padStart(n)
const padEnd = (s, n) => String(s).padEnd(n)

// ---- sync call overhead ------------------------------------------------------------------------

const SMALL = 256
const small = new KvCache({ size: SMALL, nLayer: 1, nEmbdKGqa: 8, nSeqMax: 4 })
fill(small, SMALL / 2, 2)
const big = new KvCache({ size: 65536, nLayer: 1, nEmbdKGqa: 8, nSeqMax: 8 })
fill(big, 65536, 8)

const obj = { x: 1 }
function jsGetter(o) {
  return o.x
}
const ub = { pos: [100000], seqIds: [0] }
const N = 1_000_000

const rows = []
const baseline = perCall(N, () => small.disposed)
rows.push(['pure JS function call (V8 may inline it)', perCall(N, () => jsGetter(obj))])
rows.push(['cache.disposed (getter, no-op native call)', baseline])
rows.push(['cache.usedCells (getter)', perCall(N, () => small.usedCells)])
rows.push(['cache.seqPosMax(0)', perCall(N, () => small.seqPosMax(0))])
rows.push([`cache.seqRm(0, 1e9, -1) (no-op range, ${SMALL} cells)`, perCall(N / 4, () => small.seqRm(0, 1e9, -1))])
rows.push([
  `cache.findSlot(1 token) + seqRm to undo (${SMALL} cells)`,
  perCall(N / 4, () => {
    small.findSlot(ub)
    return small.seqRm(0, 100000, 100001)
  }),
])
rows.push(['cache.seqPosMax(0) (65,536 cells)', perCall(N, () => big.seqPosMax(0))])
rows.push(['cache.seqRm(0, 1e9, -1) (no-op range, 65,536 cells)', perCall(200, () => big.seqRm(0, 1e9, -1))])
if (small.usedCells !== SMALL / 2) throw new Error(`state drifted: usedCells ${small.usedCells}`)

console.log(`Sync call overhead (node ${process.version}; median of ${LOOPS} loops, ns per call)`)
console.log(`Baseline: the 'disposed' getter, the cheapest native call (${fmt(baseline)} ns).`)
console.log()
console.log(`| ${padEnd('call', 56)} | ${pad('ns/call', 10)} | ${pad('x baseline', 10)} | ${pad('above baseline (ns)', 19)} |`)
console.log(`|${'-'.repeat(58)}|${'-'.repeat(12)}|${'-'.repeat(12)}|${'-'.repeat(21)}|`)
for (const [name, ns] of rows) {
  console.log(`| ${padEnd(name, 56)} | ${pad(fmt(ns), 10)} | ${pad(fmt(ns / baseline, 2), 10)} | ${pad(fmt(ns - baseline), 19)} |`)
}
small.dispose()
big.dispose()

// ---- update(): async vs sync -------------------------------------------------------------------

// the layout of the Rust data bench: 4,096 cells, 4 layers, n_embd 1024, f16 (64 MiB)
const DATA = { size: 4096, nLayer: 4, nEmbdKGqa: 1024, nSeqMax: 4 }
function fragmented() {
  const c = new KvCache(DATA)
  fill(c, DATA.size, 2)
  c.seqRm(1, -1, -1)
  c.defrag()
  return c
}
const check = fragmented()
const report = check.updateSync()
check.dispose()
if (!report.defrag || report.defrag.cellsMoved === 0) throw new Error('defrag moved nothing')

// sync and async runs alternate, each on a fresh cache, so drift affects both alike
const syncRuns = []
const asyncRuns = []
for (let k = 0; k <= LOOPS; k++) {
  for (const [runs, op] of [
    [syncRuns, (c) => c.updateSync()],
    [asyncRuns, (c) => c.update()],
  ]) {
    const c = fragmented()
    const t0 = process.hrtime.bigint()
    await op(c)
    const dt = Number(process.hrtime.bigint() - t0) / 1e6
    if (k > 0) runs.push(dt) // the first round warms up
    c.dispose()
  }
}
const syncDefrag = median(syncRuns)
const asyncDefrag = median(asyncRuns)
const spread = (xs) => `${Math.min(...xs).toFixed(1)}-${Math.max(...xs).toFixed(1)} ms`

const idle = new KvCache({ size: 256, nLayer: 1, nEmbdKGqa: 8 })
const nIdle = 2000
const timeIdle = async (f) => {
  const samples = []
  for (let k = 0; k <= LOOPS; k++) {
    const t0 = process.hrtime.bigint()
    for (let i = 0; i < nIdle; i++) await f()
    if (k > 0) samples.push(Number(process.hrtime.bigint() - t0) / nIdle / 1e3)
  }
  return median(samples)
}
const syncIdle = await timeIdle(() => idle.updateSync())
const asyncIdle = await timeIdle(() => idle.update())
idle.dispose()

console.log()
console.log(`update() vs updateSync() (median of ${LOOPS})`)
console.log()
console.log(`| ${padEnd('case', 62)} | ${pad('updateSync', 12)} | ${pad('update (async)', 14)} | ${pad('async/sync', 10)} |`)
console.log(`|${'-'.repeat(64)}|${'-'.repeat(14)}|${'-'.repeat(16)}|${'-'.repeat(12)}|`)
console.log(
  `| ${padEnd(`defrag: ${report.defrag.cellsMoved} cells, ${(report.defrag.bytesCopied / 2 ** 20).toFixed(0)} MiB (4096 cells, 4 layers, 1024 f16)`, 62)} | ${pad(fmt(syncDefrag, 2) + ' ms', 12)} | ${pad(fmt(asyncDefrag, 2) + ' ms', 14)} | ${pad(fmt(asyncDefrag / syncDefrag, 2), 10)} |`,
)
console.log(
  `| ${padEnd('nothing pending (pure call / threadpool round trip)', 62)} | ${pad(fmt(syncIdle, 2) + ' us', 12)} | ${pad(fmt(asyncIdle, 2) + ' us', 14)} | ${pad(fmt(asyncIdle / syncIdle, 1), 10)} |`,
)
console.log()
console.log(`defrag spread (min-max): updateSync ${spread(syncRuns)}, update ${spread(asyncRuns)}`)

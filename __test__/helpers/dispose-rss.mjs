// Child process of kv-cache.spec.mjs's dispose test (run with --expose-gc): creates warmup + rounds caches of
// 64 MiB of tensors, places a sequence on every cell and writes every K and V row (so every page of the
// tensors is resident: they are calloc'd and only cost RSS once touched), disposes each cache and KEEPS
// the disposed object referenced, so no finalizer can free what dispose() did not. Prints @@RESULT with
// the RSS figures in MiB.
//
//   node --expose-gc __test__/helpers/dispose-rss.mjs <rounds> <warmup>
import { createRequire } from 'node:module'

const require = createRequire(import.meta.url)
const { KvCache } = require('../../index.js')

if (typeof gc !== 'function') throw new Error('run with node --expose-gc')
const [ROUNDS, WARMUP] = process.argv.slice(2).map(Number)
const OPTIONS = { size: 4096, nLayer: 4, nEmbdKGqa: 1024 } // f16 K and V: 4 x 2 x 4096 x 1024 x 2 B = 64 MiB
const MiB = 2 ** 20

const rss = () => {
  gc()
  gc()
  return process.memoryUsage().rss
}

// the row data and the ubatch are made once, before any measurement, and reused every round
const probe = new KvCache(OPTIONS)
const cacheBytes = probe.totalBytes
const kRows = Buffer.alloc(OPTIONS.size * probe.rowSize(0, 'k'), 0x3c)
const vRows = Buffer.alloc(OPTIONS.size * probe.rowSize(0, 'v'), 0x3c)
probe.dispose()
const ubatch = { pos: Int32Array.from({ length: OPTIONS.size }, (_, i) => i), seqIds: Array(OPTIONS.size).fill(0) }

function filledCache() {
  const c = new KvCache(OPTIONS)
  const slot = c.findSlot(ubatch)
  if (!slot || slot.head !== 0 || c.usedCells !== OPTIONS.size) throw new Error(`findSlot did not take every cell: ${JSON.stringify(slot)}, ${c.usedCells} used`)
  for (let l = 0; l < OPTIONS.nLayer; l++) {
    c.writeK(l, 0, kRows)
    c.writeV(l, 0, vRows)
  }
  return c
}

// what one filled, live cache costs: the figure a dispose() that freed nothing would add every round
const beforeLive = rss()
const live = filledCache()
const liveGrowth = rss() - beforeLive
if (live.readK(OPTIONS.nLayer - 1, OPTIONS.size - 1, 1)[0] !== 0x3c) throw new Error('the last K row was not written')
live.dispose()

const kept = []
let rss0 = 0
let peak = 0
const started = Date.now()
for (let round = 0; round < WARMUP + ROUNDS; round++) {
  const c = filledCache()
  c.dispose()
  kept.push(c)
  if (round === WARMUP - 1) rss0 = rss()
  if (round >= WARMUP) peak = Math.max(peak, process.memoryUsage().rss)
}
const rss1 = rss()
if (!kept.every((c) => c.disposed)) throw new Error('a cache is not disposed')

console.log('@@RESULT ' + JSON.stringify({
  rounds: ROUNDS,
  warmup: WARMUP,
  cacheMiB: cacheBytes / MiB,
  liveGrowthMiB: liveGrowth / MiB,
  growthMiB: (rss1 - rss0) / MiB,
  peakGrowthMiB: (Math.max(peak, rss1) - rss0) / MiB,
  rssBeforeMiB: rss0 / MiB,
  rssAfterMiB: rss1 / MiB,
  seconds: (Date.now() - started) / 1000,
}))

// Child process of kv-cache.spec.mjs's memory tests (run with --expose-gc), at an 8B llama's
// geometry: 32 layers x 1,024-wide f16 K and V x 8,192 cells = 1 GiB of tensors. Ten rounds of
// create, write every row, dispose, as a long-running app makes and drops caches; then an idle
// new cache, and clear() of a full one. Prints @@RESULT with RSS and residentBytes in MiB.
//
//   node --expose-gc __test__/helpers/memory-rounds.mjs <rounds>
import { createRequire } from 'node:module'

const require = createRequire(import.meta.url)
const { KvCache } = require('../../index.js')

if (typeof gc !== 'function') throw new Error('run with node --expose-gc')
const ROUNDS = Number(process.argv[2] ?? 10)
const OPTIONS = { size: 8192, nLayer: 32, nEmbdKGqa: 1024, flashAttn: true }
const MiB = 2 ** 20
const rss = () => {
  gc()
  return process.memoryUsage().rss / MiB
}

const rows = Buffer.alloc(OPTIONS.size * 1024 * 2, 0x3c)
function filled() {
  const c = new KvCache(OPTIONS)
  for (let l = 0; l < OPTIONS.nLayer; l++) {
    c.writeK(l, 0, rows)
    c.writeV(l, 0, rows)
  }
  return c
}

const start = rss()
const afterDispose = []
const createMs = []
for (let r = 0; r < ROUNDS; r++) {
  const t0 = performance.now()
  const c = new KvCache(OPTIONS)
  createMs.push(performance.now() - t0)
  for (let l = 0; l < OPTIONS.nLayer; l++) {
    c.writeK(l, 0, rows)
    c.writeV(l, 0, rows)
  }
  c.dispose()
  afterDispose.push(rss() - start)
}
const beforeIdle = rss()
const idle = new KvCache(OPTIONS)
const idleGrowth = rss() - beforeIdle
const idleResident = idle.residentBytes / MiB
idle.dispose()

const full = filled()
const fullRss = rss()
const fullResident = full.residentBytes / MiB
full.clear()
const clearedRss = rss()
const clearedResident = full.residentBytes / MiB
const zeroAfterClear = full.readK(31, 8191, 1).every((b) => b === 0)
full.dispose()

console.log('@@RESULT ' + JSON.stringify({
  tensorMiB: 1024,
  afterDispose,
  createMs,
  idleGrowth,
  idleResident,
  fullRss: fullRss - start,
  fullResident,
  clearedRss: clearedRss - start,
  clearedResident,
  zeroAfterClear,
}))

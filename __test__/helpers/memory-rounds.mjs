// Child process of kv-cache.spec.mjs's memory tests (run with --expose-gc), at an 8B llama's
// geometry: 32 layers x 1,024-wide f16 K and V x 8,192 cells = 1 GiB of tensors. Ten rounds of
// create, write every row, dispose, as a long-running app makes and drops caches; then an idle
// new cache, clear() of a full one, and seqRm then defrag of one of two chats. Prints @@RESULT
// with RSS and residentBytes in MiB.
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
function filled(options = {}) {
  const c = new KvCache({ ...OPTIONS, ...options })
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

// two chats of 4,096 cells each; dropping one hands its half back, and so does the defrag that
// moves the other to the front (its old cells are free then)
const chats = filled({ nSeqMax: 2 })
const half = OPTIONS.size / 2
const positions = Array.from({ length: half }, (_, p) => p)
chats.findSlot({ pos: positions, seqIds: Array(half).fill(0) })
chats.findSlot({ pos: positions, seqIds: Array(half).fill(1) })
const beforeRm = rss()
chats.seqRm(0)
const seqRmRss = rss() - beforeRm
const seqRmResident = chats.residentBytes / MiB
chats.defrag()
await chats.update()
const defragRss = rss() - beforeRm
const defragResident = chats.residentBytes / MiB
const movedIntact = chats.cell(0).seqIds[0] === 1 && chats.readK(31, 0, 1).every((b) => b === 0x3c)
chats.dispose()

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
  seqRmRss,
  seqRmResident,
  defragRss,
  defragResident,
  movedIntact,
}))

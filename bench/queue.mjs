// Throughput of 8 saves of one cache started at once (they queue per cache) against the same 8
// saves awaited one after the other, measured in the same run.
//
//   npm run build && node bench/queue.mjs
//
// The queue runs the saves one after the other as well (they share the cache), so the ratio
// shows the queue's own cost: it should be close to 1.

import { createRequire } from 'node:module'
import { fileURLToPath } from 'node:url'
import fs from 'node:fs'
import os from 'node:os'
import path from 'node:path'

const require = createRequire(import.meta.url)
const root = path.resolve(path.dirname(fileURLToPath(import.meta.url)), '..')
const { KvCache } = require(path.join(root, 'index.js'))

const SAVES = 8
const ROUNDS = 7
const dir = fs.mkdtempSync(path.join(os.tmpdir(), 'kvc-queue-bench-'))
const files = Array.from({ length: SAVES }, (_, i) => path.join(dir, `s${i}.ggsq`))

// 8 sequences of 512 cells, f16, 4 layers x 512 wide: 8 MiB of K/V, 1 MiB per sequence file
const cache = new KvCache({ size: 4096, nLayer: 4, nEmbdKGqa: 512, nSeqMax: SAVES })
for (let s = 0; s < SAVES; s++) {
  cache.findSlot({ pos: Array.from({ length: 512 }, (_, i) => i), seqIds: Array(512).fill(s) })
}
const tokens = Array.from({ length: 512 }, (_, i) => i)

async function serial() {
  for (let s = 0; s < SAVES; s++) await cache.saveSequenceFile(files[s], s, tokens)
}
const queued = () => Promise.all(files.map((f, s) => cache.saveSequenceFile(f, s, tokens)))

async function time(fn) {
  const t0 = process.hrtime.bigint()
  await fn()
  return Number(process.hrtime.bigint() - t0) / 1e6
}

const median = (xs) => [...xs].sort((a, b) => a - b)[xs.length >> 1]
const results = { serial: [], queued: [] }
await time(serial)
for (let r = 0; r < ROUNDS; r++) {
  // alternate the order so that neither gets the warmer page cache every time
  for (const name of r % 2 ? ['queued', 'serial'] : ['serial', 'queued']) {
    results[name].push(await time(name === 'serial' ? serial : queued))
  }
}
const [s, q] = [median(results.serial), median(results.queued)]
console.log(`${SAVES} saves of 1 MiB sequence files, median of ${ROUNDS} rounds`)
console.log(`serial (await each): ${s.toFixed(1)} ms  ${((SAVES * 1000) / s).toFixed(0)} saves/s`)
console.log(`queued (Promise.all): ${q.toFixed(1)} ms  ${((SAVES * 1000) / q).toFixed(0)} saves/s  (${(s / q).toFixed(2)}x serial throughput)`)
fs.rmSync(dir, { recursive: true, force: true })

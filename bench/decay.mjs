// The release by decay against the release inside each operation and against no release, on a
// decode loop at an 8B llama's geometry (32 layers, 1,024-wide f16 K/V, flash attention,
// 8,192 cells): a chat of 8,000 tokens whose last 2,000 are removed and refilled (a rollback,
// or a context shift's refill), rows written as a decode writes them. Rounds interleave the
// three settings; medians of BENCH_ROUNDS (9). Then idle memory: how long after a seqRm of
// every cell (1 GiB) residentBytes is back, with the default.
//
//   npm run build && node bench/decay.mjs

import { createRequire } from 'node:module'
import { fileURLToPath } from 'node:url'
import path from 'node:path'
import { BIG_TOKENS, bigCache, median } from './timing.mjs'

const require = createRequire(import.meta.url)
const root = path.resolve(path.dirname(fileURLToPath(import.meta.url)), '..')
const { KvCache } = require(path.join(root, 'index.js'))

const ROUNDS = Number(process.env.BENCH_ROUNDS ?? 9)
const REFILL = 2000
const TIMES = 20
const SETTINGS = [['default (decay)', true], ["'now'", 'now'], ['false', false]]

/** bigCache's cache and rows, made with `releaseMemory`. */
function bigCacheWith(releaseMemory) {
  const WithRelease = class extends KvCache {
    constructor(options) {
      super({ ...options, releaseMemory })
    }
  }
  return bigCache(WithRelease)
}

const caches = SETTINGS.map(([, releaseMemory]) => bigCacheWith(releaseMemory))

const rows = Buffer.alloc(REFILL * 2048, 0x3c)
const pos = Int32Array.from({ length: REFILL }, (_, i) => BIG_TOKENS - REFILL + i)
const seqIds = new Array(REFILL).fill(0)

/** Removes and refills the last 2,000 tokens 20 times, writing their rows; ms. */
function loop(c) {
  const t0 = process.hrtime.bigint()
  for (let k = 0; k < TIMES; k++) {
    c.seqRm(0, BIG_TOKENS - REFILL, -1)
    const slot = c.findSlot({ pos, seqIds })
    for (let il = 0; il < 32; il++) {
      c.writeK(il, slot.head, rows)
      c.writeV(il, slot.head, rows)
    }
  }
  return Number(process.hrtime.bigint() - t0) / 1e6
}

const times = SETTINGS.map(() => [])
for (let r = 0; r < ROUNDS; r++) {
  for (let i = 0; i < SETTINGS.length; i++) {
    const k = (i + r) % SETTINGS.length
    times[k].push(loop(caches[k]))
  }
}
const base = median(times[2])
console.log(`# decode loop at the 8B geometry: ${TIMES} x (seqRm of the last ${REFILL.toLocaleString('en')} of ${BIG_TOKENS.toLocaleString('en')} tokens, refill, rows written); median of ${ROUNDS}, ms`)
console.log('| releaseMemory | ms | against false |')
console.log('|---|---|---|')
for (const [i, [name]] of SETTINGS.entries()) {
  const m = median(times[i])
  console.log(`| ${name} | ${m.toFixed(0)} | ${(m / base).toFixed(2)}x |`)
}
const ratio = median(times[0]) / base
console.log(`- the default within 1.1x of releaseMemory false: ${ratio.toFixed(2)}x: ${ratio <= 1.1 ? 'met' : 'NOT met'}`)
for (const c of caches) c.dispose()

// idle memory: a seqRm of every cell with the default, then how long until the pages are back
const idle = bigCache(KvCache)
const held = idle.residentBytes
const t0 = process.hrtime.bigint()
idle.seqRm(0)
while (idle.residentBytes > held / 64) await new Promise((resolve) => setTimeout(resolve, 5))
const backMs = Number(process.hrtime.bigint() - t0) / 1e6
console.log(`- idle: after a seqRm of ${(held / 2 ** 30).toFixed(2)} GiB of cells, residentBytes back to ${(idle.residentBytes / 2 ** 20).toFixed(1)} MiB in ${backMs.toFixed(0)} ms (goal: within the delay, 1,000 ms, plus a second)`)
idle.dispose()

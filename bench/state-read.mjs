// Async `stateRead` into a fresh cache against `stateReadSync` of the same bytes (issue 39), at
// the 8B geometry (32 layers, 1,024-wide f16 K/V, flash attention) with a ~500 MiB state
// (4,000 tokens): the default call (which copies the caller's bytes at the call) and the one
// that takes them (`{ transfer: true }`, read without a copy; each round hands it a fresh
// copy made before the clock starts), against `stateReadSync`, a `Buffer.from` copy of the
// same bytes, and `loadSequenceFile` against `fs.promises.readFile` of the same state as a
// file. Each round makes a fresh cache (untimed) per load and runs the operations in an order
// rotated every round; the ratios are medians of the per-round ratios.
//
//   npm run build && node --expose-gc bench/state-read.mjs      # BENCH_ROUNDS=7 by default
import fs from 'node:fs'
import os from 'node:os'
import path from 'node:path'
import { createRequire } from 'node:module'
import { median } from './timing.mjs'

const require = createRequire(import.meta.url)
const { KvCache } = require('../index.js')
const ROUNDS = Number(process.env.BENCH_ROUNDS ?? 7)
const TOKENS = 4000
const geometry = { size: 4096, nLayer: 32, nEmbdKGqa: 1024, flashAttn: true, typeK: 'f16', typeV: 'f16' }
const fresh = () => new KvCache(geometry)
const gc = globalThis.gc ?? (() => {})
const time = async (f) => {
  const t0 = process.hrtime.bigint()
  await f()
  return Number(process.hrtime.bigint() - t0) / 1e6
}

/** A cache holding sequence 0 at positions 0..TOKENS-1 with non-constant f16 rows. */
function source() {
  const c = fresh()
  for (let p = 0; p < TOKENS; p += 500) {
    c.findSlot({ pos: Int32Array.from({ length: 500 }, (_, i) => p + i), seqIds: new Array(500).fill(0) })
  }
  const rows = Buffer.alloc(TOKENS * 2048)
  for (let i = 0; i < rows.length; i += 2) rows.writeUInt16LE(0x3c00 ^ ((i * 2654435761) >>> 20) & 0x3ff, i)
  for (let il = 0; il < 32; il++) {
    c.writeK(il, 0, rows)
    c.writeV(il, 0, rows)
  }
  return c
}

const dir = fs.mkdtempSync(path.join(os.tmpdir(), 'kv-state-read-bench-'))
try {
  const file = path.join(dir, 'chat.ggsq')
  const src = source()
  src.saveSequenceFileSync(file, 0, Int32Array.from({ length: TOKENS }, (_, i) => i % 300))
  const blob = src.stateWriteSync(0)
  src.dispose()
  // older addons refuse the option as unknown
  let transferable = true
  try {
    const c = fresh()
    await c.stateRead(Buffer.from(blob), 0, { transfer: true })
    c.dispose()
  } catch (e) {
    if (e.code !== 'ERR_KV_INVALID_ARG') throw e
    transferable = false
  }
  const ops = {
    sync: async () => {
      const c = fresh()
      const ms = await time(() => c.stateReadSync(blob, 0))
      c.dispose()
      return ms
    },
    async: async () => {
      const c = fresh()
      const ms = await time(() => c.stateRead(blob, 0))
      c.dispose()
      return ms
    },
    ...(transferable && {
      transferred: async () => {
        const c = fresh()
        const data = Buffer.from(blob)
        const ms = await time(() => c.stateRead(data, 0, { transfer: true }))
        c.dispose()
        return ms
      },
    }),
    copy: () => time(() => (globalThis.__sink = Buffer.from(blob))),
    readFile: () => time(async () => (globalThis.__sink = await fs.promises.readFile(file))),
    load: async () => {
      const c = fresh()
      const ms = await time(() => c.loadSequenceFile(file, 0))
      c.dispose()
      return ms
    },
  }
  const names = Object.keys(ops)
  const t = Object.fromEntries(names.map((n) => [n, []]))
  const ratios = {}
  const add = (k, v) => (ratios[k] ??= []).push(v)
  for (let r = 0; r < ROUNDS; r++) {
    const ms = {}
    for (let i = 0; i < names.length; i++) {
      const name = names[(i + r) % names.length]
      globalThis.__sink = null
      gc()
      ms[name] = await ops[name]()
      t[name].push(ms[name])
    }
    add('async/sync', ms.async / ms.sync)
    if (transferable) add('transferred/sync', ms.transferred / ms.sync)
    add('async/copy', ms.async / ms.copy)
    add('readFile/load', ms.readFile / ms.load)
  }
  const mib = (blob.length / 2 ** 20).toFixed(0)
  console.log(`# stateRead into a fresh cache: 8B geometry, ${TOKENS} tokens, ${mib} MiB state (node ${process.version}; median of ${ROUNDS} interleaved rounds)`)
  console.log()
  console.log('| operation | ms |')
  console.log('|---|---|')
  const label = {
    sync: 'stateReadSync',
    async: 'stateRead (default: copies at the call)',
    transferred: 'stateRead { transfer: true }',
    copy: 'Buffer.from (a copy)',
    readFile: 'fs.promises.readFile of the file',
    load: 'loadSequenceFile of the file',
  }
  for (const n of names) console.log(`| ${label[n]} | ${median(t[n]).toFixed(0)} |`)
  console.log()
  console.log('| ratio | median | goal |')
  console.log('|---|---|---|')
  const goal = { 'async/sync': '<= 1.6', 'transferred/sync': '<= 1.2', 'async/copy': '', 'readFile/load': '>= 1.0' }
  for (const [k, v] of Object.entries(ratios)) console.log(`| ${k} | ${median(v).toFixed(2)} | ${goal[k]} |`)
} finally {
  fs.rmSync(dir, { recursive: true, force: true })
}

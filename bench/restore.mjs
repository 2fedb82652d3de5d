// A chat restored into a fresh cache, as an app restoring one does, at the 8B geometry (32
// layers, 1,024-wide f16 K/V, flash attention, 8,000 tokens: a 0.98 GiB sequence file):
// `loadSequenceFile` against `fs.promises.readFile` of the same file, and `stateRead` against a
// copy of the same bytes into fresh memory (`Buffer.from`). Each round makes a new cache
// (untimed) for each load and times the load and its baseline back to back; the ratios are
// medians of the per-round ratios.
//
//   npm run build && node bench/restore.mjs            # BENCH_ROUNDS=7 by default
//   BENCH_BASELINE=/path/to/older/llama-kv-cache.linux-x64-gnu.node node bench/restore.mjs
import fs from 'node:fs'
import os from 'node:os'
import path from 'node:path'
import { createRequire } from 'node:module'
import { BIG_TOKENS, bigCache, median } from './timing.mjs'

const require = createRequire(import.meta.url)
const addons = [['ours', require('../index.js')]]
if (process.env.BENCH_BASELINE) addons.push(['baseline', require(process.env.BENCH_BASELINE)])
const ROUNDS = Number(process.env.BENCH_ROUNDS ?? 7)
const fresh = ({ KvCache }) =>
  new KvCache({ size: 8192, nLayer: 32, nEmbdKGqa: 1024, flashAttn: true, typeK: 'f16', typeV: 'f16' })
const time = async (f) => {
  const t0 = process.hrtime.bigint()
  await f()
  return Number(process.hrtime.bigint() - t0) / 1e6
}

const dir = fs.mkdtempSync(path.join(os.tmpdir(), 'kv-restore-bench-'))
try {
  const file = path.join(dir, 'chat.ggsq')
  const src = bigCache(addons[0][1].KvCache)
  src.saveSequenceFileSync(file, 0, Int32Array.from({ length: BIG_TOKENS }, (_, i) => i % 300))
  const blob = await src.stateWrite(0)
  src.dispose()
  const t = {}
  const add = (key, v) => (t[key] ??= []).push(v)
  for (let r = 0; r < ROUNDS; r++) {
    for (const [name, addon] of addons) {
      let c = fresh(addon)
      const load = await time(() => c.loadSequenceFile(file, 0))
      const read = await time(() => fs.promises.readFile(file))
      c.dispose()
      c = fresh(addon)
      const stateRead = await time(() => c.stateRead(blob, 0))
      const copy = await time(() => Buffer.from(blob))
      c.dispose()
      add(`${name} load`, load)
      add(`${name} read`, read)
      add(`${name} load ratio`, read / load)
      add(`${name} stateRead`, stateRead)
      add(`${name} copy`, copy)
      add(`${name} stateRead ratio`, copy / stateRead)
    }
  }
  const gib = (fs.statSync(file).size / 2 ** 30).toFixed(2)
  console.log(`# Restoring a chat into a fresh cache: 8B geometry, ${gib} GiB file (node ${process.version}; median of ${ROUNDS} interleaved rounds)`)
  console.log()
  console.log('| addon | operation | ms | baseline | ms | baseline/ours (goal) |')
  console.log('|---|---|---|---|---|---|')
  for (const [name] of addons) {
    const m = (k) => median(t[`${name} ${k}`])
    console.log(`| ${name} | loadSequenceFile | ${m('load').toFixed(0)} | fs.promises.readFile | ${m('read').toFixed(0)} | ${m('load ratio').toFixed(2)} (>= 1.0) |`)
    console.log(`| ${name} | stateRead | ${m('stateRead').toFixed(0)} | Buffer.from (a copy) | ${m('copy').toFixed(0)} | ${m('stateRead ratio').toFixed(2)} (>= 0.9) |`)
  }
} finally {
  fs.rmSync(dir, { recursive: true, force: true })
}

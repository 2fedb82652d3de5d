// State I/O and creation through JS, as a fraction of memcpy of the same bytes measured in the
// same run: stateWrite into a new Buffer, stateRead without a layout, whole cache and one
// sequence, at the issue's workload (65,536 cells, 8 sequences, 2 layers of 32-wide f16 rows,
// V transposed); then `new KvCache` at an 8B llama's geometry. With BENCH_BASELINE (an older
// build of the addon) both builds run interleaved in one process, op by op, so the machine's
// load hits both alike.
//
//   node bench/state.mjs
//   BENCH_BASELINE=/path/to/older/llama-kv-cache.linux-x64-gnu.node node bench/state.mjs
import { createRequire } from 'node:module'
import { median } from './timing.mjs'

const require = createRequire(import.meta.url)
const ROUNDS = Number(process.env.BENCH_ROUNDS ?? 21)
const SIZE = 65536
const N_SEQ = 8

const builds = [['this build', require('../index.js')]]
if (process.env.BENCH_BASELINE) builds.unshift(['baseline', require(process.env.BENCH_BASELINE)])

function setup({ KvCache }) {
  const c = new KvCache({ size: SIZE, nLayer: 2, nEmbdKGqa: 32, nSeqMax: N_SEQ })
  const len = SIZE / N_SEQ
  for (let s = 0; s < N_SEQ; s++) c.findSlot({ pos: Int32Array.from({ length: len }, (_, i) => i), seqIds: new Array(len).fill(s) })
  for (let il = 0; il < 2; il++) {
    c.writeK(il, 0, Buffer.alloc(SIZE * 64, il + 1))
    c.writeV(il, 0, Buffer.alloc(SIZE * 64, il + 3))
  }
  return { c, whole: c.stateWriteSync(-1), seq: c.stateWriteSync(3) }
}

const sides = builds.map(([name, addon]) => ({ name, addon, ...setup(addon) }))
const bytes = sides[0].c.totalBytes
const src = Buffer.alloc(bytes, 1)
const dst = Buffer.alloc(bytes)
const ns = (f) => {
  const t0 = process.hrtime.bigint()
  f()
  return Number(process.hrtime.bigint() - t0)
}
const OPS = [
  ['stateWrite, whole cache (new Buffer)', (s) => s.c.stateWriteSync(-1), (s) => s.whole.length],
  ['stateWrite, one sequence (new Buffer)', (s) => s.c.stateWriteSync(3), (s) => s.seq.length],
  ['stateRead, whole cache (layout detected)', (s) => s.c.stateReadSync(s.whole), (s) => s.whole.length],
  ['stateRead, one sequence (layout detected)', (s) => s.c.stateReadSync(s.seq, 3), (s) => s.seq.length],
]
const samples = new Map()
const add = (key, v) => samples.set(key, [...(samples.get(key) ?? []), v])
for (let r = 0; r <= ROUNDS; r++) {
  const memcpy = ns(() => src.copy(dst))
  if (r > 0) add('memcpy', memcpy)
  for (const [label, op] of OPS) {
    for (let k = 0; k < sides.length; k++) {
      const side = sides[(r + k) % sides.length]
      const t = ns(() => op(side))
      if (r > 0) add(`${label}|${side.name}`, t)
    }
  }
}
const memcpyNs = median(samples.get('memcpy'))
console.log(`# State I/O through JS (node ${process.version}; ${SIZE.toLocaleString('en')} cells, K/V tensors ${(bytes / 2 ** 20).toFixed(0)} MiB; median of ${ROUNDS})`)
console.log()
console.log(`memcpy of the K/V tensors: ${(memcpyNs / 1e3).toFixed(0)} us`)
console.log()
console.log(`| op | ${sides.map((s) => `${s.name} us | ${s.name} / memcpy`).join(' | ')} |`)
console.log(`|---|${sides.map(() => '---|---').join('|')}|`)
for (const [label, , size] of OPS) {
  const cells = sides.map((s) => {
    const t = median(samples.get(`${label}|${s.name}`))
    const frac = (memcpyNs * size(s)) / bytes / t
    return `${(t / 1e3).toFixed(0)} | ${frac.toFixed(2)}`
  })
  console.log(`| ${label} | ${cells.join(' | ')} |`)
}

// creation at an 8B llama's geometry (32 layers, 1,024-wide f16 K and V)
console.log()
console.log(`| new KvCache, 32 layers x 1,024 f16 | ${sides.map((s) => `${s.name} ms`).join(' | ')} |`)
console.log(`|---|${sides.map(() => '---').join('|')}|`)
for (const cells of [16384, 131072]) {
  const times = sides.map(() => [])
  for (let r = 0; r < 7; r++) {
    sides.forEach((s, k) => {
      let c
      times[k].push(ns(() => { c = new s.addon.KvCache({ size: cells, nLayer: 32, nEmbdKGqa: 1024 }) }))
      c.dispose()
    })
  }
  console.log(`| ${cells.toLocaleString('en')} cells (${cells / 8192} GiB) | ${times.map((t) => (median(t) / 1e6).toFixed(3)).join(' | ')} |`)
}

// Same-run benchmark against llama.cpp 0.1.103: llama.cpp's own KV cache operations through its
// C API (crates/conformance/driver/seed/kv-bench.cpp), our Rust core (the conformance crate's
// `bench-core`, built without the `cuda` feature) and our JS binding (the addon as shipped), on
// one workload, in interleaved rounds.
//
//   npm run bench:llama                    # builds all three, runs 4,096 and 65,536 cells + 8B rows
//   BENCH_ROUNDS=15 BENCH_BIG=0 node bench/llama.mjs
//   BENCH_RELEASE=now node bench/llama.mjs  # the JS cache's releaseMemory: true (default), now, false
//
// Workload (the issue's): 8 sequences filling the cache in one contiguous block each, f16 K/V,
// 2 layers with 32-wide rows, V transposed (no flash attention), one thread. Every round restores
// the filled cache on each side (untimed) and warms each side's call path with a few O(1) calls,
// then times each op once on each side, in a rotating order; the tables show medians. Ratios are llama.cpp's time / ours: above 1, we are faster.
// The last section writes and reads a 0.98 GiB sequence file at an 8B llama's geometry against
// plain fs calls (BENCH_BIG=0 skips it; it needs about 4 GiB of memory and 2 GiB of disk).

import { spawn } from 'node:child_process'
import { createInterface } from 'node:readline'
import { createRequire } from 'node:module'
import { fileURLToPath } from 'node:url'
import fs from 'node:fs'
import os from 'node:os'
import path from 'node:path'
import { BIG_TOKENS, bigCache, median, perCall } from './timing.mjs'

const require = createRequire(import.meta.url)
const root = path.resolve(path.dirname(fileURLToPath(import.meta.url)), '..')
const { KvCache } = require(path.join(root, 'index.js'))

const ROUNDS = Number(process.env.BENCH_ROUNDS ?? 11)
const SIZES = (process.env.BENCH_SIZES ?? '4096,65536').split(',').map(Number)
const N_SEQ = 8
// the JS side's releaseMemory (the default unless BENCH_RELEASE says 'now' or 'false')
const RELEASE = { now: { releaseMemory: 'now' }, false: { releaseMemory: false } }[process.env.BENCH_RELEASE] ?? {}
const target = process.env.CARGO_TARGET_DIR ?? path.join(root, 'target')

const pad = (s, n) => String(s).padStart(n)
const padEnd = (s, n) => String(s).padEnd(n)
const us = (ns) => (ns / 1e3 >= 100 ? (ns / 1e3).toFixed(0) : (ns / 1e3).toFixed(2))

/** A child process answering one JSON line per command line. */
class Peer {
  constructor(name, program) {
    this.name = name
    this.child = spawn(program, [], { stdio: ['pipe', 'pipe', 'inherit'] })
    this.lines = createInterface({ input: this.child.stdout })[Symbol.asyncIterator]()
  }
  async ask(line) {
    this.child.stdin.write(line + '\n')
    const { value, done } = await this.lines.next()
    if (done) throw new Error(`${this.name} exited on: ${line}`)
    const answer = JSON.parse(value)
    if (answer.error) throw new Error(`${this.name}: ${answer.error} (on: ${line})`)
    return answer
  }
  close() {
    this.child.stdin.end('quit\n')
  }
}

/** Our JS binding on the same workload, with the same ops as the two peers. */
class JsSide {
  constructor(size, dir) {
    this.cache = new KvCache({ size, nLayer: 2, nEmbdKGqa: 32, nSeqMax: N_SEQ, typeK: 'f16', typeV: 'f16', ...RELEASE })
    this.len = size / N_SEQ
    this.seqBlobs = Array.from({ length: N_SEQ }, (_, s) => fs.readFileSync(path.join(dir, `seq-${s}.bin`)))
    this.whole = fs.readFileSync(path.join(dir, 'whole.bin'))
    for (let s = 0; s < N_SEQ; s++) this.cache.stateReadSync(this.seqBlobs[s], s)
    if (this.cache.usedCells !== size) throw new Error('the JS cache is not full after the loads')
    this.rope = { rope: { headDim: 16, nHead: 2, type: 'norm' } }
    const bytes = this.cache.totalBytes
    this.src = Buffer.alloc(bytes, 1)
    this.dst = Buffer.alloc(bytes)
    this.out = Buffer.alloc(this.whole.length)
  }
  time(op) {
    const c = this.cache
    c.stateReadSync(this.whole)
    // the restore evicts the call path from the CPU caches: a few O(1) calls bring it back, as
    // the other two sides do, so the time is the op's and not the first call's after 16 MiB
    c.seqPosMax(0)
    c.seqPosMax(1)
    globalThis.__sink = c.usedCells
    const s = 3 % N_SEQ
    const L = this.len
    let t0 = process.hrtime.bigint()
    switch (op) {
      case 'seq_rm_mid': c.seqRm(s, L / 4, L / 2); break
      case 'seq_rm_tail': c.seqRm(s, L - 16, -1); break
      case 'seq_add': c.seqAdd(s, L / 2, -1, -(L / 4)); break
      case 'seq_div': c.seqDiv(s, 0, -1, 2); break
      case 'seq_cp': c.seqCp(s, (s + 1) % N_SEQ, 0, -1); break
      case 'seq_rm_short': c.seqRm(s, L / 2, L / 2 + 16); break
      case 'seq_add_short': c.seqAdd(s, L - 16, -1, 16); break
      case 'seq_div_short': c.seqDiv(s, L - 16, -1, 2); break
      case 'seq_cp_short': c.seqCp(s, (s + 1) % N_SEQ, L / 2, L / 2 + 16); break
      case 'seq_keep': c.seqKeep(s); break
      case 'seq_pos_max': c.seqPosMax(s); break
      case 'clear': c.clear(); break
      case 'defrag_update':
        for (let q = 1; q < N_SEQ; q += 2) c.seqRm(q, -1, -1)
        t0 = process.hrtime.bigint()
        c.defrag()
        // the bytes it moved: the same plan on all three sides (the differential suite pins it)
        this.defragBytes = c.updateSync(this.rope).defrag.bytesCopied
        break
      case 'defrag_scattered':
        for (let q = 0; q < N_SEQ; q++) for (let p = 0; p < L; p += 64) c.seqRm(q, p, p + 1)
        t0 = process.hrtime.bigint()
        c.defrag()
        this.scatteredBytes = c.updateSync(this.rope).defrag.bytesCopied
        break
      case 'kshift_all':
        for (let q = 0; q < N_SEQ; q++) c.seqAdd(q, 0, -1, 1)
        t0 = process.hrtime.bigint()
        c.updateSync(this.rope)
        break
      case 'seq_get': c.stateWriteSync(s, { layout: 'seed' }); break
      case 'seq_set':
        c.seqRm(s, -1, -1)
        t0 = process.hrtime.bigint()
        c.stateReadSync(this.seqBlobs[s], s)
        break
      case 'seq_get_into': c.stateWriteIntoSync(this.out, s, { layout: 'seed' }); break
      case 'state_get_into': c.stateWriteIntoSync(this.out, -1, { layout: 'seed' }); break
      case 'state_get': c.stateWriteSync(-1, { layout: 'seed' }); break
      case 'state_set': c.stateReadSync(this.whole); break
      case 'set_all':
        c.clear()
        for (let q = 0; q < N_SEQ; q++) c.stateReadSync(this.seqBlobs[q], q)
        break
      case 'copy_new_seq': globalThis.__sink = Buffer.from(this.seqBlobs[s]); break
      case 'copy_new_whole': globalThis.__sink = Buffer.from(this.whole); break
      case 'memcpy_seq': this.seqBlobs[s].copy(this.out); break
      case 'memcpy': this.src.copy(this.dst); break
      case 'memset': this.dst.fill(0); break
      default: throw new Error(`unknown op ${op}`)
    }
    const ns = Number(process.hrtime.bigint() - t0)
    c.updateSync(this.rope) // a pending K-shift must not leak into the next op's timing
    return ns
  }
  dispose() {
    this.cache.dispose()
  }
}

const OPS = [
  ['seq_rm_mid', 'seq_rm, middle quarter of one sequence'],
  ['seq_rm_tail', 'seq_rm, last 16 tokens of one sequence'],
  ['seq_add', 'seq_add, second half of one sequence'],
  ['seq_div', 'seq_div, one sequence'],
  ['seq_cp', 'seq_cp, one whole sequence'],
  ['seq_rm_short', 'seq_rm, 16 tokens in the middle of one sequence'],
  ['seq_add_short', 'seq_add, last 16 tokens of one sequence'],
  ['seq_div_short', 'seq_div, last 16 tokens of one sequence'],
  ['seq_cp_short', 'seq_cp, 16 tokens in the middle of one sequence'],
  ['seq_keep', 'seq_keep'],
  ['seq_pos_max', 'seq_pos_max'],
  ['clear', 'clear'],
  ['defrag_update', 'defrag + update (every other sequence removed)'],
  ['defrag_scattered', 'defrag + update, a 1-cell hole every 64 cells'],
  ['kshift_all', 'K-shift of every cell (update)'],
  ['seq_get', 'state get, one sequence'],
  ['seq_set', 'state set, one sequence'],
  ['state_get', 'state get, whole cache'],
  ['seq_get_into', 'state get into a reused buffer, one sequence'],
  ['state_get_into', 'state get into a reused buffer, whole cache'],
  ['state_set', 'state set, whole cache'],
  ['set_all', 'whole cache set (clear + 8 sequence sets)'],
  ['copy_new_seq', 'baseline: one sequence\'s state copied to new memory'],
  ['copy_new_whole', 'baseline: the whole state copied to new memory'],
  ['memcpy_seq', 'baseline: memcpy of one sequence\'s state'],
  ['memcpy', 'baseline: memcpy of the K/V tensors'],
  ['memset', 'baseline: memset of the K/V tensors'],
]

async function sameRun(size, core, llama) {
  const dir = fs.mkdtempSync(path.join(os.tmpdir(), `kv-bench-${size}-`))
  try {
    const { model, bytes } = await core.ask(`setup ${size} ${N_SEQ} ${dir}`)
    await llama.ask(`setup ${model} ${size} ${N_SEQ} ${dir} ${bytes}`)
    const js = new JsSide(size, dir)
    const sides = [
      ['llama', (op) => llama.ask(`time ${op}`).then((a) => a.ns)],
      ['core', (op) => core.ask(`time ${op}`).then((a) => a.ns)],
      ['js', async (op) => js.time(op)],
    ]
    const samples = Object.fromEntries(OPS.map(([op]) => [op, { llama: [], core: [], js: [] }]))
    for (let r = 0; r <= ROUNDS; r++) {
      for (const [op] of OPS) {
        for (let k = 0; k < sides.length; k++) {
          const [name, time] = sides[(r + k) % sides.length]
          const ns = await time(op)
          if (r > 0) samples[op][name].push(ns) // round 0 warms up
        }
      }
    }
    const m = Object.fromEntries(
      OPS.map(([op]) => [op, Object.fromEntries(Object.entries(samples[op]).map(([k, v]) => [k, median(v)]))]),
    )
    const mib = (bytes / 2 ** 20).toFixed(bytes < 2 ** 20 ? 2 : 0)
    console.log()
    console.log(`## ${size.toLocaleString('en')} cells, ${N_SEQ} sequences, f16, 2 layers x 32, V transposed (K/V tensors ${mib} MiB); median of ${ROUNDS} rounds`)
    console.log()
    console.log(`| ${padEnd('op', 48)} | ${pad('llama.cpp us', 12)} | ${pad('core us', 9)} | ${pad('JS us', 9)} | ${pad('llama/core', 10)} | ${pad('llama/JS', 8)} |`)
    console.log(`|${'-'.repeat(50)}|${'-'.repeat(14)}|${'-'.repeat(11)}|${'-'.repeat(11)}|${'-'.repeat(12)}|${'-'.repeat(10)}|`)
    for (const [op, label] of OPS) {
      const { llama: l, core: c, js: j } = m[op]
      console.log(
        `| ${padEnd(label, 48)} | ${pad(us(l), 12)} | ${pad(us(c), 9)} | ${pad(us(j), 9)} | ${pad((l / c).toFixed(2), 10)} | ${pad((l / j).toFixed(2), 8)} |`,
      )
    }
    // data ops as a fraction of memcpy speed over the same bytes, each side against its own memcpy
    const payload = {
      seq_get: js.seqBlobs[3 % N_SEQ].length,
      seq_get_into: js.seqBlobs[3 % N_SEQ].length,
      state_get_into: js.whole.length,
      seq_set: js.seqBlobs[3 % N_SEQ].length,
      state_get: js.whole.length,
      state_set: js.whole.length,
      set_all: js.whole.length,
      kshift_all: bytes / 2,
      defrag_update: js.defragBytes,
      defrag_scattered: js.scatteredBytes,
      clear: bytes,
    }
    // new memory against a copy into new memory of the same bytes; the rest against memcpy
    // (memset for clear) of the tensors, scaled to the bytes the op moves
    const newMemory = { seq_get: 'copy_new_seq', state_get: 'copy_new_whole' }
    const sameBytes = { seq_set: 'memcpy_seq', seq_get_into: 'memcpy_seq' }
    const fraction = (op, side) => {
      if (newMemory[op]) return m[newMemory[op]][side] / m[op][side]
      if (sameBytes[op]) return m[sameBytes[op]][side] / m[op][side]
      const base = op === 'clear' ? 'memset' : 'memcpy'
      return (m[base][side] * payload[op]) / bytes / m[op][side]
    }
    console.log()
    console.log(`Speed as a fraction of the same side's memcpy (memset for clear) over the bytes moved (K-shift: the K bytes; defrag: the bytes its moves copy, ${(js.defragBytes / 2 ** 20).toFixed(1)} MiB, scattered ${(js.scatteredBytes / 2 ** 10).toFixed(0)} KiB). A one-sequence set or get into a buffer is measured against a memcpy of exactly its bytes, a state get into new memory against a copy of its bytes into new memory (first-touch page faults cost as much as the copy here):`)
    console.log()
    console.log(`| ${padEnd('op', 48)} | ${pad('llama.cpp', 9)} | ${pad('core', 6)} | ${pad('JS', 6)} |`)
    console.log(`|${'-'.repeat(50)}|${'-'.repeat(11)}|${'-'.repeat(8)}|${'-'.repeat(8)}|`)
    for (const [op, label] of OPS) {
      if (!(op in payload)) continue
      const frac = (side) => fraction(op, side).toFixed(2)
      console.log(`| ${padEnd(label, 48)} | ${pad(frac('llama'), 9)} | ${pad(frac('core'), 6)} | ${pad(frac('js'), 6)} |`)
    }
    // the goals for this size, through JS, stated as checks
    const stateOps = ['seq_get', 'seq_set', 'state_get', 'state_set', 'seq_get_into', 'state_get_into']
    const slowest = (score) => stateOps.reduce((a, op) => (score(op) < score(a) ? op : a))
    const [memWorst, llamaWorst] = [slowest((op) => fraction(op, 'js')), slowest((op) => m[op].llama / m[op].js)]
    const seqOps = OPS.map(([op]) => op).filter((op) => op.startsWith('seq_') && !['seq_get', 'seq_set', 'seq_get_into'].includes(op))
    const worst = seqOps.reduce((a, op) => (m[op].llama / m[op].js < m[a].llama / m[a].js ? op : a))
    const worstRatio = m[worst].llama / m[worst].js
    const clearFrac = m.memset.js / m.clear.js
    console.log()
    console.log(`Checks through JS at ${size.toLocaleString('en')} cells:`)
    console.log(`- every sequence operation >= 10x llama.cpp: slowest ratio ${worstRatio.toFixed(1)}x (${worst}): ${worstRatio >= 10 ? 'met' : 'NOT met'}`)
    console.log(`- clear >= 0.8x a memset of the tensors: ${clearFrac.toFixed(2)}x: ${clearFrac >= 0.8 ? 'met' : 'NOT met'}`)
    const memFrac = fraction(memWorst, 'js')
    const llamaRatio = m[llamaWorst].llama / m[llamaWorst].js
    console.log(`- state get/set >= 0.8x memcpy of the same bytes: slowest ${memFrac.toFixed(2)}x (${memWorst}): ${memFrac >= 0.8 ? 'met' : 'NOT met'}`)
    console.log(`- state get/set >= 2x llama.cpp: slowest ${llamaRatio.toFixed(2)}x (${llamaWorst}): ${llamaRatio >= 2 ? 'met' : 'NOT met'}`)
    js.dispose()
  } finally {
    fs.rmSync(dir, { recursive: true, force: true })
  }
}

function callFloor() {
  const c = new KvCache({ size: 4096, nLayer: 2, nEmbdKGqa: 32, nSeqMax: N_SEQ })
  for (let s = 0; s < N_SEQ; s++) c.findSlot({ pos: Int32Array.from({ length: 256 }, (_, i) => i), seqIds: new Array(256).fill(s) })
  const ub = { pos: [100000], seqIds: [0] }
  const pos = Int32Array.of(100000)
  const seqIds = Int32Array.of(0)
  const rows = [
    ['no-op napi call (the `disposed` getter)', perCall(1e6, () => c.disposed)],
    ['seqPosMax(3)', perCall(1e6, () => c.seqPosMax(3))],
    ['updateSync() with nothing pending', perCall(2e5, () => c.updateSync())],
    ['findSlot, 1-token ubatch (+ seqRm to undo it)', perCall(2e5, () => c.findSlot(ub) && c.seqRm(0, 100000, 100001))],
    ['findSlotPacked, 1 token (+ seqRm to undo it)', perCall(2e5, () => c.findSlotPacked(pos, seqIds) !== null && c.seqRm(0, 100000, 100001))],
    ['findSlot, 1 token into free cells (no undo)', placements((c, i) => c.findSlot({ pos: [i], seqIds: [0] }) !== null)],
    ['findSlotPacked, 1 token into free cells (no undo)', placements((c, i) => {
      pos[0] = i
      return c.findSlotPacked(pos, seqIds) !== null
    })],
  ]
  c.dispose()
  console.log()
  console.log(`## JS call floor (4,096 cells; median of 9 loops)`)
  console.log()
  console.log(`| ${padEnd('call', 48)} | ${pad('ns/call', 8)} | ${pad('above no-op', 11)} |`)
  console.log(`|${'-'.repeat(50)}|${'-'.repeat(10)}|${'-'.repeat(13)}|`)
  for (const [name, ns] of rows) {
    console.log(`| ${padEnd(name, 48)} | ${pad(ns.toFixed(0), 8)} | ${pad((ns - rows[0][1]).toFixed(0), 11)} |`)
  }
  const above = rows[1][1] - rows[0][1]
  const [pair, alone] = [rows[4][1], rows[6][1]]
  console.log()
  console.log(`Checks:`)
  console.log(`- the cheapest call (seqPosMax) within 0.3 us of a no-op napi call: ${(above / 1e3).toFixed(3)} us above it: ${above <= 300 ? 'met' : 'NOT met'}`)
  console.log(`- a one-token findSlot under 1 us (findSlotPacked): ${(alone / 1e3).toFixed(3)} us: ${alone < 1000 ? 'met' : 'NOT met'}; with the seqRm that undoes it ${(pair / 1e3).toFixed(3)} us`)
}

/** ns per call of `place(cache, i)`, one token per call into a cleared 65,536-cell cache (the
 * clear is not timed): median of 9 rounds of 50,000 calls, after one warm-up round. */
function placements(place) {
  const c = new KvCache({ size: 65536, nLayer: 1, nEmbdKGqa: 8, nSeqMax: N_SEQ })
  const calls = 50000
  const samples = []
  let sink = 0
  for (let r = 0; r < 10; r++) {
    c.clear()
    const t0 = process.hrtime.bigint()
    for (let i = 0; i < calls; i++) sink ^= place(c, i) ? 1 : 0
    const ns = Number(process.hrtime.bigint() - t0) / calls
    if (r > 0) samples.push(ns)
  }
  if (c.usedCells !== calls) throw new Error(`placements: ${c.usedCells} cells used, ${calls} expected`)
  globalThis.__sink = sink
  c.dispose()
  return median(samples)
}

/** The 8B geometry: 32 layers, 1,024-wide f16 K and V, flash attention, 8,000 tokens. */
async function big() {
  const TOKENS = BIG_TOKENS
  const ROUNDS_BIG = Number(process.env.BENCH_BIG_ROUNDS ?? 6)
  const dir = fs.mkdtempSync(path.join(os.tmpdir(), 'kv-bench-8b-'))
  const c = bigCache(KvCache)
  try {
    const tokens = Int32Array.from({ length: TOKENS }, (_, i) => i % 300)
    const ours = path.join(dir, 'ours.ggsq')
    const plain = path.join(dir, 'plain.bin')
    c.saveSequenceFileSync(ours, 0, tokens)
    const bytes = fs.statSync(ours).size
    const blob = c.stateWriteSync(0)
    const t = { save: [], write: [], writeDurable: [], fsync: [], writeSync: [], load: [], read: [], stateRead: [], copy: [] }
    const time = async (key, f) => {
      const t0 = process.hrtime.bigint()
      await f()
      t[key].push(Number(process.hrtime.bigint() - t0) / 1e6)
    }
    const data = fs.readFileSync(ours)
    // each write goes to a path removed beforehand (untimed), so none pays for truncating or
    // replacing a 1 GiB file, and the order rotates every round, so none always follows the
    // same op (the disk's write-back of the previous one lands on whoever comes next)
    const writes = [
      ['save', () => c.saveSequenceFile(ours, 0, tokens), ours],
      ['write', () => fs.promises.writeFile(plain, data), plain],
      // the same durability as ours: the write, then an fsync of the file (timed on its own too)
      ['writeDurable', async () => {
        await fs.promises.writeFile(plain, data)
        const fh = await fs.promises.open(plain, 'r+')
        await time('fsync', () => fh.sync())
        await fh.close()
      }, plain],
      ['writeSync', () => {
        const fd = fs.openSync(plain, 'w')
        fs.writeSync(fd, data)
        fs.fsyncSync(fd)
        fs.closeSync(fd)
      }, plain],
    ]
    for (let r = 0; r < ROUNDS_BIG; r++) {
      for (let k = 0; k < writes.length; k++) {
        const [key, f, file] = writes[(r + k) % writes.length]
        fs.rmSync(file, { force: true })
        await time(key, f)
      }
      c.seqRm(0, -1, -1)
      await time('load', () => c.loadSequenceFile(ours, 0))
      await time('read', () => fs.promises.readFile(plain))
      c.seqRm(0, -1, -1)
      await time('stateRead', () => c.stateRead(blob, 0))
      await time('copy', () => Buffer.from(blob))
    }
    const m = Object.fromEntries(Object.entries(t).map(([k, v]) => [k, median(v)]))
    console.log()
    console.log(`## 8B geometry: 32 layers, 1,024-wide f16 K/V, flash attention, ${TOKENS.toLocaleString('en')} tokens: ${(bytes / 2 ** 30).toFixed(2)} GiB sequence file; median of ${ROUNDS_BIG}`)
    console.log()
    console.log(`| ${padEnd('operation', 34)} | ${pad('ours ms', 8)} | ${padEnd('plain Node for the same bytes', 44)} | ${pad('ms', 6)} | ${pad('plain/ours', 10)} |`)
    console.log(`|${'-'.repeat(36)}|${'-'.repeat(10)}|${'-'.repeat(46)}|${'-'.repeat(8)}|${'-'.repeat(12)}|`)
    const row = (name, ours, plainName, plainMs) =>
      console.log(`| ${padEnd(name, 34)} | ${pad(ours.toFixed(0), 8)} | ${padEnd(plainName, 44)} | ${pad(plainMs.toFixed(0), 6)} | ${pad((plainMs / ours).toFixed(2), 10)} |`)
    row('saveSequenceFile (with fsync)', m.save, 'fs.promises.writeFile + FileHandle.sync', m.writeDurable)
    console.log(`| ${padEnd('  of which the fsync (plain side)', 34)} | ${pad('', 8)} | ${padEnd('FileHandle.sync after the writeFile', 44)} | ${pad(m.fsync.toFixed(0), 6)} | ${pad('', 10)} |`)
    row('saveSequenceFile (with fsync)', m.save, 'fs.promises.writeFile (no fsync)', m.write)
    row('saveSequenceFile (with fsync)', m.save, 'fs.writeSync + fs.fsyncSync', m.writeSync)
    row('loadSequenceFile', m.load, 'fs.promises.readFile', m.read)
    row(`stateRead of the ${(blob.length / 2 ** 30).toFixed(2)} GiB blob`, m.stateRead, 'Buffer.from (a copy)', m.copy)
  } finally {
    c.dispose()
    fs.rmSync(dir, { recursive: true, force: true })
  }
}

const core = new Peer('bench-core', path.join(target, 'release', 'bench-core'))
const { bench } = await core.ask('paths')
const llama = new Peer('llama.cpp kv-bench', bench)
console.log(`# llama.cpp 0.1.103 (C API) vs our Rust core vs our JS binding (releaseMemory: ${RELEASE.releaseMemory ?? 'default'}), same run (node ${process.version}, ${os.cpus()[0].model})`)
try {
  for (const size of SIZES) await sameRun(size, core, llama)
} finally {
  core.close()
  llama.close()
}
callFloor()
if (process.env.BENCH_BIG !== '0') await big()

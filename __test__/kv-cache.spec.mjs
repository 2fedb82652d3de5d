import test from 'ava'
import path from 'node:path'
import { createRequire } from 'node:module'
import { fileURLToPath } from 'node:url'
import { runScript } from './helpers/run-script.mjs'

const require = createRequire(import.meta.url)
const { KvCache } = require('../index.js')
const DISPOSE_RSS = path.join(path.dirname(fileURLToPath(import.meta.url)), 'helpers', 'dispose-rss.mjs')
const MEMORY_ROUNDS = path.join(path.dirname(fileURLToPath(import.meta.url)), 'helpers', 'memory-rounds.mjs')

const TYPES = ['f32', 'f16', 'bf16', 'q8_0', 'q4_0', 'q4_1', 'q5_0', 'q5_1', 'iq4_nl']
const make = (o = {}) => new KvCache({ size: 64, nLayer: 2, nEmbdKGqa: 32, nSeqMax: 4, ...o })
const seq = (s, p0, n) => ({ pos: Array.from({ length: n }, (_, k) => p0 + k), seqIds: Array(n).fill(s) })
const code = (t, fn, expected) => {
  const e = t.throws(fn)
  t.is(e.code, expected, e.message)
  t.true(e instanceof Error)
  return e
}

test('construction reports geometry and documented defaults', (t) => {
  const c = make()
  t.is(c.size, 64)
  t.is(c.nLayer, 2)
  t.is(c.typeK, 'f16')
  t.is(c.typeV, 'f16')
  t.true(c.vTrans)
  t.false(c.recurrent)
  t.true(c.canShift)
  t.is(c.padding, 32)
  t.is(c.totalBytes, 2 * 2 * 64 * 32 * 2)
  t.is(c.sizeKBytes, c.sizeVBytes)
  t.is(c.rowSize(1, 'k'), 64)
  t.is(c.n, 64)
  const fa = make({ flashAttn: true, typeK: 'q8_0', typeV: 'q4_0', nEmbdVGqa: [32, 64] })
  t.false(fa.vTrans)
  t.is(fa.padding, 256)
  t.is(fa.rowSize(0, 'k'), 34)
  t.is(fa.rowSize(1, 'v'), 36)
})

test('invalid construction is refused with a named value', (t) => {
  code(t, () => make({ size: 0 }), 'ERR_KV_INVALID_ARG')
  code(t, () => make({ size: -5 }), 'ERR_KV_OUT_OF_RANGE')
  code(t, () => make({ size: 1.5 }), 'ERR_KV_INVALID_ARG')
  code(t, () => make({ size: NaN }), 'ERR_KV_INVALID_ARG')
  t.regex(code(t, () => make({ typeV: 'q8_0' }), 'ERR_KV_INVALID_ARG').message, /flash attention/)
  t.regex(code(t, () => make({ typeK: 'q3_k' }), 'ERR_KV_INVALID_ARG').message, /q3_k/)
  t.regex(code(t, () => make({ typeK: 'q4_0', flashAttn: true, nEmbdKGqa: 48 }), 'ERR_KV_INVALID_ARG').message, /48/)
  t.regex(code(t, () => make({ nSeqMax: 257 }), 'ERR_KV_OUT_OF_RANGE').message, /257/)
  code(t, () => make({ nEmbdKGqa: [32, 32, 32] }), 'ERR_KV_INVALID_ARG')
  code(t, () => new KvCache(), 'ERR_KV_INVALID_ARG')
  t.regex(code(t, () => new KvCache({ nLayer: 1, nEmbdKGqa: 8 }), 'ERR_KV_INVALID_ARG').message, /size/)
})

test('256 sequences, as llama.cpp allows: ids in every word of a cell set, through seqCp, seqRm, defrag and state', async (t) => {
  const c = make({ size: 1024, nSeqMax: 256 })
  t.is(c.nSeqMax, 256)
  // two tokens for each sequence, sequence after sequence, as a server's 256 slots would
  for (let s = 0; s < 256; s++) c.findSlot(seq(s, 0, 2))
  t.is(c.usedCells, 512)
  t.is(c.seqPosMax(255), 1)
  c.seqCp(200, 255)
  t.deepEqual(c.cell(400), { pos: 0, delta: 0, src: -1, tail: -1, seqIds: [200, 255] })
  t.is(c.seqCellCount(255), 4)
  t.true(c.seqRm(63, -1, -1))
  t.true(c.seqRm(64, 1, -1))
  t.is(c.seqCellCount(63), 0)
  t.is(c.seqCellCount(64), 1)
  c.defrag()
  await c.update()
  t.is(c.usedCells, 509)
  t.is(c.seqPosMax(255), 1)
  const whole = c.stateWriteSync()
  const back = make({ size: 1024, nSeqMax: 256 })
  back.stateReadSync(whole)
  t.deepEqual(back.cells(), c.cells())
  // one sequence of the last word, into another of the first
  const one = c.stateWriteSync(255)
  const into = make({ size: 1024, nSeqMax: 256 })
  into.stateReadSync(one, 3)
  t.is(into.seqCellCount(3), 4)
  t.is(into.seqPosMax(3), 1)
  code(t, () => c.seqRm(256), 'ERR_KV_OUT_OF_RANGE')
  t.regex(code(t, () => c.findSlot(seq(256, 5, 1)), 'ERR_KV_OUT_OF_RANGE').message, /256/)
})

test('findSlot places tokens and returns null when full', (t) => {
  const c = make({ size: 8 })
  t.deepEqual(c.findSlot(seq(0, 0, 5)), { head: 0, len: 5, n: 8 })
  t.is(c.usedCells, 5)
  t.is(c.findSlot(seq(1, 0, 4)), null)
  t.is(c.usedCells, 5)
  const shared = c.findSlot({ pos: new Int32Array([5]), seqIds: [[1, 2]] })
  t.is(shared.head, 5)
  t.is(c.nTokens, 7)
  t.deepEqual(c.cell(5).seqIds, [1, 2])
})

test('recurrent findSlot uses equal-length groups', (t) => {
  const c = make({ size: 4, recurrent: true, nEmbdKS: 32, nEmbdVS: 64 })
  t.false(c.canShift)
  const slot = c.findSlot({ pos: [0, 1, 0, 1], seqIds: [0, 2], nSeqTokens: 2 })
  t.deepEqual(slot, { head: 0, len: 2, n: 2 })
  t.is(c.cell(2).tail, 1)
  t.is(c.seqPosMax(2), 1)
  t.false(c.seqRm(0, 1, -1))
  t.true(c.seqRm(0))
})

test('malformed ubatches are errors and change nothing', (t) => {
  const c = make()
  code(t, () => c.findSlot({ pos: [0, 1], seqIds: [0] }), 'ERR_KV_INVALID_ARG')
  code(t, () => c.findSlot({ pos: [0], seqIds: [7] }), 'ERR_KV_OUT_OF_RANGE')
  code(t, () => c.findSlot({ pos: [-3], seqIds: [0] }), 'ERR_KV_INVALID_ARG')
  code(t, () => c.findSlot({ pos: [0.5], seqIds: [0] }), 'ERR_KV_INVALID_ARG')
  code(t, () => c.findSlot({ pos: 'nope', seqIds: [0] }), 'ERR_KV_INVALID_ARG')
  code(t, () => c.findSlot(5), 'ERR_KV_INVALID_ARG')
  t.is(c.usedCells, 0)
})

test('sequence operations mirror llama.cpp', (t) => {
  const c = make()
  c.prepareBatch(seq(0, 0, 10))
  c.seqCp(0, 1)
  t.is(c.nTokens, 20)
  t.true(c.seqRm(1, 5))
  t.is(c.seqPosMax(1), 4)
  t.is(c.seqCellCount(1), 5)
  c.seqAdd(0, 5, 10, -2)
  t.true(c.hasShift)
  t.is(c.cell(9).pos, 7)
  t.is(c.cell(9).delta, -2)
  c.seqDiv(0, 0, 4, 2)
  t.is(c.cell(3).pos, 1)
  c.seqKeep(1)
  t.is(c.usedCells, 5)
  t.is(c.seqPosMax(0), 0, 'an empty sequence gives 0, as llama.cpp of that era')
  t.is(c.seqCellCount(0), 0)
  t.true(c.seqRm(-1))
  t.is(c.usedCells, 0)
  t.is(c.posMax, -1)
  t.is(c.cellEnd, 0)
})

test('llama.node context shift keeps positions contiguous', (t) => {
  const c = make({ size: 64, nSeqMax: 1 })
  c.prepareBatch(seq(0, 0, 64))
  const nKeep = 4
  const nDiscard = 30
  c.seqRm(0, nKeep + 1, nKeep + nDiscard + 1)
  c.seqAdd(0, nKeep + 1 + nDiscard, 64, -nDiscard)
  t.is(c.seqPosMax(0), 33)
  const v = c.view(1)
  t.is(v.usedCells, 34)
  t.is(v.maxContiguous, 30)
  t.is(v.maxContiguousIdx, nKeep + 1)
})

test('every sequence-id and number error is coded', (t) => {
  const c = make()
  code(t, () => c.seqRm(4), 'ERR_KV_OUT_OF_RANGE')
  code(t, () => c.seqRm(-2), 'ERR_KV_OUT_OF_RANGE')
  code(t, () => c.seqCp(0, 9), 'ERR_KV_OUT_OF_RANGE')
  code(t, () => c.seqKeep(-1), 'ERR_KV_OUT_OF_RANGE')
  code(t, () => c.seqAdd(0, 0, 1, 2 ** 40), 'ERR_KV_OUT_OF_RANGE')
  code(t, () => c.seqDiv(0, 0, 10, 0), 'ERR_KV_INVALID_ARG')
  code(t, () => c.seqPosMax('0'), 'ERR_KV_INVALID_ARG')
  code(t, () => c.seqRm(0, NaN), 'ERR_KV_INVALID_ARG')
  code(t, () => c.cell(64), 'ERR_KV_OUT_OF_RANGE')
  code(t, () => c.readK(2, 0, 1), 'ERR_KV_OUT_OF_RANGE')
  code(t, () => c.rowSize(0, 'x'), 'ERR_KV_INVALID_ARG')
  code(t, () => c.scheduleDefrag(Infinity), 'ERR_KV_INVALID_ARG')
})

for (const type of TYPES) {
  test(`raw rows round trip for ${type}`, (t) => {
    const c = make({ typeK: type, typeV: type, flashAttn: true })
    const row = c.rowSize(0, 'k')
    const data = Buffer.alloc(row * 3, 0)
    for (let i = 0; i < data.length; i++) data[i] = (i * 13) % 251
    // keep scales finite for the quantized types: d is the first f16 of each block
    c.writeK(1, 10, data)
    c.writeV(1, 61, data)
    t.deepEqual(c.readK(1, 10, 3), data)
    t.deepEqual(c.readV(1, 61, 3), data)
    code(t, () => c.writeK(1, 62, data), 'ERR_KV_OUT_OF_RANGE')
    code(t, () => c.writeK(1, 0, data.subarray(1)), 'ERR_KV_INVALID_ARG')
    code(t, () => c.writeK(1, 0, [1, 2, 3]), 'ERR_KV_INVALID_ARG')
  })
}

test('f32 rows convert through the cache type and transposed V', (t) => {
  const c = make()
  const vals = Float32Array.from({ length: 64 }, (_, i) => i / 4 - 8)
  c.writeVF32(0, 62, vals)
  t.deepEqual(c.readVF32(0, 62, 2), vals)
  c.writeKF32(0, 0, vals)
  t.deepEqual(c.readKF32(0, 0, 2), vals)
  code(t, () => c.writeKF32(0, 0, Array.from(vals)), 'ERR_KV_INVALID_ARG')
  code(t, () => c.writeKF32(0, 0, vals.subarray(0, 5)), 'ERR_KV_INVALID_ARG')
})

test('update applies defrag with real data moves', async (t) => {
  const c = make({ size: 16, nSeqMax: 2 })
  for (let i = 0; i < 16; i++) {
    c.findSlot({ pos: [i], seqIds: [i % 2] })
    c.writeKF32(0, i, new Float32Array(32).fill(i))
  }
  c.seqRm(1)
  c.defrag()
  t.true(c.defragPending)
  const report = await c.update()
  t.true(report.defrag.cellsMoved > 0)
  t.false(c.defragPending)
  for (let i = 0; i < 8; i++) {
    const pos = c.cell(i).pos
    t.is(c.readKF32(0, i, 1)[0], pos)
  }
})

test('update rotates K on a pending shift and clears deltas', async (t) => {
  const c = make({ typeK: 'f32' })
  c.findSlot(seq(0, 10, 2))
  const k = Float32Array.from({ length: 64 }, (_, i) => (i % 7) - 3)
  c.writeKF32(0, 0, k)
  c.seqAdd(0, 0, -1, -5)
  const pending = c.updateSync()
  t.true(pending.shiftPending)
  const r = await c.update({ rope: { headDim: 16, nHead: 2, type: 'neox', freqBase: 10000 } })
  t.is(r.shiftedCells, 2)
  t.false(c.hasShift)
  t.is(c.cell(0).delta, 0)
  t.notDeepEqual(c.readKF32(0, 0, 2), k)
  const e = await t.throwsAsync(c.update({ rope: { headDim: 16, nHead: 3 } }).then(() => {
    c.seqAdd(0, 0, -1, 1)
    return c.update({ rope: { headDim: 16, nHead: 3 } })
  }))
  t.is(e.code, 'ERR_KV_INVALID_ARG')
})

test('a cache that cannot shift refuses with ERR_KV_UNSUPPORTED', async (t) => {
  const c = make({ canShift: false })
  c.findSlot(seq(0, 3, 1))
  c.seqAdd(0, 0, -1, -1)
  const e = await t.throwsAsync(c.update({ rope: { headDim: 16, nHead: 2 } }))
  t.is(e.code, 'ERR_KV_UNSUPPORTED')
  t.true(c.hasShift)
})

test('sync calls during an async task throw ERR_KV_BUSY', async (t) => {
  const c = make()
  const p = c.update()
  code(t, () => c.seqRm(0), 'ERR_KV_BUSY')
  code(t, () => c.dispose(), 'ERR_KV_BUSY')
  await p
  t.true(c.seqRm(0))
})

test('an aborted signal rejects the task', async (t) => {
  const c = make()
  const ac = new AbortController()
  ac.abort()
  const e = await t.throwsAsync(c.update({ signal: ac.signal }))
  t.is(e.code, 'ERR_KV_ABORTED')
  t.is(e.name, 'AbortError')
  t.true(c.seqRm(0), 'the cache stays usable')
})

test('dispose frees at once and later use is a clear error', (t) => {
  const c = make()
  c.dispose()
  t.true(c.disposed)
  code(t, () => c.size, 'ERR_KV_DISPOSED')
  code(t, () => c.seqRm(0), 'ERR_KV_DISPOSED')
  t.notThrows(() => c.dispose())
  const d = make()
  d[Symbol.dispose]()
  t.true(d.disposed)
})

test('view lists cells with pos + delta', (t) => {
  const c = make({ size: 8 })
  c.findSlot({ pos: [0, 1, 2], seqIds: [[0, 1, 2, 3], 0, 0] })
  c.seqAdd(0, 2, 3, 4)
  const v = c.view(2)
  t.deepEqual(Array.from(v.pos.slice(0, 3)), [0, 1, 10])
  t.deepEqual(v.seqIds[0], [0, 1])
  t.is(v.tokenCount, 6)
  t.is(v.usedCells, 3)
  t.is(v.maxContiguous, 5)
  t.is(v.maxContiguousIdx, 3)
})

// Why this catches a leak: each round fills a 64 MiB cache (every cell placed, every K and V row written, so
// all its calloc'd pages are resident; the child measures that a live filled cache does cost ~64-72 MiB of RSS)
// and disposes it while keeping the object referenced, so only dispose() itself can give the memory back (no
// finalizer can). The bound is two caches, 128 MiB: an allocator may keep one round's freed memory for the next
// round instead of returning it (glibc does about half the time here: after the first free of an 8 MiB tensor it
// raises its mmap threshold, later tensors come from its heap, and RSS then stays ~72 MiB higher, flat, for all
// the remaining rounds). If dispose() freed nothing, the 50 measured rounds would add 50 x 64 MiB = 3.2 GiB, 25
// times the bound (measured with the dispose() call taken out of the child: +3205 MiB); keeping even one cache
// in ten would add 320 MiB.
test('dispose() returns a filled 64 MiB cache at once: 50 rounds of fill + dispose, objects kept alive, grow RSS by under two caches (128 MiB), not 50', async (t) => {
  const ROUNDS = 50
  const BOUND_MIB = 128
  const r = await runScript(DISPOSE_RSS, [ROUNDS, 5], ['--expose-gc'])
  t.log(
    `one filled cache: ${r.cacheMiB} MiB of tensors, +${r.liveGrowthMiB.toFixed(1)} MiB RSS while live; ` +
      `${r.rounds} rounds after ${r.warmup} warm-up: RSS ${r.rssBeforeMiB.toFixed(1)} -> ${r.rssAfterMiB.toFixed(1)} MiB ` +
      `(growth ${r.growthMiB.toFixed(1)} MiB, highest after a dispose ${r.peakGrowthMiB.toFixed(1)} MiB above the start), ${r.seconds.toFixed(1)} s`,
  )
  t.is(r.cacheMiB, 64)
  t.true(r.liveGrowthMiB > 0.75 * r.cacheMiB, `a live filled cache must be resident for the check to mean anything: +${r.liveGrowthMiB} MiB`)
  t.true(r.rounds * r.liveGrowthMiB > 20 * BOUND_MIB, 'a dispose() that freed nothing would exceed the bound many times over')
  t.true(r.growthMiB < BOUND_MIB, `RSS grew by ${r.growthMiB} MiB over ${r.rounds} disposed caches`)
  t.true(r.peakGrowthMiB < BOUND_MIB, `RSS after a dispose reached ${r.peakGrowthMiB} MiB above the start`)
})

test('without an NVIDIA driver CUDA is reported absent and refused cleanly', (t) => {
  const status = KvCache.cudaStatus()
  if (status.available) {
    t.true(KvCache.cudaDevices().length > 0)
    return
  }
  t.deepEqual(KvCache.cudaDevices(), [])
  t.regex(status.reason, /driver|CUDA|device/i)
  for (const device of ['cuda', 'cuda:0', ['cpu', 'cuda:1']]) {
    const e = code(t, () => make({ device }), 'ERR_KV_CUDA_UNAVAILABLE')
    t.regex(e.message, /CUDA unavailable/)
  }
  code(t, () => make({ device: 'gpu' }), 'ERR_KV_INVALID_ARG')
  code(t, () => make({ device: ['cpu', 'cpu', 'cpu'] }), 'ERR_KV_INVALID_ARG')
  const c = make({ device: ['cpu', 'cpu'] })
  t.deepEqual(c.bytesPerDevice, [{ device: 'cpu', bytes: c.totalBytes }])
})

test('memory that cannot be allocated is ERR_KV_BACKEND, not an abort', (t) => {
  // 2^31 cells x 64 layers x 8192 f16 values: petabytes
  const e = code(t, () => new KvCache({ size: 2 ** 31, nLayer: 64, nEmbdKGqa: 8192 }), 'ERR_KV_BACKEND')
  t.regex(e.message, /allocate|overflow/)
})

// Host tensors are anonymous mappings of their own: whatever caches came before, a new one
// commits no page, dispose() returns its pages, and clear() hands them back too. With heap
// memory (calloc) the second 1 GiB cache came back memset and RSS stayed at 1.1 GiB after
// every dispose, because glibc raises its mmap threshold after the first large free.
test('regression: ten 1 GiB caches made, filled and disposed leave RSS within 64 MiB of the start, an idle cache costs none, and clear(), seqRm and defrag return the pages', async (t) => {
  const r = await runScript(MEMORY_ROUNDS, [10], ['--expose-gc'])
  t.log(`RSS after each dispose (MiB over the start): ${r.afterDispose.map((x) => x.toFixed(0)).join(', ')}`)
  t.log(`create (ms): ${r.createMs.map((x) => x.toFixed(2)).join(', ')}; idle cache +${r.idleGrowth.toFixed(1)} MiB RSS`)
  t.log(`full: +${r.fullRss.toFixed(0)} MiB RSS, residentBytes ${r.fullResident} MiB; after clear(): +${r.clearedRss.toFixed(0)} MiB, residentBytes ${r.clearedResident} MiB`)
  for (const [i, growth] of r.afterDispose.entries()) t.true(growth < 64, `after dispose ${i + 1}: RSS ${growth.toFixed(0)} MiB over the start`)
  t.true(r.idleGrowth < 64, `an idle cache added ${r.idleGrowth.toFixed(0)} MiB of RSS`)
  t.is(r.idleResident, 0)
  // the measurement means something: a full cache does hold its 1 GiB
  t.true(r.fullRss > 900, `a full cache added only ${r.fullRss.toFixed(0)} MiB of RSS`)
  t.is(r.fullResident, r.tensorMiB)
  t.is(r.clearedResident, 0)
  t.true(r.clearedRss < 64, `after clear() RSS is ${r.clearedRss.toFixed(0)} MiB over the start`)
  t.true(r.zeroAfterClear)
  // dropping one of two chats hands its half back, and so does the defrag that moves the other
  t.log(`seqRm of half: ${r.seqRmRss.toFixed(0)} MiB RSS, residentBytes ${r.seqRmResident} MiB; then defrag: ${r.defragRss.toFixed(0)} MiB, residentBytes ${r.defragResident} MiB`)
  t.is(r.seqRmResident, r.tensorMiB / 2)
  t.true(r.seqRmRss < -400, `seqRm of half the cache changed RSS by ${r.seqRmRss.toFixed(0)} MiB`)
  t.is(r.defragResident, r.tensorMiB / 2)
  t.true(r.defragRss < -400, `after the defrag RSS is ${r.defragRss.toFixed(0)} MiB from before seqRm`)
  t.true(r.movedIntact)
})

test('clear() hands tensor memory back unless releaseMemory is false, and reads zeros either way', (t) => {
  const o = { size: 4096, nLayer: 4, nEmbdKGqa: 1024 }
  const rows = Buffer.alloc(4096 * 2048, 9)
  for (const [options, kept] of [[{}, false], [{ releaseMemory: true }, false], [{ releaseMemory: false }, true]]) {
    const c = new KvCache({ ...o, ...options })
    t.is(c.releaseMemory, !kept)
    for (let l = 0; l < 4; l++) c.writeK(l, 0, rows)
    t.is(c.residentBytes, c.totalBytes / 2, 'the written K tensors count')
    c.clear()
    t.is(c.residentBytes, kept ? c.totalBytes / 2 : 0, JSON.stringify(options))
    t.true(c.readK(3, 4095, 1).every((b) => b === 0))
    c.dispose()
  }
  code(t, () => new KvCache({ ...o, releaseMemory: 'no' }), 'ERR_KV_INVALID_ARG')
})

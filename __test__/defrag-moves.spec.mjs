import test from 'ava'
import { Worker } from 'node:worker_threads'
import { createRequire } from 'node:module'

const require = createRequire(import.meta.url)
const { KvCache } = require('../index.js')

// 2 sequences interleaved token by token over `size` cells, then sequence 1 removed: every odd
// cell below size / 2 is a hole, filled from the top, one cell per run
function fragmented(size) {
  const c = new KvCache({ size, nLayer: 2, nEmbdKGqa: 8, nSeqMax: 2, typeK: 'f16', typeV: 'f16' })
  const pos = Int32Array.from({ length: size }, (_, i) => i >> 1)
  const seqIds = Array.from({ length: size }, (_, i) => i & 1)
  c.prepareBatch({ pos, seqIds })
  const k = new Float32Array(size * 8).map((_, i) => Math.floor(i / 8))
  for (let layer = 0; layer < 2; layer++) c.writeKF32(layer, 0, k)
  c.seqRm(1, -1, -1)
  c.defrag()
  return c
}

// the seed's plan for that cache, by source cell: hole 2h + 1 takes cell size - 2 - 2h
function expectedMoves(size) {
  const moves = []
  for (let h = size / 4 - 1; h >= 0; h--) moves.push({ src: size - 2 - 2 * h, dst: 2 * h + 1, len: 1 })
  return moves
}

for (const size of [64, 512, 4096]) {
  // 16 runs take napi-rs objects, 128 and 1,024 the builder in JS: the same plain objects
  test(`a defrag of ${size / 4} single-cell runs reports them as plain { src, dst, len } objects`, (t) => {
    const c = fragmented(size)
    const { defrag } = c.updateSync()
    t.deepEqual(defrag.moves, expectedMoves(size))
    t.is(defrag.cellsMoved, size / 4)
    for (const m of defrag.moves) {
      t.is(Object.getPrototypeOf(m), Object.prototype)
      t.deepEqual(Object.keys(m), ['src', 'dst', 'len'])
    }
    t.deepEqual(Object.getOwnPropertyDescriptor(defrag.moves[0], 'len'), { value: 1, writable: true, enumerable: true, configurable: true })
    // the data moved as reported: cell dst holds what cell src held (its K value, the cell
    // index, is even and below 4,096: exact in f16)
    const k = c.readKF32(0, 0, size / 2)
    for (const m of defrag.moves) t.is(k[m.dst * 8], m.src)
  })
}

test('regression: a program that replaced the global Array still gets its defrag report (the JS builder called `new Array`)', (t) => {
  const c = fragmented(512)
  const saved = globalThis.Array
  let moves
  // synchronous from the replacement to the restore: no other test runs in between
  try {
    globalThis.Array = function Array() {
      throw new Error('replaced')
    }
    moves = c.updateSync().defrag.moves
  } finally {
    globalThis.Array = saved
  }
  t.deepEqual(moves, expectedMoves(512))
})

test('a builder that throws (Array.prototype.push replaced) falls back to napi-rs objects, with no exception left pending', (t) => {
  const c = fragmented(512)
  const saved = Array.prototype.push
  let moves
  try {
    Array.prototype.push = function push() {
      throw new Error('replaced')
    }
    moves = c.updateSync().defrag.moves
  } finally {
    Array.prototype.push = saved
  }
  t.deepEqual(moves, expectedMoves(512))
  // the next call runs normally: the builder's exception was cleared, not left to surface
  t.is(c.seqPosMax(0), 255)
})

test('the async update reports many runs the same way', async (t) => {
  const c = fragmented(512)
  const report = await c.update()
  t.deepEqual(report.defrag.moves, expectedMoves(512))
})

test('a worker thread gets its own moves builder: reports in a worker and here agree', async (t) => {
  const here = fragmented(512).updateSync().defrag.moves
  const code = `
    const { parentPort, workerData } = require('node:worker_threads')
    const { KvCache } = require(workerData.addon)
    const size = 512
    const c = new KvCache({ size, nLayer: 2, nEmbdKGqa: 8, nSeqMax: 2, typeK: 'f16', typeV: 'f16' })
    c.prepareBatch({ pos: Int32Array.from({ length: size }, (_, i) => i >> 1), seqIds: Array.from({ length: size }, (_, i) => i & 1) })
    c.seqRm(1, -1, -1)
    c.defrag()
    parentPort.postMessage([c.updateSync().defrag.moves, c.updateSync().defrag])
  `
  const worker = new Worker(code, { eval: true, workerData: { addon: require.resolve('../index.js') } })
  const [moves, second] = await new Promise((resolve, reject) => {
    worker.once('message', resolve)
    worker.once('error', reject)
  })
  await worker.terminate()
  t.deepEqual(moves, here)
  t.is(second, undefined)
  // the main thread's builder still works after the worker's environment is gone
  t.deepEqual(fragmented(4096).updateSync().defrag.moves, expectedMoves(4096))
})

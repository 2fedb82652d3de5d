// (f) Context awareness: the main thread and two worker threads load the addon and use caches at the same
// time; a third worker is terminated while it holds a cache. The main thread's cache must survive all of it.
import assert from 'node:assert/strict'
import { Worker, isMainThread, parentPort, workerData } from 'node:worker_threads'
import { KvCache } from 'llama-kv-cache'

const N_WORKERS = 2

async function exercise(id) {
  const cache = new KvCache({ size: 64, nLayer: 2, nEmbdKGqa: 16, nSeqMax: 4, typeK: 'f32', typeV: 'f32' })
  for (let step = 0; step < 32; step++) {
    const slot = cache.findSlot({ pos: [step, step], seqIds: [id, (id + 1) % 4] })
    assert.ok(slot, `step ${step} fits`)
    cache.writeKF32(0, slot.head, new Float32Array(16).fill(id * 1000 + step))
  }
  cache.seqRm((id + 1) % 4)
  cache.defrag()
  const report = await cache.update()
  // a state round trip on the threadpool, into a second cache of this thread
  const copy = new KvCache({ size: 64, nLayer: 2, nEmbdKGqa: 16, nSeqMax: 4, typeK: 'f32', typeV: 'f32' })
  const restored = await copy.stateRead(await cache.stateWrite(id), id)
  assert.equal(restored.cells, 32)
  assert.deepEqual(copy.readKF32(0, 5, 1), cache.readKF32(0, 5, 1))
  // after the defrag every cell in use still holds the row this thread wrote for its position
  let ownData = true
  for (let i = 0; i < cache.usedCells; i++) ownData &&= cache.readKF32(0, i, 1)[0] === id * 1000 + cache.cell(i).pos
  return { id, used: cache.usedCells, moved: report.defrag.cellsMoved, ownData }
}

if (isMainThread) {
  // Every thread waits at this barrier until all have created their cache, so the addon is live in three
  // threads at once rather than one after another.
  const arrived = new Int32Array(new SharedArrayBuffer(4))
  const started = (w) =>
    new Promise((resolve, reject) => {
      let result
      w.on('message', (m) => (result = m))
      w.on('error', reject)
      w.on('exit', (code) => (code === 0 ? resolve(result) : reject(new Error(`worker exited with ${code}`))))
    })
  const workers = Array.from({ length: N_WORKERS }, (_, i) => new Worker(new URL(import.meta.url), { workerData: { id: i + 1, arrived } }))
  const done = workers.map(started)
  const mine = new KvCache({ size: 32, nLayer: 1, nEmbdKGqa: 8 })
  Atomics.add(arrived, 0, 1)
  Atomics.notify(arrived, 0)
  const deadline = Date.now() + 20000
  while (Atomics.load(arrived, 0) < N_WORKERS + 1) {
    assert.ok(Date.now() < deadline, 'workers did not reach the barrier')
    await new Promise((r) => setTimeout(r, 5))
  }
  assert.ok(mine.findSlot({ pos: [0, 1], seqIds: [0, 0] }))
  const [mainResult, ...results] = await Promise.all([exercise(0), ...done])
  for (const r of [mainResult, ...results]) {
    assert.equal(r.used, 32, `thread ${r.id} kept its own sequence`)
    assert.ok(r.moved > 0, `thread ${r.id}: the defrag moved cells`)
    assert.ok(r.ownData, `thread ${r.id} reads back its own rows`)
  }

  // A worker torn down while it owns a cache: its environment cleanup must not touch other threads.
  const doomed = new Worker(new URL(import.meta.url), { workerData: { id: 3, hold: true } })
  await new Promise((resolve, reject) => {
    doomed.once('message', resolve)
    doomed.once('error', reject)
  })
  await doomed.terminate()

  assert.equal(mine.usedCells, 2, 'the main thread cache is intact')
  assert.equal(mine.seqRm(0), true)
  mine.dispose()
  console.log(`main thread + ${N_WORKERS} concurrent workers each used their own cache (defrag moved ${[mainResult, ...results].map((r) => r.moved).join('/')} cells); a terminated worker cleaned up`)
} else if (workerData.hold) {
  const cache = new KvCache({ size: 1024, nLayer: 4, nEmbdKGqa: 64 })
  cache.findSlot({ pos: [0, 1, 2], seqIds: [0, 0, 0] })
  parentPort.postMessage('holding')
  setInterval(() => cache.usedCells, 1000)
} else {
  const { id, arrived } = workerData
  const early = new KvCache({ size: 8, nLayer: 1, nEmbdKGqa: 4 })
  Atomics.add(arrived, 0, 1)
  Atomics.notify(arrived, 0)
  while (Atomics.load(arrived, 0) < N_WORKERS + 1) Atomics.wait(arrived, 0, Atomics.load(arrived, 0), 50)
  assert.ok(early.findSlot({ pos: [0], seqIds: [0] }))
  parentPort.postMessage(await exercise(id))
}

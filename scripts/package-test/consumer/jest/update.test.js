// (d) jest, second file in the same process (--runInBand): the addon is initialised a second time.
const { KvCache } = require('llama-kv-cache')

test('async update defragments on the threadpool', async () => {
  const cache = new KvCache({ size: 32, nLayer: 1, nEmbdKGqa: 8, nSeqMax: 2, typeK: 'f32' })
  for (let i = 0; i < 8; i++) {
    cache.findSlot({ pos: [i], seqIds: [i % 2] })
    cache.writeKF32(0, i, new Float32Array(8).fill(i))
  }
  cache.seqRm(1)
  cache.defrag()
  const report = await cache.update()
  expect(report.defrag.cellsMoved).toBeGreaterThan(0)
  for (let i = 0; i < 4; i++) expect(cache.readKF32(0, i, 1)[0]).toBe(cache.cell(i).pos)
})

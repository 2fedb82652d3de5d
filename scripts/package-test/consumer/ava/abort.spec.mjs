// (e) ava, second file: runs concurrently with the first in another worker thread.
import test from 'ava'
import { KvCache } from 'llama-kv-cache'

test('an already aborted signal rejects with ERR_KV_ABORTED', async (t) => {
  const cache = new KvCache({ size: 8, nLayer: 1, nEmbdKGqa: 4 })
  const controller = new AbortController()
  controller.abort()
  const e = await t.throwsAsync(cache.update({ signal: controller.signal }))
  t.is(e.code, 'ERR_KV_ABORTED')
  t.is(e.name, 'AbortError')
  t.true(cache.seqRm(-1))
})

test('state round trip through a sequence file on the threadpool', async (t) => {
  const { mkdtempSync } = await import('node:fs')
  const { tmpdir } = await import('node:os')
  const { join } = await import('node:path')
  const file = join(mkdtempSync(join(tmpdir(), 'kv-ava-')), 'seq.ggsq')
  const a = new KvCache({ size: 16, nLayer: 2, nEmbdKGqa: 8, nSeqMax: 2, typeK: 'f32', typeV: 'f32' })
  a.findSlot({ pos: [0, 1, 2], seqIds: [1, 1, 1] })
  a.writeKF32(1, 2, new Float32Array(8).fill(2.5))
  await a.saveSequenceFile(file, 1, [10, 11, 12])
  const b = new KvCache({ size: 16, nLayer: 2, nEmbdKGqa: 8, nSeqMax: 2, typeK: 'f32', typeV: 'f32' })
  const loaded = await b.loadSequenceFile(file, 0)
  t.deepEqual(loaded.tokens, [10, 11, 12])
  t.is(b.seqPosMax(0), 2)
  t.deepEqual(Array.from(b.readKF32(1, loaded.cells - 1, 1)), new Array(8).fill(2.5))
})

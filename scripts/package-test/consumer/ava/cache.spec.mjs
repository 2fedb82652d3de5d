// (e) ava, in its default worker-thread mode: each test file loads the addon in its own worker.
import test from 'ava'
import { KvCache } from 'llama-kv-cache'

test('findSlot, seqRm and view', (t) => {
  const cache = new KvCache({ size: 16, nLayer: 2, nEmbdKGqa: 8 })
  t.deepEqual(cache.findSlot({ pos: [0, 1, 2], seqIds: [0, 0, 0] }), { head: 0, len: 3, n: 16 })
  t.true(cache.seqRm(0, 2))
  t.is(cache.view().tokenCount, 2)
})

test('a pending async task makes sync calls throw ERR_KV_BUSY', async (t) => {
  const cache = new KvCache({ size: 16, nLayer: 1, nEmbdKGqa: 8 })
  const pending = cache.update()
  t.is(t.throws(() => cache.seqRm(0)).code, 'ERR_KV_BUSY')
  await pending
  t.true(cache.seqRm(0))
})

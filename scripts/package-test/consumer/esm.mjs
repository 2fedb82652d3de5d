// (b) ES module: named import through Node's CommonJS named-export detection, plus the default import.
import assert from 'node:assert/strict'
import binding, { KvCache } from 'llama-kv-cache'
import { reusePrompts } from 'llama-kv-cache/node-llama-cpp'
import { reusePrompts as reuseLlamaNode } from 'llama-kv-cache/llama.node'

assert.equal(KvCache, binding.KvCache)
const cache = new KvCache({ size: 16, nLayer: 1, nEmbdKGqa: 8, nSeqMax: 2 })
assert.deepEqual(cache.findSlot({ pos: [0, 1, 0], seqIds: [0, 0, 1] }), { head: 0, len: 3, n: 16 })
cache.seqCp(0, 1, 0, 1)
assert.deepEqual(cache.cell(0).seqIds, [0, 1])
assert.equal(cache.seqCellCount(1), 2)
cache.seqKeep(1)
assert.equal(cache.usedCells, 2)
const report = await cache.update()
assert.equal(report.shiftPending, false)
assert.throws(() => reusePrompts({}), { code: 'ERR_KV_INVALID_ARG' })
assert.throws(() => reuseLlamaNode({}, { modelPath: 'x.gguf' }), { code: 'ERR_KV_INVALID_ARG' })
console.log(`ESM import ok, ${cache.usedCells} cells in use`)

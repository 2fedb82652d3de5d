// (a) CommonJS: require the installed package and drive one cache through slot search, sequence removal and view.
'use strict'
const assert = require('node:assert/strict')
const path = require('node:path')
const binding = require('llama-kv-cache')
const { KvCache } = binding

assert.equal(typeof KvCache, 'function', 'KvCache is exported')
assert.equal(binding.__napiBindingTarget, 'native', 'the native addon was loaded, not a WASI fallback')

const cache = new KvCache({ size: 32, nLayer: 2, nEmbdKGqa: 16, nSeqMax: 2, typeK: 'f32', typeV: 'f32' })
const slot = cache.findSlot({ pos: [0, 1, 2, 3, 4, 5, 6, 7], seqIds: [0, 0, 0, 0, 0, 0, 0, 0] })
assert.ok(slot, 'the ubatch fits')
assert.equal(slot.head, 0)
assert.equal(slot.len, 8)
assert.equal(cache.usedCells, 8)

const row = Float32Array.from({ length: 16 }, (_, i) => i / 4)
cache.writeKF32(1, 3, row)
assert.deepEqual(cache.readKF32(1, 3, 1), row, 'K rows round-trip')

assert.equal(cache.seqRm(0, 4, -1), true)
assert.equal(cache.usedCells, 4)
assert.equal(cache.seqPosMax(0), 3)

const view = cache.view()
assert.ok(view.pos instanceof Int32Array)
assert.deepEqual(Array.from(view.pos.slice(0, 5)), [0, 1, 2, 3, -1])
assert.deepEqual(view.seqIds.slice(0, 4), [[0], [0], [0], [0]])
assert.equal(view.usedCells, 4)
assert.equal(view.tokenCount, 4)
assert.equal(view.maxContiguous, 28)
assert.equal(view.maxContiguousIdx, 4)

assert.throws(() => cache.findSlot({ pos: [0], seqIds: [7] }), { code: 'ERR_KV_OUT_OF_RANGE' })
cache.dispose()
assert.throws(() => cache.size, { code: 'ERR_KV_DISPOSED' })

// the adapters: subpaths whose peers are optional peer dependencies, not installed here
for (const sub of ['node-llama-cpp', 'llama.node']) {
  const { reusePrompts } = require(`llama-kv-cache/${sub}`)
  assert.equal(typeof reusePrompts, 'function', `llama-kv-cache/${sub} exports reusePrompts`)
  assert.throws(() => reusePrompts(null), { code: 'ERR_KV_INVALID_ARG' })
}

const platformPackage = path.dirname(require.resolve(`${process.argv[2]}/package.json`))
console.log(`loaded from ${path.basename(platformPackage)}`)

// Cells with extensions from JS: the files of M-RoPE models (Qwen2-VL and the like) carry
// `x, y, tok` after each cell's seq id count (llama.cpp 0.1.161's llama_kv_cell_ext). A cache
// built for such a model keeps them (`cellExt`, `cells().ext`), places ubatches with them,
// loads and saves llama.cpp 0.1.161's own files byte for byte, and refuses to shift
// positions; a cache without them refuses such files by name and stays as it was. The prompt
// store keeps them in its blocks and checkpoints. The peer's side (its own files, and ours continuing in it) runs in crates/conformance's cargo tests.
import test from 'ava'
import fs from 'node:fs'
import os from 'node:os'
import path from 'node:path'
import { createRequire } from 'node:module'
import { fileURLToPath } from 'node:url'

const require = createRequire(import.meta.url)
const { KvCache, PromptStore, modelInfoSync, inspectState, convertStateFileSync } = require('../index.js')

const HERE = path.dirname(fileURLToPath(import.meta.url))
const MODELS = path.join(HERE, '..', 'interop', 'models')
const fixture = (name) => path.join(HERE, 'fixtures', 't161', `t161-${name}`)
const sidecar = (name) => JSON.parse(fs.readFileSync(fixture(`${name}.json`), 'utf8'))
const code = (code, message) => ({ code, ...(message ? { message } : {}) })

const tmpDir = fs.mkdtempSync(path.join(os.tmpdir(), 'kv-cell-ext-'))
test.after.always(() => fs.rmSync(tmpDir, { recursive: true, force: true }))
const tmp = (name) => path.join(tmpDir, name)

// the occupied cells: [pos, seq ids, [x, y, tok]]
function occupied(cache) {
  const c = cache.cells()
  const out = []
  for (let i = 0; i < c.pos.length; i++) {
    const ids = [...c.seqIds.subarray(c.seqOffsets[i], c.seqOffsets[i + 1])]
    if (ids.length) out.push([c.pos[i], ids, [...c.ext.subarray(3 * i, 3 * i + 3)]])
  }
  return out
}

const extCache = (o = {}) =>
  new KvCache({ size: 16, nLayer: 2, nEmbdKGqa: 8, nSeqMax: 2, cellExt: 'pos2-tok', mrope: true, ...o })

test('modelInfoSync and fromModel: an M-RoPE model keeps pos2-tok cells and cannot shift', (t) => {
  const info = modelInfoSync(path.join(MODELS, 'qwen2vl.gguf'))
  t.is(info.cellExt, 'pos2-tok')
  t.is(info.rope.type, 'mrope')
  t.is(modelInfoSync(path.join(MODELS, 'llama-h16.gguf')).cellExt, 'none')
  const cache = KvCache.fromModel(path.join(MODELS, 'qwen2vl.gguf'), { nCtx: 32, nSeqMax: 2 })
  t.is(cache.cellExt, 'pos2-tok')
  t.true(cache.mrope)
  t.false(cache.canShift)
  const plain = KvCache.fromModel(path.join(MODELS, 'llama-h16.gguf'), { nCtx: 32 })
  t.is(plain.cellExt, 'none')
  t.false(plain.mrope)
  t.is(plain.cells().ext.length, 0)
})

test("llama.cpp 0.1.161's Qwen2-VL session loads with every cell's extension and saves back byte for byte", (t) => {
  const name = 'qwen2vl-par2'
  const { prompts } = sidecar(name)
  const cache = KvCache.fromModel(path.join(MODELS, 'qwen2vl.gguf'), { nCtx: 32, nSeqMax: 2 })
  cache.loadSessionFileSync(fixture(`${name}.ggsn`))
  const cells = occupied(cache)
  t.is(cells.length, prompts.flat().length)
  for (const [pos, [seq], ext] of cells) t.deepEqual(ext, [pos, pos, prompts[seq][pos]])
  cache.saveSessionFileSync(tmp('back.ggsn'), prompts.flat(), { version: 11, arch: 'qwen2vl' })
  t.true(fs.readFileSync(tmp('back.ggsn')).equals(fs.readFileSync(fixture(`${name}.ggsn`))))
  t.is(inspectState(tmp('back.ggsn')).cellExt, 'pos2-tok')
})

test('an M-RoPE cache refuses seqAdd and seqDiv with ERR_KV_UNSUPPORTED and changes nothing', (t) => {
  const cache = extCache()
  cache.findSlot({ pos: [0, 1, 2], seqIds: [0, 0, 0] })
  const before = occupied(cache)
  t.throws(() => cache.seqAdd(0, 0, -1, 1), code('ERR_KV_UNSUPPORTED', /seqAdd: .*M-RoPE positions/))
  t.throws(() => cache.seqDiv(0, 0, -1, 2), code('ERR_KV_UNSUPPORTED', /seqDiv: .*M-RoPE positions/))
  t.deepEqual(occupied(cache), before)
  t.false(cache.hasShift)
})

test('findSlot records each token\'s extension, or an M-RoPE text position without a token', (t) => {
  const cache = extCache()
  t.truthy(cache.findSlot({ pos: [0, 1], seqIds: [0, 0], ext: Int32Array.of(5, 6, -1, 1, 1, 300) }))
  t.truthy(cache.findSlot({ pos: [4], seqIds: [1], ext: [7, 8, 9] }))
  t.truthy(cache.findSlot({ pos: [2], seqIds: [0] }))
  t.deepEqual(occupied(cache), [
    [0, [0], [5, 6, -1]],
    [1, [0], [1, 1, 300]],
    [4, [1], [7, 8, 9]],
    [2, [0], [2, 2, -1]],
  ])
  // seqCp shares the cells, extensions and all
  cache.seqCp(0, 1, -1, -1)
  t.deepEqual(occupied(cache)[0], [0, [0, 1], [5, 6, -1]])
})

test('the packed forms take the extensions as one Int32Array, as a decode loop refills it', (t) => {
  const cache = extCache()
  const pos = Int32Array.of(0, 1)
  const seqIds = Int32Array.of(0, 0)
  t.is(cache.findSlotPacked(pos, seqIds, null, 1, Int32Array.of(5, 6, -1, 1, 1, 300)), 0)
  t.is(cache.prepareBatchPacked(Int32Array.of(2), Int32Array.of(0), null, 1, { ext: Int32Array.of(9, 9, 301) }), 2)
  // the deprecated trailing argument, for one minor version
  t.is(cache.prepareBatchPacked(Int32Array.of(3), Int32Array.of(0), null, 1, {}, Int32Array.of(7, 7, 302)), 3)
  t.deepEqual(occupied(cache), [
    [0, [0], [5, 6, -1]],
    [1, [0], [1, 1, 300]],
    [2, [0], [9, 9, 301]],
    [3, [0], [7, 7, 302]],
  ])
  t.throws(
    () => cache.prepareBatchPacked(Int32Array.of(4), Int32Array.of(0), null, 1, { ext: Int32Array.of(1, 1, 1) }, Int32Array.of(1, 1, 1)),
    code('ERR_KV_INVALID_ARG', /ext is given twice/),
  )
  t.throws(() => cache.prepareBatchPacked(Int32Array.of(4), Int32Array.of(0), null, 1, { exts: Int32Array.of(1, 1, 1) }), code('ERR_KV_INVALID_ARG', /exts/))
  t.throws(() => cache.findSlotPacked(pos, seqIds, null, 1, Int32Array.of(1, 2, 3)), code('ERR_KV_INVALID_ARG', /1 cell extensions for 2 tokens/))
  t.is(cache.usedCells, 4)
})

test('bad cell extensions are coded errors that name the value, and change nothing', (t) => {
  t.throws(() => extCache({ cellExt: 'pos3' }), code('ERR_KV_INVALID_ARG', /cellExt must be 'none', 'pos2' or 'pos2-tok', got "pos3"/))
  t.throws(
    () => extCache({ recurrent: true, nEmbdKGqa: 0, nEmbdKS: 8, nEmbdVS: 8 }),
    code('ERR_KV_INVALID_ARG', /recurrent cache keeps no cell extensions, got cellExt 'pos2-tok'/),
  )
  const cache = extCache()
  t.throws(() => cache.findSlot({ pos: [0, 1], seqIds: [0, 0], ext: [1, 2, 3, 4] }), code('ERR_KV_INVALID_ARG', /ext holds 4 numbers/))
  t.throws(
    () => cache.findSlot({ pos: [0, 1], seqIds: [0, 0], ext: [1, 2, 3] }),
    code('ERR_KV_INVALID_ARG', /1 cell extensions for 2 tokens/),
  )
  t.throws(() => cache.findSlot({ pos: [0], seqIds: [0], ext: [1, 2, 0.5] }), code('ERR_KV_INVALID_ARG', /ext\[2\]/))
  t.is(cache.usedCells, 0)
  const plain = new KvCache({ size: 16, nLayer: 2, nEmbdKGqa: 8 })
  t.throws(() => plain.findSlot({ pos: [0], seqIds: [0], ext: [1, 2, 3] }), code('ERR_KV_INVALID_ARG', /cellExt 'none'/))
  t.is(plain.usedCells, 0)
})

test('a cache without extensions refuses an M-RoPE file by name and stays as it was', (t) => {
  const info = inspectState(fixture('qwen2vl.ggsq'))
  t.is(info.cellExt, 'pos2-tok')
  t.is(inspectState(fixture('h16-f16.ggsq')).cellExt, 'none')
  const l = info.layers[0]
  const plain = new KvCache({ size: 32, nLayer: info.nLayer, nEmbdKGqa: l.kRowSize / 2, nEmbdVGqa: l.vRowSize / 2, nSeqMax: 2 })
  plain.findSlot({ pos: [0, 1], seqIds: [1, 1] })
  const before = occupied(plain)
  t.throws(() => plain.loadSequenceFileSync(fixture('qwen2vl.ggsq'), 0), code('ERR_KV_UNSUPPORTED', /'pos2-tok' cell extension, and this cache keeps 'none'/))
  t.deepEqual(occupied(plain), before)
})

test('convertStateFileSync keeps the extension in the form of the output version', (t) => {
  convertStateFileSync(fixture('qwen2vl.ggsn'), tmp('v9.ggsn'), { version: 9 })
  t.is(inspectState(tmp('v9.ggsn')).cellExt, 'pos2')
  convertStateFileSync(fixture('qwen2vl.ggsn'), tmp('v11.ggsn'), { version: 11 })
  t.true(fs.readFileSync(tmp('v11.ggsn')).equals(fs.readFileSync(fixture('qwen2vl.ggsn'))))
})

test('the prompt store keeps every cell\'s extension: the peer\'s file written back, a live cache restored', async (t) => {
  const prompt = sidecar('qwen2vl').prompts[0]
  const fromFile = new PromptStore({ model: 'qwen2vl', blockTokens: 16 })
  t.is(fromFile.putFileSync(fixture('qwen2vl.ggsn')).tokens, prompt.length)
  t.is(fromFile.writeFileSync(prompt, tmp('stored.ggsn')), prompt.length)
  const model = () => KvCache.fromModel(path.join(MODELS, 'qwen2vl.gguf'), { nCtx: 32, nSeqMax: 1 })
  const cells = (file) => {
    const c = model()
    c.loadSessionFileSync(file)
    return occupied(c)
  }
  t.deepEqual(cells(tmp('stored.ggsn')), cells(fixture('qwen2vl.ggsn')))

  // a live cache with an image's tokens: 2D positions apart from their text positions
  const cache = model()
  const n = 20
  const ext = Array.from({ length: n }, (_, p) => (p >= 4 && p < 12 ? [4 + ((p - 4) % 4), 4 + Math.floor((p - 4) / 4), -1] : [p, p, 300 + p])).flat()
  cache.findSlot({ pos: Array.from({ length: n }, (_, p) => p), seqIds: Array(n).fill(0), ext })
  const tokens = Array.from({ length: n }, (_, p) => 300 + p)
  const store = new PromptStore({ model: 'qwen2vl-live', blockTokens: 16 })
  t.is((await store.put(cache, 0, tokens)).tokens, n)
  const fresh = model()
  t.is(await store.restore(fresh, 0, tokens), n)
  t.deepEqual(occupied(fresh), occupied(cache))
})

// Model-aware API: modelInfoSync, KvCache.fromModel, checkState and the `model` CLI, against the tiny models of
// interop/make_models.py and the peer fixtures made from them.
import test from 'ava'
import fs from 'node:fs'
import os from 'node:os'
import path from 'node:path'
import { execFileSync, spawnSync } from 'node:child_process'
import { createRequire } from 'node:module'
import { fileURLToPath } from 'node:url'

const require = createRequire(import.meta.url)
const { KvCache, PromptStore, modelInfoSync, checkState, inspectState } = require('../index.js')

const HERE = path.dirname(fileURLToPath(import.meta.url))
const ROOT = path.resolve(HERE, '..')
const MODELS = path.join(ROOT, 'interop', 'models')
const FIXTURES = path.join(HERE, 'fixtures')
const CLI = path.join(ROOT, 'bin', 'llama-kv-cache.js')
const model = (name) => path.join(MODELS, name)

const tmpDir = fs.mkdtempSync(path.join(os.tmpdir(), 'kv-model-'))
test.after.always(() => fs.rmSync(tmpDir, { recursive: true, force: true }))
const tmp = (name) => path.join(tmpDir, name)

const code = (code, message) => ({ code, ...(message ? { message } : {}) })

/**
 * Waits until `file` last changed more than 100 ms ago: the fingerprint cache remembers only a
 * version that old, since a rewrite within one tick of the filesystem's clock can keep every stamp.
 */
async function settled(file) {
  const since = () => Date.now() - Math.max(fs.statSync(file).ctimeMs, fs.statSync(file).mtimeMs)
  while (since() <= 150) await new Promise((resolve) => setTimeout(resolve, 160 - since()))
}

// ---- input errors that need no model --------------------------------------------------------------------

test('modelInfoSync: a missing file is ERR_KV_IO naming the path', (t) => {
  t.throws(() => modelInfoSync(tmp('absent.gguf')), code('ERR_KV_IO', /absent\.gguf/))
})

test('modelInfoSync: a file that is not GGUF is ERR_KV_INVALID_MODEL naming the magic', (t) => {
  fs.writeFileSync(tmp('text.gguf'), 'hello, world')
  t.throws(() => modelInfoSync(tmp('text.gguf')), code('ERR_KV_INVALID_MODEL', /magic/))
})

test('modelInfoSync: a GGUF without general.architecture is ERR_KV_INVALID_MODEL naming the key', (t) => {
  const b = Buffer.alloc(24)
  b.write('GGUF', 0, 'latin1')
  b.writeUInt32LE(3, 4)
  fs.writeFileSync(tmp('empty.gguf'), b)
  t.throws(() => modelInfoSync(tmp('empty.gguf')), code('ERR_KV_INVALID_MODEL', /general\.architecture/))
})

test('modelInfoSync: a metadata count past the end of the file is refused before allocating', (t) => {
  const b = Buffer.alloc(24)
  b.write('GGUF', 0, 'latin1')
  b.writeUInt32LE(3, 4)
  b.writeBigUInt64LE(0xffffffffffffn, 16)
  fs.writeFileSync(tmp('huge.gguf'), b)
  t.throws(() => modelInfoSync(tmp('huge.gguf')), code('ERR_KV_INVALID_MODEL', /metadata count 281474976710655/))
})

test('modelInfoSync, fromModel and checkState: a model path that is not a string is ERR_KV_INVALID_ARG', (t) => {
  t.throws(() => modelInfoSync(42), code('ERR_KV_INVALID_ARG', /ggufPath must be a path string or a Buffer, got number/))
  t.throws(() => KvCache.fromModel(null), code('ERR_KV_INVALID_ARG', /ggufPath must be a path string or a Buffer, got null/))
  t.throws(() => checkState(new Uint8Array(4), {}), code('ERR_KV_INVALID_ARG', /ggufPath must be a path string or a Buffer, got object/))
})

// ---- the tiny models --------------------------------------------------------------------------------------

// No switch turns these off: without the models (written by `npm test`'s set-up) the spec fails with one test
// that names the set-up command, and the model tests are not registered, so nothing passes vacuously.
const MODEL_FILES = ['llama-h16.gguf', 'llama-h32.gguf', 'llama-h64.gguf', 'mamba.gguf', 'gemma3-swa.gguf', 'jamba.gguf', 'qwen2-h64.gguf', 'qwen2-h64-yarn.gguf', 'llama-h64-yarn.gguf', 'lfm2-swa.gguf', 'qwen35.gguf', 'nemotron-h.gguf', 'falcon-h1.gguf', 'deepseek2-mla.gguf']
const missingModels = MODEL_FILES.filter((m) => !fs.existsSync(model(m)))
const unregistered = []
if (missingModels.length > 0) {
  test('model: the tiny models are set up', (t) => {
    t.fail(
      `interop/models lacks ${missingModels.join(', ')}, so ${unregistered.length} model tests cannot run.\n` +
        'Set up from the repository root with:\n  node scripts/setup.mjs\n(`npm test` runs it first, as pretest)',
    )
  })
}
const mtest = missingModels.length === 0 ? test : (title) => unregistered.push(title)

mtest('modelInfoSync reads the geometry of the tiny llama, Mamba, Gemma 3 and Jamba models', (t) => {
  const h16 = modelInfoSync(model('llama-h16.gguf'))
  t.like(h16, { arch: 'llama', nLayer: 2, nEmbdHeadK: 16, nEmbdHeadV: 16, memory: 'unified' })
  t.deepEqual(h16.nEmbdKGqa, [32, 32])
  t.deepEqual(h16.layers[0], { nHead: 4, nHeadKv: 2, nEmbdKGqa: 32, nEmbdVGqa: 32, swa: false, memory: 'attention' })
  t.like(h16.rope, { type: 'norm', nRot: 16, freqBase: 10000, freqScale: 1, scalingType: 'linear' })
  t.is(h16.bytesPerCell.f16, 2 * 2 * 32 * 2)
  t.is(h16.bytesPerCell.q8_0, 2 * 2 * 34)

  const mamba = modelInfoSync(model('mamba.gguf'))
  t.like(mamba, { arch: 'mamba', memory: 'recurrent' })
  t.like(mamba.recurrent, { ssmDConv: 4, ssmDInner: 128, ssmDState: 16, nEmbdKS: 384, nEmbdVS: 2048 })
  t.deepEqual([mamba.nEmbdKGqa, mamba.nEmbdVGqa], [[384, 384], [2048, 2048]])
  t.is(mamba.rope.type, 'none')

  const gemma = modelInfoSync(model('gemma3-swa.gguf'))
  t.like(gemma, { arch: 'gemma3', memory: 'iswa', unsupported: undefined })
  t.like(gemma.swa, { window: 4, pattern: 2, chunked: false, layers: [0] }) // its sliding_window_pattern key (as today's llama.cpp reads it)
  t.is(gemma.rope.type, 'neox')

  const jamba = modelInfoSync(model('jamba.gguf'))
  t.like(jamba, { arch: 'jamba', memory: 'hybrid', unsupported: undefined })
})

// a minimal GGUF v3: u32 and string metadata, f32 tensors of zeros
function gguf(kv, tensors) {
  const parts = []
  const u32 = (n) => { const b = Buffer.alloc(4); b.writeUInt32LE(n); parts.push(b) }
  const u64 = (n) => { const b = Buffer.alloc(8); b.writeBigUInt64LE(BigInt(n)); parts.push(b) }
  const str = (s) => { u64(Buffer.byteLength(s)); parts.push(Buffer.from(s)) }
  parts.push(Buffer.from('GGUF'))
  u32(3)
  u64(tensors.length)
  u64(Object.keys(kv).length)
  for (const [k, v] of Object.entries(kv)) {
    str(k)
    if (typeof v === 'string') { u32(8); str(v) } else { u32(4); u32(v) }
  }
  let offset = 0
  for (const [name, n] of tensors) {
    str(name)
    u32(1)
    u64(n)
    u32(0) // f32
    u64(offset)
    offset += Math.ceil((4 * n) / 32) * 32
  }
  const head = Buffer.concat(parts)
  return Buffer.concat([head, Buffer.alloc((32 - (head.length % 32)) % 32), Buffer.alloc(offset)])
}

mtest('modelInfoSync().shift is the K-shift of update(): norm, NeoX and YaRN as llama.cpp 0.1.161 applies them', async (t) => {
  const h16 = modelInfoSync(model('llama-h16.gguf'))
  t.deepEqual(h16.shift, {
    rope: { headDim: 16, nHead: 2, nRot: 16, type: 'norm', freqBase: 10000, freqScale: 1, extFactor: 0, attnFactor: 1, betaFast: 32, betaSlow: 1, nCtxOrig: 256, dimsOffset: 0 },
    ropeLayers: [],
  })
  t.is(modelInfoSync(model('qwen2-h64.gguf')).shift.rope.type, 'neox')
  t.like(modelInfoSync(model('qwen2-h64-yarn.gguf')).shift.rope, { type: 'neox', freqScale: 0.25, extFactor: 1, attnFactor: 1, nCtxOrig: 64 })
  t.like(modelInfoSync(model('llama-h64-yarn.gguf')).shift.rope, { type: 'norm', extFactor: 1, attnFactor: 1 - 2 ** -24, nCtxOrig: 64 })
  t.is(modelInfoSync(model('mamba.gguf')).shift, undefined, 'no RoPE')
  // a model whose RoPE needs its rope_freqs tensor: modelInfoSync does not read tensor data
  const llama = {
    'general.architecture': 'llama',
    'llama.context_length': 4096,
    'llama.embedding_length': 64,
    'llama.block_count': 2,
    'llama.attention.head_count': 4,
  }
  fs.writeFileSync(tmp('plain.gguf'), gguf(llama, []))
  fs.writeFileSync(tmp('freqs.gguf'), gguf(llama, [['rope_freqs.weight', 8]]))
  t.is(modelInfoSync(tmp('plain.gguf')).shift.rope.headDim, 16)
  const freqs = modelInfoSync(tmp('freqs.gguf'))
  t.deepEqual(freqs.rope.factorTensors, ['rope_freqs.weight'])
  t.is(freqs.shift, undefined)
  // the options work as they are
  const c = new KvCache({ size: 8, nLayer: 2, nEmbdKGqa: 32 })
  c.prepareBatch({ pos: [0, 1, 2], seqIds: [0, 0, 0] })
  c.writeKF32(0, 0, new Float32Array(3 * 32).fill(1))
  c.seqAdd(0, 1, -1, 5)
  t.is((await c.update(h16.shift)).shiftedCells, 2) // the cells that moved
  t.notDeepEqual(c.readKF32(0, 1, 1), new Float32Array(32).fill(1))
})

mtest('modelInfoSync reads the header only, and the fingerprint covers header and data size, or the whole file', async (t) => {
  const file = model('llama-h32.gguf')
  const a = modelInfoSync(file)
  t.true(a.bytesRead <= 64 * 1024 && a.bytesRead < a.fileSize, `read ${a.bytesRead} of ${a.fileSize}`)
  t.regex(a.fingerprint, /^blake3:[0-9a-f]{64}$/)
  t.is(modelInfoSync(file).fingerprint, a.fingerprint, 'stable')
  t.not(modelInfoSync(model('llama-h16.gguf')).fingerprint, a.fingerprint)

  // another weight: same header fingerprint, another file fingerprint
  const bytes = fs.readFileSync(file)
  const copy = tmp('h32-weight.gguf')
  bytes[bytes.length - 1] ^= 0xff
  fs.writeFileSync(copy, bytes)
  t.is(modelInfoSync(copy).fingerprint, a.fingerprint)
  const whole = modelInfoSync(copy, { hashFile: true }) // a new file version: read whole
  t.regex(whole.fingerprint, /^blake3-file:[0-9a-f]{64}$/)
  t.is(whole.bytesRead >= whole.fileSize, true)
  t.true(modelInfoSync(copy, { hashFile: true }).bytesRead >= whole.fileSize, 'a file changed this instant is not remembered')
  await settled(copy)
  t.is(modelInfoSync(copy, { hashFile: true }).bytesRead >= whole.fileSize, true) // hashed once it settled, and remembered
  const again = modelInfoSync(copy, { hashFile: true }) // remembered for this version
  t.is(again.fingerprint, whole.fingerprint)
  t.true(again.bytesRead < again.fileSize, `read ${again.bytesRead}`)
  t.not(modelInfoSync(file, { hashFile: true }).fingerprint, whole.fingerprint)

  // another header (general.name's last byte): another fingerprint
  const renamed = fs.readFileSync(file)
  const at = renamed.indexOf('llama-h32', 0, 'latin1')
  renamed[at + 8] = '9'.charCodeAt(0)
  fs.writeFileSync(tmp('h39.gguf'), renamed)
  t.not(modelInfoSync(tmp('h39.gguf')).fingerprint, a.fingerprint)
})

mtest('modelInfoSync: every truncation of a real model is ERR_KV_INVALID_MODEL', (t) => {
  const bytes = fs.readFileSync(model('llama-h16.gguf'))
  const header = modelInfoSync(model('llama-h16.gguf')).headerSize
  const cuts = [0, 3, 4, 20, 24, 100, 1000, header - 1, header, header + 1, bytes.length - 1]
  for (const n of cuts) {
    fs.writeFileSync(tmp('cut.gguf'), bytes.subarray(0, n))
    t.throws(() => modelInfoSync(tmp('cut.gguf')), code('ERR_KV_INVALID_MODEL'), `cut at ${n}`)
  }
})

// ---- fromModel and checkState against the peer fixtures ------------------------------------------------

const sidecar = (name) => JSON.parse(fs.readFileSync(path.join(FIXTURES, `${name}.json`), 'utf8'))
const FIXTURE_NAMES = fs.readdirSync(FIXTURES).filter((f) => /\.gg(sn|sq)$/.test(f)).sort()
const T161 = path.join(FIXTURES, 't161')
// committed fixtures: a missing directory throws here (the spec fails) rather than registering no tests
const T161_NAMES = fs.readdirSync(T161).filter((f) => /\.gg(sn|sq)$/.test(f)).sort()
const ALL_MODELS = MODEL_FILES

/**
 * Whether nothing a state file records can tell model `a` from model `b`: the same memory, the same
 * sliding-window layers and per-layer K/V widths, (for a rotated state) the same head size, and (for a
 * session that names its architecture) the same architecture. llama.cpp itself loads such a state into
 * either model (llama-h32 and llama-h64 both have 64-wide K rows; llama-h64 and qwen2-h64 the same cache).
 */
function indistinguishable(a, b, file) {
  const [x, y] = [modelInfoSync(model(a)), modelInfoSync(model(b))]
  const state = inspectState(file)
  const rotated = (state.nRotK ?? 0) > 0
  return x.memory === y.memory &&
    JSON.stringify([x.nEmbdKGqa, x.nEmbdVGqa, x.layers.map((l) => l.swa)]) === JSON.stringify([y.nEmbdKGqa, y.nEmbdVGqa, y.layers.map((l) => l.swa)]) &&
    (!rotated || x.nEmbdHeadK === y.nEmbdHeadK) &&
    (state.arch === undefined || x.arch === y.arch)
}

/** checkState: the fixture fits its own model, and every other model either says why not, or cannot be told apart. */
function checkAgainstModels(t, file, own) {
  t.deepEqual(checkState(file, model(own)), { fits: true, reasons: [] })
  t.deepEqual(checkState(fs.readFileSync(file), model(own)), { fits: true, reasons: [] }, 'bytes too')
  for (const other of ALL_MODELS.filter((m) => m !== own)) {
    const fit = checkState(file, model(other))
    if (indistinguishable(own, other, file)) {
      t.true(fit.fits, `${other} has ${own}'s cache geometry: ${JSON.stringify(fit.reasons)}`)
      continue
    }
    t.false(fit.fits, `${path.basename(file)} with ${other}`)
    t.true(fit.reasons.length > 0)
    for (const r of fit.reasons) {
      t.true(r.message.includes(r.field) && r.message.includes(r.state) && r.message.includes(r.model), JSON.stringify(r))
    }
  }
}

for (const name of FIXTURE_NAMES) {
  mtest(`fromModel builds a cache that loads ${name}, and checkState says it fits its model and why not the others`, (t) => {
    const side = sidecar(name)
    const file = path.join(FIXTURES, name)
    const info = inspectState(file)
    const c = KvCache.fromModel(model(side.model), {
      nCtx: side.n_ctx,
      nSeqMax: Math.max(side.n_seq_max, info.streams.length),
      typeK: info.layers[0].kType,
      typeV: info.layers[0].vType,
      flashAttn: info.vTrans === false,
    })
    const loaded = info.format === 'session' ? c.loadSessionFileSync(file) : c.loadSequenceFileSync(file, 0)
    t.deepEqual(loaded.tokens, info.tokens)
    t.is(c.usedCells, info.streams.reduce((n, s) => n + s.cellCount, 0))
    c.dispose()
    checkAgainstModels(t, file, side.model)
  })
}

for (const name of T161_NAMES) {
  mtest(`checkState: llama.cpp 0.1.161's ${name} fits its model (iSWA and hybrid part by part) and says why not the others`, (t) => {
    const side = JSON.parse(fs.readFileSync(path.join(T161, name.replace(/(\.post)?\.gg(sn|sq)$/, '.json')), 'utf8'))
    checkAgainstModels(t, path.join(T161, name), side.model)
  })
}

mtest('checkState compares iSWA states part by part and rotated states by head size', (t) => {
  const swa = checkState(path.join(T161, 't161-gemma3-swa.ggsn'), model('llama-h16.gguf'))
  t.like(swa.reasons.find((r) => r.field === 'memory'), { state: 'iswa', model: 'unified' })
  t.true(swa.reasons.some((r) => r.field.startsWith('swa.')), JSON.stringify(swa.reasons))
  const rot = checkState(path.join(T161, 't161-h64-q8_0-fa.ggsn'), model('llama-h32.gguf'))
  t.like(rot.reasons.find((r) => r.field === 'nRotK'), { state: '64', model: '32' })
  const hybrid = checkState(path.join(T161, 't161-jamba.ggsn'), model('mamba.gguf'))
  t.like(hybrid.reasons.find((r) => r.field === 'memory'), { state: 'hybrid', model: 'recurrent' })
})

mtest('checkState names the field and both values', (t) => {
  const fit = checkState(path.join(FIXTURES, 'ln-h32-f16.ggsn'), model('llama-h16.gguf'))
  t.deepEqual(fit.reasons[0], {
    field: 'layers[0].kWidth',
    state: '64',
    model: '32',
    message: 'layers[0].kWidth: the state has 64, the model has 32 (K row widths differ)',
  })
  const mamba = checkState(path.join(FIXTURES, 'ln-mamba.ggsn'), model('llama-h16.gguf'))
  t.like(mamba.reasons.find((r) => r.field === 'arch'), { state: 'mamba', model: 'llama' })
  t.like(mamba.reasons.find((r) => r.field === 'layers[0].vWidth'), { state: '2048', model: '32' })
  const gemma = checkState(path.join(FIXTURES, 'ln-h16-f16.ggsn'), model('gemma3-swa.gguf'))
  t.like(gemma.reasons.find((r) => r.field === 'memory'), { state: 'unified', model: 'iswa' })
  // a seed-era (stream-less) state of a one-cache llama.cpp can fit a recurrent model whole
  t.deepEqual(checkState(path.join(FIXTURES, 'nlc-mamba.ggsq'), model('mamba.gguf')), { fits: true, reasons: [] })
})

mtest('checkState: a state that does not parse is ERR_KV_INVALID_STATE, a bad model ERR_KV_INVALID_MODEL', (t) => {
  t.throws(() => checkState(new Uint8Array([1, 2, 3]), model('llama-h16.gguf')), code('ERR_KV_INVALID_STATE'))
  fs.writeFileSync(tmp('bad.gguf'), 'GGUF')
  t.throws(() => checkState(path.join(FIXTURES, 'ln-h16-f16.ggsn'), tmp('bad.gguf')), code('ERR_KV_INVALID_MODEL'))
})

mtest('fromModel refuses bad options with coded errors', (t) => {
  t.throws(() => KvCache.fromModel(model('gemma3-swa.gguf'), { device: 'cpu' }), code('ERR_KV_UNSUPPORTED', /iSWA and hybrid memories, and a cache of a stream per sequence, live in host memory/))
  t.throws(() => KvCache.fromModel(model('gemma3-swa.gguf'), { nUbatch: -1 }), code('ERR_KV_OUT_OF_RANGE', /nUbatch/))
  t.throws(() => KvCache.fromModel(model('jamba.gguf'), { device: 'cpu' }), code('ERR_KV_UNSUPPORTED', /host memory/))
  t.throws(() => KvCache.fromModel(model('llama-h16.gguf'), { typeK: 'q9' }), code('ERR_KV_INVALID_ARG', /q9/))
  t.throws(() => KvCache.fromModel(model('llama-h16.gguf'), { nSeqMax: 0 }), code('ERR_KV_OUT_OF_RANGE', /nSeqMax/))
  t.throws(() => KvCache.fromModel(model('llama-h16.gguf'), { typeV: 'q8_0' }), code('ERR_KV_INVALID_ARG', /flash attention/))
  t.throws(() => KvCache.fromModel(model('llama-h16.gguf'), { nCtx: 1.5 }), code('ERR_KV_INVALID_ARG', /nCtx/))
})

mtest('fromModel pads the context like llama.cpp 0.1.161, defaults to the trained one, and gives Mamba a cell per sequence', (t) => {
  // 256 with or without flash attention (the seed padded to 32 without)
  const a = KvCache.fromModel(model('llama-h16.gguf'), { nCtx: 100 })
  t.like(a, { size: 256, nLayer: 2, vTrans: true })
  t.is(a.rowSize(1, 'k'), 64)
  const b = KvCache.fromModel(model('llama-h16.gguf'), { nCtx: 100, flashAttn: true })
  t.is(b.size, 256)
  t.is(KvCache.fromModel(model('llama-h16.gguf')).size, modelInfoSync(model('llama-h16.gguf')).nCtxTrain)
  const m = KvCache.fromModel(model('mamba.gguf'), { nCtx: 4096, nSeqMax: 3, typeK: 'f32', typeV: 'f32' })
  t.like(m, { size: 3, recurrent: true, canShift: false })
  t.is(m.rowSize(0, 'v'), 2048 * 4)
})

mtest('fromModel remembers the RoPE: update() shifts K exactly as update({ rope }) from the GGUF does', async (t) => {
  const info = modelInfoSync(model('llama-h32.gguf'))
  const rope = { headDim: info.nEmbdHeadK, nHead: info.layers[0].nHeadKv, nRot: info.rope.nRot, type: info.rope.type, freqBase: info.rope.freqBase }
  const made = () => {
    const c = KvCache.fromModel(model('llama-h32.gguf'), { nCtx: 64 })
    c.prepareBatch({ pos: [0, 1, 2, 3, 4, 5], seqIds: [0, 0, 0, 0, 0, 0] })
    const k = new Float32Array(6 * 64).map((_, i) => Math.sin(i * 0.37))
    for (const layer of [0, 1]) c.writeKF32(layer, 0, k)
    c.seqRm(0, 0, 2)
    c.seqAdd(0, 2, -1, -2)
    return c
  }
  const a = made()
  const b = made()
  const ra = await a.update()
  const rb = b.updateSync({ rope })
  t.like(ra, { shiftedCells: 4, shiftPending: false })
  t.like(rb, { shiftedCells: 4, shiftPending: false })
  for (const layer of [0, 1]) t.deepEqual(a.readK(layer, 0, 6), b.readK(layer, 0, 6))
  t.notDeepEqual(a.readKF32(0, 2, 1), new Float32Array(64).map((_, i) => Math.sin((2 * 64 + i) * 0.37)), 'K was rotated')

  // a plain cache still needs `rope`
  const plain = new KvCache({ size: 64, nLayer: 2, nEmbdKGqa: 64 })
  plain.prepareBatch({ pos: [0, 1], seqIds: [0, 0] })
  plain.seqAdd(0, 0, -1, 3)
  t.true(plain.updateSync().shiftPending)
})

// ---- PromptStore({ model: ggufPath }) --------------------------------------------------------------

mtest('PromptStore with model: a GGUF path keys its blocks by the hash of the whole file', async (t) => {
  const dir = tmp('store')
  const file = model('llama-h16.gguf')
  const tokens = Array.from({ length: 64 }, (_, i) => 300 + i)
  const cache = KvCache.fromModel(file, { nCtx: 64 })
  cache.prepareBatch({ pos: tokens.map((_, i) => i), seqIds: tokens.map(() => 0) })
  for (const layer of [0, 1]) cache.writeKF32(layer, 0, new Float32Array(64 * 32).map((_, i) => i / 7))
  const byPath = new PromptStore({ model: file, path: dir, blockTokens: 16 })
  t.like(await byPath.put(cache, 0, tokens), { tokens: 64, blocksWritten: 4 })
  t.is(byPath.lookupSync(tokens), 64)
  // the same store opened with the fingerprint itself, or with a copy of the file, finds the blocks
  const copy = tmp('copy.gguf')
  fs.copyFileSync(file, copy)
  t.is(new PromptStore({ model: modelInfoSync(file, { hashFile: true }).fingerprint, path: dir, blockTokens: 16 }).lookupSync(tokens), 64)
  t.is(new PromptStore({ model: copy, path: dir, blockTokens: 16 }).lookupSync(tokens), 64)
  // another model, or the path string taken literally, does not
  t.is(new PromptStore({ model: model('llama-h32.gguf'), path: dir, blockTokens: 16 }).lookupSync(tokens), 0)
  t.is(new PromptStore({ model: 'llama-h16', path: dir, blockTokens: 16 }).lookupSync(tokens), 0)
})

test('PromptStore with model: a *.gguf path that cannot be read is ERR_KV_IO, a broken one ERR_KV_INVALID_MODEL', (t) => {
  t.throws(() => new PromptStore({ model: tmp('absent.gguf') }), code('ERR_KV_IO', /absent\.gguf/))
  fs.writeFileSync(tmp('broken.gguf'), 'GGUF\x03')
  t.throws(() => new PromptStore({ model: tmp('broken.gguf') }), code('ERR_KV_INVALID_MODEL'))
  t.is(new PromptStore({ model: 'sha256:abc' }).blockTokens > 0, true, 'other strings are identities as they are')
})

// A store opened for a GGUF file checks every state put into it against that model (issue 37: an
// empty store of model B took model A's file, was bound to A's shape, and then refused B's own).
const WRONG_MODEL_FILES = [
  ['t161-h16-f16.ggsq', 'llama-h32.gguf', 't161-h32-q8_0-fa.ggsq', /layers\[0\]\.kWidth: the state has 32, the model has 64/],
  ['t161-gemma3-swa.ggsq', 'jamba.gguf', 't161-jamba.ggsq', /memory: the state has iswa, the model has hybrid/],
  ['t161-jamba.ggsq', 'mamba.gguf', 't161-mamba.ggsq', /memory: the state has hybrid, the model has recurrent/],
  ['t161-gemma3-swa.ggsq', 'llama-h64.gguf', 't161-h64-f16-fa.ggsq', /memory: the state has iswa, the model has unified/],
]
for (const [file, target, own, reason] of WRONG_MODEL_FILES) {
  mtest(`putFile_of_another_models_state: ${file} into an empty store of ${target} is refused, and the model's own file is taken`, async (t) => {
    const dir = tmp(`wrong-${target}-${file}`)
    const store = new PromptStore({ model: model(target), path: dir, blockTokens: 16 })
    const e = await t.throwsAsync(store.putFile(path.join(T161, file)), { code: 'ERR_KV_STORE_GEOMETRY' })
    t.regex(e.message, reason)
    t.regex(e.message, new RegExp(target.replace('.', '\\.')))
    t.throws(() => store.putFileSync(path.join(T161, file)), { code: 'ERR_KV_STORE_GEOMETRY' })
    t.like(store.lookupDetailSync([1, 2, 3]), { tokens: 0, reason: 'no-model' }, 'the refused file bound nothing')
    const put = await store.putFile(path.join(T161, own))
    t.true(put.tokens > 0)
  })
}

mtest('put_of_a_cache_of_another_model: a live cache that does not fit the store\'s model is refused before it binds the store', async (t) => {
  const tokens = Array.from({ length: 32 }, (_, i) => 300 + i)
  const fill = (cache) => cache.place([{ pos: tokens.map((_, i) => i), seqIds: tokens.map(() => 0) }])
  const h16 = KvCache.fromModel(model('llama-h16.gguf'), { nCtx: 64 })
  fill(h16)
  const store = new PromptStore({ model: model('llama-h32.gguf'), blockTokens: 16 })
  const e = await t.throwsAsync(store.put(h16, 0, tokens), { code: 'ERR_KV_STORE_GEOMETRY' })
  t.regex(e.message, /kWidth: the state has 32, the model has 64/)
  const gemma = KvCache.fromModel(model('gemma3-swa.gguf'), { nCtx: 256 })
  fill(gemma)
  t.throws(() => store.putSync(gemma, 0, tokens), { code: 'ERR_KV_STORE_GEOMETRY', message: /memory: the state has iswa, the model has unified/ })
  const h32 = KvCache.fromModel(model('llama-h32.gguf'), { nCtx: 64 })
  fill(h32)
  t.like(await store.put(h32, 0, tokens), { tokens: 32, blocksWritten: 2 })
})

mtest('a_model_swapped_in_place_is_a_miss: rewritten with its old size and mtime put back, the store hashes it again', async (t) => {
  const file = tmp('swapped.gguf')
  const original = fs.readFileSync(model('llama-h16.gguf'))
  fs.writeFileSync(file, original)
  await settled(file) // old enough for its hash to be remembered, as a model on disk is
  const dir = tmp('swap-store')
  const tokens = Array.from({ length: 32 }, (_, i) => 300 + i)
  const cache = KvCache.fromModel(file, { nCtx: 64 })
  cache.prepareBatch({ pos: tokens.map((_, i) => i), seqIds: tokens.map(() => 0) })
  t.like(await new PromptStore({ model: file, path: dir, blockTokens: 16 }).put(cache, 0, tokens), { blocksWritten: 2 })
  t.is(modelInfoSync(file, { hashFile: true }).bytesRead < original.length, true, 'the hash is remembered')
  // another model's weights of the same size, written into the same file, its mtime put back
  // as `touch -r` does (to the nanosecond)
  const stamp = tmp('swapped.stamp')
  execFileSync('touch', ['-r', file, stamp])
  const swapped = Buffer.from(original)
  swapped[swapped.length - 3] ^= 1
  const fd = fs.openSync(file, 'r+')
  fs.writeSync(fd, swapped, 0, swapped.length, 0)
  fs.closeSync(fd)
  execFileSync('touch', ['-r', stamp, file])
  const [before, after] = [stamp, file].map((f) => fs.statSync(f, { bigint: true }))
  t.is(after.mtimeNs, before.mtimeNs)
  t.is(after.size, BigInt(original.length))
  t.is(new PromptStore({ model: file, path: dir, blockTokens: 16 }).lookupSync(tokens), 0)
})

mtest('lookupDetail tells nothing stored from blocks without the checkpoint a memory needs', async (t) => {
  const tokens = Array.from({ length: 40 }, (_, i) => 300 + i)
  // a plain cache: full blocks restore, and a prompt ending inside a block gets a checkpoint
  const plain = new PromptStore({ model: model('llama-h32.gguf'), blockTokens: 16 })
  t.deepEqual(await plain.lookupDetail(tokens), { tokens: 0, blocks: 0, reason: 'no-model' })
  const h32 = KvCache.fromModel(model('llama-h32.gguf'), { nCtx: 64 })
  h32.prepareBatch({ pos: tokens.map((_, i) => i), seqIds: tokens.map(() => 0) })
  t.like(await plain.put(h32, 0, tokens), { tokens: 40, checkpointsWritten: 1 })
  t.deepEqual(plain.lookupDetailSync(tokens), { tokens: 40, blocks: 2, checkpointAt: 40, reason: 'complete' })
  t.deepEqual(plain.lookupDetailSync([...tokens.slice(0, 36), 1, 2, 3]), { tokens: 32, blocks: 2, reason: 'prefix-ends' })
  t.deepEqual(plain.lookupDetailSync([9, ...tokens]), { tokens: 0, blocks: 0, reason: 'no-blocks' })
  // a hybrid memory needs its recurrent state where the restore point is: the attention blocks
  // of a prompt diverging inside the third block are there, but no checkpoint at 32
  const hybrid = new PromptStore({ model: model('jamba.gguf'), blockTokens: 16 })
  const jamba = KvCache.fromModel(model('jamba.gguf'), { nCtx: 256 })
  jamba.place([{ pos: tokens.map((_, i) => i), seqIds: [0], nSeqTokens: tokens.length }])
  t.like(await hybrid.put(jamba, 0, tokens), { tokens: 40, blocksWritten: 2, checkpointsWritten: 1 })
  t.deepEqual(hybrid.lookupDetailSync(tokens), { tokens: 40, blocks: 2, checkpointAt: 40, reason: 'complete' })
  const diverged = [...tokens.slice(0, 36), 1, 2, 3]
  t.deepEqual(hybrid.lookupDetailSync(diverged), { tokens: 0, blocks: 2, reason: 'no-checkpoint' })
  t.is(hybrid.lookupSync(diverged), 0)
})

// ---- CLI ----------------------------------------------------------------------------------------------

const cli = (...args) => spawnSync(process.execPath, [CLI, ...args], { encoding: 'utf8' })

mtest('CLI model: geometry and a KV memory table at 4k/8k/32k/128k and the trained context', (t) => {
  const r = cli('model', model('llama-h32.gguf'), '--n-seq-max', '2')
  t.is(r.status, 0, r.stderr)
  t.regex(r.stdout, /arch +llama \(llama-h32\), 2 layers/)
  t.regex(r.stdout, /KV heads 2, K width 64, V width 64/)
  t.regex(r.stdout, /rope +norm, n_rot 32, base 10000/)
  // f16: 2 layers x (64 + 64) x 2 bytes = 512 B per cell; 4096 cells = 2 MiB, 2 sequences = 4 MiB
  t.regex(r.stdout, /4096 +2\.00 MiB \/ 4\.00 MiB/)
  t.regex(r.stdout, /131072 +64\.0 MiB \/ 128 MiB/)
  t.regex(r.stdout, /256 .*\(trained\)/)

  const json = JSON.parse(execFileSync(process.execPath, [CLI, 'model', model('mamba.gguf'), '--json'], { encoding: 'utf8' }))
  t.is(json.memory, 'recurrent')
  t.is(json.nSeqMax, 4)
  const row = json.kvMemory.find((x) => x.nCtx === 131072)
  const state = KvCache.planMemory(model('mamba.gguf')).bytes
  t.deepEqual(row.f16, { one: state, all: 4 * state }, 'a recurrent state does not grow with the context')
  t.deepEqual(row.q4_0, row.f16, 'and is f32 whatever the K/V types')
})

mtest('regression: CLI model printed a unified cache\'s bytes for every model (an iSWA window cache as large as the context, a hybrid without its recurrent state, V of latent attention)', (t) => {
  for (const name of ['gemma3-swa.gguf', 'jamba.gguf', 'deepseek2-mla.gguf', 'lfm2-swa.gguf']) {
    const json = JSON.parse(execFileSync(process.execPath, [CLI, 'model', model(name), '--json', '--n-seq-max', '3'], { encoding: 'utf8' }))
    for (const row of json.kvMemory) {
      const plan = (nCtx, nSeqMax) => KvCache.planMemory(model(name), { nCtx, nSeqMax, flashAttn: true }).bytes
      t.deepEqual(row.f16, { one: plan(row.nCtx, 1), all: plan(3 * row.nCtx, 3) }, `${name} ${row.nCtx}`)
    }
  }
  // gemma3's window cache is the window and a ubatch, not the context: 1 MiB base + 192 KiB window at 4,096
  t.regex(cli('model', model('gemma3-swa.gguf')).stdout, /4096 +1\.19 MiB/)
  // heads of 16 take no q8_0 with flash attention: n/a, as llama.cpp 0.1.161 refuses that context
  t.regex(cli('model', model('jamba.gguf')).stdout, /4096 +522 KiB \/ [\d.]+ MiB +n\/a +n\/a/)
})

mtest('CLI inspect --model adds the fit verdict and exits 3 when the state does not fit', (t) => {
  const file = path.join(FIXTURES, 'ln-h16-f16.ggsn')
  const ok = cli('inspect', file, '--model', model('llama-h16.gguf'))
  t.is(ok.status, 0, ok.stderr)
  t.regex(ok.stdout, /fits +yes/)
  const bad = cli('inspect', file, '--model', model('llama-h32.gguf'), '--json')
  t.is(bad.status, 3)
  const json = JSON.parse(bad.stdout)
  t.false(json.fits)
  t.is(json.reasons[0].field, 'layers[0].kWidth')
  const missing = cli('model')
  t.is(missing.status, 2)
  t.regex(missing.stderr, /model needs a GGUF file/)
  const notGguf = cli('model', file)
  t.is(notGguf.status, 1)
  t.regex(notGguf.stderr, /ERR_KV_INVALID_MODEL/)
})

// ---- live iSWA memories (llama.cpp 0.1.161's llama_kv_cache_iswa) ----------------------------------------
// The cell-by-cell differential against 0.1.161 itself runs in crates/conformance (tests/live_caches.rs); these
// check the JS face: kind, parts, placement, layer routing, state I/O, shifts and refusals.

const gemma = (o = {}) => KvCache.fromModel(model('gemma3-swa.gguf'), { nCtx: 512, nSeqMax: 2, nUbatch: 16, ...o })
const ubatch = (seq, p0, n) => ({ pos: Array.from({ length: n }, (_, k) => p0 + k), seqIds: Array(n).fill(seq) })

mtest('fromModel gives a sliding-window model an iSWA memory sized as llama.cpp 0.1.161 sizes it', (t) => {
  const c = gemma()
  t.is(c.kind, 'iswa')
  t.is(c.nLayer, 2)
  const [base, swa] = c.parts
  // layer 1 is full attention, layer 0 uses the window of 4; the window cache holds 4 per sequence plus a
  // ubatch, padded to 256
  t.like(base, { role: 'base', layers: [1], size: 512, nStream: 1, nSwa: 0, swaType: 'none', typeK: 'f16' })
  t.like(swa, { role: 'swa', layers: [0], size: 256, nStream: 1, nSwa: 4, swaType: 'standard' })
  t.false(c.canShift)
  t.is(gemma({ swaFull: true }).parts[1].size, 512)
  t.true(gemma({ swaFull: true }).canShift)
  // one stream per sequence: nCtx / nSeqMax cells each, padded to 256
  t.deepEqual(gemma({ kvUnified: false }).parts.map((p) => [p.size, p.nStream]), [[256, 2], [256, 2]])
  t.like(KvCache.fromModel(model('gemma3-swa.gguf'), { typeK: 'q8_0', typeV: 'q8_0', flashAttn: true }).parts[0], { nRotK: 64, nRotV: 64 })
  t.is(KvCache.fromModel(model('llama-h16.gguf')).kind, 'kv')
  t.is(KvCache.fromModel(model('mamba.gguf')).kind, 'recurrent')
})

mtest('fromModel of Mamba removes as llama.cpp 0.1.161 does, a recurrent cache of the seed as the seed does', (t) => {
  const info = modelInfoSync(model('mamba.gguf'))
  const today = KvCache.fromModel(model('mamba.gguf'), { nSeqMax: 2, typeK: 'f32', typeV: 'f32' })
  const { nEmbdKS, nEmbdVS } = info.recurrent
  const seed = new KvCache({ size: 2, nLayer: info.nLayer, nEmbdKGqa: 0, nEmbdVGqa: 0, nEmbdKS, nEmbdVS, recurrent: true, nSeqMax: 2, typeK: 'f32', typeV: 'f32' })
  const pos = Array.from({ length: 11 }, (_, i) => i)
  // one group of 11 tokens of sequence 0: its state cell at position 10
  for (const c of [today, seed]) t.truthy(c.findSlot({ pos, seqIds: [0], nSeqTokens: 11 }))
  // from inside the state to its end: both refuse (no rollback snapshots)
  t.false(today.seqRm(0, 5, -1))
  t.false(seed.seqRm(0, 5, -1))
  // a range the state's position (10) is not in: 0.1.161 removes nothing and says so, the seed refuses
  t.true(today.seqRm(0, 0, 5))
  t.false(seed.seqRm(0, 0, 5))
  t.is(today.seqPosMax(0), 10)
  // an empty sequence: 0.1.161 starts its maximum at -1, the seed at 0
  t.is(today.seqPosMax(1), -1)
  t.is(seed.seqPosMax(1), 0)
  // -1: 0.1.161 compares it unsigned with the sequence count and refuses; the seed removes everything
  t.false(today.seqRm(-1, -1, -1))
  t.is(today.usedCells, 1)
  t.true(seed.seqRm(-1, -1, -1))
  t.is(seed.usedCells, 0)
  today.dispose()
  seed.dispose()
})

mtest('an iSWA memory places ubatches cell by cell, routes rows by model layer and drops what the window no longer sees', (t) => {
  const c = gemma()
  const placed = c.place([ubatch(0, 0, 8), ubatch(1, 0, 3)])
  t.is(placed.length, 2)
  t.deepEqual(placed[0].map((p) => [p.part, p.stream, [...p.cells]]), [['base', 0, [0, 1, 2, 3, 4, 5, 6, 7]], ['swa', 0, [0, 1, 2, 3, 4, 5, 6, 7]]])
  t.deepEqual([...placed[1][0].cells], [8, 9, 10])
  t.deepEqual([...placed[1][0].tokens], [0, 1, 2])
  // rows of layer 0 live in the window cache, of layer 1 in the base cache
  const row = c.parts[0].typeK === 'f16' ? 2 * 64 : 0
  const rows = Buffer.alloc(3 * row)
  for (let i = 0; i < rows.length; i++) rows[i] = (i * 7) & 0xff
  c.writeRows(0, 'k', placed[1][1].cells, rows)
  t.deepEqual(c.readRows(0, 'k', placed[1][1].cells), rows)
  t.is(c.readRows(1, 'k', placed[1][0].cells).every((b) => b === 0), true)
  t.deepEqual(c.readRows(0, 'k', [9]), rows.subarray(row, 2 * row))
  // 300 more tokens of sequence 0: the window cache (256 cells) reuses cells of positions the window of 4
  // no longer sees, and purges the older ones; the base cache keeps them all
  for (let p = 8; p < 308; p += 15) t.truthy(c.place([ubatch(0, p, Math.min(15, 308 - p))]))
  t.is(c.seqPosMax(0), 307)
  t.true(c.seqPosMin(0) > 0)
  t.is(c.parts[0].usedCells, 308 + 3)
  t.true(c.parts[1].usedCells <= 256)
  c.seqRm(0, 300, -1)
  t.is(c.seqPosMax(0), 299)
  c.seqCp(1, 0, -1, -1)
  c.seqKeep(1)
  t.is(c.seqPosMax(0), -1) // today's memories read -1 for a sequence without cells
  t.is(c.seqPosMin(1), 0)
  c.clear()
  t.deepEqual(c.parts.map((p) => p.usedCells), [0, 0])
})

mtest('an iSWA memory writes and reads its state transactionally, in llama.cpp 0.1.161\'s bytes', async (t) => {
  const c = gemma()
  c.place([ubatch(0, 0, 6), ubatch(1, 0, 4)])
  c.writeRows(1, 'v', [0, 1], Buffer.alloc(2 * 128, 9))
  const whole = c.stateWriteSync()
  const d = gemma()
  t.like(d.stateReadSync(whole), { layout: 'streams', cells: 20 })
  t.deepEqual(d.stateWriteSync(), whole)
  t.deepEqual(await d.stateWrite(), whole)
  t.deepEqual(d.readRows(1, 'v', [0, 1]), Buffer.alloc(2 * 128, 9))
  // sizes and writes into the caller's buffer, as for a 'kv' cache
  t.is(c.stateSize(), whole.length)
  t.is(c.stateSize(1, { layout: 'streams-rot' }), c.stateWriteSync(1, { layout: 'streams-rot' }).length)
  const into = Buffer.alloc(whole.length + 8)
  t.is(c.stateWriteIntoSync(into), whole.length)
  t.deepEqual(into.subarray(0, whole.length), whole)
  t.is(await c.stateWriteInto(into.fill(0)), whole.length)
  t.deepEqual(into.subarray(0, whole.length), whole)
  t.throws(() => c.stateWriteIntoSync(Buffer.alloc(16)), code('ERR_KV_INVALID_ARG', /cannot hold/))
  const seq0 = c.stateWriteSync(0, { layout: 'streams-rot' })
  const e = gemma()
  t.like(await e.stateRead(seq0, 1), { layout: 'streams-rot' })
  // a sequence's state leaves out the window cache's cells its window no longer sees (positions 0 and 1
  // from position 5 through a window of 4), as 0.1.161 writes it; positions come from the window cache
  t.deepEqual([e.seqPosMin(1), e.seqPosMax(1), e.seqPosMax(0)], [2, 5, -1])
  t.deepEqual(e.parts.map((p) => p.usedCells), [6, 4])
  // refusals leave the memory as it was
  const before = e.stateWriteSync()
  t.throws(() => e.stateReadSync(new Uint8Array([1, 2, 3])), code('ERR_KV_INVALID_STATE'))
  t.throws(() => e.stateReadSync(whole, 0, { part: 'base' }), code('ERR_KV_INVALID_ARG', /reads all its parts at once/))
  const small = KvCache.fromModel(model('gemma3-swa.gguf'), { nCtx: 256, nSeqMax: 2, nUbatch: 16 })
  small.place([ubatch(0, 0, 250)].map((u) => u))
  const big = gemma()
  big.place([ubatch(0, 0, 16), ubatch(0, 16, 16)])
  t.throws(() => small.stateReadSync(big.stateWriteSync(0), 1), code('ERR_KV_NO_SPACE'))
  t.is(small.seqPosMax(0), 249)
  t.deepEqual(e.stateWriteSync(), before)
})

mtest('the 0.1.161 peer\'s iSWA session reads into a live iSWA memory and writes back byte for byte', (t) => {
  const file = path.join(FIXTURES, 't161', 't161-gemma3-swa.ggsn')
  const bytes = fs.readFileSync(file)
  const ins = inspectState(file)
  const payload = bytes.subarray(bytes.length - ins.parts.reduce((n, p) => n + p.bytes, 0))
  const c = KvCache.fromModel(model('gemma3-swa.gguf'), { nCtx: 32, nUbatch: 32 })
  t.like(c.stateReadSync(payload), { layout: 'streams-rot' })
  t.deepEqual(c.stateWriteSync(-1, { layout: 'streams-rot' }), Buffer.from(payload))
  t.is(c.seqPosMax(0), 9)
})

mtest('an iSWA memory shifts positions only with swaFull, as llama.cpp 0.1.161 allows, and refuses the seed\'s own calls by kind', async (t) => {
  const c = gemma()
  c.place([ubatch(0, 0, 8)])
  t.throws(() => c.seqAdd(0, 4, -1, -2), code('ERR_KV_UNSUPPORTED', /swaFull/))
  t.throws(() => c.findSlot(ubatch(0, 8, 1)), code('ERR_KV_UNSUPPORTED', /^findSlot is an operation of the seed's one-stream cache; this cache is of kind 'iswa'/))
  t.throws(() => c.defrag(), code('ERR_KV_UNSUPPORTED', /^defrag .*kind 'iswa'/))
  // every such refusal names the call, getters and the rows methods included
  t.throws(() => c.padding, code('ERR_KV_UNSUPPORTED', /^padding is an operation/))
  // the tensor sizes are every kind's: the sum over the parts (and their streams)
  const full = gemma({ swaFull: true })
  t.true(c.sizeKBytes > 0 && c.totalBytes === c.sizeKBytes + c.sizeVBytes)
  t.true(full.totalBytes > c.totalBytes, 'a window cache of every position is larger')
  const jamba = KvCache.fromModel(model('jamba.gguf'), { nCtx: 256 })
  const attention = KvCache.fromModel(model('llama-h16.gguf'), { nCtx: 256 })
  t.true(jamba.totalBytes > 0 && jamba.totalBytes === jamba.sizeKBytes + jamba.sizeVBytes)
  t.true(attention.totalBytes > 0)
  t.throws(() => c.readVF32(0, 0, 1), code('ERR_KV_UNSUPPORTED', /^readVF32 is an operation/))
  t.throws(() => c.createStateReadStream(0), code('ERR_KV_UNSUPPORTED', /^createStateReadStream is an operation/))
  t.throws(() => c.readRows(2, 'k', [0]), code('ERR_KV_OUT_OF_RANGE', /layer 2/))
  t.throws(() => c.readRows(0, 'q', [0]), code('ERR_KV_INVALID_ARG', /tensor must be 'k', 'v', 'r' or 's', got "q"/))
  t.throws(() => c.writeRows(0, 'k', [0, 1], Buffer.alloc(5)), code('ERR_KV_INVALID_ARG', /5 bytes for 2 cells/))
  t.throws(() => c.readRows(0, 'k', [0], 1), code('ERR_KV_OUT_OF_RANGE', /stream 1/))
  t.is(KvCache.fromModel(model('llama-h16.gguf')).place([ubatch(0, 0, 1)])[0][0].part, 'whole', 'place works on the seed\'s cache too')

  const f = gemma({ swaFull: true })
  f.place([ubatch(0, 0, 8)])
  f.seqRm(0, 2, 4)
  f.seqAdd(0, 4, -1, -2)
  t.true(f.hasShift)
  await f.update()
  t.false(f.hasShift)
  t.deepEqual([f.seqPosMin(0), f.seqPosMax(0)], [0, 5])
})

mtest('an iSWA memory saves and loads llama.cpp\'s session and sequence files, the 0.1.161 peer\'s byte for byte', async (t) => {
  const peer = path.join(FIXTURES, 't161', 't161-gemma3-swa.ggsn')
  const c = KvCache.fromModel(model('gemma3-swa.gguf'), { nCtx: 32, nUbatch: 32 })
  const loaded = c.loadSessionFileSync(peer)
  t.like(loaded, { format: 'session', version: 11, arch: 'gemma3', layout: 'streams-rot', cells: 20 })
  c.saveSessionFileSync(tmp('again.ggsn'), loaded.tokens, { arch: 'gemma3', version: 11 })
  t.deepEqual(fs.readFileSync(tmp('again.ggsn')), fs.readFileSync(peer))
  const seqPeer = path.join(FIXTURES, 't161', 't161-gemma3-swa.ggsq')
  const d = KvCache.fromModel(model('gemma3-swa.gguf'), { nCtx: 32, nUbatch: 32, nSeqMax: 2 })
  const seq = await d.loadSequenceFile(seqPeer, 1)
  t.like(seq, { format: 'sequence', version: 4 })
  t.deepEqual([d.seqPosMax(1), d.seqPosMax(0)], [9, -1])
  d.loadSequenceFileSync(seqPeer, 0)
  await d.saveSequenceFile(tmp('seq0.ggsq'), 0, seq.tokens, { version: 4 })
  t.deepEqual(fs.readFileSync(tmp('seq0.ggsq')), fs.readFileSync(seqPeer))
  await d.saveSequenceFile(tmp('seq1.ggsq'), 1, seq.tokens, { version: 4 })
  const e = KvCache.fromModel(model('gemma3-swa.gguf'), { nCtx: 32, nUbatch: 32, nSeqMax: 2 })
  e.loadSequenceFileSync(tmp('seq1.ggsq'), 1)
  t.deepEqual(e.stateWriteSync(1, { layout: 'streams-rot' }), d.stateWriteSync(1, { layout: 'streams-rot' }))
  // refusals name what is wrong and leave the memory as it was
  const before = e.stateWriteSync()
  t.throws(() => e.loadSessionFileSync(tmp('seq1.ggsq')), code('ERR_KV_INVALID_STATE', /expected a session file/))
  t.throws(() => e.loadSessionFileSync(path.join(FIXTURES, 't161', 't161-h16-f16.ggsn')), code('ERR_KV_INVALID_STATE', /not a state of this iSWA memory/))
  t.throws(() => e.loadSequenceFileSync(seqPeer, 0, { part: 'swa' }), code('ERR_KV_INVALID_ARG', /reads every part of its file/))
  t.throws(() => e.saveSequenceFileSync(tmp('bad.ggsq'), 0, [1], { version: 7 }), code('ERR_KV_INVALID_ARG', /versions/))
  t.false(fs.existsSync(tmp('bad.ggsq')))
  t.deepEqual(e.stateWriteSync(), before)
})

mtest('fromModel gives a hybrid model llama.cpp 0.1.161\'s hybrid memory: attention and recurrent parts placed, removed, shifted and saved together', async (t) => {
  const c = KvCache.fromModel(model('jamba.gguf'), { nCtx: 256, nSeqMax: 2 })
  t.is(c.kind, 'hybrid')
  t.deepEqual(c.parts.map((p) => [p.role, p.layers, p.size, p.typeK]), [['attention', [1], 256, 'f16'], ['recurrent', [0], 2, 'f32']])
  // a hybrid takes each sequence's tokens as one group
  const [where] = c.place([{ pos: [0, 1, 2, 3], seqIds: [0], nSeqTokens: 4 }])
  t.deepEqual(where.map((p) => [p.part, [...p.cells], [...p.tokens]]), [['attention', [0, 1, 2, 3], [0, 1, 2, 3]], ['recurrent', [0], [0]]])
  // the state cell's R and S rows (layer 0, f32: 384 and 2,048 wide) and the attention rows (layer 1)
  const r = Buffer.alloc(384 * 4, 3)
  const kv = Buffer.alloc(4 * 32 * 2, 5)
  c.writeRows(0, 'k', [0], r)
  c.writeRows(1, 'k', where[0].cells, kv)
  t.deepEqual(c.readRows(0, 'k', [0]), r)
  t.deepEqual(c.readRows(1, 'k', [0, 1, 2, 3]), kv)
  t.throws(() => c.writeRows(0, 'k', [0], r, 1), code('ERR_KV_OUT_OF_RANGE', /stream 1/))
  // a recurrent state cannot lose its end: refused, and neither part changes
  t.false(c.seqRm(0, 2, -1))
  t.deepEqual([c.seqPosMin(0), c.seqPosMax(0), c.parts[0].usedCells], [3, 3, 4])
  const state = c.stateWriteSync()
  t.is(c.stateSize(), state.length)
  t.is(c.stateSize(0), c.stateWriteSync(0).length)
  const d = KvCache.fromModel(model('jamba.gguf'), { nCtx: 256, nSeqMax: 2 })
  t.like(await d.stateRead(state), { cells: 5 })
  t.deepEqual(d.stateWriteSync(), state)
  t.deepEqual(d.readRows(0, 'k', [0]), r)
  // Jamba has no RoPE: a shift is done without a rotation
  d.seqAdd(0, 0, -1, 2)
  t.true(d.hasShift)
  await d.update()
  t.false(d.hasShift)
  t.deepEqual([d.seqPosMin(0), d.seqPosMax(0)], [5, 5])
  t.true(d.seqRm(0, -1, -1))
  t.is(d.seqPosMax(0), -1)
})

mtest('the 0.1.161 peer\'s hybrid files load into a live hybrid memory and save back byte for byte', (t) => {
  for (const ext of ['ggsn', 'ggsq']) {
    const peer = path.join(FIXTURES, 't161', `t161-jamba.${ext}`)
    const c = KvCache.fromModel(model('jamba.gguf'), { nCtx: 32 })
    const loaded = ext === 'ggsn' ? c.loadSessionFileSync(peer) : c.loadSequenceFileSync(peer, 0)
    t.like(loaded, { version: ext === 'ggsn' ? 11 : 4, layout: 'streams-rot' })
    const again = tmp(`jamba-again.${ext}`)
    if (ext === 'ggsn') c.saveSessionFileSync(again, loaded.tokens, { arch: 'jamba', version: 11 })
    else c.saveSequenceFileSync(again, 0, loaded.tokens, { version: 4 })
    t.deepEqual(fs.readFileSync(again), fs.readFileSync(peer))
  }
  const c = KvCache.fromModel(model('jamba.gguf'), { nCtx: 32 })
  t.throws(() => c.loadSessionFileSync(path.join(FIXTURES, 't161', 't161-gemma3-swa.ggsn')), code('ERR_KV_INVALID_STATE', /hybrid/))
  t.is(c.seqPosMax(0), -1)
})

mtest('KvCache.planMemory is the memory fromModel builds, for every tiny model and context, and refused as fromModel refuses', (t) => {
  const contexts = [
    { nCtx: 4096 },
    { nCtx: 8192, nSeqMax: 3, kvUnified: false, typeK: 'q8_0', typeV: 'q8_0', flashAttn: true },
    { nCtx: 1000, nSeqMax: 2, swaFull: true, nUbatch: 64 },
  ]
  let planned = 0
  let refused = 0
  for (const name of fs.readdirSync(MODELS).filter((n) => n.endsWith('.gguf')).sort()) {
    for (const options of contexts) {
      let plan
      try {
        plan = KvCache.planMemory(model(name), options)
      } catch (e) {
        // the same code and message from fromModel
        t.throws(() => KvCache.fromModel(model(name), options), code(e.code, e.message), `${name} ${JSON.stringify(options)}`)
        t.true(['ERR_KV_UNSUPPORTED', 'ERR_KV_INVALID_ARG'].includes(e.code), e.message)
        refused++
        continue
      }
      const c = KvCache.fromModel(model(name), options)
      t.is(plan.kind, c.kind, name)
      t.deepEqual(plan.parts, c.parts, `${name} ${JSON.stringify(options)}`)
      t.is(plan.bytes, c.totalBytes, name)
      t.is(plan.bytes, plan.parts.reduce((sum, p) => sum + p.bytes, 0))
      c.dispose()
      planned++
    }
  }
  t.true(planned >= 40 && refused >= 6, `${planned} planned, ${refused} refused`)
  // the options are checked as fromModel checks them
  t.throws(() => KvCache.planMemory(model('llama-h32.gguf'), { nSeqMax: 0 }), code('ERR_KV_OUT_OF_RANGE', /nSeqMax/))
  t.throws(() => KvCache.planMemory(model('llama-h32.gguf'), { typeK: 'q9' }), code('ERR_KV_INVALID_ARG', /q9/))
  t.throws(() => KvCache.planMemory(tmp('absent.gguf')), code('ERR_KV_IO', /absent\.gguf/))
  fs.writeFileSync(tmp('truncated.gguf'), 'GGUF\x03')
  t.throws(() => KvCache.planMemory(tmp('truncated.gguf')), code('ERR_KV_INVALID_MODEL', /truncated/))
  t.throws(() => KvCache.planMemory(model('llama-h16.gguf'), { nSeqMax: 257 }), code('ERR_KV_OUT_OF_RANGE', /nSeqMax must be in \[1, 256\], got 257/))
  // a context whose padding overflows, for the seed's cache and an iSWA memory alike
  for (const name of ['llama-h16.gguf', 'gemma3-swa.gguf']) {
    t.throws(() => KvCache.planMemory(model(name), { nCtx: 2 ** 32 - 1 }), code('ERR_KV_OUT_OF_RANGE', /nCtx 4294967295 is too large/))
  }
  t.throws(() => KvCache.planMemory(42), code('ERR_KV_INVALID_ARG', /ggufPath/))
})

mtest('fromModel of a unified model with kvUnified: false builds llama.cpp 0.1.161\'s cache of a stream per sequence, and reads and writes its split files byte for byte', async (t) => {
  const make = (options) => KvCache.fromModel(model('llama-h16.gguf'), { nCtx: 32, nSeqMax: 2, kvUnified: false, ...options })
  const c = make()
  t.is(c.kind, 'kv-streams')
  t.deepEqual(c.parts.map((p) => [p.role, p.size, p.nStream]), [['whole', 256, 2]])
  // 0.1.161's own session and sequence files of a split context (its default kv_unified)
  const peer = path.join(FIXTURES, 't161', 't161-h16-f16-par2-split.ggsn')
  const loaded = c.loadSessionFileSync(peer)
  t.like(loaded, { cells: 16, layout: 'streams-rot' })
  c.saveSessionFileSync(tmp('split-again.ggsn'), loaded.tokens, { arch: 'llama', version: 11 })
  t.deepEqual(fs.readFileSync(tmp('split-again.ggsn')), fs.readFileSync(peer))
  const seqPeer = path.join(FIXTURES, 't161', 't161-h16-f16-par2-split.ggsq')
  const d = make()
  const seq = d.loadSequenceFileSync(seqPeer, 1)
  d.saveSequenceFileSync(tmp('split-again.ggsq'), 1, seq.tokens, { version: 4 })
  t.deepEqual(fs.readFileSync(tmp('split-again.ggsq')), fs.readFileSync(seqPeer))
  // each sequence in its own stream: placement, removal and copies stay there
  const [[where]] = c.place([{ pos: [20, 21], seqIds: [1, 1] }])
  t.is(where.stream, 1)
  t.true(c.seqRm(1, 21, -1))
  t.deepEqual([c.seqPosMax(1), c.seqPosMax(0)], [20, 9])
  // a copy into another sequence's stream copies the stream, as 0.1.161 does: sequence 1 becomes 0's
  c.seqCp(0, 1, -1, -1)
  t.deepEqual([c.seqPosMin(1), c.seqPosMax(1), c.parts[0].usedCells], [0, 9, 20])
  // the seed's own calls are refused by name, as on the other kinds of today
  t.throws(() => c.findSlot({ pos: [0], seqIds: [0] }), code('ERR_KV_UNSUPPORTED', /^findSlot is an operation of the seed's one-stream cache; this cache is llama\.cpp 0\.1\.161's cache of a stream per sequence \(2 streams/))
  t.throws(() => make({ device: 'cpu' }), code('ERR_KV_UNSUPPORTED', /stream per sequence.*kvUnified: true can live on a device/))
  t.is(make({ device: 'cpu', kvUnified: true }).parts[0].nStream, 1)
  // one sequence: a stream either way, the seed's cache
  t.like(make({ nSeqMax: 1 }), { kind: 'kv', size: 256 })
  // the prompt store takes it both ways with a one-stream cache of the same model
  const tokens = Array.from({ length: 40 }, (_, i) => 3 + i)
  const e = make({ nCtx: 512 })
  fillGroup(e, 1, 40, 4)
  const store = new PromptStore({ model: 'split-llama', blockTokens: 16 })
  t.like(await store.put(e, 1, tokens), { tokens: 40 })
  const unified = KvCache.fromModel(model('llama-h16.gguf'), { nCtx: 512, nSeqMax: 2 })
  t.is(await store.restore(unified, 0, tokens), 40)
  const f = make({ nCtx: 512 })
  t.is(await store.restore(f, 0, tokens), 40)
  t.deepEqual(f.readRows(0, 'v', [...Array(40).keys()], 0), e.readRows(0, 'v', [...Array(40).keys()], 1))
  t.deepEqual(unified.readRows(1, 'k', [...Array(40).keys()]), e.readRows(1, 'k', [...Array(40).keys()], 1))
})

mtest('place works on every kind: a kv or recurrent cache places each ubatch as findSlot does, all or none', (t) => {
  const ub = (seq, p0, n) => ({ pos: Array.from({ length: n }, (_, i) => p0 + i), seqIds: Array(n).fill(seq) })
  const c = KvCache.fromModel(model('llama-h16.gguf'), { nCtx: 32, nSeqMax: 2 })
  const byFindSlot = KvCache.fromModel(model('llama-h16.gguf'), { nCtx: 32, nSeqMax: 2 })
  const placed = c.place([ub(0, 0, 5), ub(1, 0, 3)])
  const slots = [byFindSlot.findSlot(ub(0, 0, 5)), byFindSlot.findSlot(ub(1, 0, 3))]
  t.deepEqual(placed.map(([p]) => [p.part, p.stream, [...p.cells], [...p.tokens]]), slots.map((s) => ['whole', 0, Array.from({ length: s.len }, (_, i) => s.head + i), Array.from({ length: s.len }, (_, i) => i)]))
  t.deepEqual(c.stateWriteSync(), byFindSlot.stateWriteSync())
  // 260 more tokens do not fit in 256 cells: nothing placed, the first ubatch's cells included
  const before = c.stateWriteSync()
  t.is(c.place([ub(0, 5, 8), ub(0, 13, 260)]), null)
  t.deepEqual(c.stateWriteSync(), before)
  t.throws(() => c.place([ub(0, 5, 1), ub(9, 0, 1)]), code('ERR_KV_OUT_OF_RANGE'))
  t.deepEqual(c.stateWriteSync(), before)
  // a recurrent cache: each sequence's tokens as one group, in its state cell
  const m = KvCache.fromModel(model('mamba.gguf'), { nSeqMax: 2 })
  const [[a], [b]] = m.place([{ pos: [0, 1, 2], seqIds: [0], nSeqTokens: 3 }, { pos: [0, 1], seqIds: [1], nSeqTokens: 2 }])
  t.deepEqual([a.part, [...a.tokens], b.part, [...b.tokens]], ['whole', [0], 'whole', [0]])
  t.not(a.cells[0], b.cells[0])
  t.deepEqual([m.seqPosMax(0), m.seqPosMax(1)], [2, 1])
})

mtest('regression: fromModel of a Mamba model kept its state in f16, where llama.cpp 0.1.161 keeps f32, and could not load 0.1.161\'s own session', (t) => {
  const peer = path.join(FIXTURES, 't161', 't161-mamba.ggsn')
  const c = KvCache.fromModel(model('mamba.gguf'))
  t.deepEqual(c.parts.map((p) => [p.role, p.typeK, p.typeV]), [['whole', 'f32', 'f32']])
  const loaded = c.loadSessionFileSync(peer)
  t.like(loaded, { format: 'session', version: 11, arch: 'mamba', cells: 1 })
  c.saveSessionFileSync(tmp('mamba-again.ggsn'), loaded.tokens, { arch: 'mamba', version: 11 })
  t.deepEqual(fs.readFileSync(tmp('mamba-again.ggsn')), fs.readFileSync(peer))
  // whatever K/V types the options name: 0.1.161 ignores them for a recurrent state
  t.is(KvCache.fromModel(model('mamba.gguf'), { typeK: 'q8_0', typeV: 'q8_0', flashAttn: true }).parts[0].typeK, 'f32')
})

mtest('regression: fromModel of a llama with quantized K/V kept them unrotated, where llama.cpp 0.1.161 rotates them (Hadamard, heads of 64), and could not load 0.1.161\'s own file', (t) => {
  const peer = path.join(FIXTURES, 't161', 't161-h64-q8_0-fa-shift.ggsn')
  const c = KvCache.fromModel(model('llama-h64.gguf'), { nCtx: 32, typeK: 'q8_0', typeV: 'q8_0', flashAttn: true })
  t.deepEqual(c.parts.map((p) => [p.nRotK, p.nRotV]), [[64, 64]])
  const loaded = c.loadSessionFileSync(peer)
  t.like(loaded, { format: 'session', version: 11, layout: 'streams-rot' })
  c.saveSessionFileSync(tmp('h64-q8-again.ggsn'), loaded.tokens, { arch: 'llama', version: 11 })
  t.deepEqual(fs.readFileSync(tmp('h64-q8-again.ggsn')), fs.readFileSync(peer))
  // f16 is never rotated
  t.deepEqual(KvCache.fromModel(model('llama-h64.gguf'), { nCtx: 32 }).parts.map((p) => [p.nRotK, p.nRotV]), [[0, 0]])
})

mtest('regression: fromModel built K/V types llama.cpp 0.1.161 refuses for the model (a block that does not divide the head, K and V apart under latent attention)', (t) => {
  // Jamba's heads are 16 wide: q8_0's block of 32 does not divide them
  t.throws(() => KvCache.fromModel(model('jamba.gguf'), { typeK: 'q8_0', flashAttn: true }), code('ERR_KV_INVALID_ARG', /typeK q8_0 .* head size .* got 16/))
  t.throws(() => KvCache.fromModel(model('jamba.gguf'), { typeV: 'q8_0', flashAttn: true }), code('ERR_KV_INVALID_ARG', /typeV q8_0 .* got 16/))
  t.throws(() => KvCache.fromModel(model('deepseek2-mla.gguf'), { typeK: 'f16', typeV: 'f32' }), code('ERR_KV_INVALID_ARG', /one type.*typeK f16 and typeV f32/))
  // without flash attention a quantized K is not checked against the head (0.1.161 neither)
  t.is(KvCache.fromModel(model('jamba.gguf'), { typeK: 'q8_0' }).parts[0].typeK, 'q8_0')
})

mtest('an LFM2 model with a window gets a hybrid-iSWA memory: a base cache without layers, a window cache and the recurrent state', (t) => {
  const c = KvCache.fromModel(model('lfm2-swa.gguf'), { nCtx: 256, nSeqMax: 2, nUbatch: 16 })
  t.is(c.kind, 'hybrid')
  t.deepEqual(c.parts.map((p) => [p.role, p.layers, p.nSwa]), [['base', [], 0], ['swa', [1, 3], 4], ['recurrent', [0, 2], 0]])
  const [where] = c.place([{ pos: [0, 1, 2, 3, 4, 5], seqIds: [0], nSeqTokens: 6 }])
  t.deepEqual(where.map((p) => p.part), ['base', 'swa', 'recurrent'])
  // a short convolution's state is R rows only (n_embd * (l_cache - 1) = 64 floats)
  c.writeRows(0, 'k', [where[2].cells[0]], Buffer.alloc(64 * 4, 7))
  const state = c.stateWriteSync()
  const d = KvCache.fromModel(model('lfm2-swa.gguf'), { nCtx: 256, nSeqMax: 2, nUbatch: 16 })
  d.stateReadSync(state)
  t.deepEqual(d.stateWriteSync(), state)
  t.deepEqual(d.readRows(0, 'k', [where[2].cells[0]]), Buffer.alloc(64 * 4, 7))
  // the recurrent state holds the last position only: 0.1.161's hybrid minimum is the larger one
  t.deepEqual([d.seqPosMin(0), d.seqPosMax(0)], [5, 5])
})

mtest('Qwen3.5 gets a hybrid memory split by its attention interval, its attention cells keeping M-RoPE\'s extension', (t) => {
  const info = modelInfoSync(model('qwen35.gguf'))
  // every layer has KV heads: only `full_attention_interval` (2) tells the gated delta nets
  t.like(info, { arch: 'qwen35', memory: 'hybrid', unsupported: undefined, cellExt: 'pos2-tok' })
  t.deepEqual(info.layers.map((l) => [l.nHeadKv, l.memory]), [[1, 'recurrent'], [1, 'attention'], [1, 'recurrent'], [1, 'attention']])
  // a conv state of the Q, K and V channels ((4 - 1) x (16 + 2 x 2 x 8)), one 8x8 state per value head
  t.like(info.recurrent, { ssmNGroup: 2, nEmbdKS: 144, nEmbdVS: 128 })
  const c = KvCache.fromModel(model('qwen35.gguf'), { nCtx: 32 })
  t.deepEqual(c.parts.map((p) => [p.role, p.layers]), [['attention', [1, 3]], ['recurrent', [0, 2]]])
  // the 0.1.161 peer's files load and save back byte for byte
  for (const ext of ['ggsn', 'ggsq']) {
    const peer = path.join(FIXTURES, 't161', `t161-qwen35.${ext}`)
    const d = KvCache.fromModel(model('qwen35.gguf'), { nCtx: 32 })
    const loaded = ext === 'ggsn' ? d.loadSessionFileSync(peer) : d.loadSequenceFileSync(peer, 0)
    t.is(d.seqPosMax(0), 9)
    const again = tmp(`qwen35-again.${ext}`)
    if (ext === 'ggsn') d.saveSessionFileSync(again, loaded.tokens, { arch: 'qwen35', version: 11 })
    else d.saveSequenceFileSync(again, 0, loaded.tokens, { version: 4 })
    t.deepEqual(fs.readFileSync(again), fs.readFileSync(peer))
  }
  // a gated delta net's layer reads its conv state (R) rows; an attention layer its K rows
  const [where] = c.place([{ pos: [0, 1, 2], seqIds: [0], nSeqTokens: 3 }])
  t.deepEqual(where.map((p) => p.part), ['attention', 'recurrent'])
  t.is(c.readRows(0, 'k', where[1].cells).length, 144 * 4)
  t.is(c.readRows(1, 'k', where[0].cells).length, 3 * 16 * 2)
})

mtest('Nemotron-H\'s MLP-only layer is in neither part of its hybrid memory, and a layer index there says so', (t) => {
  const info = modelInfoSync(model('nemotron-h.gguf'))
  t.deepEqual(info.layers.map((l) => l.memory), ['recurrent', 'attention', 'neither'])
  // Mamba-2: (4 - 1) x (64 + 2 x 2 x 8) conv channels, 8 x 64 SSM state
  t.like(info.recurrent, { ssmNGroup: 2, nEmbdKS: 288, nEmbdVS: 512 })
  const c = KvCache.fromModel(model('nemotron-h.gguf'), { nCtx: 32 })
  t.deepEqual(c.parts.map((p) => [p.role, p.layers]), [['attention', [1]], ['recurrent', [0]]])
  t.throws(() => c.readRows(2, 'k', [0]), code('ERR_KV_OUT_OF_RANGE', /layer 2 keeps nothing in this memory/))
  t.throws(() => c.readRows(3, 'k', [0]), code('ERR_KV_OUT_OF_RANGE', /layer 3 is out of range \[0, 3\)/))
})

mtest('Falcon-H1 keeps every layer in both parts: \'k\'/\'v\' name its attention rows, \'r\'/\'s\' its Mamba-2 state', (t) => {
  const info = modelInfoSync(model('falcon-h1.gguf'))
  t.deepEqual(info.layers.map((l) => l.memory), ['both', 'both'])
  t.like(info, { memory: 'hybrid', unsupported: undefined })
  const c = KvCache.fromModel(model('falcon-h1.gguf'), { nCtx: 32 })
  t.deepEqual(c.parts.map((p) => [p.role, p.layers]), [['attention', [0, 1]], ['recurrent', [0, 1]]])
  const [where] = c.place([{ pos: [0, 1, 2, 3], seqIds: [0], nSeqTokens: 4 }])
  const [attn, recr] = where
  t.deepEqual([attn.part, recr.part], ['attention', 'recurrent'])
  // K of layer 1 (16 f16 per token) and its conv state R ((4 - 1) x (64 + 2 x 2 x 8) f32)
  t.is(c.readRows(1, 'k', attn.cells).length, 4 * 16 * 2)
  t.is(c.readRows(1, 'r', recr.cells).length, 288 * 4)
  t.is(c.readRows(1, 's', recr.cells).length, 512 * 4)
  c.writeRows(1, 's', recr.cells, Buffer.alloc(512 * 4, 9))
  c.writeRows(1, 'v', attn.cells, Buffer.alloc(4 * 16 * 2, 3))
  t.deepEqual(c.readRows(1, 's', recr.cells), Buffer.alloc(512 * 4, 9))
  t.deepEqual(c.readRows(1, 'v', attn.cells), Buffer.alloc(4 * 16 * 2, 3))
  // the state round-trips with both kinds of rows in it
  const d = KvCache.fromModel(model('falcon-h1.gguf'), { nCtx: 32 })
  d.stateReadSync(c.stateWriteSync())
  t.deepEqual(d.readRows(1, 's', recr.cells), Buffer.alloc(512 * 4, 9))
  // an attention-only layer (Jamba's layer 1) and any layer of an iSWA memory keep no state
  const j = KvCache.fromModel(model('jamba.gguf'), { nCtx: 32 })
  t.throws(() => j.readRows(1, 'r', [0]), code('ERR_KV_OUT_OF_RANGE', /layer 1 keeps no recurrent state/))
  t.is(j.readRows(0, 'r', [0]).length, j.readRows(0, 'k', [0]).length)
  t.throws(() => gemma().readRows(0, 's', [0]), code('ERR_KV_OUT_OF_RANGE', /layer 0 keeps no recurrent state/))
  // the 0.1.161 peer's files load and save back byte for byte
  for (const ext of ['ggsn', 'ggsq']) {
    const peer = path.join(FIXTURES, 't161', `t161-falcon-h1.${ext}`)
    const e = KvCache.fromModel(model('falcon-h1.gguf'), { nCtx: 32 })
    const loaded = ext === 'ggsn' ? e.loadSessionFileSync(peer) : e.loadSequenceFileSync(peer, 0)
    const again = tmp(`falcon-again.${ext}`)
    if (ext === 'ggsn') e.saveSessionFileSync(again, loaded.tokens, { arch: 'falcon-h1', version: 11 })
    else e.saveSequenceFileSync(again, 0, loaded.tokens, { version: 4 })
    t.deepEqual(fs.readFileSync(again), fs.readFileSync(peer))
  }
})

mtest('fromModel of a multi-head latent attention model keeps no V, as 0.1.161 does, and reads its peer files byte for byte', (t) => {
  t.like(modelInfoSync(model('deepseek2-mla.gguf')), { arch: 'deepseek2', mla: true })
  t.is(modelInfoSync(model('llama-h16.gguf')).mla, false)
  const c = KvCache.fromModel(model('deepseek2-mla.gguf'), { nCtx: 32 })
  t.like(c.parts[0], { role: 'whole', typeK: 'f16', typeV: 'none' })
  for (const ext of ['ggsn', 'ggsq']) {
    const peer = path.join(FIXTURES, 't161', `t161-deepseek2-mla.${ext}`)
    const d = KvCache.fromModel(model('deepseek2-mla.gguf'), { nCtx: 32 })
    const loaded = ext === 'ggsn' ? d.loadSessionFileSync(peer) : d.loadSequenceFileSync(peer, 0)
    t.is(loaded.tokens.length, 10)
    const again = tmp(`mla-again.${ext}`)
    if (ext === 'ggsn') d.saveSessionFileSync(again, loaded.tokens, { arch: 'deepseek2', version: 11 })
    else d.saveSequenceFileSync(again, 0, loaded.tokens, { version: 4 })
    t.deepEqual(fs.readFileSync(again), fs.readFileSync(peer))
  }
  // the K-shift rotates the last nRot (16) dimensions of each latent K row, as 0.1.161's does
  // (behind its n_embd_nope, 32 here): the latent stays, the rotated part moves
  t.like(modelInfoSync(model('deepseek2-mla.gguf')).shift.rope, { nRot: 16, headDim: 48, dimsOffset: 32 })
  c.loadSessionFileSync(path.join(FIXTURES, 't161', 't161-deepseek2-mla.ggsn'))
  const before = c.readRows(0, 'k', [5])
  c.seqAdd(0, 2, -1, -1)
  c.updateSync()
  const after = c.readRows(0, 'k', [5])
  t.deepEqual(after.subarray(0, 64), before.subarray(0, 64))
  t.notDeepEqual(after.subarray(64), before.subarray(64))
})

// ---- the prompt store with live caches of today's kinds -----------------------------------------------

/** Places positions 0..n-1 of `seq`, 16 per ubatch, and fills every row of them with bytes made of `salt`. */
const fillGroup = (c, seq, n, salt) => {
  for (let p0 = 0; p0 < n; p0 += 16) fillUbatch(c, seq, p0, Math.min(16, n - p0), salt)
}

const fillUbatch = (c, seq, p0, n, salt) => {
  const [where] = c.place([{ pos: Array.from({ length: n }, (_, k) => p0 + k), seqIds: [seq], nSeqTokens: n }])
  for (const placed of where) {
    for (const layer of c.parts.find((p) => p.role === placed.part).layers) {
      for (const kv of placed.part === 'recurrent' ? ['k'] : ['k', 'v']) {
        const row = c.readRows(layer, kv, [placed.cells[0]], placed.stream).length
        const bytes = Buffer.alloc(row * placed.cells.length)
        for (let i = 0; i < bytes.length; i++) bytes[i] = (i * 31 + layer * 7 + salt) & 0x7f
        c.writeRows(layer, kv, placed.cells, bytes, placed.stream)
      }
    }
  }
}

for (const [name, make] of [
  ['an iSWA memory (window only)', () => gemma()],
  ['an iSWA memory with swaFull', () => gemma({ swaFull: true })],
  ['a hybrid memory (Jamba)', () => KvCache.fromModel(model('jamba.gguf'), { nCtx: 512, nSeqMax: 2 })],
]) {
  mtest(`PromptStore.put and restore work on ${name}: the restored sequence writes the same state`, async (t) => {
    const c = make()
    // 300 tokens: more than the window cache's 256 cells, so that without swaFull it keeps only the window
    fillGroup(c, 0, 300, 3)
    if (name.includes('window only')) t.true(c.parts[1].usedCells < 300)
    const tokens = Array.from({ length: 300 }, (_, i) => 5 + i)
    const store = new PromptStore({ model: `live-${name}`, blockTokens: 16 })
    t.like(await store.put(c, 0, tokens), { tokens: 300 })
    const d = make()
    const progress = []
    t.is(await store.restore(d, 0, [...tokens, 99, 98], { onProgress: (done, total) => progress.push([done, total]) }), 300)
    // reports are queued to the JS thread: wait for the last one
    for (let i = 0; i < 1000 && progress.length < 2; i++) await new Promise((resolve) => setImmediate(resolve))
    t.deepEqual(progress, [[0, 300], [300, 300]])
    t.deepEqual(d.stateWriteSync(0, { layout: 'streams-rot' }), c.stateWriteSync(0, { layout: 'streams-rot' }))
    // into another sequence, beside what the cache holds
    const e = make()
    fillGroup(e, 0, 8, 5)
    const other = e.stateWriteSync(0)
    t.is(store.restoreSync(e, 1, tokens), 300)
    t.deepEqual([e.seqPosMax(1), e.seqPosMax(0)], [299, 7])
    t.deepEqual(e.stateWriteSync(0), other)
    // a prompt that diverges in the last block restores from full blocks only where they suffice: the
    // window cache held the whole range (swaFull); the window alone or a recurrent state needs the checkpoint
    const diverged = [...tokens.slice(0, 296), 7, 7, 7, 7]
    t.is(store.lookupSync(diverged), name.includes('swaFull') ? 288 : 0)
  })
}

for (const [name, make, point, under] of [
  ['an iSWA memory (window only)', () => gemma(), 280, 0],
  ['an iSWA memory with swaFull', () => gemma({ swaFull: true }), 336, 272],
  ['a hybrid memory (Jamba)', () => KvCache.fromModel(model('jamba.gguf'), { nCtx: 512, nSeqMax: 2 }), 280, 0],
]) {
  mtest(`restore with maxLoadTokens on ${name} loads the longest restore point not past it: a checkpoint where the memory needs one`, async (t) => {
    const c = make()
    const tokens = Array.from({ length: 340 }, (_, i) => 11 + i)
    // a turn ends at 280, the next at 340 (past the 256 cells of a window-only cache, which then
    // keeps its window in checkpoints only): checkpoints at both, blocks up to 336
    fillGroup(c, 0, 280, 4)
    const store = new PromptStore({ model: `cap-${name}`, blockTokens: 16 })
    t.like(await store.put(c, 0, tokens.slice(0, 280)), { tokens: 280 })
    const turn = c.stateWriteSync(0, { layout: 'streams-rot' })
    for (let p0 = 280; p0 < 340; p0 += 16) fillUbatch(c, 0, p0, Math.min(16, 340 - p0), 4)
    t.like(await store.put(c, 0, tokens), { tokens: 340 })
    // 336 has no checkpoint: only a memory whose window cache keeps every position restores there
    const d = make()
    t.is(await store.restore(d, 0, tokens, { maxLoadTokens: 339 }), point)
    t.is(store.lookupSync(tokens.slice(0, 339)), point)
    t.is(d.seqPosMax(0), point - 1)
    if (point === 280) t.deepEqual(d.stateWriteSync(0, { layout: 'streams-rot' }), turn, 'the memory holds the first turn exactly')
    t.is(store.restoreSync(make(), 0, tokens, { maxLoadTokens: 340 }), 340)
    t.is(store.restoreSync(make(), 0, tokens, { maxLoadTokens: 279 }), under)
  })
}

mtest('regression: PromptStore.restore into a live memory with a stream per sequence (kvUnified: false) assembled a one-stream payload, which the memory refused', async (t) => {
  for (const name of ['gemma3-swa.gguf', 'jamba.gguf', 'lfm2-swa.gguf']) {
    const make = (kvUnified) => KvCache.fromModel(model(name), { nCtx: 768, nSeqMax: 3, kvUnified, nUbatch: 64 })
    const c = make(false)
    fillGroup(c, 1, 40, 9)
    const tokens = Array.from({ length: 40 }, (_, i) => 3 + i)
    const store = new PromptStore({ model: `split-${name.replace('.gguf', '')}`, blockTokens: 16 })
    await store.put(c, 1, tokens)
    // into sequence 1 (its own stream) and 2 of a split memory, and into a unified one: the same state
    const d = make(false)
    t.is(await store.restore(d, 1, tokens), 40, name)
    t.deepEqual(d.stateWriteSync(1), c.stateWriteSync(1), name)
    t.is(store.restoreSync(d, 2, tokens), 40, name)
    t.deepEqual([d.seqPosMax(2), d.seqPosMax(0)], [39, -1], name)
    const u = make(true)
    t.is(store.restoreSync(u, 1, tokens), 40, name)
    const filled = make(true)
    fillGroup(filled, 1, 40, 9)
    t.deepEqual(u.stateWriteSync(1), filled.stateWriteSync(1), name)
  }
})

mtest('PromptStore.restore into a live cache of another kind or shape is ERR_KV_STORE_GEOMETRY and changes nothing', async (t) => {
  const c = gemma()
  fillGroup(c, 0, 20, 1)
  const tokens = Array.from({ length: 20 }, (_, i) => 5 + i)
  const store = new PromptStore({ model: 'live-refusals', blockTokens: 16 })
  await store.put(c, 0, tokens)
  for (const other of [
    KvCache.fromModel(model('jamba.gguf'), { nCtx: 256, nSeqMax: 2 }),
    gemma({ typeK: 'q8_0', typeV: 'q8_0', flashAttn: true }),
  ]) {
    fillGroup(other, 1, 4, 9)
    const before = other.stateWriteSync(-1, { layout: 'streams-rot' })
    await t.throwsAsync(store.restore(other, 1, tokens), code('ERR_KV_STORE_GEOMETRY', /live-refusals/))
    t.deepEqual(other.stateWriteSync(-1, { layout: 'streams-rot' }), before)
  }
  const unified = KvCache.fromModel(model('llama-h16.gguf'), { nCtx: 256, nSeqMax: 2 })
  await t.throwsAsync(store.restore(unified, 1, tokens), code('ERR_KV_STORE_GEOMETRY', /iswa/))
  await t.throwsAsync(store.restore(gemma(), 2, tokens), code('ERR_KV_OUT_OF_RANGE', /seq id 2/))
  // a pending shift: K rows are not those of positions 0..n
  const f = gemma({ swaFull: true })
  fillGroup(f, 0, 20, 1)
  f.seqAdd(0, 0, -1, 1)
  await t.throwsAsync(store.put(f, 0, tokens), code('ERR_KV_STORE_NOT_PREFIX', /update\(\)/))
  // a store without the model's record holds nothing for a live iSWA memory
  t.is(await new PromptStore({ model: 'live-empty', blockTokens: 16 }).restore(gemma(), 0, tokens), 0)
})

// ---- multi-head latent attention: caches without V -----------------------------------------------------

mtest("a cache without V (noV) loads 0.1.161's latent-attention files, writes them back byte for byte, and is refused where it cannot be", async (t) => {
  const info = inspectState(path.join(T161, 't161-deepseek2-mla.ggsn'))
  t.deepEqual(info.layers.map((l) => [l.kType, l.kRowSize, l.vType, l.vRowSize]), [['f16', 96, 'none', 0], ['f16', 96, 'none', 0]])
  const make = (o = {}) => new KvCache({ size: 32, nLayer: 2, nEmbdKGqa: 48, nEmbdVGqa: 0, noV: true, ...o })
  for (const ext of ['ggsn', 'ggsq']) {
    const peer = path.join(T161, `t161-deepseek2-mla.${ext}`)
    const c = make()
    const loaded = ext === 'ggsn' ? await c.loadSessionFile(peer) : await c.loadSequenceFile(peer, 0)
    t.like(loaded, { layout: 'streams-rot', cells: 10 })
    t.is(c.readRows(0, 'v', [0]).length, 0)
    const again = tmp(`mla-again.${ext}`)
    if (ext === 'ggsn') c.saveSessionFileSync(again, loaded.tokens, { arch: 'deepseek2', version: 11 })
    else c.saveSequenceFileSync(again, 0, loaded.tokens, { version: 4 })
    t.deepEqual(fs.readFileSync(again), fs.readFileSync(peer))
    t.throws(() => c.stateWriteSync(-1, { layout: 'seed' }), code('ERR_KV_UNSUPPORTED', /noV/))
  }
  // a cache that keeps V does not take a payload without, and the other way round; neither changes
  const withV = new KvCache({ size: 32, nLayer: 2, nEmbdKGqa: 48, nEmbdVGqa: 32 })
  const before = withV.stateWriteSync()
  t.throws(() => withV.loadSessionFileSync(path.join(T161, 't161-deepseek2-mla.ggsn')), code('ERR_KV_INVALID_STATE', /no V/))
  t.deepEqual(withV.stateWriteSync(), before)
  const noV = make()
  t.throws(() => noV.loadSessionFileSync(path.join(T161, 't161-h16-f16.ggsn')), code('ERR_KV_INVALID_STATE'))
  t.throws(() => make({ nRotV: 64 }), code('ERR_KV_INVALID_ARG', /noV/))
})

// ---- llama.cpp's in-memory sequence states and context checkpoints ---------------------------------------

mtest("stateWrite's partial and envelope forms: llama.cpp's checkpoints and llama_state_seq_get_data's bytes, read back by stateRead", async (t) => {
  for (const make of [() => gemma(), () => KvCache.fromModel(model('jamba.gguf'), { nCtx: 256, nSeqMax: 2 })]) {
    const c = make()
    fillGroup(c, 0, 40, 3)
    const whole = c.stateWriteSync(0, { layout: 'streams-rot' })
    const partial = c.stateWriteSync(0, { layout: 'streams-rot', partial: true })
    // a checkpoint is the window cache of an iSWA memory, the recurrent part of a hybrid: the
    // last part of the whole state
    t.true(partial.length < whole.length)
    t.deepEqual(whole.subarray(whole.length - partial.length), partial)
    const enveloped = await c.stateWrite(0, { layout: 'streams-rot', envelope: true })
    t.deepEqual(enveloped.subarray(0, 8), Buffer.from([0xd8, 0x3c, 0x14, 0xaf, 0, 0, 0, 0]))
    t.deepEqual(enveloped.subarray(8), whole)
    t.is(c.stateSize(0, { layout: 'streams-rot', partial: true, envelope: true }), partial.length + 8)
    const into = Buffer.alloc(partial.length + 8)
    t.is(c.stateWriteIntoSync(into, 0, { layout: 'streams-rot', partial: true, envelope: true }), partial.length + 8)
    // the envelope is read past; a partial state changes only its parts
    const d = make()
    d.stateReadSync(enveloped, 0)
    t.deepEqual(d.stateWriteSync(0, { layout: 'streams-rot' }), whole)
    const e = make()
    fillGroup(e, 1, 8, 5)
    const first = e.stateWriteSync(1, { layout: 'streams-rot' })
    t.true(e.stateReadSync(into, 0, { partial: true }).cells > 0)
    t.deepEqual(e.stateWriteSync(0, { layout: 'streams-rot', partial: true }), partial)
    t.deepEqual(e.stateWriteSync(1, { layout: 'streams-rot' }), first, 'another sequence keeps what it held')
    t.is(e.parts[0].usedCells, 8, "the first part (base or attention cache) keeps only sequence 1's cells")
    // llama.cpp's files hold whole states without the envelope
    t.throws(() => c.saveSequenceFileSync(tmp('p.ggsq'), 0, [1, 2], { partial: true }), code('ERR_KV_INVALID_ARG', /stateWrite/))
    t.false(fs.existsSync(tmp('p.ggsq')))
  }
})

// llama.cpp 0.1.161's files (session v11 / sequence v4) from JS: inspection with parts and
// rotation, loading one part, the rotation option, conversion between versions, and typed
// refusals of malformed files that leave the cache unchanged. The peer runs in
// crates/conformance's cargo tests; the fixtures it wrote are t161-* (sidecar t161-<name>.json).
import test from 'ava'
import fs from 'node:fs'
import os from 'node:os'
import path from 'node:path'
import { execFileSync } from 'node:child_process'
import { createRequire } from 'node:module'
import { registerPeerSuite, runPeerScript } from '../interop/peers.mjs'

const require = createRequire(import.meta.url)
const { KvCache, inspectState, convertStateFileSync, modelInfoSync } = require('../index.js')
const FIXTURES = path.join(import.meta.dirname ?? path.dirname(new URL(import.meta.url).pathname), 'fixtures', 't161')
const CLI = path.join(FIXTURES, '..', '..', '..', 'bin', 'llama-kv-cache.js')
const fixture = (name) => path.join(FIXTURES, `t161-${name}`)
const sidecar = (name) => JSON.parse(fs.readFileSync(fixture(`${name}.json`), 'utf8'))
const SPECS = fs.readdirSync(FIXTURES).filter((f) => /^t161-.*\.json$/.test(f)).map((f) => f.slice(5, -5))
const tmp = () => fs.mkdtempSync(path.join(os.tmpdir(), 'kvc-t161-'))
const CONTINUE = path.join(FIXTURES, '..', '..', '..', 'interop', 'continue.mjs')
const MODELS = path.join(FIXTURES, '..', '..', '..', 'interop', 'models')
const NLC_TYPE = { 0: 'F32', 1: 'F16', 2: 'Q4_0', 8: 'Q8_0' }

const TYPE_SIZE = { f32: [4, 1], f16: [2, 1], q8_0: [34, 32], q4_0: [18, 32] }
const width = (type, rowSize) => (rowSize / TYPE_SIZE[type][0]) * TYPE_SIZE[type][1]

// a cache shaped like one memory of an inspection (a part, or the file itself)
function cacheFor(m, o = {}) {
  const l = m.layers[0]
  const recurrent = m.kind === 'recurrent'
  // latent attention keeps no V
  const noV = l.vType === 'none'
  return new KvCache({
    size: recurrent ? 2 : 32,
    nLayer: m.nLayer,
    nEmbdKGqa: recurrent ? 0 : width(l.kType, l.kRowSize),
    nEmbdVGqa: recurrent || noV ? 0 : m.vTrans ? l.vRowSize / TYPE_SIZE[l.vType][0] : width(l.vType, l.vRowSize),
    ...(noV ? { noV: true } : {}),
    ...(recurrent ? { nEmbdKS: width(l.kType, l.kRowSize), nEmbdVS: width(l.vType, l.vRowSize), recurrent: true } : {}),
    typeK: l.kType,
    typeV: noV ? l.kType : l.vType,
    flashAttn: m.vTrans === false && !recurrent,
    nSeqMax: 2,
    nRotK: m.nRotK ?? 0,
    nRotV: m.nRotV ?? 0,
    ...o,
  })
}

test('every t161 fixture inspects with its memory, parts and rotation', (t) => {
  t.true(SPECS.length >= 12)
  for (const name of SPECS) {
    const side = sidecar(name)
    for (const [ext, version] of [['ggsn', 11], ['ggsq', 4]]) {
      const info = inspectState(fixture(`${name}.${ext}`))
      t.is(info.version, version, name)
      t.is(info.layout, 'streams-rot', name)
      t.is(info.memory, side.memory, name)
      const kv = info.parts ? info.parts.filter((p) => p.kind === 'kv') : side.memory === 'recurrent' ? [] : [info]
      t.is(info.recurrent, side.memory === 'recurrent', name)
      for (const m of kv) {
        // the lightning indexer keeps its keys rotated over its 64-wide head, whatever their type
        t.is(m.nRotK, m.role === 'indexer' ? 64 : side.nRotK, `${name} nRotK`)
        t.is(m.nRotV, side.nRotV, `${name} nRotV`)
        t.is(m.vTrans, !side.flashAttn, name)
      }
      if (side.memory === 'unified' || side.memory === 'recurrent') t.is(info.parts, undefined, name)
      else t.is(info.parts.reduce((n, p) => n + p.bytes, 0) + info.byteAccounting.header + info.byteAccounting.session, info.bytes)
    }
  }
})

test('inspect --json lists the parts of an iSWA and a hybrid file in payload order', (t) => {
  const iswa = JSON.parse(execFileSync(process.execPath, [CLI, 'inspect', fixture('gemma3-swa-q8_0-fa.ggsq'), '--json'], { encoding: 'utf8' }))
  t.is(iswa.memory, 'iswa')
  t.deepEqual(iswa.parts.map((p) => [p.kind, p.role]), [['kv', 'base'], ['kv', 'swa']])
  const [base, swa] = iswa.parts
  t.deepEqual(Object.keys(base), ['kind', 'role', 'streams', 'nLayer', 'vTrans', 'layers', 'nRotK', 'nRotV', 'bytes'])
  t.is(base.streams[0].cellCount, 10)
  // a one-sequence save keeps only the cells inside the sliding window (4) of the SWA cache
  t.deepEqual(swa.streams[0].seqs['0'], { cells: 4, posMin: 6, posMax: 9 })
  t.deepEqual([base.nRotK, base.nRotV, base.layers[0].kType], [64, 64, 'q8_0'])
  const hybrid = JSON.parse(execFileSync(process.execPath, [CLI, 'inspect', fixture('jamba.ggsn'), '--json'], { encoding: 'utf8' }))
  t.deepEqual(hybrid.parts.map((p) => [p.kind, p.role]), [['kv', 'attention'], ['recurrent', 'recurrent']])
  t.false('nRotK' in hybrid.parts[1])
  t.deepEqual(hybrid.parts[1].layers, [{ kType: 'f32', kRowSize: 1536, vType: 'f32', vRowSize: 8192 }])
  const human = execFileSync(process.execPath, [CLI, 'inspect', fixture('jamba.ggsn')], { encoding: 'utf8' })
  t.regex(human, /memory {3}hybrid: 2 parts/)
  t.regex(human, /part 1 {3}recurrent \(recurrent\)/)
})

test('a rotated quantized cache loads a v11 session with the same rotation, writes it back byte for byte, and shifts', async (t) => {
  const file = fixture('h64-q8_0-fa.ggsn')
  const info = inspectState(file)
  const c = cacheFor(info)
  const loaded = await c.loadSessionFile(file)
  t.is(loaded.cells, 10)
  t.is(loaded.layout, 'streams-rot')
  const dir = tmp()
  const out = path.join(dir, 'again.ggsn')
  await c.saveSessionFile(out, loaded.tokens, { version: 11, arch: loaded.arch })
  t.deepEqual(fs.readFileSync(out), fs.readFileSync(file))
  // a rotated cache cannot write a layout that has no place for the rotation
  const e = t.throws(() => c.saveSessionFileSync(path.join(dir, 'v9.ggsn'), loaded.tokens, { version: 9 }))
  t.is(e.code, 'ERR_KV_UNSUPPORTED')
  t.regex(e.message, /nRotK 64/)
  t.false(fs.existsSync(path.join(dir, 'v9.ggsn')))
  // the K-shift of a rotated K (rotate back, RoPE, rotate forward; compared with 0.1.161's own
  // shift bit for bit in crates/conformance/tests/kshift.rs)
  const before = c.readK(0, 5, 1)
  c.seqRm(0, 2, 4)
  c.seqAdd(0, 4, -1, -2)
  t.true(c.updateSync({ rope: { headDim: 64, nHead: 1, type: 'norm', freqBase: 10000 } }).shiftedCells > 0)
  t.notDeepEqual(c.readK(0, 5, 1), before)
  t.is(c.seqPosMax(0), 7)
})

// K rows of sequence 0 by position, layer after layer
function kByPos(c) {
  const rows = []
  const cells = c.cells()
  for (let layer = 0; layer < c.nLayer; layer++) {
    for (let i = 0; i < c.size; i++) {
      if (cells.pos[i] >= 0) rows.push([`${layer}:${cells.pos[i]}`, Buffer.from(c.readK(layer, i, 1))])
    }
  }
  return new Map(rows)
}

// our shift of a shift fixture's state before 0.1.161's shift, and that state after it
function shiftBoth(name, options) {
  const { p0, p1, delta } = sidecar(name).shift
  const c = cacheFor(inspectState(fixture(`${name}.ggsn`)))
  c.loadSessionFileSync(fixture(`${name}.ggsn`))
  c.seqRm(0, p0, p1)
  c.seqAdd(0, p1, -1, -delta)
  const shifted = c.updateSync(options).shiftedCells
  const post = cacheFor(inspectState(fixture(`${name}.post.ggsn`)))
  post.loadSessionFileSync(fixture(`${name}.post.ggsn`))
  return { shifted, ours: kByPos(c), theirs: kByPos(post) }
}

const SHIFTS = SPECS.filter((name) => sidecar(name).shift)

test('the K-shift through JS with modelInfoSync().shift (norm, NeoX, YaRN; rotated q8_0/q4_0 K) is bit-identical to 0.1.161\'s', (t) => {
  const quantized = SHIFTS.filter((name) => sidecar(name).typeK !== 0)
  t.true(quantized.length >= 10)
  const kinds = new Set()
  for (const name of quantized) {
    const side = sidecar(name)
    const info = modelInfoSync(path.join(MODELS, side.model))
    const { rope, ropeLayers } = info.shift
    t.deepEqual(ropeLayers, [])
    // what the GGUF says, in update()'s terms
    t.is(rope.type, info.rope.type, name)
    t.is(rope.extFactor, info.rope.scalingType === 'yarn' ? 1 : 0, name)
    t.is(Math.fround(rope.freqScale), Math.fround(info.rope.freqScale), name)
    kinds.add(`${rope.type}${rope.extFactor ? '+yarn' : ''}`)
    const { shifted, ours, theirs } = shiftBoth(name, info.shift)
    t.true(shifted > 0, name)
    t.is(ours.size, 2 * (side.prompts[0].length - (side.shift.p1 - side.shift.p0)), name)
    for (const [at, row] of ours) t.deepEqual(row, theirs.get(at), `${name}: K at layer:position ${at}`)
    // the comparison can fail: NeoX shifted as norm, YaRN without its extrapolation mix
    if (rope.type === 'neox' || rope.extFactor) {
      const wrong = shiftBoth(name, { rope: { ...rope, type: 'norm', extFactor: 0 } })
      t.true([...wrong.ours].some(([at, row]) => !row.equals(wrong.theirs.get(at))), `${name}: a wrong RoPE matched`)
    }
  }
  t.deepEqual([...kinds].sort(), ['neox', 'neox+yarn', 'norm', 'norm+yarn'])
})

test('regression: modelInfoSync().shift carries 0.1.161\'s YaRN attention factor (1 - 2^-24 for factor 12), not the metadata\'s 1', (t) => {
  const name = 'h64-yarn-f32-fa-shift'
  const info = modelInfoSync(path.join(MODELS, sidecar(name).model))
  t.is(info.rope.attnFactor, 1)
  t.is(info.shift.rope.attnFactor, 1 - 2 ** -24)
  // f32 K: the cells the shift does not move (positions < p0) are bit-identical to the peer's
  // only with that factor (moved cells differ from the peer's FMA-fused arithmetic in the last bits)
  const unmoved = (rows) => [...rows].filter(([at]) => Number(at.split(':')[1]) < sidecar(name).shift.p0)
  const right = shiftBoth(name, info.shift)
  t.is(unmoved(right.ours).length, 4)
  for (const [at, row] of unmoved(right.ours)) t.deepEqual(row, right.theirs.get(at), at)
  const old = shiftBoth(name, { rope: { ...info.shift.rope, attnFactor: 1 } })
  t.true(unmoved(old.ours).some(([at, row]) => !row.equals(old.theirs.get(at))))
})

test('a rotation mismatch is refused naming n_rot_k, and the cache is unchanged', (t) => {
  const file = fixture('h64-q8_0-fa.ggsn')
  const info = inspectState(file)
  const c = cacheFor(info, { nRotK: 0, nRotV: 0 })
  c.findSlot({ pos: [0, 1], seqIds: [0, 0] })
  const before = c.stateWriteSync()
  const e = t.throws(() => c.loadSessionFileSync(file))
  t.is(e.code, 'ERR_KV_INVALID_STATE')
  t.regex(e.message, /n_rot_k 64/)
  t.deepEqual(c.stateWriteSync(), before)
  const bad = t.throws(() => cacheFor(info, { nRotK: 48 }))
  t.is(bad.code, 'ERR_KV_INVALID_ARG')
  t.regex(bad.message, /nRotK/)
})

test('one part of an iSWA or hybrid file loads into a cache shaped like it', (t) => {
  const iswa = inspectState(fixture('gemma3-swa.ggsn'))
  const base = cacheFor(iswa.parts[0])
  // base and SWA caches have the same shape here: without `part` the file is ambiguous
  const amb = t.throws(() => base.loadSessionFileSync(fixture('gemma3-swa.ggsn')))
  t.is(amb.code, 'ERR_KV_INVALID_STATE')
  t.regex(amb.message, /base part .* and swa part/)
  t.is(base.loadSessionFileSync(fixture('gemma3-swa.ggsn'), { part: 'base' }).cells, 10)
  const swa = cacheFor(iswa.parts[1])
  t.is(swa.loadSequenceFileSync(fixture('gemma3-swa.ggsq'), 1, { part: 'swa' }).cells, 4)
  t.is(swa.seqCellCount(1), 4)
  const missing = t.throws(() => swa.loadSessionFileSync(fixture('gemma3-swa.ggsn'), { part: 'attention' }))
  t.is(missing.code, 'ERR_KV_INVALID_STATE')
  t.regex(missing.message, /part 'attention' is not in this file \(it holds base, swa\)/)
  t.is(t.throws(() => swa.loadSessionFileSync(fixture('gemma3-swa.ggsn'), { part: 'middle' })).code, 'ERR_KV_INVALID_ARG')

  // the hybrid's parts differ in shape, so each cache finds its own
  const hybrid = inspectState(fixture('jamba.ggsn'))
  const attn = cacheFor(hybrid.parts[0])
  t.is(attn.loadSessionFileSync(fixture('jamba.ggsn')).cells, 10)
  const recr = cacheFor(hybrid.parts[1])
  t.is(recr.loadSessionFileSync(fixture('jamba.ggsn')).cells, 1)
  t.is(recr.loadSequenceFileSync(fixture('jamba.ggsq'), 1, { part: 'recurrent' }).cells, 1)
  // stateRead of a payload of several memories takes the part too
  const body = fs.readFileSync(fixture('jamba.ggsn')).subarray(hybrid.byteAccounting.header + hybrid.byteAccounting.session)
  t.is(attn.stateReadSync(body, -1, { part: 'attention' }).cells, 10)
})

test('convert: v11 to v10 and v9 and back, one part out of an iSWA file, and typed refusals', (t) => {
  const dir = tmp()
  const src = fixture('h16-f16.ggsn')
  const v10 = path.join(dir, 'v10.ggsn')
  convertStateFileSync(src, v10, { version: 10 })
  t.like(inspectState(v10), { version: 10, layout: 'streams', nRotK: undefined })
  const back = path.join(dir, 'back.ggsn')
  convertStateFileSync(v10, back, { version: 11 })
  t.deepEqual(fs.readFileSync(back), fs.readFileSync(src))
  const extracted = path.join(dir, 'extracted.ggsq')
  convertStateFileSync(fixture('h16-f16-par2.ggsn'), extracted, { seqId: 1, version: 3 })
  t.like(inspectState(extracted), { version: 3, layout: 'streams', format: 'sequence' })
  t.deepEqual(inspectState(extracted).streams[0].seqs, { 1: { cells: 6, posMin: 0, posMax: 5 } })
  const seq = path.join(dir, 'seq.ggsq')
  convertStateFileSync(fixture('h16-f16-par2.ggsq'), seq, { version: 2 })
  t.like(inspectState(seq), { version: 2, layout: 'streams', format: 'sequence' })
  const seqBack = path.join(dir, 'seq4.ggsq')
  convertStateFileSync(seq, seqBack, { version: 4 })
  t.deepEqual(fs.readFileSync(seqBack), fs.readFileSync(fixture('h16-f16-par2.ggsq')))

  const base = path.join(dir, 'base.ggsn')
  convertStateFileSync(fixture('gemma3-swa.ggsn'), base, { part: 'base', version: 11 })
  const info = inspectState(base)
  t.is(info.memory, 'unified')
  t.is(info.streams[0].cellCount, 10)
  const v10iswa = path.join(dir, 'iswa10.ggsn')
  convertStateFileSync(fixture('gemma3-swa.ggsn'), v10iswa, { version: 10 })
  t.deepEqual(inspectState(v10iswa).parts.map((p) => p.role), ['base', 'swa'])

  const rot = t.throws(() => convertStateFileSync(fixture('h64-q8_0-fa.ggsn'), path.join(dir, 'no.ggsn'), { version: 10 }))
  t.is(rot.code, 'ERR_KV_UNSUPPORTED')
  t.regex(rot.message, /nRotK 64/)
  // re-typing a rotated cache rotates back (into f16) or forward (into q8_0, with the rotation given)
  const f16 = path.join(dir, 'f16.ggsn')
  convertStateFileSync(fixture('h64-q8_0-fa.ggsn'), f16, { typeK: 'f16', typeV: 'f16', version: 11 })
  t.like(inspectState(f16), { nRotK: 0, nRotV: 0, layers: [{ kType: 'f16' }, { kType: 'f16' }] })
  const q8 = path.join(dir, 'q8.ggsn')
  execFileSync(process.execPath, [CLI, 'convert', f16, q8, '--type-k', 'q8_0', '--type-v', 'q8_0', '--n-rot-k', '64', '--n-rot-v', '64', '--version', '11'])
  t.like(inspectState(q8), { nRotK: 64, nRotV: 64, layers: [{ kType: 'q8_0' }, { kType: 'q8_0' }] })
  const badRot = t.throws(() => convertStateFileSync(f16, path.join(dir, 'no.ggsn'), { typeK: 'q8_0', typeV: 'q8_0', nRotK: 48 }))
  t.is(badRot.code, 'ERR_KV_INVALID_ARG')
  t.regex(badRot.message, /nRotK/)
  const layout = t.throws(() => convertStateFileSync(src, path.join(dir, 'no.ggsn'), { layout: 'streams-rot', version: 9 }))
  t.is(layout.code, 'ERR_KV_INVALID_ARG')
  t.regex(layout.message, /version 9/)
  const part = t.throws(() => convertStateFileSync(src, path.join(dir, 'no.ggsn'), { part: 'swa' }))
  t.regex(part.message, /part 'swa' is not in this file/)
  t.false(fs.existsSync(path.join(dir, 'no.ggsn')))
})

test('malformed v11 / v4, iSWA and hybrid files are refused with ERR_KV_INVALID_STATE and change nothing', (t) => {
  for (const [name, ext, part] of [['h64-q8_0-fa', 'ggsn'], ['gemma3-swa', 'ggsq', 'swa'], ['jamba', 'ggsn', 'recurrent'], ['h16-f16-par2-split', 'ggsq']]) {
    const file = fixture(`${name}.${ext}`)
    const bytes = fs.readFileSync(file)
    const info = inspectState(file)
    const m = part ? info.parts.find((p) => p.role === part) : info
    const c = cacheFor(m, { nSeqMax: 2 })
    c.findSlot({ pos: [0], seqIds: [0] })
    const before = c.stateWriteSync(-1, { layout: m.nRotK ? 'streams-rot' : 'streams' })
    const dir = tmp()
    const bad = path.join(dir, `bad.${ext}`)
    // every cut shorter than the file, and a bumped version
    const cuts = [...Array(Math.ceil(bytes.length / 37)).keys()].map((i) => i * 37)
    const variants = cuts.map((n) => bytes.subarray(0, n))
    const bumped = Buffer.from(bytes)
    bumped.writeUInt32LE(ext === 'ggsn' ? 12 : 5, 4)
    variants.push(bumped)
    for (const v of variants) {
      fs.writeFileSync(bad, v)
      const load = () => (ext === 'ggsn' ? c.loadSessionFileSync(bad, { part }) : c.loadSequenceFileSync(bad, 1, { part }))
      const e = t.throws(load, undefined, `${name} ${v.length} bytes`)
      t.is(e.code, 'ERR_KV_INVALID_STATE', `${name} ${v.length}: ${e.message}`)
      t.deepEqual(c.stateWriteSync(-1, { layout: m.nRotK ? 'streams-rot' : 'streams' }), before)
    }
  }
})

// 0.1.161's own files, converted by us to ggsq 3 / ggsn 9, continue in node-llama-cpp 3.22.1 and
// llama.node 1.7.15 with the token 0.1.161 produced (`next2`). Rotated files have no older version
// (refused above).
registerPeerSuite(test, 'today', () => {
  const vocab = JSON.parse(fs.readFileSync(path.join(FIXTURES, '..', '..', '..', 'interop', 'models', 'vocab.json'), 'utf8')).tokens
  // prompt text whose tokenization is `ids` (the BOS is llama.node's own; '\u2581' is a space)
  const textOf = (ids) => ids.filter((id, i) => !(i === 0 && id === 1)).map((id) => vocab[id].replaceAll('\u2581', ' ')).join('').replace(/^ /, '')
  for (const name of ['h16-f16', 'h16-f16-fa', 'h32-q8_0-fa', 'h64-f16-fa']) {
    test(`llama.node continues llama.cpp 0.1.161's t161-${name}.ggsn converted to ggsn 9`, async (t) => {
      const side = sidecar(name)
      const conv = path.join(tmp(), `${name}.ggsn`)
      convertStateFileSync(fixture(`${name}.ggsn`), conv, { version: 9 })
      t.like(inspectState(conv), { version: 9, layout: 'streams' })
      const type = (id) => NLC_TYPE[id].toLowerCase()
      const options = {
        mode: 'session',
        ctx: { n_parallel: 1, flash_attn_type: side.flashAttn ? 'on' : 'off', cache_type_k: type(side.typeK), cache_type_v: type(side.typeV) },
        prompt: textOf([...side.prompts[0], side.next[0]]),
        n_predict: 1,
      }
      const { runs } = await runPeerScript(CONTINUE, ['llama-node', side.model, conv, JSON.stringify(options)], (m) => t.log(m))
      t.is(runs[0].error, undefined)
      t.is(runs[0].prompt_n, 1, 'llama.node decoded only the next token on top of the loaded cells')
      t.is(runs[0].tokens[0], side.next2[0], `llama.node after ${side.next[0]}: ${JSON.stringify(runs[0].pieces)}`)
    })
  }

  for (const name of ['h16-f16', 'h16-f16-fa', 'h32-q8_0-fa', 'h64-f16-fa', 'h16-f16-par2-split']) {
    test(`node-llama-cpp continues llama.cpp 0.1.161's t161-${name}.ggsq converted to ggsq 3`, async (t) => {
      const side = sidecar(name)
      const conv = path.join(tmp(), `${name}.ggsq`)
      convertStateFileSync(fixture(`${name}.ggsq`), conv, { version: 3, nStream: side.kvUnified ? 1 : side.prompts.length })
      t.like(inspectState(conv), { version: 3, layout: 'streams' })
      const seq = side.seq
      const options = {
        ctx: { sequences: side.prompts.length, flashAttention: side.flashAttn, k: NLC_TYPE[side.typeK], v: NLC_TYPE[side.typeV] },
        seqIndex: seq,
        evaluate: [side.next[seq]],
        n: 1,
      }
      const { runs } = await runPeerScript(CONTINUE, ['node-llama-cpp', side.model, conv, JSON.stringify(options)], (m) => t.log(m))
      t.is(runs[0].error, undefined)
      t.is(runs[0].loaded_tokens, side.prompts[seq].length)
      t.is(runs[0].tokens[0], side.next2[seq], `node-llama-cpp after ${side.next[seq]}: ${JSON.stringify(runs[0].tokens)}`)
    })
  }
})

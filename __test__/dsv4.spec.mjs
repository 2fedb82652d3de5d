// DeepSeek V4's states from JS: llama.cpp 0.1.161's own files of a tiny deepseek4 model
// (fixtures/dsv4, written by crates/conformance's 0.1.161 peer) inspected part by part, converted (whole, one
// sequence, one part), checked against the model, and refused by live caches with a code.
import test from 'ava'
import fs from 'node:fs'
import os from 'node:os'
import path from 'node:path'
import { execFileSync } from 'node:child_process'
import { createRequire } from 'node:module'

const require = createRequire(import.meta.url)
const { KvCache, PromptStore, inspectState, convertStateFileSync, checkState } = require('../index.js')
const HERE = import.meta.dirname ?? path.dirname(new URL(import.meta.url).pathname)
const FIXTURES = path.join(HERE, 'fixtures', 'dsv4')
const CLI = path.join(HERE, '..', 'bin', 'llama-kv-cache.js')
const MODELS = path.join(HERE, '..', 'interop', 'models')
const SESSION = path.join(FIXTURES, 't161-deepseek4-par2.ggsn')
const SEQUENCE = path.join(FIXTURES, 't161-deepseek4-par2.ggsq')
const model = (name) => {
  const p = path.join(MODELS, name)
  if (!fs.existsSync(p)) throw new Error(`${p} is missing: run node scripts/setup.mjs`)
  return p
}
const tmp = () => fs.mkdtempSync(path.join(os.tmpdir(), 'kvc-dsv4-'))

test('inspectState shows a dsv4 state part by part: raw window cache, compressed caches, compressors', (t) => {
  for (const [file, nStream] of [[SESSION, 2], [SEQUENCE, 1]]) {
    const info = inspectState(file)
    t.is(info.memory, 'dsv4')
    t.is(info.version, file === SESSION ? 11 : 4)
    t.deepEqual(info.parts.map((p) => [p.role, p.nLayer]), [['base', 0], ['swa', 3]])
    t.is(info.parts[1].layers[0].vType, 'none', 'K is V: the raw cache keeps K only')
    const { partial, sections } = info.compressed
    t.false(partial)
    t.deepEqual(sections.map((s) => [s.group, s.kind, s.ratio, s.layers]), [
      ['csa', 'cache', 4, [1]], ['hca', 'cache', 128, [2]], ['lid', 'cache', 4, [1]],
      ['csa', 'compressor', 4, [1]], ['hca', 'compressor', 128, [2]], ['lid', 'compressor', 4, [1]],
    ])
    t.true(sections.every((s) => s.nStream === nStream))
    // a sequence of 135 positions fills 33 rows of 4 and one of 128; a session writes every row
    t.deepEqual(sections.slice(0, 3).map((s) => s.nRows), file === SESSION ? [256, 256, 256] : [33, 1, 33])
    t.deepEqual(sections.slice(0, 3).map((s) => s.rowType), ['f16', 'f16', 'f16'])
    const b = info.byteAccounting
    const parts = info.parts.reduce((n, p) => n + p.bytes, 0)
    t.is(b.header + b.session + parts + b.compressed, info.bytes)
  }
})

test('the CLI prints a dsv4 state\'s sections, in text and JSON', (t) => {
  const text = execFileSync(process.execPath, [CLI, 'inspect', SEQUENCE], { encoding: 'utf8' })
  t.regex(text, /memory {3}dsv4: 2 parts/)
  t.regex(text, /hca cache {6}ratio 128, 1 stream\(s\) x 1 rows of 32 f16, layers \[2\]/)
  t.regex(text, /\+ compressed \d+ \+ framing/)
  const json = JSON.parse(execFileSync(process.execPath, [CLI, 'inspect', SEQUENCE, '--json', '--model', model('deepseek4.gguf')], { encoding: 'utf8' }))
  t.is(json.memory, 'dsv4')
  t.is(json.compressed.sections.length, 6)
  t.true(json.fits)
})

test('checkState: a dsv4 state fits its model and names the memory for another', (t) => {
  t.deepEqual(checkState(SEQUENCE, model('deepseek4.gguf')), { fits: true, reasons: [] })
  const other = checkState(SEQUENCE, model('deepseek32-dsa.gguf'))
  t.false(other.fits)
  t.true(other.reasons.some((r) => r.field === 'memory' && r.state === 'dsv4' && r.model === 'dsa'))
})

test('convertStateFileSync writes a dsv4 state back byte for byte, takes a sequence out of a session, and refuses a re-typing by name', (t) => {
  const dir = tmp()
  const back = path.join(dir, 'back.ggsn')
  convertStateFileSync(SESSION, back)
  t.true(fs.readFileSync(back).equals(fs.readFileSync(SESSION)))
  const one = path.join(dir, 'seq1.ggsq')
  convertStateFileSync(SESSION, one, { seqId: 1 })
  const info = inspectState(one)
  t.is(info.format, 'sequence')
  t.deepEqual(info.compressed.sections.map((s) => [s.nStream, s.nRows]), [[1, 33], [1, 1], [1, 33], [1, 8], [1, 128], [1, 8]])
  // with the model's window (8), the sequence is the peer's own save of it, byte for byte
  const windowed = path.join(dir, 'seq1-window.ggsq')
  convertStateFileSync(SESSION, windowed, { seqId: 1, swaWindow: 8 })
  const payload = (f) => fs.readFileSync(f).subarray(12 + 4 * inspectState(f).nTokens)
  t.true(payload(windowed).equals(payload(SEQUENCE)))
  t.true(fs.statSync(windowed).size < fs.statSync(one).size)
  // the part option takes the raw window cache alone, as a file of one memory
  const swa = path.join(dir, 'swa.ggsq')
  convertStateFileSync(SEQUENCE, swa, { part: 'swa' })
  t.is(inspectState(swa).memory, 'unified')
  const e = t.throws(() => convertStateFileSync(SEQUENCE, path.join(dir, 'q8.ggsq'), { typeK: 'q8_0' }))
  t.is(e.code, 'ERR_KV_UNSUPPORTED')
  t.regex(e.message, /re-typing.*dsv4/)
  t.false(fs.existsSync(path.join(dir, 'q8.ggsq')))
  fs.rmSync(dir, { recursive: true })
})

test('no live cache takes a dsv4 state: fromModel and a load are refused with ERR_KV_UNSUPPORTED, the cache unchanged', (t) => {
  const e = t.throws(() => KvCache.fromModel(model('deepseek4.gguf')))
  t.is(e.code, 'ERR_KV_UNSUPPORTED')
  t.regex(e.message, /dsv4/)
  const c = new KvCache({ size: 64, nLayer: 3, nEmbdKGqa: 32, nEmbdVGqa: 0, noV: true, nSeqMax: 2 })
  const load = t.throws(() => c.loadSequenceFileSync(SEQUENCE, 1))
  t.is(load.code, 'ERR_KV_UNSUPPORTED')
  t.regex(load.message, /dsv4/)
  t.is(c.usedCells, 0)
  c.dispose()
})

test('the prompt store keeps a dsv4 state and writes it back with its compressed caches', async (t) => {
  const dir = tmp()
  const store = new PromptStore({ model: 'deepseek4', blockTokens: 16, path: dir })
  await t.throwsAsync(store.putFile(SESSION), { code: 'ERR_KV_STORE_NOT_PREFIX', message: /one sequence/ })
  const { tokens } = inspectState(SEQUENCE)
  t.is((await store.putFile(SEQUENCE)).tokens, tokens.length)
  t.is(await store.lookup(tokens), tokens.length)
  const out = path.join(dir, 'out.ggsq')
  t.is(await store.writeFile(tokens, out), tokens.length)
  const [ours, peer] = [inspectState(out), inspectState(SEQUENCE)]
  t.is(ours.memory, 'dsv4')
  t.deepEqual(ours.compressed, peer.compressed)
  fs.rmSync(dir, { recursive: true })
})

import test from 'ava'
import fs from 'node:fs'
import os from 'node:os'
import path from 'node:path'
import { execFileSync, spawnSync } from 'node:child_process'
import { createRequire } from 'node:module'

const require = createRequire(import.meta.url)
const { KvCache, inspectState, convertStateFileSync } = require('../index.js')
const FIXTURES = path.join(import.meta.dirname ?? path.dirname(new URL(import.meta.url).pathname), 'fixtures')
const CLI = path.join(FIXTURES, '..', '..', 'bin', 'llama-kv-cache.js')

const tmp = () => fs.mkdtempSync(path.join(os.tmpdir(), 'kvc-'))
const make = (o = {}) => new KvCache({ size: 64, nLayer: 2, nEmbdKGqa: 32, nSeqMax: 4, ...o })

function filled(o) {
  const c = make(o)
  c.findSlot({ pos: [0, 1, 2], seqIds: [[0, 1], [0, 1], [0, 1]] })
  for (let p = 3; p < 9; p++) c.findSlot({ pos: [p, p], seqIds: [0, 1] })
  for (let i = 0; i < 15; i++) {
    for (let il = 0; il < 2; il++) {
      c.writeKF32(il, i, Float32Array.from({ length: 32 }, (_, j) => i + j / 64))
      c.writeVF32(il, i, Float32Array.from({ length: 32 }, (_, j) => -i - j / 64))
    }
  }
  return c
}

// the h16 model's cache: 2 layers, head_dim 16, 2 KV heads, n_ctx 256
const peerCache = (o = {}) => new KvCache({ size: 256, nLayer: 2, nEmbdKGqa: 32, nSeqMax: 2, ...o })

test('whole-cache state round trips byte for byte, sync and async', async (t) => {
  const a = filled()
  const blob = a.stateWriteSync()
  t.is(blob.length, a.stateSize())
  const b = make()
  t.deepEqual(b.stateReadSync(blob).cells, 15)
  t.deepEqual(b.stateWriteSync(), blob)
  const c = make()
  const r = await c.stateRead(await a.stateWrite(-1, { layout: 'seed' }))
  t.is(r.layout, 'seed')
  t.deepEqual(c.stateWriteSync(-1, { layout: 'seed' }), a.stateWriteSync(-1, { layout: 'seed' }))
})

test('stateWriteInto fills a caller buffer with the same bytes, sync and async, and refuses a small one', async (t) => {
  const a = filled()
  for (const seq of [-1, 1]) {
    const expected = a.stateWriteSync(seq)
    const buf = new Uint8Array(expected.length + 3).fill(0xee)
    t.is(a.stateWriteIntoSync(buf, seq), expected.length)
    t.deepEqual(Buffer.from(buf.subarray(0, expected.length)), expected)
    t.deepEqual([...buf.subarray(expected.length)], [0xee, 0xee, 0xee])
    const view = new Uint8Array(new ArrayBuffer(expected.length + 8), 8)
    t.is(await a.stateWriteInto(view, seq), expected.length)
    t.deepEqual(Buffer.from(view), expected)
  }
  const small = Buffer.alloc(a.stateSize() - 1, 1)
  const err = t.throws(() => a.stateWriteIntoSync(small), { code: 'ERR_KV_INVALID_ARG' })
  t.regex(err.message, new RegExp(`${small.length}.*${small.length + 1}`))
  t.true(small.every((b) => b === 1))
  t.throws(() => a.stateWriteIntoSync([1, 2, 3]), { code: 'ERR_KV_INVALID_ARG' })
  await t.throwsAsync(async () => a.stateWriteInto(small), { code: 'ERR_KV_INVALID_ARG' })
})

test('stateRead reads a view into a larger buffer in place, sync and async', async (t) => {
  const a = filled()
  const blob = a.stateWriteSync(1)
  const backing = new Uint8Array(blob.length + 16).fill(0x55)
  backing.set(blob, 16)
  const view = backing.subarray(16)
  const b = make()
  const r = b.stateReadSync(view, 2)
  t.is(r.cells, a.seqCellCount(1))
  t.true(r.placed instanceof Uint32Array)
  t.is(r.placed.length, r.cells)
  t.deepEqual(b.stateWriteSync(2, { layout: 'seed' }), a.stateWriteSync(1, { layout: 'seed' }))
  const c = make()
  t.is((await c.stateRead(view, 3)).cells, a.seqCellCount(1))
  t.deepEqual(c.stateWriteSync(3, { layout: 'seed' }), a.stateWriteSync(1, { layout: 'seed' }))
})

test.serial('async stateRead of multi-MiB payloads, copied into reused staging memory or transferred, loads what stateReadSync loads', async (t) => {
  // 1 MiB and more is copied into staging memory that the next copy reuses: a smaller
  // payload after a larger one must read its own bytes only
  // (serial: its JS work would delay the progress report the abort test below waits for)
  const geometry = { size: 512, nLayer: 4, nEmbdKGqa: 512, typeK: 'f16', typeV: 'f16' }
  const source = (cells, seed) => {
    const c = new KvCache(geometry)
    c.findSlot({ pos: Int32Array.from({ length: cells }, (_, i) => i), seqIds: new Array(cells).fill(0) })
    const rows = Buffer.alloc(cells * 1024)
    for (let i = 0; i < rows.length; i += 2) rows.writeUInt16LE(0x3c00 ^ ((i * seed) >>> 7) & 0x3ff, i)
    for (let il = 0; il < 4; il++) {
      c.writeK(il, 0, rows)
      c.writeV(il, 0, rows)
    }
    return c.stateWriteSync(0)
  }
  const large = source(500, 2654435761)
  const smaller = source(300, 40503)
  t.true(smaller.length > 1 << 20)
  for (const [blob, options] of [[large, undefined], [smaller, undefined], [large, { transfer: true }]]) {
    const expected = new KvCache(geometry)
    expected.stateReadSync(blob, 0)
    const c = new KvCache(geometry)
    const data = Buffer.from(blob)
    const pending = c.stateRead(data, 0, options)
    t.is(data.length, options ? 0 : blob.length, options ? 'taken' : 'copied')
    if (!options) data.fill(0xff)
    await pending
    t.deepEqual(c.stateWriteSync(0), expected.stateWriteSync(0))
  }
})

test('transfer is an option of stateRead only: the file loaders refuse it', async (t) => {
  const a = filled()
  const dir = tmp()
  const file = path.join(dir, 'seq.bin')
  a.saveSequenceFileSync(file, 0, [1, 2, 3])
  const c = make()
  const refused = { code: 'ERR_KV_INVALID_ARG', message: /transfer is an option of stateRead/ }
  t.throws(() => c.loadSequenceFileSync(file, 0, { transfer: true }), refused)
  t.throws(() => c.loadSequenceFile(file, 0, { transfer: true }), refused)
  t.is(c.stateReadSync(a.stateWriteSync(0), 0, { transfer: true }).cells, a.seqCellCount(0))
  fs.rmSync(dir, { recursive: true, force: true })
})

test('a sequence restores into another id', (t) => {
  const a = filled()
  const blob = a.stateWriteSync(1)
  const b = make()
  const r = b.stateReadSync(blob, 3)
  t.is(r.cells, 9)
  t.is(b.seqPosMax(3), 8)
  // seq 1's fifth cell in `a` is cell 6 (cells 0-2 shared, then 3: seq 0, 4: seq 1, 5: seq 0, 6: seq 1)
  t.deepEqual(b.readKF32(0, r.placed[4], 1), a.readKF32(0, 6, 1))
})

test('corrupted states fail with ERR_KV_INVALID_STATE and change nothing', (t) => {
  const a = filled()
  const blob = a.stateWriteSync()
  const b = filled()
  b.seqRm(1, 4)
  const before = b.stateWriteSync()
  for (const bad of [blob.subarray(0, 10), blob.subarray(0, blob.length - 1), Buffer.concat([blob, Buffer.from([0])])]) {
    const e = t.throws(() => b.stateReadSync(bad))
    t.is(e.code, 'ERR_KV_INVALID_STATE', e.message)
  }
  const wrongType = filled({ typeK: 'f32', typeV: 'f32' }).stateWriteSync()
  t.regex(t.throws(() => b.stateReadSync(wrongType)).message, /type/)
  t.deepEqual(b.stateWriteSync(), before)
  t.is(t.throws(() => b.stateReadSync(blob, 9)).code, 'ERR_KV_OUT_OF_RANGE')
  t.is(t.throws(() => b.stateReadSync('nope')).code, 'ERR_KV_INVALID_ARG')
  t.is(t.throws(() => b.stateReadSync(blob, -1, { layout: 'v3' })).code, 'ERR_KV_INVALID_ARG')
})

test('no room for a sequence is ERR_KV_NO_SPACE unless scattering is allowed', (t) => {
  const blob = filled().stateWriteSync(0)
  const b = make({ size: 16 })
  b.findSlot({ pos: Array.from({ length: 16 }, (_, i) => i), seqIds: Array(16).fill(2) })
  for (let p = 0; p < 16; p += 2) b.seqRm(2, p, p + 1)
  b.seqRm(2, 15, 16)
  const before = b.stateWriteSync()
  t.is(t.throws(() => b.stateReadSync(blob, 0)).code, 'ERR_KV_NO_SPACE')
  t.deepEqual(b.stateWriteSync(), before)
  t.is(b.stateReadSync(blob, 0, { allowScattered: true }).cells, 9)
})

test('sequence and session files save atomically and load back', async (t) => {
  const dir = tmp()
  const a = filled()
  const seqFile = path.join(dir, 's.ggsq')
  await a.saveSequenceFile(seqFile, 1, [5, 6, 7])
  const b = make()
  const loaded = await b.loadSequenceFile(seqFile, 2)
  t.deepEqual(loaded.tokens, [5, 6, 7])
  t.is(loaded.format, 'sequence')
  t.is(loaded.version, 2)
  t.is(b.seqCellCount(2), 9)
  const sessFile = path.join(dir, 's.ggsn')
  const progress = []
  await a.saveSessionFile(sessFile, new Int32Array([1, 2]), { arch: 'llama', version: 10, onProgress: (d, n) => progress.push([d, n]) })
  const s = b.loadSessionFileSync(sessFile)
  t.is(s.arch, 'llama')
  t.is(s.version, 10)
  t.deepEqual(b.stateWriteSync(), a.stateWriteSync())
  await new Promise((r) => setImmediate(r))
  t.true(progress.length > 0)
  t.is(progress.at(-1)[0], progress.at(-1)[1])
  // a failed save leaves the previous file intact and no temporary file behind
  const good = fs.readFileSync(seqFile)
  const e = t.throws(() => a.saveSequenceFileSync(seqFile, 1, [1.5]))
  t.is(e.code, 'ERR_KV_INVALID_ARG')
  await t.throwsAsync(a.saveSequenceFile(path.join(dir, 'missing', 'x.ggsq'), 1, []), { code: 'ERR_KV_IO' })
  t.is(t.throws(() => a.saveSequenceFileSync(seqFile, 1, [], { version: 5 })).code, 'ERR_KV_INVALID_ARG')
  t.deepEqual(fs.readFileSync(seqFile), good)
  t.deepEqual(fs.readdirSync(dir).sort(), ['s.ggsn', 's.ggsq'])
  await t.throwsAsync(b.loadSequenceFile(sessFile, 0), { code: 'ERR_KV_INVALID_STATE' })
  await t.throwsAsync(b.loadSessionFile(path.join(dir, 'nope')), { code: 'ERR_KV_IO' })
})

test('the cache is busy while a state task runs, and an abort stops it', async (t) => {
  const a = filled()
  const p = a.stateWrite()
  t.is(t.throws(() => a.usedCells).code, 'ERR_KV_BUSY')
  t.true((await p).length > 0)
  // a state large enough (64 layers, 128 MB) that the first progress report reaches JS while
  // the task still runs: aborting then stops it between layers
  const big = new KvCache({ size: 1024, nLayer: 64, nEmbdKGqa: 256, typeK: 'f32', typeV: 'f32', flashAttn: true })
  big.findSlot({ pos: Array.from({ length: 1024 }, (_, i) => i), seqIds: Array(1024).fill(0) })
  const ac = new AbortController()
  let reports = 0
  const q = big.stateWrite(-1, { signal: ac.signal, onProgress: () => { reports++; ac.abort() } })
  const e = await t.throwsAsync(q)
  t.is(e.code, 'ERR_KV_ABORTED', e.message)
  t.is(e.name, 'AbortError')
  t.true(reports >= 1)
  t.is(big.usedCells, 1024, 'the cache stays usable')
  big.dispose()
  const done = new AbortController()
  done.abort()
  const pre = await t.throwsAsync(a.stateRead(Buffer.alloc(4), -1, { signal: done.signal }))
  t.is(pre.code, 'ERR_KV_ABORTED')
})

const peerFiles = fs.readdirSync(FIXTURES).filter((f) => /\.gg(sn|sq)$/.test(f))

test('files written by llama.node and node-llama-cpp load and write back identically', (t) => {
  let checked = 0
  for (const f of peerFiles) {
    const side = JSON.parse(fs.readFileSync(path.join(FIXTURES, `${f}.json`), 'utf8'))
    if (side.recurrent || side.model !== 'llama-h16.gguf') continue
    const info = inspectState(path.join(FIXTURES, f))
    const c = peerCache({ flashAttn: info.vTrans === false, typeK: info.layers[0].kType, typeV: info.layers[0].vType, nSeqMax: side.n_seq_max })
    const file = path.join(FIXTURES, f)
    const out = path.join(tmp(), f)
    const opts = { version: info.version, layout: info.layout, nStream: info.streams.length }
    if (info.format === 'session') {
      const l = c.loadSessionFileSync(file)
      c.saveSessionFileSync(out, l.tokens, { ...opts, arch: l.arch })
    } else {
      const seq = side.seq_id ?? 0
      const l = c.loadSequenceFileSync(file, seq)
      c.saveSequenceFileSync(out, seq, l.tokens, opts)
    }
    t.deepEqual(fs.readFileSync(out), fs.readFileSync(file), f)
    checked++
  }
  t.true(checked >= 6)
})

test('truncated peer files are refused at every field boundary and the cache is untouched', (t) => {
  const file = fs.readFileSync(path.join(FIXTURES, 'nlc-h16-f16.ggsq'))
  const dir = tmp()
  const c = peerCache()
  c.findSlot({ pos: [0, 1, 2], seqIds: [1, 1, 1] })
  const before = c.stateWriteSync()
  for (let cut = 0; cut < file.length; cut += 3) {
    const p = path.join(dir, 'cut.ggsq')
    fs.writeFileSync(p, file.subarray(0, cut))
    const e = t.throws(() => c.loadSequenceFileSync(p, 0))
    t.true(['ERR_KV_INVALID_STATE'].includes(e.code), `${cut}: ${e.code} ${e.message}`)
  }
  t.deepEqual(c.stateWriteSync(), before)
})

test('inspectState describes a peer file', (t) => {
  const info = inspectState(path.join(FIXTURES, 'nlc-h16-f16-seq1of2.ggsq'))
  t.is(info.magic, 'ggsq')
  t.is(info.version, 3)
  t.is(info.streams.length, 2)
  t.is(info.streams[0].cellCount, 0)
  t.deepEqual(info.streams[1].seqs['1'], { cells: 9, posMin: 0, posMax: 8 })
  t.is(info.layers[0].kType, 'f16')
  t.is(info.bytes, fs.statSync(path.join(FIXTURES, 'nlc-h16-f16-seq1of2.ggsq')).size)
  t.is(t.throws(() => inspectState(Buffer.from('nope'))).code, 'ERR_KV_INVALID_STATE')
})

test('convertStateFileSync changes version and layout and re-types K/V', (t) => {
  const dir = tmp()
  const src = path.join(FIXTURES, 'ln-h16-f16.ggsn')
  const seqOut = path.join(dir, 'seq0.ggsq')
  convertStateFileSync(src, seqOut, { seqId: 0, version: 3 })
  const info = inspectState(seqOut)
  t.is(info.format, 'sequence')
  t.is(info.version, 3)
  const f32 = path.join(dir, 'f32.ggsn')
  convertStateFileSync(src, f32, { typeK: 'f32', typeV: 'f32', layout: 'seed' })
  const i2 = inspectState(f32)
  t.is(i2.layers[0].kType, 'f32')
  t.is(i2.layout, 'seed')
  const back = path.join(dir, 'back.ggsn')
  convertStateFileSync(f32, back, { typeK: 'f16', typeV: 'f16', layout: 'streams' })
  t.deepEqual(fs.readFileSync(back), fs.readFileSync(src), 'f16 -> f32 -> f16 is lossless')
  t.is(t.throws(() => convertStateFileSync(src, path.join(dir, 'x'), { typeV: 'q8_0' })).code, 'ERR_KV_INVALID_ARG')
})

test('the CLI inspects the bundled sample and converts files', (t) => {
  const text = execFileSync(process.execPath, [CLI, 'inspect'], { encoding: 'utf8' })
  t.regex(text, /session \('ggsn'\) version 9/)
  const json = JSON.parse(execFileSync(process.execPath, [CLI, 'inspect', path.join(FIXTURES, 'ln-h16-f16.ggsn'), '--json'], { encoding: 'utf8' }))
  t.deepEqual(Object.keys(json).slice(0, 5), ['format', 'magic', 'version', 'nTokens', 'arch'])
  t.is(json.streams[0].cellCount, 7)
  t.is(json.nLayer, 2)
  const out = path.join(tmp(), 'c.ggsq')
  execFileSync(process.execPath, [CLI, 'convert', path.join(FIXTURES, 'nlc-h16-f16.ggsq'), out, '--version', '2'])
  t.is(inspectState(out).version, 2)
  const bad = spawnSync(process.execPath, [CLI, 'inspect', path.join(FIXTURES, 'missing.ggsq')], { encoding: 'utf8' })
  t.is(bad.status, 1)
  t.regex(bad.stderr, /ERR_KV_IO/)
  const usage = spawnSync(process.execPath, [CLI, 'frobnicate'], { encoding: 'utf8' })
  t.is(usage.status, 2)
})

test('convert writes other stream counts, renames sequences, turns sequences into sessions, and refuses to guess', (t) => {
  const dir = tmp()
  const slot1 = path.join(dir, 'slot1.ggsq')
  convertStateFileSync(path.join(FIXTURES, 'ln-h16-f16.ggsn'), slot1, { seqId: 0, asSeqId: 1, nStream: 2, version: 3 })
  const info = inspectState(slot1)
  t.is(info.streams.length, 2)
  t.is(info.streams[0].cellCount, 0)
  t.deepEqual(info.streams[1].seqs['1'], { cells: 7, posMin: 0, posMax: 6 })
  // a sequence past the last stream would be written nowhere: refused, no file left
  const nowhere = path.join(dir, 'nowhere.ggsq')
  const past = t.throws(() => convertStateFileSync(path.join(FIXTURES, 'ln-h16-f16.ggsn'), nowhere, { seqId: 0, asSeqId: 2, nStream: 2, version: 3 }))
  t.is(past.code, 'ERR_KV_INVALID_ARG')
  t.regex(past.message, /sequence 2 has no stream of its own among nStream 2/)
  t.false(fs.existsSync(nowhere))
  const session = path.join(dir, 's.ggsn')
  convertStateFileSync(path.join(FIXTURES, 'nlc-h16-f16.ggsq'), session, { to: 'session', arch: 'llama' })
  t.is(inspectState(session).format, 'session')
  const mamba = path.join(FIXTURES, 'nlc-mamba.ggsq')
  const e = t.throws(() => convertStateFileSync(mamba, path.join(dir, 'm.ggsq'), { version: 3 }))
  t.is(e.code, 'ERR_KV_INVALID_ARG')
  t.regex(e.message, /recurrent/)
  convertStateFileSync(mamba, path.join(dir, 'm.ggsq'), { version: 3, recurrent: true })
  t.deepEqual(fs.readFileSync(path.join(dir, 'm.ggsq')), fs.readFileSync(mamba))
  const ln = inspectState(path.join(FIXTURES, 'ln-mamba.ggsn'))
  t.is(ln.recurrent, true)
  t.is(ln.layout, 'streams', 'a session without the outputs block is today\'s format')
  t.is(inspectState(mamba).recurrent ?? null, null, 'a stream-less sequence file cannot tell')
})

// inspectState and convertStateFileSync on files: a path is described from its metadata only, and
// converted layer by layer, so neither costs memory in proportion to the file.
import test from 'ava'
import fs from 'node:fs'
import os from 'node:os'
import path from 'node:path'
import { spawnSync } from 'node:child_process'
import { createRequire } from 'node:module'

const require = createRequire(import.meta.url)
const { inspectState } = require('../index.js')
const HERE = import.meta.dirname ?? path.dirname(new URL(import.meta.url).pathname)
const FIXTURES = path.join(HERE, 'fixtures')
const ADDON = path.join(HERE, '..', 'index.js')

const tmp = () => fs.mkdtempSync(path.join(os.tmpdir(), 'kvc-ic-'))
const fixtures = () =>
  [FIXTURES, path.join(FIXTURES, 't161')].flatMap((dir) =>
    fs.readdirSync(dir).filter((f) => /\.(ggsn|ggsq)$/.test(f)).map((f) => path.join(dir, f)))

/** A ggsq v3 file of `cells` cells and 2 f16 layers with `row`-byte K and V rows: headers written, rows a hole. */
function sparseSequenceFile(file, cells, row) {
  const fd = fs.openSync(file, 'w')
  const u32 = (...v) => Buffer.from(new Uint32Array(v).buffer)
  const head = [u32(0x67677371, 3, 2, 11, 22, 1, cells)]
  for (let i = 0; i < cells; i++) head.push(u32(i, 1, 0))
  head.push(u32(0, 2))
  let at = 0
  for (const b of head) at += fs.writeSync(fd, b, 0, b.length, at)
  const block = BigInt(row) * BigInt(cells)
  let pos = BigInt(at)
  for (let i = 0; i < 4; i++) {
    const h = Buffer.alloc(12)
    h.writeInt32LE(1, 0)
    h.writeBigUInt64LE(BigInt(row), 4)
    fs.writeSync(fd, h, 0, 12, Number(pos))
    pos += 12n + block
  }
  fs.ftruncateSync(fd, Number(pos))
  fs.closeSync(fd)
  return Number(pos)
}

/** Runs `body` (JS source using `addon` and `file`) in a fresh node; returns its JSON result and peak RSS growth. */
function inChild(body, file) {
  const script = `
    const addon = require(${JSON.stringify(ADDON)})
    const file = ${JSON.stringify(file)}
    const before = process.resourceUsage().maxRSS
    const result = (() => { ${body} })()
    const grew = (process.resourceUsage().maxRSS - before) * 1024
    process.stdout.write(JSON.stringify({ result, grew }))`
  const r = spawnSync(process.execPath, ['-e', script], { encoding: 'utf8' })
  if (r.status !== 0) throw new Error(r.stderr)
  return JSON.parse(r.stdout)
}

test('inspectState of a path describes the file as inspectState of its bytes does', (t) => {
  const files = fixtures()
  t.true(files.length >= 40)
  for (const f of files) t.deepEqual(inspectState(f), inspectState(fs.readFileSync(f)), f)
})

test('inspectState of a sparse 4 GiB file reads its metadata only (RSS growth under 16 MiB)', (t) => {
  const dir = tmp()
  const file = path.join(dir, 'big.ggsq')
  const size = sparseSequenceFile(file, 16, 64 * 2 ** 20)
  t.true(size > 4 * 2 ** 30)
  const { result, grew } = inChild('const i = addon.inspectState(file); return { bytes: i.bytes, layers: i.layers, cells: i.streams[0].cellCount }', file)
  fs.rmSync(dir, { recursive: true })
  t.is(result.bytes, size)
  t.is(result.cells, 16)
  t.deepEqual(result.layers[1], { kType: 'f16', kRowSize: 64 * 2 ** 20, vType: 'f16', vRowSize: 64 * 2 ** 20 })
  t.true(grew < 16 * 2 ** 20, `RSS grew by ${grew} bytes`)
})

/** A sequence file of a 2-layer, 8192-wide f16 cache (16 KiB rows): `cells` cells of sequence 0, rows filled. */
function bigSequenceFile(file, cells) {
  const { KvCache } = require('../index.js')
  const c = new KvCache({ size: cells, nLayer: 2, nEmbdKGqa: 8192, nSeqMax: 1, flashAttn: true })
  c.findSlot({ pos: Int32Array.from({ length: cells }, (_, i) => i), seqIds: [0], nSeqTokens: cells })
  const rows = Float32Array.from({ length: 8192 * 256 }, (_, i) => Math.sin(i) * 4)
  for (let il = 0; il < 2; il++) {
    for (let first = 0; first < cells; first += 256) {
      c.writeKF32(il, first, rows)
      c.writeVF32(il, first, rows)
    }
  }
  c.saveSequenceFileSync(file, 0, [1, 2, 3], { version: 3 })
  c.dispose()
  return fs.statSync(file).size
}

test('convertStateFileSync reports progress after each layer up to the output size', (t) => {
  const { convertStateFileSync } = require('../index.js')
  const dir = tmp()
  const src = path.join(FIXTURES, 't161', 't161-gemma3-swa.ggsn')
  const out = path.join(dir, 'out.ggsn')
  const seen = []
  convertStateFileSync(src, out, { version: 10, onProgress: (done, total) => seen.push([done, total]) })
  const size = fs.statSync(out).size
  t.true(seen.length >= 4, `${seen.length} progress calls`)
  t.true(seen.every(([d, tot], i) => tot === size && d <= tot && (i === 0 || d >= seen[i - 1][0])))
  t.is(seen.at(-1)[0], size)
  t.is(inspectState(out).memory, 'iswa')
  fs.rmSync(dir, { recursive: true })
})

test('convertStateFileSync: an onProgress that throws stops it with ERR_KV_ABORTED, leaving the old output and no litter', (t) => {
  const { convertStateFileSync } = require('../index.js')
  const dir = tmp()
  const out = path.join(dir, 'out.ggsq')
  fs.writeFileSync(out, 'old')
  const e = t.throws(() => convertStateFileSync(path.join(FIXTURES, 'nlc-h16-f16.ggsq'), out, {
    typeK: 'f32',
    onProgress: () => { throw new Error('stop here') },
  }))
  t.is(e.code, 'ERR_KV_ABORTED')
  t.regex(e.message, /stop here/)
  t.deepEqual(fs.readdirSync(dir), ['out.ggsq'])
  t.is(fs.readFileSync(out, 'utf8'), 'old')
  const bad = t.throws(() => convertStateFileSync(path.join(FIXTURES, 'nlc-h16-f16.ggsq'), out, { onProgress: 3 }))
  t.is(bad.code, 'ERR_KV_INVALID_ARG')
  fs.rmSync(dir, { recursive: true })
})

test('convertStateFileSync streams: converting a 256 MiB file to q8_0 K grows RSS by under 48 MiB', (t) => {
  const dir = tmp()
  const src = path.join(dir, 'big.ggsq')
  const size = bigSequenceFile(src, 4096)
  t.true(size > 256 * 2 ** 20)
  const out = path.join(dir, 'out.ggsq')
  const { result, grew } = inChild(`
    addon.convertStateFileSync(file, ${JSON.stringify(out)}, { typeK: 'q8_0', version: 2 })
    return addon.inspectState(${JSON.stringify(out)}).layers[0]`, src)
  t.is(result.kType, 'q8_0')
  t.is(result.vType, 'f16')
  t.log(`RSS grew by ${(grew / 2 ** 20).toFixed(1)} MiB converting ${(size / 2 ** 20).toFixed(0)} MiB`)
  t.true(grew < 48 * 2 ** 20, `RSS grew by ${grew} bytes converting ${size} bytes`)
  fs.rmSync(dir, { recursive: true })
})

const CLI = path.join(HERE, '..', 'bin', 'llama-kv-cache.js')
const T161_H16 = path.join(FIXTURES, 't161', 't161-h16-f16.ggsn')

/** What convertStateFileSync itself writes for `src` at `version`: the CLI must write the same bytes. */
function convertedBytes(src, version) {
  const { convertStateFileSync } = require('../index.js')
  const dir = tmp()
  const out = path.join(dir, 'expected.ggsn')
  convertStateFileSync(src, out, { version })
  const bytes = fs.readFileSync(out)
  fs.rmSync(dir, { recursive: true })
  return bytes
}

test('CLI convert prints only the output path on a pipe, no progress bar', (t) => {
  const dir = tmp()
  const piped = spawnSync(process.execPath, [CLI, 'convert', T161_H16, path.join(dir, 'a.ggsn'), '--version', '10'], { encoding: 'utf8' })
  t.is(piped.status, 0, piped.stderr)
  t.is(piped.stderr, '')
  t.is(piped.stdout.trim(), path.join(dir, 'a.ggsn'))
  t.deepEqual(fs.readFileSync(path.join(dir, 'a.ggsn')), convertedBytes(T161_H16, 10))
  fs.rmSync(dir, { recursive: true })
})

// util-linux `script` (Debian's bsdutils, always installed there) runs the command on a pseudo-terminal;
// BSD's and macOS's `script` take other arguments, Windows has none
const TTY_TITLE = 'CLI convert draws a progress bar on a terminal (through script(1))'
;(process.platform === 'linux'
  ? test
  : (title, fn) => test.skip(`${title}: skipped: needs util-linux script(1) for a pseudo-terminal, Linux only (this is ${process.platform})`, fn))(TTY_TITLE, (t) => {
  const dir = tmp()
  const quote = (s) => `'${s.replace(/'/g, "'\\''")}'`
  const cmd = [process.execPath, CLI, 'convert', T161_H16, path.join(dir, 'b.ggsn'), '--version', '10'].map(quote).join(' ')
  const tty = spawnSync('script', ['-qec', cmd, '/dev/null'], { encoding: 'utf8' })
  if (tty.error) {
    t.fail(`script(1) cannot run here (${tty.error.code}): install it with \`apt-get install bsdutils\` (util-linux's script)`)
    return
  }
  t.is(tty.status, 0, tty.stdout)
  const size = fs.statSync(path.join(dir, 'b.ggsn')).size
  t.regex(tty.stdout, new RegExp(`\\rb\\.ggsn \\[#{30}\\] ${size}/${size}`))
  t.deepEqual(fs.readFileSync(path.join(dir, 'b.ggsn')), convertedBytes(T161_H16, 10))
  fs.rmSync(dir, { recursive: true })
})

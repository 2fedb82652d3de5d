// inspectState and convertStateFile on files: a path is described from its metadata only, and
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

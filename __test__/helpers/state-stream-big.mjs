// Large state streams, each in its own process so that its RSS is its own (ava runs the tests
// of a file concurrently). Prints `@@RESULT {json}`. Modes:
//   over4g  a 4.1 GiB one-sequence state streamed out of an untouched cache (lazily zeroed
//           tensors: reading them maps the zero page), every byte checked against the layout
//   far     a generated payload loaded into cells whose rows lie past 4 GiB in their tensor
//   files   a 256 MiB state saved to a file and loaded back through fs streams
import fs from 'node:fs'
import os from 'node:os'
import path from 'node:path'
import crypto from 'node:crypto'
import { Readable } from 'node:stream'
import v8 from 'node:v8'
import vm from 'node:vm'
import { pipeline } from 'node:stream/promises'
import { createRequire } from 'node:module'

const require = createRequire(import.meta.url)
const { KvCache } = require('../../index.js')

// A consumer drops each chunk at once; V8 collects dropped Buffers on its own schedule, after
// about 64 MiB of them (fs streams' chunks wait the same way). The over4g check collects every
// 16 chunks (64 MiB) so that it measures what the stream itself keeps.
v8.setFlagsFromString('--expose-gc')
const collect = vm.runInNewContext('gc')
const kb = (field) => Number(fs.readFileSync('/proc/self/status', 'utf8').match(new RegExp(`${field}:\\s+(\\d+)`))[1])
const MiB = 1 << 20
const u32 = (v) => { const b = Buffer.alloc(4); b.writeUInt32LE(v); return b }
const u64 = (v) => { const b = Buffer.alloc(8); b.writeBigUInt64LE(BigInt(v)); return b }
// a streams-layout one-sequence payload's head: n_stream 1, the cells (pos, 1 id), v_trans, n_layer
function head(positions, seq, vTrans, nLayer) {
  const cells = Buffer.alloc(12 * positions.length)
  positions.forEach((p, i) => { cells.writeInt32LE(p, 12 * i); cells.writeUInt32LE(1, 12 * i + 4); cells.writeInt32LE(seq, 12 * i + 8) })
  return Buffer.concat([u32(1), u32(positions.length), cells, u32(vTrans), u32(nLayer)])
}
const F16 = 1
const occupy = (c, seq, n) => c.findSlot({ pos: Int32Array.from({ length: n }, (_, i) => i), seqIds: new Array(n).fill(seq) })

async function over4g() {
  const [nLayer, width, n] = [32, 4096, 8448]
  const row = width * 2
  const c = new KvCache({ size: n, nLayer, nEmbdKGqa: width, flashAttn: true })
  occupy(c, 0, n)
  // two marked rows in the last layer's last cell: both land past 4 GiB in the payload
  const kRow = Buffer.alloc(row, 0x11)
  const vRow = Buffer.alloc(row, 0x22)
  c.writeK(nLayer - 1, n - 1, kRow)
  c.writeV(nLayer - 1, n - 1, vRow)
  // every non-zero byte of the payload, by offset
  const spans = []
  let off = 0
  const at = (bytes) => { spans.push([off, bytes]); off += bytes.length }
  at(head(Array.from({ length: n }, (_, i) => i), 0, 0, nLayer))
  for (const [which, marked] of [['k', kRow], ['v', vRow]]) {
    for (let il = 0; il < nLayer; il++) {
      at(Buffer.concat([u32(F16), u64(row)]))
      if (il === nLayer - 1) spans.push([off + (n - 1) * row, marked])
      off += n * row
      void which
    }
  }
  const expectedSize = off
  // the iterator may hand over several chunks at once (read() returns all that is buffered)
  const zero = Buffer.alloc(4 * MiB)
  const isZero = (b) => {
    for (let o = 0; o < b.length; o += zero.length) {
      const part = b.subarray(o, o + zero.length)
      if (!part.equals(zero.subarray(0, part.length))) return false
    }
    return true
  }
  let pos = 0
  let chunks = 0
  let mismatches = 0
  let si = 0
  let peakGrowth = 0
  const check = (chunk) => {
    chunks++
    let i = 0
    while (i < chunk.length) {
      const abs = pos + i
      while (si < spans.length && spans[si][0] + spans[si][1].length <= abs) si++
      const span = spans[si]
      const end = pos + chunk.length
      if (!span || abs < span[0]) {
        const to = Math.min(span ? span[0] : end, end)
        if (!isZero(chunk.subarray(i, to - pos))) mismatches++
        i = to - pos
      } else {
        const to = Math.min(span[0] + span[1].length, end)
        if (!chunk.subarray(i, to - pos).equals(span[1].subarray(abs - span[0], to - span[0]))) mismatches++
        i = to - pos
      }
    }
    pos += chunk.length
    if (chunks % 16 === 0) {
      peakGrowth = Math.max(peakGrowth, kb('VmRSS') - rss0)
      collect()
    }
  }
  const rss0 = kb('VmRSS')
  const [anon0, file0] = [kb('RssAnon'), kb('RssFile')]
  const started = process.hrtime.bigint()
  const s = c.createStateReadStream(0)
  const size = s.size
  for await (const chunk of s) check(chunk)
  return {
    size,
    stateSize: c.stateSize(0),
    expectedSize,
    streamed: pos,
    chunks,
    mismatches,
    seconds: Number(process.hrtime.bigint() - started) / 1e9,
    rssGrowthMiB: Math.max(peakGrowth, kb('VmRSS') - rss0) / 1024,
    anonGrowthMiB: (kb('RssAnon') - anon0) / 1024,
    fileGrowthMiB: (kb('RssFile') - file0) / 1024,
  }
}

async function far() {
  const width = 262144 // 512 KiB rows: cell 8192 starts at 4 GiB
  const row = width * 2
  const n = 8300
  const c = new KvCache({ size: n, nLayer: 1, nEmbdKGqa: width, flashAttn: true, nSeqMax: 2 })
  occupy(c, 0, n - 8)
  const positions = [0, 1, 2, 3]
  const k = Buffer.alloc(4 * row)
  const v = Buffer.alloc(4 * row)
  for (let i = 0; i < k.length; i++) { k[i] = (i * 7 + 1) & 255; v[i] = (i * 13 + 5) & 255 }
  const payload = Buffer.concat([head(positions, 1, 0, 1), u32(F16), u64(row), k, u32(F16), u64(row), v])
  // odd-sized pieces: row and header boundaries fall inside them
  const pieces = []
  for (let o = 0; o < payload.length; o += 100003) pieces.push(payload.subarray(o, o + 100003))
  const rss0 = kb('VmRSS')
  const w = c.createStateWriteStream(1)
  await pipeline(Readable.from(pieces), w)
  const placed = Array.from(w.result.placed)
  const out = []
  for await (const chunk of c.createStateReadStream(1)) out.push(chunk)
  return {
    placed,
    beyond4GiB: placed[0] * row >= 2 ** 32,
    kMatches: c.readK(0, placed[0], 4).equals(k),
    vMatches: c.readV(0, placed[0], 4).equals(v),
    roundTrips: Buffer.concat(out).equals(payload),
    rssGrowthMiB: (kb('VmRSS') - rss0) / 1024,
  }
}

async function hashOf(readable) {
  const h = crypto.createHash('sha256')
  for await (const chunk of readable) h.update(chunk)
  return h.digest('hex')
}

async function files() {
  const geo = { size: 4096, nLayer: 16, nEmbdKGqa: 1024 } // transposed V; 256 MiB of tensors
  const n = 4000
  const a = new KvCache(geo)
  occupy(a, 0, n)
  const rows = Buffer.alloc(n * 2048)
  for (let il = 0; il < geo.nLayer; il++) {
    for (let i = 0; i < rows.length; i += 4096) rows.writeUInt32LE((il * 2654435761 + i) >>> 0, i)
    a.writeK(il, 0, rows)
    a.writeV(il, 0, rows)
  }
  const dir = fs.mkdtempSync(path.join(os.tmpdir(), 'kvc-stream-'))
  const file = path.join(dir, 'state.bin')
  try {
    let rss0 = kb('VmRSS')
    await pipeline(a.createStateReadStream(0), fs.createWriteStream(file))
    const saveGrowthMiB = (kb('VmRSS') - rss0) / 1024
    const fileBytes = fs.statSync(file).size
    const b = new KvCache(geo)
    rss0 = kb('VmRSS')
    const w = b.createStateWriteStream(0)
    await pipeline(fs.createReadStream(file, { highWaterMark: MiB }), w)
    const loadGrowthMiB = (kb('VmRSS') - rss0) / 1024
    const want = await hashOf(fs.createReadStream(file))
    return {
      fileBytes,
      stateSize: a.stateSize(0),
      cells: w.result.cells,
      tensorMiB: b.totalBytes / MiB,
      saveGrowthMiB,
      loadGrowthMiB,
      sameState: (await hashOf(b.createStateReadStream(0))) === want,
    }
  } finally {
    fs.rmSync(dir, { recursive: true, force: true })
  }
}

const modes = { over4g, far, files }
const result = await modes[process.argv[2]]()
console.log(`@@RESULT ${JSON.stringify(result)}`)

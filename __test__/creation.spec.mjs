import test from 'ava'
import { spawnSync } from 'node:child_process'
import { createRequire } from 'node:module'

const require = createRequire(import.meta.url)
const ADDON = require.resolve('../index.js')
const { KvCache } = require(ADDON)

// one 32 MiB K and V tensor per layer: 8,192 cells of 1,024-wide f16 rows, 4 layers
const geometry = { size: 8192, nLayer: 4, nEmbdKGqa: 1024, flashAttn: true }
const TENSOR = 8192 * 2048

test('residentBytes (what V8 is told) counts tensor pages as they are written, not at creation (creation ran a full GC)', (t) => {
  const c = new KvCache(geometry)
  t.is(c.residentBytes, 0, 'a new cache holds no tensor memory')
  c.writeK(0, 5, Buffer.alloc(2048, 1))
  // the OS's page: 4 KiB on x86-64, up to 64 KiB elsewhere
  const page = c.residentBytes
  t.true(page >= 4096 && page <= 65536 && (page & (page - 1)) === 0, `one written row counts its page, not ${page}`)
  c.writeK(1, 0, Buffer.alloc(TENSOR, 1))
  t.is(c.residentBytes, page + TENSOR, 'a whole written tensor counts whole')
  c.findSlot({ pos: [0, 1], seqIds: [0, 0] })
  const blob = c.stateWriteSync(-1)
  c.clear()
  t.is(c.residentBytes, 0, 'clear() hands the memory back (releaseMemory defaults to true)')
  t.true(c.readK(0, 5, 1).every((b) => b === 0))
  c.stateReadSync(blob)
  t.is(c.residentBytes, 4 * 2 * TENSOR, 'a whole-cache load writes every tensor (and zeroes the cells it does not hold)')
  c.dispose()
  const keep = new KvCache({ ...geometry, releaseMemory: false })
  keep.writeK(0, 5, Buffer.alloc(2048, 1))
  keep.clear()
  t.is(keep.residentBytes, TENSOR, 'with releaseMemory false, clear() zeroes every byte in place and keeps the memory')
  t.true(keep.readK(0, 5, 1).every((b) => b === 0))
  keep.dispose()
})

test('creating a 16 GiB cache runs no garbage collection and commits no tensor memory', (t) => {
  const script = `
    const { KvCache } = require(${JSON.stringify(ADDON)})
    const kb = () => Number(require('fs').readFileSync('/proc/self/status', 'utf8').match(/VmRSS:\\s+(\\d+)/)[1])
    const before = kb()
    const t0 = process.hrtime.bigint()
    const caches = [16384, 131072].map((size) => new KvCache({ size, nLayer: 32, nEmbdKGqa: 1024 }))
    const ms = Number(process.hrtime.bigint() - t0) / 1e6
    console.log('@@' + JSON.stringify({ ms, rssMiB: (kb() - before) / 1024, gib: caches.map((c) => c.totalBytes / 2 ** 30) }))
  `
  const r = spawnSync(process.execPath, ['--trace-gc', '-e', script], { encoding: 'utf8' })
  t.is(r.status, 0, r.stderr)
  const gcs = r.stdout.split('\n').filter((l) => /Mark-Compact|Scavenge/.test(l) && /external memory/.test(l))
  t.deepEqual(gcs, [], 'no collection for external memory pressure')
  const out = JSON.parse(r.stdout.split('\n').find((l) => l.startsWith('@@')).slice(2))
  t.deepEqual(out.gib, [2, 16])
  t.true(out.rssMiB < 64, `creating 18 GiB of caches grew RSS by ${out.rssMiB} MiB`)
  t.log(`2 GiB + 16 GiB caches created in ${out.ms.toFixed(2)} ms, RSS +${out.rssMiB.toFixed(1)} MiB`)
})

test('a state of 8 MiB or more is written into a Buffer from Node\'s allocator: the same bytes, sync and async', async (t) => {
  // 16,384 cells of 4 x 64-wide f16 rows: a 16 MiB whole-cache state, 2 MiB per sequence
  const c = new KvCache({ size: 16384, nLayer: 4, nEmbdKGqa: 64, nSeqMax: 2, flashAttn: true })
  c.findSlot({ pos: Int32Array.from({ length: 16384 }, (_, i) => i >> 1), seqIds: Array.from({ length: 16384 }, (_, i) => i & 1) })
  for (let il = 0; il < 4; il++) c.writeK(il, 0, Buffer.alloc(16384 * 128, il + 1))
  for (const seq of [-1, 1]) {
    const expected = Buffer.alloc(c.stateSize(seq))
    c.stateWriteIntoSync(expected, seq)
    t.true(seq !== -1 || expected.length >= 8 << 20)
    // (Buffer.equals: ava's deepEqual enumerates every index of a typed array)
    t.true(c.stateWriteSync(seq).equals(expected), `stateWriteSync(${seq})`)
    t.true((await c.stateWrite(seq)).equals(expected), `stateWrite(${seq})`)
  }
  // queued behind another call, the task allocates the payload itself
  const [first, second] = await Promise.all([c.stateWrite(-1), c.stateWrite(-1)])
  t.true(first.equals(second))
  c.dispose()
})

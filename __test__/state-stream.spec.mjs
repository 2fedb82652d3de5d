import test from 'ava'
import { Readable } from 'node:stream'
import { pipeline } from 'node:stream/promises'
import { createRequire } from 'node:module'
import { runScript } from './helpers/run-script.mjs'

const require = createRequire(import.meta.url)
const { KvCache } = require('../index.js')
const BIG = new URL('./helpers/state-stream-big.mjs', import.meta.url).pathname

const make = (o = {}) => new KvCache({ size: 64, nLayer: 2, nEmbdKGqa: 32, nSeqMax: 4, ...o })

// sequences 0 and 1 share 3 cells, sequence 0 goes on to 9 cells, sequence 2 has 5; distinct rows
function filled(o) {
  const c = make(o)
  c.findSlot({ pos: [0, 1, 2], seqIds: [[0, 1], [0, 1], [0, 1]] })
  c.findSlot({ pos: [3, 4, 5, 6, 7, 8], seqIds: [0, 0, 0, 0, 0, 0] })
  c.findSlot({ pos: [0, 1, 2, 3, 4], seqIds: [2, 2, 2, 2, 2] })
  for (let i = 0; i < 14; i++) {
    for (let il = 0; il < 2; il++) {
      c.writeKF32(il, i, Float32Array.from({ length: 32 }, (_, j) => i + j / 64 + il))
      c.writeVF32(il, i, Float32Array.from({ length: 32 }, (_, j) => -i - j / 64 - il))
    }
  }
  return c
}

const collect = async (readable) => {
  const parts = []
  for await (const chunk of readable) parts.push(chunk)
  return Buffer.concat(parts)
}
const pieces = (buf, size) => Array.from({ length: Math.ceil(buf.length / size) }, (_, i) => buf.subarray(i * size, (i + 1) * size))
const snapshot = (c) => [c.usedCells, c.head, c.stateWriteSync(-1), c.stateWriteSync(0, { layout: 'seed' })]

test('a read stream produces exactly the bytes of stateWrite, in chunks of any size', async (t) => {
  for (const flashAttn of [false, true]) {
    const c = filled({ flashAttn })
    for (const seq of [-1, 0, 2, 3]) {
      for (const options of [{}, { layout: 'seed' }, { chunkSize: 7 }, { chunkSize: 1, layout: 'streams-rot' }]) {
        const { chunkSize, ...writeOptions } = options // stateWrite has no chunks
        const expected = c.stateWriteSync(seq, writeOptions)
        const s = c.createStateReadStream(seq, options)
        t.is(s.size, expected.length)
        t.deepEqual(await collect(s), expected, `seq ${seq} ${JSON.stringify(options)}`)
      }
    }
    t.is(c.usedCells, 14, 'the cache is free again once the stream ended')
  }
})

test('a write stream loads what a read stream produced, like stateRead, from pieces of any size', async (t) => {
  for (const flashAttn of [false, true]) {
    const src = filled({ flashAttn })
    for (const [seq, dest] of [[-1, -1], [0, 3], [2, 1]]) {
      const payload = src.stateWriteSync(seq)
      const want = filled({ flashAttn })
      want.seqRm(1)
      const expected = want.stateReadSync(payload, dest)
      for (const size of [1, 5, 1000]) {
        const c = filled({ flashAttn })
        c.seqRm(1)
        const w = c.createStateWriteStream(dest)
        await pipeline(Readable.from(pieces(payload, size)), w)
        t.deepEqual(w.result, expected, `${seq} -> ${dest}, pieces of ${size}`)
        t.deepEqual(snapshot(c), snapshot(want))
      }
      // and straight from a read stream
      const c = filled({ flashAttn })
      c.seqRm(1)
      await pipeline(src.createStateReadStream(seq, { chunkSize: 33 }), c.createStateWriteStream(dest))
      t.deepEqual(snapshot(c), snapshot(want))
    }
  }
})

test('a stream holds the cache: sync calls are busy, async calls queue behind it, and it waits its turn', async (t) => {
  const c = filled()
  const order = []
  const before = c.stateWrite(0).then(() => order.push('stateWrite before'))
  const s = c.createStateReadStream(0)
  t.is(s.size, null, 'the size is known once the calls before it settled')
  const after = c.stateWrite(2).then(() => order.push('stateWrite after'))
  t.is(t.throws(() => c.seqRm(0)).code, 'ERR_KV_BUSY')
  const bytes = await collect(s)
  order.push('stream')
  await Promise.all([before, after])
  t.deepEqual(order, ['stateWrite before', 'stream', 'stateWrite after'])
  t.is(s.size, bytes.length)
  t.deepEqual(bytes, c.stateWriteSync(0))
  // a destroyed stream releases the cache at once, also before its turn came
  const queued = c.stateWrite(-1)
  const early = c.createStateWriteStream(1)
  early.destroy()
  await queued
  await new Promise((resolve) => early.on('close', resolve))
  const late = c.createStateReadStream(-1)
  late.destroy()
  await new Promise((resolve) => late.on('close', resolve))
  t.is(c.usedCells, 14)
  const open = c.createStateReadStream(0)
  t.throws(() => c.dispose(), { code: 'ERR_KV_BUSY' }, 'dispose waits for streams too')
  open.destroy()
  await new Promise((resolve) => open.on('close', resolve))
  c.dispose()
})

test('a load that fails, ends early, is destroyed or aborted leaves the cache as it was', async (t) => {
  for (const flashAttn of [false, true]) {
    const src = filled({ flashAttn })
    // other rows for the same cells: a load into sequence 2 reuses the cells it frees, a
    // whole-cache load overwrites live cells; either must put the old rows back
    for (let il = 0; il < 2; il++) {
      src.writeK(il, 0, Buffer.alloc(14 * 64, 0xa5))
      src.writeV(il, 0, Buffer.alloc(14 * 64, 0x5a))
    }
    const other = make({ nEmbdKGqa: 64, flashAttn })
    other.findSlot({ pos: [0, 1], seqIds: [0, 0] })
    const one = src.stateWriteSync(2)
    const whole = src.stateWriteSync(-1)
    const cases = [
      ['truncated', 2, [one.subarray(0, one.length - 1)], 'ERR_KV_INVALID_STATE'],
      ['trailing bytes', 2, [one, Buffer.from([0])], 'ERR_KV_INVALID_STATE'],
      ['a bad layer header', -1, [whole.subarray(0, whole.length - 2 * 14 * 64 - 100), Buffer.alloc(200, 0xff)], 'ERR_KV_INVALID_STATE'],
      ['a payload for another geometry', 2, [other.stateWriteSync(0)], 'ERR_KV_INVALID_STATE'],
      ['not bytes', 2, ['text'], 'ERR_KV_INVALID_STATE'],
    ]
    for (const [name, dest, chunks, code] of cases) {
      const c = filled({ flashAttn })
      const before = snapshot(c)
      const err = await t.throwsAsync(pipeline(Readable.from(chunks), c.createStateWriteStream(dest)), undefined, name)
      t.is(err.code, code, `${name}: ${err.message}`)
      t.deepEqual(snapshot(c), before, `${name}, flash attention ${flashAttn}`)
    }
    // destroyed halfway through the data
    const c = filled({ flashAttn })
    const before = snapshot(c)
    const w = c.createStateWriteStream(-1)
    await new Promise((resolve) => w.write(whole.subarray(0, whole.length >> 1), resolve))
    w.destroy()
    await new Promise((resolve) => w.on('close', resolve))
    t.deepEqual(snapshot(c), before, 'destroyed')
    // aborted through a signal
    const ac = new AbortController()
    const a = c.createStateWriteStream(2, { signal: ac.signal })
    const run = pipeline(new Readable({
      read() {
        this.push(one.subarray(0, one.length - 20))
        ac.abort()
      },
    }), a)
    const e = await t.throwsAsync(run)
    t.is(e.code, 'ERR_KV_ABORTED')
    t.is(e.name, 'AbortError')
    t.deepEqual(snapshot(c), before, 'aborted')
  }
})

test('stream arguments are checked when the stream is made', async (t) => {
  const c = filled()
  t.throws(() => c.createStateReadStream(4), { code: 'ERR_KV_OUT_OF_RANGE' })
  t.throws(() => c.createStateWriteStream(9), { code: 'ERR_KV_OUT_OF_RANGE' })
  t.throws(() => c.createStateReadStream(0, { chunkSize: 0 }), { code: 'ERR_KV_OUT_OF_RANGE' })
  t.throws(() => c.createStateReadStream(0, { layout: 'newest' }), { code: 'ERR_KV_INVALID_ARG' })
  t.throws(() => c.createStateWriteStream(0, { signal: {} }), { code: 'ERR_KV_INVALID_ARG' })
  t.throws(() => c.createStateReadStream(0, 'fast'), { code: 'ERR_KV_INVALID_ARG' })
  const rotated = make({ typeK: 'q8_0', typeV: 'q8_0', flashAttn: true, nRotK: 32, nRotV: 32 })
  t.throws(() => rotated.createStateReadStream(-1, { layout: 'streams' }), { code: 'ERR_KV_UNSUPPORTED' })
  // an aborted signal destroys the stream with the addon's abort error
  const ac = new AbortController()
  ac.abort()
  const e = await t.throwsAsync(collect(c.createStateReadStream(0, { signal: ac.signal })))
  t.is(e.code, 'ERR_KV_ABORTED')
  // a disposed cache refuses
  const d = make()
  d.dispose()
  t.throws(() => d.createStateReadStream(), { code: 'ERR_KV_DISPOSED' })
  t.is(c.usedCells, 14)
})

// the large cases run one at a time: each measures its own process's RSS, and three such
// processes at once on a small machine disturb each other's timing (and so V8's collections).
// They read RSS from /proc/self/status (helpers/state-stream-big.mjs), which only Linux has.
const linux = process.platform === 'linux'
  ? test.serial
  : (title, fn) => test.skip(`${title}: skipped: the child reads RSS from /proc/self/status, Linux only (this is ${process.platform})`, fn)

linux('a 4.1 GiB state streams out exactly (no 32-bit truncation), keeping under 64 MiB of RSS', async (t) => {
  const r = await runScript(BIG, ['over4g'])
  t.true(r.size > 2 ** 32, `${r.size}`)
  t.is(r.size, r.expectedSize)
  t.is(r.stateSize, r.expectedSize)
  t.is(r.streamed, r.expectedSize)
  t.is(r.mismatches, 0, 'every byte is where the layout puts it: headers, zero rows, the two marked rows past 4 GiB')
  t.true(r.rssGrowthMiB < 64, `RSS grew by ${r.rssGrowthMiB} MiB`)
  t.log(`${(r.size / 2 ** 30).toFixed(2)} GiB in ${r.chunks} chunks, ${r.seconds.toFixed(2)} s, RSS +${r.rssGrowthMiB.toFixed(1)} MiB`)
})

linux('a streamed load writes rows that lie past 4 GiB in their tensor to the right place', async (t) => {
  const r = await runScript(BIG, ['far'])
  t.true(r.beyond4GiB, `placed at ${r.placed}`)
  t.true(r.kMatches)
  t.true(r.vMatches)
  t.true(r.roundTrips)
  t.true(r.rssGrowthMiB < 64, `RSS grew by ${r.rssGrowthMiB} MiB`)
})

linux('a 250 MiB state round trips through a file with RSS growth under 64 MiB beyond the tensors', async (t) => {
  const r = await runScript(BIG, ['files'])
  t.is(r.fileBytes, r.stateSize)
  t.is(r.cells, 4000)
  t.true(r.sameState)
  t.true(r.saveGrowthMiB < 64, `saving grew RSS by ${r.saveGrowthMiB} MiB`)
  t.true(r.loadGrowthMiB < r.tensorMiB + 64, `loading grew RSS by ${r.loadGrowthMiB} MiB (tensors: ${r.tensorMiB} MiB)`)
  t.log(`save +${r.saveGrowthMiB.toFixed(1)} MiB, load +${r.loadGrowthMiB.toFixed(1)} MiB for ${r.tensorMiB} MiB of tensors`)
})

// findSlotPacked: llama_batch's packed arrays instead of a ubatch object. It must place every
// ubatch exactly where findSlot does, and refuse malformed input with coded errors, changing
// nothing.

import test from 'ava'
import { createRequire } from 'node:module'

const require = createRequire(import.meta.url)
const { KvCache } = require('../index.js')

const make = (o = {}) => new KvCache({ size: 64, nLayer: 1, nEmbdKGqa: 8, nSeqMax: 4, ...o })
const i32 = (...xs) => Int32Array.from(xs)
const snapshot = (c) => {
  const cols = c.cells()
  return { head: c.head, n: c.n, used: c.usedCells, pos: [...cols.pos], ids: [...cols.seqIds], offsets: [...cols.seqOffsets] }
}
const code = (t, fn, expected, pattern) => {
  const e = t.throws(fn)
  t.is(e.code, expected, e.message)
  t.true(e instanceof Error)
  if (pattern) t.regex(e.message, pattern)
  return e
}

/** The same ubatch in the object form and in the packed form. */
function both(groups, nSeqTokens = 1) {
  const pos = groups.flatMap((g) => g.pos)
  const shared = groups.some((g) => g.ids.length > 1)
  return {
    object: { pos, seqIds: groups.map((g) => (g.ids.length === 1 ? g.ids[0] : g.ids)), nSeqTokens },
    packed: [
      Int32Array.from(pos),
      Int32Array.from(groups.flatMap((g) => g.ids)),
      shared ? Int32Array.from(groups.map((g) => g.ids.length)) : undefined,
      nSeqTokens === 1 ? undefined : nSeqTokens,
    ],
  }
}

test('findSlotPacked places every ubatch where findSlot does', (t) => {
  const a = make()
  const b = make()
  let x = 0x9e3779b9
  const rand = (n) => {
    x ^= x << 13
    x ^= x >>> 17
    x ^= x << 5
    return (x >>> 0) % n
  }
  let placed = 0
  for (let step = 0; step < 300; step++) {
    if (rand(5) === 0) {
      const [s, p0, n] = [rand(4), rand(40), rand(20)]
      t.is(a.seqRm(s, p0, p0 + n), b.seqRm(s, p0, p0 + n))
      continue
    }
    const groups = Array.from({ length: 1 + rand(6) }, () => {
      const ids = [rand(4)]
      if (rand(4) === 0) ids.push((ids[0] + 1 + rand(3)) % 4)
      return { pos: [rand(50)], ids }
    })
    const { object, packed } = both(groups)
    const slot = a.findSlot(object)
    const head = b.findSlotPacked(...packed)
    t.is(head, slot === null ? null : slot.head, `step ${step}`)
    placed += slot !== null
  }
  t.true(placed > 50)
  t.deepEqual(snapshot(b), snapshot(a))
})

test('findSlotPacked returns null when the ubatch does not fit, as findSlot does', (t) => {
  const a = make({ size: 8 })
  const c = make({ size: 8 })
  t.is(c.findSlotPacked(i32(0, 1, 2, 3, 4), i32(0, 0, 0, 0, 0)), 0)
  a.findSlot({ pos: [0, 1, 2, 3, 4], seqIds: [0, 0, 0, 0, 0] })
  // the seed's failed search still moves the head: the twin shows where
  t.is(c.findSlotPacked(i32(0, 1, 2, 3), i32(1, 1, 1, 1)), null)
  t.is(a.findSlot({ pos: [0, 1, 2, 3], seqIds: [1, 1, 1, 1] }), null)
  t.deepEqual(snapshot(c), snapshot(a))
  t.is(c.usedCells, 5)
  t.is(c.findSlotPacked(i32(5), i32(1, 2), i32(2)), 5)
  t.deepEqual(c.cell(5).seqIds, [1, 2])
})

test('findSlotPacked takes recurrent groups with nSeqTokens', (t) => {
  const a = make({ size: 4, recurrent: true, nEmbdKS: 8, nEmbdVS: 8 })
  const b = make({ size: 4, recurrent: true, nEmbdKS: 8, nEmbdVS: 8 })
  const { object, packed } = both([{ pos: [0, 1], ids: [0] }, { pos: [0, 1], ids: [2, 3] }], 2)
  t.is(b.findSlotPacked(...packed), a.findSlot(object).head)
  t.deepEqual(snapshot(b), snapshot(a))
  t.is(b.cell(b.cell(2).tail).pos, 1)
})

test('malformed packed ubatches are coded errors naming the bad value and change nothing', (t) => {
  const c = make({ size: 8 })
  c.findSlotPacked(i32(0, 1), i32(0, 0))
  const before = snapshot(c)
  code(t, () => c.findSlotPacked([0], i32(0)), 'ERR_KV_INVALID_ARG', /Int32Array, got object/)
  code(t, () => c.findSlotPacked(new Float32Array(1), i32(0)), 'ERR_KV_INVALID_ARG', /other than Int32Array/)
  code(t, () => c.findSlotPacked(i32(0), 0), 'ERR_KV_INVALID_ARG', /Int32Array, got number/)
  code(t, () => c.findSlotPacked(i32(0), i32(0), [1]), 'ERR_KV_INVALID_ARG', /Int32Array/)
  code(t, () => c.findSlotPacked(i32(0, 1), i32(0)), 'ERR_KV_INVALID_ARG', /2 positions but 1 groups/)
  code(t, () => c.findSlotPacked(i32(), i32()), 'ERR_KV_INVALID_ARG', /no tokens/)
  code(t, () => c.findSlotPacked(i32(-1), i32(0)), 'ERR_KV_INVALID_ARG', /position -1/)
  code(t, () => c.findSlotPacked(i32(3), i32(4)), 'ERR_KV_OUT_OF_RANGE', /seq id 4/)
  code(t, () => c.findSlotPacked(i32(3), i32(0, 1), i32(1)), 'ERR_KV_INVALID_ARG', /sums to 1 but seqIds holds 2/)
  code(t, () => c.findSlotPacked(i32(3), i32(0), i32(2)), 'ERR_KV_INVALID_ARG', /more seq ids than seqIds holds \(1\)/)
  code(t, () => c.findSlotPacked(i32(3), i32(0), i32(0)), 'ERR_KV_INVALID_ARG', /nSeqIds\[0\] must be at least 1, got 0/)
  code(t, () => c.findSlotPacked(i32(3), i32(0), null, 0), 'ERR_KV_INVALID_ARG', /nSeqTokens/)
  code(t, () => c.findSlotPacked(i32(3), i32(0), null, 1.5), 'ERR_KV_INVALID_ARG', /nSeqTokens must be an integer, got 1.5/)
  code(t, () => c.findSlotPacked(i32(3), i32(0), null, '1'), 'ERR_KV_INVALID_ARG', /number/)
  t.deepEqual(snapshot(c), before)
  c.dispose()
  code(t, () => c.findSlotPacked(i32(3), i32(0)), 'ERR_KV_DISPOSED')
})

test('prepareBatchPacked takes the steps of prepareBatch, head and n included', (t) => {
  const a = make({ size: 64 })
  const b = make({ size: 64 })
  for (const [groups, advanceHead] of [
    [[{ pos: [0], ids: [0] }, { pos: [1], ids: [0] }, { pos: [2], ids: [0] }], undefined],
    [[{ pos: [3], ids: [0, 1] }], false],
    [[{ pos: [0], ids: [2] }, { pos: [1], ids: [2] }], true],
  ]) {
    const { object, packed } = both(groups)
    const options = advanceHead === undefined ? undefined : { advanceHead }
    const slot = a.prepareBatch(object, options)
    const head = b.prepareBatchPacked(packed[0], packed[1], packed[2] ?? null, undefined, options)
    t.is(head, slot.head)
    t.is(b.n, slot.n)
    t.deepEqual(snapshot(b), snapshot(a))
  }
  const full = make({ size: 8 })
  t.is(full.prepareBatchPacked(i32(0, 1, 2, 3, 4, 5, 6, 7, 8), i32(0, 0, 0, 0, 0, 0, 0, 0, 0)), null)
  code(t, () => full.prepareBatchPacked(i32(0), i32(9)), 'ERR_KV_OUT_OF_RANGE', /seq id 9/)
  code(t, () => full.prepareBatchPacked(i32(0), i32(0), null, 1, { advanceHead: 'yes' }), 'ERR_KV_INVALID_ARG')
  t.is(full.usedCells, 0)
})

// One case of payloads.spec.mjs, run in its own `node --expose-gc` process: state payloads of a
// MiB or more are lent to JS from staging memory that goes back for the next payload when the
// garbage collector frees their Buffer. Prints `@@RESULT <json>` with what the case checked.
import { createRequire } from 'node:module'
import { setImmediate as turn } from 'node:timers/promises'

const require = createRequire(import.meta.url)
const { KvCache } = require('../../index.js')

if (typeof globalThis.gc !== 'function') throw new Error('run with --expose-gc')

const SIZE = 65536
const N_SEQ = 8

/** A full cache of 8 sequences, every row distinct: a sequence's state is 2.1 MiB, the whole
 * cache's 16.8 MiB. */
function filled() {
  const c = new KvCache({ size: SIZE, nLayer: 2, nEmbdKGqa: 32, nSeqMax: N_SEQ, typeK: 'f16', typeV: 'f16' })
  const n = SIZE / N_SEQ
  for (let s = 0; s < N_SEQ; s++) {
    c.place([{ pos: Array.from({ length: n }, (_, i) => i), seqIds: Array.from({ length: n }, () => s) }])
  }
  const row = new Float32Array(32)
  for (let cell = 0; cell < SIZE; cell++) {
    for (let il = 0; il < 2; il++) {
      for (let j = 0; j < 32; j++) row[j] = ((cell * 31 + il * 7 + j) % 251) / 8
      c.writeKF32(il, cell, row)
      c.writeVF32(il, cell, row.map((x) => -x))
    }
  }
  return c
}

/** Lets the garbage collector free what the case dropped, and Node run the Buffers' finalizers
 * (from its event loop). */
async function collect() {
  globalThis.gc()
  await turn()
  globalThis.gc()
  await turn()
}

const cases = {
  /** Payloads made after earlier ones were scribbled over, dropped and collected are the
   * state's bytes, never the stale bytes of the memory they reuse; so are payloads made while
   * others are still held (they take the other routes). */
  async reuse() {
    const c = filled()
    const reference = new Map([-1, 3].map((s) => {
      const out = Buffer.alloc(c.stateSize(s))
      c.stateWriteIntoSync(out, s)
      return [s, out]
    }))
    let mismatches = 0
    let made = 0
    for (let round = 0; round < 24; round++) {
      const seq = round % 3 === 0 ? -1 : 3
      const held = []
      for (let k = 0; k < 1 + (round % 4); k++) {
        const b = round % 2 ? await c.stateWrite(seq) : c.stateWriteSync(seq)
        made++
        if (!b.equals(reference.get(seq))) mismatches++
        held.push(b)
      }
      held.forEach((b) => b.fill(0x5a))
      held.length = 0
      await collect()
    }
    return { mismatches, made, big: reference.get(-1).length, small: reference.get(3).length }
  },

  /** A view of a payload kept, or its ArrayBuffer transferred, outlives the Buffer it came in:
   * its memory goes back only when the last of them is collected. */
  async views() {
    const c = filled()
    const expected = c.stateWriteSync(3).toString('base64')
    await collect()
    let payload = c.stateWriteSync(3)
    const view = payload.subarray(1000, 5000)
    const viewBytes = Buffer.from(view).toString('base64')
    payload = null
    await collect()
    const churn = [c.stateWriteSync(3), c.stateWriteSync(3), c.stateWriteSync(-1)]
    churn.forEach((b) => b.fill(0x33))
    const viewIntact = Buffer.from(view).toString('base64') === viewBytes
    await collect()
    let moved = c.stateWriteSync(3)
    const ab = structuredClone(moved.buffer, { transfer: [moved.buffer] })
    moved = null
    await collect()
    churn.push(c.stateWriteSync(3), c.stateWriteSync(3), c.stateWriteSync(-1))
    churn.forEach((b) => b.fill(0x44))
    const movedIntact = Buffer.from(ab).toString('base64') === expected
    return { viewIntact, movedIntact }
  },

  /** A synchronous loop of large stateWriteSync calls never lets Node's event loop run (where
   * the finalizers of lent Buffers run): it must hold bounded memory all the same. */
  async 'sync-loop'() {
    const c = filled()
    await collect()
    const before = process.memoryUsage.rss()
    let peak = before
    let bytes = 0
    for (let i = 0; i < 150; i++) {
      bytes += c.stateWriteSync(-1).length
      peak = Math.max(peak, process.memoryUsage.rss())
    }
    return { made: bytes, grew: peak - before }
  },
}

const name = process.argv[2]
const result = await cases[name]()
console.log('@@RESULT ' + JSON.stringify(result))

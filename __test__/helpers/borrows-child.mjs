// One case of borrows.spec.mjs, run in its own `node --expose-gc` process: a crash (a read or
// write of freed memory) then fails the spec's test instead of killing the test runner. Prints
// `@@RESULT <json>`: how the call ended (`outcome`: 'error' with its code and message, or
// 'result') and what the case checked afterwards.
import { createRequire } from 'node:module'

const require = createRequire(import.meta.url)
const { KvCache } = require('../../index.js')

if (typeof globalThis.gc !== 'function') throw new Error('run with --expose-gc')

const make = (o = {}) => new KvCache({ size: 64, nLayer: 2, nEmbdKGqa: 32, nSeqMax: 4, ...o })

/** A cache holding 15 cells of two sequences, with distinct K and V rows. */
function filled() {
  const c = make()
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

/** Cells and state bytes, to compare two caches. */
const snapshot = (c) => {
  const cols = c.cells()
  return JSON.stringify({
    head: c.head,
    n: c.n,
    used: c.usedCells,
    pos: [...cols.pos],
    ids: [...cols.seqIds],
    offsets: [...cols.seqOffsets],
    state: c.stateWriteSync().toString('base64'),
  })
}

/**
 * Detaches `buffer` the way a program hands it to a worker, drops the copy that took its memory,
 * collects it, and churns the allocator so that freed memory is reused: a native read of the old
 * memory would now see other bytes (or fault).
 */
function detachAndFree(buffer) {
  // the copy that now owns the memory is dropped at once
  structuredClone(buffer, { transfer: [buffer] })
  globalThis.gc()
  const churn = []
  for (let i = 0; i < 64; i++) churn.push(new Uint8Array(4096 + i).fill(0xa5))
  globalThis.gc()
}

/** How `fn` ended. */
async function outcome(fn) {
  try {
    const value = await fn()
    return { outcome: 'result', value: value === null || typeof value !== 'object' ? value : 'object' }
  } catch (e) {
    return { outcome: 'error', code: e?.code, message: e?.message, isError: e instanceof Error }
  }
}

const cases = {
  // a getter on prepareBatchPacked's options detaches pos.buffer after pos was passed
  async 'prepare-batch-packed'() {
    const c = make()
    const pos = Int32Array.from([0, 1, 2, 3])
    const seqIds = Int32Array.from([0, 0, 0, 0])
    const before = snapshot(c)
    let getterRan = false
    const options = {
      get advanceHead() {
        getterRan = true
        detachAndFree(pos.buffer)
        return true
      },
    }
    const r = await outcome(() => c.prepareBatchPacked(pos, seqIds, null, undefined, options))
    const ref = make()
    const expected = ref.prepareBatchPacked(Int32Array.from([0, 1, 2, 3]), Int32Array.from([0, 0, 0, 0]))
    return {
      ...r,
      getterRan,
      detached: pos.byteLength === 0,
      unchanged: snapshot(c) === before,
      matchesReference: r.outcome === 'result' && r.value === expected && snapshot(c) === snapshot(ref),
    }
  },

  // findSlot's ubatch object: a getter on seqIds detaches the Int32Array pos converted before it
  async 'find-slot-object'() {
    const c = make()
    const pos = Int32Array.from([0, 1, 2, 3])
    const ubatch = {
      pos,
      get seqIds() {
        detachAndFree(pos.buffer)
        return [0, 0, 0, 0]
      },
    }
    const r = await outcome(() => c.findSlot(ubatch))
    const ref = make()
    ref.findSlot({ pos: [0, 1, 2, 3], seqIds: [0, 0, 0, 0] })
    return { ...r, detached: pos.byteLength === 0, matchesReference: r.outcome === 'result' && snapshot(c) === snapshot(ref) }
  },

  // stateReadSync: a getter on the options detaches the payload before it is read
  async 'state-read-sync'() {
    const a = filled()
    const data = new Uint8Array(a.stateWriteSync())
    const ref = make()
    ref.stateReadSync(data)
    const c = make()
    const before = snapshot(c)
    const r = await outcome(() =>
      c.stateReadSync(data, -1, {
        get layout() {
          detachAndFree(data.buffer)
          return undefined
        },
      }),
    )
    return { ...r, detached: data.byteLength === 0, unchanged: snapshot(c) === before, matchesReference: r.outcome === 'result' && snapshot(c) === snapshot(ref) }
  },

  // stateWriteIntoSync: a getter on the options detaches the destination before it is written
  async 'state-write-into-sync'() {
    const a = filled()
    const buf = new Uint8Array(a.stateSize())
    const r = await outcome(() =>
      a.stateWriteIntoSync(buf, -1, {
        get layout() {
          detachAndFree(buf.buffer)
          return undefined
        },
      }),
    )
    return { ...r, detached: buf.byteLength === 0 }
  },

  // async stateRead: the payload is transferred away and collected right after the call
  async 'state-read-async'() {
    const a = filled()
    const saved = new Uint8Array(a.stateWriteSync())
    const data = new Uint8Array(saved)
    const c = make()
    const before = snapshot(c)
    const pending = c.stateRead(data)
    detachAndFree(data.buffer)
    const r = await outcome(() => pending)
    const ref = make()
    ref.stateReadSync(saved)
    return {
      ...r,
      detached: data.byteLength === 0,
      unchanged: snapshot(c) === before,
      matchesReference: r.outcome === 'result' && snapshot(c) === snapshot(ref),
    }
  },

  // async stateRead: the caller reuses its buffer at once (the call copied it)
  async 'state-read-async-reuse'() {
    const a = filled()
    const data = new Uint8Array(a.stateWriteSync())
    const ref = make()
    ref.stateReadSync(data)
    const c = make()
    const pending = c.stateRead(data)
    data.fill(0xff)
    const r = await outcome(() => pending)
    return { ...r, matchesReference: r.outcome === 'result' && snapshot(c) === snapshot(ref) }
  },

  // async stateRead { transfer: true }: the call takes the payload's ArrayBuffer; the program
  // then tries to transfer it away, collects and churns memory, as a program breaking the
  // promise would
  async 'state-read-transfer'() {
    const a = filled()
    const saved = new Uint8Array(a.stateWriteSync())
    const data = new Uint8Array(saved)
    const ref = make()
    ref.stateReadSync(saved)
    const c = make()
    const pending = c.stateRead(data, -1, { transfer: true })
    const taken = data.byteLength === 0
    // a transfer of the taken buffer finds no memory to move (Node 20 makes an empty clone,
    // later versions throw DataCloneError); then collect and churn as detachAndFree does
    let grabbed = 0
    try {
      grabbed = structuredClone(data.buffer, { transfer: [data.buffer] }).byteLength
    } catch {}
    detachAndFree(new Uint8Array(16).buffer)
    // a write finds no memory either: the view's length is 0 (indexed writes are dropped,
    // fill throws)
    data[0] = 0xff
    const r = await outcome(() => pending)
    return { ...r, taken, grabbed, matchesReference: r.outcome === 'result' && snapshot(c) === snapshot(ref) }
  },

  // async stateRead { transfer: true } of a view of part of its ArrayBuffer: copied, so the
  // caller's buffer stays usable and may be reused at once
  async 'state-read-transfer-partial'() {
    const a = filled()
    const bytes = a.stateWriteSync()
    const whole = new Uint8Array(bytes.length + 16)
    whole.set(bytes, 8)
    const data = whole.subarray(8, 8 + bytes.length)
    const ref = make()
    ref.stateReadSync(data)
    const c = make()
    const pending = c.stateRead(data, -1, { transfer: true })
    const kept = data.byteLength === bytes.length
    whole.fill(0xff)
    const r = await outcome(() => pending)
    return { ...r, kept, matchesReference: r.outcome === 'result' && snapshot(c) === snapshot(ref) }
  },

  // async stateRead { transfer: true }: an options getter detaches the payload first; the call
  // finds nothing to take and refuses the empty payload, the cache unchanged
  async 'state-read-transfer-detached'() {
    const a = filled()
    const data = new Uint8Array(a.stateWriteSync())
    const c = make()
    const before = snapshot(c)
    const r = await outcome(() =>
      c.stateRead(data, -1, {
        get transfer() {
          detachAndFree(data.buffer)
          return true
        },
      }),
    )
    return { ...r, detached: data.byteLength === 0, unchanged: snapshot(c) === before }
  },

  // async stateWriteInto: the destination is transferred away and collected right after the call
  async 'state-write-into-async'() {
    const a = filled()
    const buf = new Uint8Array(a.stateSize())
    const pending = a.stateWriteInto(buf)
    detachAndFree(buf.buffer)
    const r = await outcome(() => pending)
    // the cache works on: a sync call is not refused as busy
    const after = await outcome(() => a.stateWriteIntoSync(new Uint8Array(a.stateSize())))
    return { ...r, detached: buf.byteLength === 0, cacheUsableAfter: after.outcome === 'result' }
  },

  // async stateWriteInto into a buffer left alone: the bytes of stateWriteSync arrive
  async 'state-write-into-async-kept'() {
    const a = filled()
    const buf = new Uint8Array(a.stateSize() + 4).fill(0xee)
    const r = await outcome(() => a.stateWriteInto(buf))
    const expected = a.stateWriteSync()
    return {
      ...r,
      matchesReference:
        r.outcome === 'result' &&
        r.value === expected.length &&
        Buffer.from(buf.subarray(0, expected.length)).equals(expected) &&
        buf.subarray(expected.length).every((b) => b === 0xee),
    }
  },
}

const name = process.argv[2]
if (!cases[name]) throw new Error(`unknown case ${name}`)
const result = await cases[name]()
console.log('@@RESULT ' + JSON.stringify(result))

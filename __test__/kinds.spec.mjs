// The cache's type by kind (index.d.ts): the members `SeedOnly` names are exactly those that
// throw ERR_KV_UNSUPPORTED on a memory that is not the seed's one-stream cache, and every other
// member works on every kind. Each member is called with arguments valid on every kind, on a
// fresh cache holding four tokens, so a refusal can only come from the kind.

import test from 'ava'
import fs from 'node:fs'
import os from 'node:os'
import path from 'node:path'
import { createRequire } from 'node:module'
import { fileURLToPath } from 'node:url'
import { finished } from 'node:stream/promises'

const require = createRequire(import.meta.url)
const { KvCache } = require('../index.js')

const HERE = path.dirname(fileURLToPath(import.meta.url))
const ROOT = path.resolve(HERE, '..')
const model = (name) => path.join(ROOT, 'interop', 'models', name)

const tmpDir = fs.mkdtempSync(path.join(os.tmpdir(), 'kv-kinds-'))
test.after.always(() => fs.rmSync(tmpDir, { recursive: true, force: true }))
let files = 0
const tmp = () => path.join(tmpDir, `f${files++}`)

// one cache of each kind, built the way an app gets it
const KINDS = {
  kv: () => KvCache.fromModel(model('llama-h16.gguf'), { nCtx: 256, nSeqMax: 2 }),
  recurrent: () => KvCache.fromModel(model('mamba.gguf'), { nCtx: 256, nSeqMax: 2 }),
  // swaFull: a window cache of every position, so that shifting positions is allowed
  iswa: () => KvCache.fromModel(model('gemma3-swa.gguf'), { nCtx: 256, nSeqMax: 2, swaFull: true }),
  hybrid: () => KvCache.fromModel(model('jamba.gguf'), { nCtx: 256, nSeqMax: 2 }),
  'kv-streams': () => KvCache.fromModel(model('llama-h16.gguf'), { nCtx: 256, nSeqMax: 2, kvUnified: false }),
}
const SEED = new Set(['kv', 'recurrent'])

const TOKENS = [1, 2, 3, 4]
const filled = (make) => {
  const c = make()
  c.place([{ pos: [0, 1, 2, 3], seqIds: [0, 0, 0, 0] }])
  return c
}
const seed = (c) => SEED.has(c.kind)
// the first layer's rows of cell 0 in the part that holds it
const rowsArgs = (c) => {
  const part = c.parts[0]
  return [part.layers[0], part.role === 'recurrent' ? 'r' : 'k', [0]]
}
// a seed cache's own bytes where the data is checked; any bytes where the call is refused first
const bytes = (c, read) => (seed(c) ? read() : new Uint8Array(4))
const floats = (c, read) => (seed(c) ? read() : new Float32Array(1))
const drain = async (stream) => {
  stream.resume()
  await finished(stream)
}

// how to call each method; getters are read
const CALLS = {
  seqRm: (c) => c.seqRm(1),
  seqCp: (c) => c.seqCp(0, 1),
  seqKeep: (c) => c.seqKeep(0),
  seqAdd: (c) => c.seqAdd(0, 2, -1, 1),
  seqDiv: (c) => c.seqDiv(0, 2, -1, 2),
  seqPosMax: (c) => c.seqPosMax(0),
  seqPosMin: (c) => c.seqPosMin(0),
  seqCellCount: (c) => c.seqCellCount(0),
  clear: (c) => c.clear(),
  releaseUnused: (c) => c.releaseUnused(),
  findSlot: (c) => c.findSlot({ pos: [4], seqIds: [0] }),
  findSlotPacked: (c) => c.findSlotPacked(Int32Array.of(4), Int32Array.of(0)),
  prepareBatch: (c) => c.prepareBatch({ pos: [4], seqIds: [0] }),
  prepareBatchPacked: (c) => c.prepareBatchPacked(Int32Array.of(4), Int32Array.of(0)),
  place: (c) => c.place([{ pos: [4], seqIds: [0] }]),
  slotRestorer: (c) => c.slotRestorer(),
  stateSize: (c) => c.stateSize(0),
  stateWriteSync: (c) => c.stateWriteSync(0),
  stateWrite: (c) => c.stateWrite(0),
  stateWriteIntoSync: (c) => c.stateWriteIntoSync(Buffer.alloc(1 << 20), 0),
  stateWriteInto: (c) => c.stateWriteInto(Buffer.alloc(1 << 20), 0),
  stateReadSync: (c) => c.stateReadSync(c.stateWriteSync(0), 1),
  stateRead: (c) => c.stateRead(c.stateWriteSync(0), 1),
  saveSequenceFileSync: (c) => c.saveSequenceFileSync(tmp(), 0, TOKENS),
  saveSequenceFile: (c) => c.saveSequenceFile(tmp(), 0, TOKENS),
  loadSequenceFileSync: (c) => {
    const f = tmp()
    c.saveSequenceFileSync(f, 0, TOKENS)
    return c.loadSequenceFileSync(f, 1)
  },
  loadSequenceFile: (c) => {
    const f = tmp()
    c.saveSequenceFileSync(f, 0, TOKENS)
    return c.loadSequenceFile(f, 1)
  },
  saveSessionFileSync: (c) => c.saveSessionFileSync(tmp(), TOKENS),
  saveSessionFile: (c) => c.saveSessionFile(tmp(), TOKENS),
  loadSessionFileSync: (c) => {
    const f = tmp()
    c.saveSessionFileSync(f, TOKENS)
    return c.loadSessionFileSync(f)
  },
  loadSessionFile: (c) => {
    const f = tmp()
    c.saveSessionFileSync(f, TOKENS)
    return c.loadSessionFile(f)
  },
  createStateReadStream: (c) => drain(c.createStateReadStream(0)),
  createStateWriteStream: (c) => {
    const state = c.stateWriteSync(0)
    const stream = c.createStateWriteStream(1)
    stream.end(state)
    return finished(stream)
  },
  readRows: (c) => c.readRows(...rowsArgs(c)),
  writeRows: (c) => c.writeRows(...rowsArgs(c), c.readRows(...rowsArgs(c))),
  rowSize: (c) => c.rowSize(0, 'k'),
  readK: (c) => c.readK(0, 0, 1),
  readV: (c) => c.readV(0, 0, 1),
  writeK: (c) => c.writeK(0, 0, bytes(c, () => c.readK(0, 0, 1))),
  writeV: (c) => c.writeV(0, 0, bytes(c, () => c.readV(0, 0, 1))),
  readKF32: (c) => c.readKF32(0, 0, 1),
  readVF32: (c) => c.readVF32(0, 0, 1),
  writeKF32: (c) => c.writeKF32(0, 0, floats(c, () => c.readKF32(0, 0, 1))),
  writeVF32: (c) => c.writeVF32(0, 0, floats(c, () => c.readVF32(0, 0, 1))),
  defrag: (c) => c.defrag(),
  fragmentation: (c) => c.fragmentation(),
  scheduleDefrag: (c) => c.scheduleDefrag(0.5),
  updateSync: (c) => c.updateSync(),
  update: (c) => c.update(),
  cellMax: (c) => c.cellMax(),
  cell: (c) => c.cell(0),
  cells: (c) => c.cells(),
  view: (c) => c.view(),
}
// members that are not about the memory's kind: lifecycle, and the native halves of the streams
const NOT_PROBED = new Set(['constructor', 'dispose', 'openStateReadSession', 'openStateWriteSession'])

const members = Object.getOwnPropertyNames(KvCache.prototype).filter((m) => !NOT_PROBED.has(m))
const call = (c, member) => {
  const d = Object.getOwnPropertyDescriptor(KvCache.prototype, member)
  if (CALLS[member]) return CALLS[member](c)
  if (d.get) return c[member]
  throw new Error(`no call for ${member}: add one to CALLS`)
}

// what calling `member` on a fresh cache of `kind` does: 'ok', 'unsupported' (refused by kind,
// naming the member) or the unexpected error itself
async function outcome(kind, member) {
  const c = filled(KINDS[kind])
  try {
    await call(c, member)
    return 'ok'
  } catch (e) {
    if (e.code === 'ERR_KV_UNSUPPORTED' && e.message.startsWith(`${member} is an operation of the seed's`)) {
      return 'unsupported'
    }
    return `${e.code}: ${e.message}`
  } finally {
    c.dispose()
  }
}

// `type SeedOnly = 'a' | 'b' | ...` of index.d.ts: the one list of seed-only members
function seedOnly() {
  const dts = fs.readFileSync(path.join(ROOT, 'index.d.ts'), 'utf8')
  const union = /export type SeedOnly =([^;]*?)\n\n/s.exec(dts)
  if (!union) throw new Error('index.d.ts declares no `export type SeedOnly = ...` union')
  return new Set([...union[1].matchAll(/'([A-Za-z0-9]+)'/g)].map((m) => m[1]))
}

test('each kind is built as named', (t) => {
  for (const [kind, make] of Object.entries(KINDS)) {
    const c = make()
    t.is(c.kind, kind)
    c.dispose()
  }
})

test('every member of KvCache has a call in this test', (t) => {
  t.deepEqual(members.filter((m) => !CALLS[m] && !Object.getOwnPropertyDescriptor(KvCache.prototype, m).get), [])
  t.true(members.length > 70, `${members.length} members`)
})

test('every member works on the seed\'s kinds', async (t) => {
  for (const kind of SEED) {
    for (const member of members) t.is(await outcome(kind, member), 'ok', `${kind}.${member}`)
  }
})

test('SeedOnly in index.d.ts is exactly the members that the other kinds refuse with ERR_KV_UNSUPPORTED', async (t) => {
  const listed = seedOnly()
  t.deepEqual([...listed].filter((m) => !members.includes(m)), [], 'SeedOnly names only members of KvCache')
  for (const kind of Object.keys(KINDS).filter((k) => !SEED.has(k))) {
    for (const member of members) {
      t.is(await outcome(kind, member), listed.has(member) ? 'unsupported' : 'ok', `${kind}.${member}`)
    }
  }
})

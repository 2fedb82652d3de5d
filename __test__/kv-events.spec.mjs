// KV events: `store.events()` in process, and the same events published over a real ZeroMQ
// socket in vLLM's wire format, decoded by a real subscriber (pyzmq + msgspec with vLLM's
// schema, interop/kv_events_subscriber.py). The events of puts, a corrupt block, evictions, a gc
// and a close arrive in order, and fold into exactly what each tier holds.
import test from 'ava'
import fs from 'node:fs'
import os from 'node:os'
import path from 'node:path'
import readline from 'node:readline'
import { spawn, spawnSync } from 'node:child_process'
import { createRequire } from 'node:module'
import { promptCache } from './helpers/store-prompts.mjs'
import { VENV_BIN } from '../scripts/setup.mjs'

const require = createRequire(import.meta.url)
const { KvCache, PromptStore } = require('../index.js')
const { publishKvEvents } = require('../lib/kv-events.js')
const ROOT = path.join(import.meta.dirname, '..')
const PYTHON = path.join(ROOT, VENV_BIN, 'python')

const tmp = (t) => {
  const dir = fs.mkdtempSync(path.join(os.tmpdir(), 'kvevents-'))
  t.teardown(() => fs.rmSync(dir, { recursive: true, force: true }))
  return dir
}
const emptyCache = () => new KvCache({ size: 128, nLayer: 2, nEmbdKGqa: 32, nSeqMax: 2 })
const blockFile = (dir, hex) => path.join(dir, 'blocks', hex.slice(0, 2), `${hex}.kvb`)
// the hashes of the blocks in a dir store (not its model record: blocks start with "KVPB")
const blockFiles = (dir) =>
  fs
    .readdirSync(path.join(dir, 'blocks'))
    .flatMap((fan) => fs.readdirSync(path.join(dir, 'blocks', fan)).map((f) => f.slice(0, 64)))
    .filter((h) => fs.readFileSync(blockFile(dir, h)).subarray(0, 4).toString('latin1') === 'KVPB')

// reads `n` events from an iterator
async function take(iterator, n) {
  const out = []
  while (out.length < n) {
    const { value, done } = await iterator.next()
    if (done) break
    out.push(value)
  }
  return out
}

// reads events up to and including the first that `last` accepts
async function until(iterator, last) {
  const out = []
  for (;;) {
    const { value, done } = await iterator.next()
    if (done) return out
    out.push(value)
    if (last(value)) return out
  }
}

// the events of a put of prompt `w` (its BlockStored first), up to the next BlockStored or end
const storedOf = (tokens) => (e) => e.type === 'BlockStored' && e.tokenIds.at(-1) === tokens.at(-1)

// folds events into the blocks of each medium, checking each removal names a known block
function fold(t, events, live = new Map()) {
  for (const e of events) {
    if (e.type === 'AllBlocksCleared') live.clear()
    const held = live.get(e.medium) ?? new Set()
    live.set(e.medium, held)
    if (e.type === 'BlockStored') e.blockHashes.forEach((h) => held.add(h))
    if (e.type === 'BlockRemoved') {
      for (const h of e.blockHashes) t.true(held.delete(h), `removed ${h} was never stored in ${e.medium}`)
    }
  }
  return live
}

// the events of the scenario the two tests share, run on a dir store (`dir`) through `store`
async function scenario(t, store, dir, iterator) {
  const events = []
  // prompt 0: six blocks, the first a root
  const p0 = promptCache(KvCache, 0)
  await store.put(p0.cache, 0, p0.tokens)
  const first = await take(iterator, 1)
  t.like(first[0], { type: 'BlockStored', parentBlockHash: null, blockSize: 16, medium: 'dir' })
  t.deepEqual(first[0].tokenIds, p0.tokens)
  t.is(first[0].blockHashes.length, 6)
  t.deepEqual([...first[0].blockHashes].sort(), blockFiles(dir).sort())
  events.push(...first)
  // prompt 1 shares its first 48 tokens: only its last three blocks are new, after block 2
  const p1 = promptCache(KvCache, 1)
  await store.put(p1.cache, 0, p1.tokens)
  const second = await take(iterator, 1)
  t.like(second[0], { type: 'BlockStored', parentBlockHash: first[0].blockHashes[2], medium: 'dir' })
  t.deepEqual(second[0].tokenIds, p1.tokens.slice(48))
  events.push(...second)
  // a flipped block of prompt 0 is found corrupt by a restore and removed
  const victim = first[0].blockHashes[4]
  const bytes = fs.readFileSync(blockFile(dir, victim))
  bytes[bytes.length >> 1] ^= 1
  fs.writeFileSync(blockFile(dir, victim), bytes)
  t.is(await store.restore(emptyCache(), 0, p0.tokens), 64)
  const removed = await take(iterator, 1)
  t.deepEqual(removed, [{ type: 'BlockRemoved', blockHashes: [victim], medium: 'dir' }])
  events.push(...removed)
  return events
}

test('events(): puts, a corrupt block, evictions and a gc, in order, naming only this namespace', async (t) => {
  const dir = tmp(t)
  const store = new PromptStore({ model: 'm', blockTokens: 16, path: dir, maxBytes: 64_000 })
  const iterator = store.events()
  const events = await scenario(t, store, dir, iterator)

  // another tenant's blocks on the same dir take it over this store's budget; this store's gc
  // evicts the oldest files, and names only its own
  const other = new PromptStore({ model: 'm', blockTokens: 16, path: dir, namespace: 'other' })
  const theirs = other.events()
  for (const w of [2, 3, 4]) {
    const p = promptCache(KvCache, w)
    await other.put(p.cache, 0, p.tokens)
  }
  const theirHashes = new Set((await take(theirs, 3)).flatMap((e) => e.blockHashes))
  await theirs.return()
  await store.gc()
  const ourHashes = () => blockFiles(dir).filter((h) => !theirHashes.has(h))
  const afterGc = ourHashes()
  // the store's own evictions: a put beyond the budget stores, then evicts; the events of the
  // gc are the ones before its BlockStored
  const p5 = promptCache(KvCache, 5)
  await store.put(p5.cache, 0, p5.tokens)
  const gc = await until(iterator, storedOf(p5.tokens))
  const put = gc.splice(-1)
  t.true(gc.length > 0 && gc.every((e) => e.type === 'BlockRemoved' && e.medium === 'dir'))
  t.true(gc.flatMap((e) => e.blockHashes).every((h) => !theirHashes.has(h)))
  events.push(...gc)
  // the folded picture is what the directory held of this store's blocks after the gc
  t.deepEqual([...fold(t, events).get('dir')].sort(), afterGc.sort())
  await other.close()
  await store.close()
  // the iterator ends with the store, after the put's evictions
  put.push(...(await until(iterator, () => false)))
  t.true(put.length > 1 && put.slice(1).every((e) => e.type === 'BlockRemoved'))
  events.push(...put)
  t.deepEqual([...fold(t, events).get('dir')].sort(), ourHashes().sort())
})

test('a memory store closed clears every block; an abort rejects with ERR_KV_ABORTED; options are checked', async (t) => {
  const store = new PromptStore({ model: 'm', blockTokens: 16 })
  const iterator = store.events()
  const controller = new AbortController()
  const aborted = store.events({ signal: controller.signal })
  const p = promptCache(KvCache, 0)
  await store.put(p.cache, 0, p.tokens)
  t.like((await take(iterator, 1))[0], { type: 'BlockStored', medium: 'memory' })
  controller.abort()
  await t.throwsAsync(aborted.next(), { code: 'ERR_KV_ABORTED', name: 'AbortError' })
  t.deepEqual(await aborted.next(), { value: undefined, done: true })
  await store.close()
  t.deepEqual(await take(iterator, 2), [{ type: 'AllBlocksCleared' }])
  t.throws(() => store.events(), { code: 'ERR_KV_DISPOSED' })
  const open = new PromptStore({ model: 'm' })
  t.throws(() => open.events({ sigal: null }), { code: 'ERR_KV_INVALID_ARG', message: /unknown option 'sigal'/ })
  t.throws(() => open.events(5), { code: 'ERR_KV_INVALID_ARG' })
  t.throws(() => open.subscribeEvents(5), { code: 'ERR_KV_INVALID_ARG', message: /must be a function, got Number/ })
  t.throws(() => open.unsubscribeEvents('x'), { code: 'ERR_KV_INVALID_ARG' })
  await t.throwsAsync(publishKvEvents(open, { endpont: 'tcp://*:1' }), { code: 'ERR_KV_INVALID_ARG', message: /'endpont'/ })
  await t.throwsAsync(publishKvEvents(open, { endpoint: 'nonsense://x' }), { code: 'ERR_KV_INVALID_ARG', message: /nonsense/ })
  await open.close()
})

test('a process listening to events (and publishing them) exits when it is idle', async (t) => {
  // a hang is the failure; the bound only keeps it from hanging the suite
  const r = spawnSync(process.execPath, ['-e',
    `const { PromptStore } = require(${JSON.stringify(path.join(ROOT, 'index.js'))})
     const { publishKvEvents } = require(${JSON.stringify(path.join(ROOT, 'lib', 'kv-events.js'))})
     const store = new PromptStore({ model: 'm' })
     const it = store.events()
     it.next().then((r) => console.log('next', JSON.stringify(r)))
     publishKvEvents(store, { endpoint: 'tcp://127.0.0.1:*' }).then(() => console.log('publishing'))`],
    { timeout: 60_000, encoding: 'utf8' },
  )
  t.is(r.status, 0, r.stderr)
  t.regex(r.stdout, /publishing/)
})

test('published over ZeroMQ in vLLM format: a subscriber decoding with vLLM schema sees every event, in order', async (t) => {
  if (!fs.existsSync(PYTHON)) t.fail(`${PYTHON} is missing: run node scripts/setup.mjs (npm test runs it first)`)
  const dir = tmp(t)
  const store = new PromptStore({ model: 'm', blockTokens: 16, path: dir, maxBytes: 64_000 })
  const iterator = store.events()
  const publisher = await publishKvEvents(store, {
    endpoint: 'tcp://127.0.0.1:*',
    replayEndpoint: 'tcp://127.0.0.1:*',
    topic: 'kv',
    dataParallelRank: 3,
  })
  t.teardown(() => publisher.close())
  // published before the subscriber exists: it gets them by replay
  const events = await scenario(t, store, dir, iterator)

  const sub = spawn(PYTHON, [path.join(ROOT, 'interop', 'kv_events_subscriber.py'), publisher.endpoint, publisher.replayEndpoint, 'kv'], {
    stdio: ['ignore', 'pipe', 'pipe'],
  })
  let stderr = ''
  sub.stderr.on('data', (d) => (stderr += d))
  t.teardown(() => sub.kill())
  const lines = readline.createInterface({ input: sub.stdout })[Symbol.asyncIterator]()
  const decoded = async (n) => {
    const out = []
    while (out.length < n) {
      const { value, done } = await lines.next()
      if (done) t.fail(`the subscriber ended: ${stderr}`)
      const line = JSON.parse(value)
      if (!line.ready) out.push(line)
    }
    return out
  }
  // live ones after it joined: a put that evicts
  const early = await decoded(events.length)
  const p5 = promptCache(KvCache, 5)
  const p6 = promptCache(KvCache, 6)
  const p7 = promptCache(KvCache, 7)
  const p8 = promptCache(KvCache, 8)
  for (const p of [p5, p6, p7, p8]) await store.put(p.cache, 0, p.tokens)
  // up to the last put's BlockStored: the earlier puts' evictions are in
  events.push(...(await until(iterator, storedOf(p8.tokens))))
  t.true(events.some((e) => e.type === 'BlockRemoved' && e.blockHashes.length > 1), 'the budget evicted')
  const got = [...early, ...(await decoded(events.length - early.length))]

  // the same events, in the same order, with vLLM's fields; sequence numbers from 0, no gap
  const shaped = got.map(({ seq, ts, dataParallelRank, loraId, ...e }) => {
    t.is(dataParallelRank, 3)
    t.true(ts > 1.7e9)
    if (e.type === 'BlockStored') t.is(loraId, null)
    return e
  })
  t.deepEqual(shaped, events)
  const seqs = [...new Set(got.map((l) => l.seq))]
  t.deepEqual(seqs, seqs.map((_, i) => i))
  t.is(publisher.published, seqs.length)

  // a gc: another tenant takes the directory over this store's budget, the gc evicts, and the
  // subscriber decodes the removals, which name only this store's blocks
  const other = new PromptStore({ model: 'm', blockTokens: 16, path: dir, namespace: 'other' })
  for (const w of [9, 10, 11]) {
    const p = promptCache(KvCache, w)
    await other.put(p.cache, 0, p.tokens)
  }
  await other.close()
  await store.gc()
  const p12 = promptCache(KvCache, 12)
  await store.put(p12.cache, 0, p12.tokens)
  const gc = (await until(iterator, storedOf(p12.tokens))).slice(0, -1)
  t.true(gc.length > 0 && gc.every((e) => e.type === 'BlockRemoved'))
  const gcDecoded = await decoded(gc.length + 1)
  t.deepEqual(gcDecoded.slice(0, -1).map(({ type, blockHashes, medium }) => ({ type, blockHashes, medium })), gc)
  await store.close()

  // AllBlocksCleared: a memory store closed while a subscriber listens
  const memory = new PromptStore({ model: 'm', blockTokens: 16 })
  const mp = await publishKvEvents(memory, { endpoint: 'tcp://127.0.0.1:*', replayEndpoint: 'tcp://127.0.0.1:*' })
  const msub = spawn(PYTHON, [path.join(ROOT, 'interop', 'kv_events_subscriber.py'), mp.endpoint, mp.replayEndpoint], { stdio: ['ignore', 'pipe', 'pipe'] })
  t.teardown(() => msub.kill())
  const mlines = readline.createInterface({ input: msub.stdout })[Symbol.asyncIterator]()
  const next = async () => {
    for (;;) {
      const { value, done } = await mlines.next()
      if (done) t.fail('the subscriber ended')
      const line = JSON.parse(value)
      if (!line.ready) return line
    }
  }
  const p0 = promptCache(KvCache, 0)
  await memory.put(p0.cache, 0, p0.tokens)
  t.like(await next(), { seq: 0, type: 'BlockStored', medium: 'memory', parentBlockHash: null })
  // the subscriber has caught up: the close's event goes out live before the sockets close
  await memory.close()
  t.like(await next(), { seq: 1, type: 'AllBlocksCleared' })
})

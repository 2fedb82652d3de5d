import test from 'ava'
import fs from 'node:fs'
import os from 'node:os'
import path from 'node:path'
import { spawnSync } from 'node:child_process'
import { createRequire } from 'node:module'
import { promptCache, promptTokens } from './helpers/store-prompts.mjs'
import { runScript } from './helpers/run-script.mjs'
import parsePrometheus from 'parse-prometheus-text-format'

const require = createRequire(import.meta.url)
const { KvCache, PromptStore, inspectState, convertStateFileSync } = require('../index.js')
const HERE = import.meta.dirname ?? path.dirname(new URL(import.meta.url).pathname)

const tmp = () => fs.mkdtempSync(path.join(os.tmpdir(), 'kvstore-'))
const emptyCache = (o = {}) => new KvCache({ size: 128, nLayer: 2, nEmbdKGqa: 32, nSeqMax: 2, ...o })
const rows = (c, n, from = 0) =>
  [0, 1].flatMap((il) => [Buffer.from(c.readK(il, from, n)), Buffer.from(c.readV(il, from, n))])

test('put then restore into another cache is byte-exact, async and sync', async (t) => {
  const store = new PromptStore({ model: 'm', blockTokens: 16 })
  const { cache, tokens } = promptCache(KvCache, 0)
  const put = await store.put(cache, 0, tokens)
  t.like(put, { tokens: 96, blocksWritten: 6, blocksSkipped: 0 })
  t.true(put.bytesWritten > 96 * 2 * 2 * 64)
  const dst = emptyCache()
  t.is(await store.restore(dst, 1, tokens), 96)
  t.deepEqual(rows(dst, 96), rows(cache, 96))
  t.is(dst.seqPosMax(1), 95)
  const sync = emptyCache()
  t.is(store.restoreSync(sync, 0, tokens.slice(0, 40)), 32)
  t.deepEqual(rows(sync, 32), rows(cache, 32))
  t.like(store.putSync(cache, 0, tokens), { blocksWritten: 0, blocksSkipped: 6 })
})

test('metrics(): Prometheus text per tier and per call, served over HTTP as docs/prompt-store.md shows', async (t) => {
  const dir = tmp()
  t.teardown(() => fs.rmSync(dir, { recursive: true, force: true }))
  const store = new PromptStore({ model: 'm', blockTokens: 16, tiers: ['memory', 'dir'], path: dir })
  const { cache, tokens } = promptCache(KvCache, 0)
  const put = await store.put(cache, 0, tokens)
  t.is(await store.lookup(tokens), 96)
  t.is(await store.restore(emptyCache(), 0, tokens), 96)
  // the handler docs/prompt-store.md shows
  const http = await import('node:http')
  const server = http.createServer(async (req, res) => {
    res.setHeader('Content-Type', 'text/plain; version=0.0.4')
    res.end(await store.metrics())
  })
  await new Promise((resolve) => server.listen(0, '127.0.0.1', resolve))
  t.teardown(() => server.close())
  const reply = await fetch(`http://127.0.0.1:${server.address().port}/metrics`)
  t.is(reply.headers.get('content-type'), 'text/plain; version=0.0.4')
  const text = await reply.text()
  const value = (line) => {
    const found = text.split('\n').find((l) => l.startsWith(line + ' '))
    t.truthy(found, `no ${line} in\n${text}`)
    return Number(found?.split(' ').pop())
  }
  // the blocks, and the store's small model record
  const written = value('llama_kv_store_written_bytes_total{namespace="",tier="memory"}')
  t.true(written >= put.bytesWritten && written < put.bytesWritten + 1024, `${written} for ${put.bytesWritten}`)
  t.is(value('llama_kv_store_written_bytes_total{namespace="",tier="dir"}'), written, 'written through')
  t.true(value('llama_kv_store_hits_total{namespace="",tier="memory"}') >= 6, 'the restore read the memory tier')
  t.is(value('llama_kv_store_hits_total{namespace="",tier="dir"}'), 0, 'and never the dir tier')
  t.is(value('llama_kv_store_evictions_total{namespace="",tier="memory"}'), 0)
  for (const op of ['lookup', 'put', 'restore']) {
    t.is(value(`llama_kv_store_call_duration_seconds_count{namespace="",op="${op}"}`), 1, op)
    t.is(value(`llama_kv_store_call_duration_seconds_bucket{namespace="",op="${op}",le="+Inf"}`), 1, op)
  }
  t.is(store.metricsSync().split('\n').filter((l) => l.startsWith('# TYPE')).length, 8)
})

test('metrics(): the counters parse with a Prometheus text parser and match stats()', async (t) => {
  const dir = tmp()
  t.teardown(() => fs.rmSync(dir, { recursive: true, force: true }))
  const { cache, tokens } = promptCache(KvCache, 0)
  await new PromptStore({ model: 'm', blockTokens: 16, path: dir, secret: 'a'.repeat(16) }).put(cache, 0, tokens)
  // another secret on the same directory: the blocks are rejected; a 1-byte budget makes gc evict
  const other = new PromptStore({ model: 'm', blockTokens: 16, path: dir, secret: 'b'.repeat(16), maxBytes: 1 })
  t.is(await other.restore(emptyCache(), 0, tokens), 0)
  t.is(await other.lookup(tokens), 0)
  await other.gc()
  const families = parsePrometheus(await other.metrics())
  const counter = (name) => {
    const family = families.find((f) => f.name === name)
    t.is(family?.type, 'COUNTER', name)
    return family.metrics.reduce((sum, m) => sum + Number(m.value), 0)
  }
  const stats = await other.stats()
  t.true(stats.rejected > 0)
  t.is(counter('llama_kv_store_rejected_blocks_total'), stats.rejected)
  t.is(counter('llama_kv_store_corrupt_blocks_total'), stats.corrupt)
  t.is(counter('llama_kv_store_evictions_total'), stats.evictions)
  t.true(stats.evictions > 0, 'gc evicted beyond maxBytes')
  // (that parser folds every labelled histogram series into one, so the histograms are checked
  // as text in the test above)
  t.is(families.find((f) => f.name === 'llama_kv_store_call_duration_seconds')?.type, 'HISTOGRAM')
})

test('metrics(): two stores of one process in different namespaces give series told apart by their namespace label', async (t) => {
  const dir = tmp()
  t.teardown(() => fs.rmSync(dir, { recursive: true, force: true }))
  const { cache, tokens } = promptCache(KvCache, 0)
  const a = new PromptStore({ model: 'm', blockTokens: 16, namespace: 'tenant-a', tiers: ['memory', 'dir'], path: dir })
  const b = new PromptStore({ model: 'm', blockTokens: 16, namespace: 'tenant-b' })
  await a.put(cache, 0, tokens)
  t.is(await a.restore(emptyCache(), 0, tokens), 96)
  t.is(await b.lookup(tokens), 0, 'the namespaces share nothing')
  // both stores' series, as one Prometheus stores them (a text exposition holds each family once:
  // each store's is parsed on its own)
  const families = [...parsePrometheus(await a.metrics()), ...parsePrometheus(b.metricsSync())]
  const series = (name) => families.filter((f) => f.name === name).flatMap((f) => f.metrics)
  for (const family of families.filter((f) => f.type === 'COUNTER')) {
    for (const m of family.metrics) t.true(['tenant-a', 'tenant-b'].includes(m.labels.namespace), `${family.name} ${JSON.stringify(m.labels)}`)
  }
  const hits = series('llama_kv_store_hits_total')
  t.deepEqual(hits.map((m) => m.labels), [
    { namespace: 'tenant-a', tier: 'memory' },
    { namespace: 'tenant-a', tier: 'dir' },
    { namespace: 'tenant-b', tier: 'memory' },
  ])
  t.true(Number(hits[0].value) >= 6, 'a\'s restore read its near tier')
  t.is(Number(hits[2].value), 0, 'b found nothing')
  t.is(Number(series('llama_kv_store_misses_total').find((m) => m.labels.namespace === 'tenant-b').value) > 0, true)
  t.deepEqual(series('llama_kv_store_corrupt_blocks_total').map((m) => m.labels), [{ namespace: 'tenant-a' }, { namespace: 'tenant-b' }])
  const text = a.metricsSync()
  t.true(text.includes('llama_kv_store_call_duration_seconds_count{namespace="tenant-a",op="restore"} 1'), text)
})

test('metrics(): a namespace holding a quote, a backslash and a newline is escaped as the text format wants', async (t) => {
  const namespace = 'te"n\\ant\nx'
  const store = new PromptStore({ model: 'm', blockTokens: 16, namespace })
  const text = await store.metrics()
  t.true(text.includes('llama_kv_store_rejected_blocks_total{namespace="te\\"n\\\\ant\\nx"} 0'), text)
  const series = text.split('\n').filter((l) => l && !l.startsWith('#'))
  t.true(series.every((l) => l.startsWith(l.split('{')[0] + '{namespace="te\\"n\\\\ant\\nx"')), 'every series, histograms included')
  const families = parsePrometheus(text)
  t.is(families.length, 8)
  for (const family of families.filter((f) => f.type === 'COUNTER')) {
    t.true(family.metrics.length > 0, family.name)
    for (const m of family.metrics) t.is(m.labels.namespace, namespace, family.name)
  }
  t.deepEqual(families.find((f) => f.name === 'llama_kv_store_hits_total').metrics[0].labels, { namespace, tier: 'memory' })
})

/** A cache whose sequence 0 holds `n` tokens with rows made of them, and those tokens. */
const longPrompt = (n) => {
  const cache = emptyCache({ size: 512 })
  const tokens = Array.from({ length: n }, (_, i) => 7 + i)
  cache.findSlot({ pos: tokens.map((_, i) => i), seqIds: tokens.map(() => 0) })
  for (let il = 0; il < 2; il++) {
    for (let i = 0; i < n; i++) {
      cache.writeKF32(il, i, Float32Array.from({ length: 32 }, (_, j) => tokens[i] + il + j / 64))
      cache.writeVF32(il, i, Float32Array.from({ length: 32 }, (_, j) => -(tokens[i] + il + j / 64)))
    }
  }
  return { cache, tokens }
}

test('restore with maxLoadTokens 100 of a stored 256-token prompt loads the 96 tokens of its last block boundary below 100', async (t) => {
  const store = new PromptStore({ model: 'm', blockTokens: 16 })
  const { cache, tokens } = longPrompt(256)
  t.like(await store.put(cache, 0, tokens), { tokens: 256 })
  const dst = emptyCache({ size: 512 })
  t.is(await store.restore(dst, 0, tokens, { maxLoadTokens: 100 }), 96)
  t.deepEqual([dst.seqPosMin(0), dst.seqPosMax(0), dst.usedCells], [0, 95, 96])
  t.deepEqual(rows(dst, 96), rows(cache, 96))
  const sync = emptyCache({ size: 512 })
  t.is(store.restoreSync(sync, 1, tokens, { maxLoadTokens: 100 }), 96)
  t.is(sync.seqPosMax(1), 95)
  t.is(store.restoreSync(emptyCache({ size: 512 }), 0, tokens, { maxLoadTokens: 15 }), 0, 'under one block: nothing')
  t.is(store.restoreSync(emptyCache({ size: 512 }), 0, tokens, { maxLoadTokens: 1e9 }), 256, 'past the prompt: all of it')
  // a checkpoint where a turn ended inside a block is a restore point too
  const turn = longPrompt(100)
  t.like(await store.put(turn.cache, 0, tokens.slice(0, 100)), { tokens: 100, checkpointsWritten: 1 })
  t.is(await store.restore(emptyCache({ size: 512 }), 0, tokens, { maxLoadTokens: 100 }), 100)
  t.is(await store.restore(emptyCache({ size: 512 }), 0, tokens, { maxLoadTokens: 99 }), 96)
})

test('restore refuses a maxLoadTokens that is not a positive integer with ERR_KV_INVALID_ARG naming it', async (t) => {
  const store = new PromptStore({ model: 'm', blockTokens: 16 })
  const { cache, tokens } = promptCache(KvCache, 0)
  await store.put(cache, 0, tokens)
  for (const [bad, shown] of [[0, '0'], [-16, '-16'], [1.5, '1.5'], [NaN, 'NaN'], [Infinity, 'inf']]) {
    const message = new RegExp(`maxLoadTokens must be a positive integer, got ${shown}$`)
    t.throws(() => store.restoreSync(emptyCache(), 0, tokens, { maxLoadTokens: bad }), { code: 'ERR_KV_INVALID_ARG', message })
    await t.throwsAsync(async () => store.restore(emptyCache(), 0, tokens, { maxLoadTokens: bad }), { code: 'ERR_KV_INVALID_ARG', message })
  }
  t.throws(() => store.restoreSync(emptyCache(), 0, tokens, { maxLoadTokens: '16' }), { code: 'ERR_KV_INVALID_ARG' })
  t.throws(() => store.restoreSync(emptyCache(), 0, tokens, { signal: AbortSignal.abort() }), { code: 'ERR_KV_INVALID_ARG', message: /unknown option 'signal'/ })
  t.throws(() => store.restoreSync(emptyCache(), 0, tokens, { maxTokens: 16 }), { code: 'ERR_KV_INVALID_ARG', message: /unknown option 'maxTokens'/ })
})

test('lookup returns the stored prefix of a diverging prompt in tokens', async (t) => {
  const store = new PromptStore({ model: 'm', blockTokens: 16 })
  const a = promptCache(KvCache, 0)
  await store.put(a.cache, 0, a.tokens)
  t.is(await store.lookup(a.tokens), 96)
  t.is(store.lookupSync(promptTokens(1)), 48) // shares the first 48 tokens
  t.is(store.lookupSync(Int32Array.from(a.tokens.slice(0, 20))), 16)
  t.is(store.lookupSync([]), 0)
  const s = store.statsSync()
  t.like(s, { backend: 'memory', blockTokens: 16, hits: 6 + 3 + 1, misses: 1, corrupt: 0, evictions: 0 })
})

test('a sequence that is not positions 0..n-1 is refused with ERR_KV_STORE_NOT_PREFIX', async (t) => {
  const store = new PromptStore({ model: 'm', blockTokens: 16 })
  const { cache, tokens } = promptCache(KvCache, 0)
  cache.seqRm(0, 0, 16)
  await t.throwsAsync(store.put(cache, 0, tokens), { code: 'ERR_KV_STORE_NOT_PREFIX', message: /80 cells must hold positions 0\.\.80/ })
  const shifted = promptCache(KvCache, 0)
  shifted.cache.seqAdd(0, 0, -1, 3)
  t.throws(() => store.putSync(shifted.cache, 0, tokens), { code: 'ERR_KV_STORE_NOT_PREFIX', message: /K-shift/ })
})

test('a cache of another geometry is refused with ERR_KV_STORE_GEOMETRY, also by a later process', async (t) => {
  const dir = tmp()
  const { cache, tokens } = promptCache(KvCache, 0)
  await new PromptStore({ model: 'm', path: dir, blockTokens: 16 }).put(cache, 0, tokens)
  const later = new PromptStore({ model: 'm', path: dir, blockTokens: 16 })
  t.is(later.lookupSync(tokens), 96)
  const q8 = emptyCache({ typeK: 'q8_0', typeV: 'q8_0', flashAttn: true })
  await t.throwsAsync(later.restore(q8, 0, tokens), { code: 'ERR_KV_STORE_GEOMETRY', message: /q8_0/ })
  const other = promptCache(KvCache, 0, { typeK: 'f32', typeV: 'f32' })
  t.throws(() => later.putSync(other.cache, 0, tokens), { code: 'ERR_KV_STORE_GEOMETRY' })
  // another model string is another store
  t.is(new PromptStore({ model: 'm2', path: dir, blockTokens: 16 }).putSync(other.cache, 0, tokens).blocksWritten, 6)
})

test('bad arguments are ERR_KV_INVALID_ARG naming the value', (t) => {
  t.throws(() => new PromptStore({ model: 'm', blockTokens: 8 }), { code: 'ERR_KV_INVALID_ARG', message: /blockTokens .* 8/ })
  t.throws(() => new PromptStore({ model: '' }), { code: 'ERR_KV_INVALID_ARG', message: /model/ })
  t.throws(() => new PromptStore({ model: 'm', maxBytes: -1 }), { code: 'ERR_KV_INVALID_ARG', message: /maxBytes/ })
  const store = new PromptStore({ model: 'm' })
  t.throws(() => store.putSync({}, 0, [1]), { code: 'ERR_KV_INVALID_ARG', message: /KvCache/ })
  t.throws(() => store.lookupSync([1.5]), { code: 'ERR_KV_INVALID_ARG', message: /tokens\[0\]/ })
  t.throws(() => store.restoreSync(emptyCache(), 5, [1]), { code: 'ERR_KV_OUT_OF_RANGE' })
  t.throws(() => store.writeFileSync([1], '/tmp/x', { kind: 'slot' }), { code: 'ERR_KV_INVALID_ARG', message: /slot/ })
})

test("policy 's3fifo': blocks round-trip, a tiered store admits them into memory at their second use, and unknown values are refused", async (t) => {
  const { cache, tokens } = promptCache(KvCache, 0)
  const store = new PromptStore({ model: 'm', blockTokens: 16, maxBytes: 1 << 20, policy: 's3fifo' })
  t.like(await store.put(cache, 0, tokens), { blocksWritten: 6 })
  const dst = emptyCache()
  t.is(await store.restore(dst, 0, tokens), 96)
  t.deepEqual(rows(dst, 96), rows(cache, 96))

  const dir = tmp()
  t.teardown(() => fs.rmSync(dir, { recursive: true, force: true }))
  const tiered = new PromptStore({ model: 'm', blockTokens: 16, tiers: ['memory', 'dir'], path: dir, maxBytes: 1 << 20, policy: 's3fifo' })
  await tiered.put(cache, 0, tokens)
  const hits = (tier) => {
    const family = parsePrometheus(tiered.metricsSync()).find((f) => f.name === 'llama_kv_store_hits_total')
    return Number(family?.metrics.find((m) => m.labels.tier === tier)?.value)
  }
  t.is(await tiered.restore(emptyCache(), 0, tokens), 96)
  t.is(hits('memory'), 0, 'the put skipped the memory tier')
  t.true(hits('dir') >= 6, 'the first restore read the dir tier')
  t.is(await tiered.restore(emptyCache(), 0, tokens), 96)
  t.true(hits('memory') >= 6, 'and copied the blocks into memory for the second')

  t.throws(() => new PromptStore({ model: 'm', policy: 'arc' }), { code: 'ERR_KV_INVALID_ARG', message: /policy.*"arc"/ })
  t.throws(() => new PromptStore({ model: 'm', path: dir, policy: 's3fifo' }), { code: 'ERR_KV_INVALID_ARG', message: /memory tier/ })
  t.notThrows(() => new PromptStore({ model: 'm', path: dir, policy: 'lru' }))
})

test('a store directory that cannot be created is ERR_KV_STORE_IO', (t) => {
  const file = path.join(tmp(), 'file')
  fs.writeFileSync(file, 'x')
  t.throws(() => new PromptStore({ model: 'm', path: path.join(file, 'store') }), { code: 'ERR_KV_STORE_IO', message: /file/ })
})

test('a store directory removed underneath fails a put with ERR_KV_STORE_IO and leaves the cache as it was', async (t) => {
  const dir = path.join(tmp(), 'store')
  const store = new PromptStore({ model: 'm', path: dir, blockTokens: 16 })
  const { cache, tokens } = promptCache(KvCache, 0)
  const before = rows(cache, 96)
  fs.rmSync(dir, { recursive: true })
  await t.throwsAsync(store.put(cache, 0, tokens), { code: 'ERR_KV_STORE_IO' })
  t.deepEqual(rows(cache, 96), before)
  t.is(cache.seqCellCount(0), 96)
})

test('the cache is busy while a store task holds it, and store tasks queue behind each other', async (t) => {
  const store = new PromptStore({ model: 'm', blockTokens: 16 })
  const { cache, tokens } = promptCache(KvCache, 0)
  const pending = store.put(cache, 0, tokens)
  t.throws(() => cache.seqRm(0, 90, -1), { code: 'ERR_KV_BUSY' })
  t.throws(() => store.restoreSync(cache, 1, tokens), { code: 'ERR_KV_BUSY' })
  const queued = store.restore(cache, 1, tokens.slice(0, 32))
  t.like(await pending, { blocksWritten: 6 })
  t.is(await queued, 32)
  t.is(cache.seqCellCount(1), 32)
})

// a prompt large enough (64 MB in 256 blocks, 32 batches) that progress reaches JS while the put
// runs; serial, so that no other test keeps the event loop busy meanwhile
test.serial('an abort signal rejects with ERR_KV_ABORTED: already aborted, or running', async (t) => {
  const cache = new KvCache({ size: 4096, nLayer: 8, nEmbdKGqa: 256, typeK: 'f32', typeV: 'f32', flashAttn: true })
  const tokens = Array.from({ length: 4096 }, (_, i) => i)
  cache.findSlot({ pos: tokens, seqIds: tokens.map(() => 0) })
  const store = new PromptStore({ model: 'm', blockTokens: 16 })
  const done = new AbortController()
  done.abort()
  await t.throwsAsync(store.restore(cache, 0, tokens, { signal: done.signal }), { code: 'ERR_KV_ABORTED' })
  await t.throwsAsync(store.lookup(tokens, { signal: done.signal }), { code: 'ERR_KV_ABORTED' })
  const running = new AbortController()
  const reports = []
  const onProgress = (d, n) => {
    reports.push([d, n])
    running.abort()
  }
  const e = await t.throwsAsync(store.put(cache, 0, tokens, { signal: running.signal, onProgress }))
  t.is(e.code, 'ERR_KV_ABORTED', e.message)
  t.deepEqual(reports[0], [0, 256])
  t.true(store.statsSync().blocks < 256, 'stopped before the end')
  cache.dispose()
})

test("restore's onProgress counts the tokens of the restore point, block by block", async (t) => {
  // (an abort between blocks rolls the load back: pinned without timing in the store's Rust
  // tests, since a report reaches JS only after the restore may have finished)
  const store = new PromptStore({ model: 'm', blockTokens: 16 })
  const { cache, tokens } = promptCache(KvCache, 0)
  await store.put(cache, 0, tokens)
  const dst = emptyCache()
  const all = []
  t.is(await store.restore(dst, 1, tokens.slice(0, 40), { onProgress: (d, n) => all.push([d, n]) }), 32)
  // reports are queued to the JS thread: wait for the last one
  for (let i = 0; i < 1000 && all.length < 3; i++) await new Promise((resolve) => setImmediate(resolve))
  t.deepEqual(all, [0, 16, 32].map((d) => [d, 32]))
  t.deepEqual(rows(dst, 32), rows(cache, 32))
})

test('an abort signal rejects a store task queued behind another with ERR_KV_ABORTED', async (t) => {
  // the first put takes long enough (8 MB) that the others are still queued at abort()
  const store = new PromptStore({ model: 'm', blockTokens: 16 })
  const cache = new KvCache({ size: 4096, nLayer: 4, nEmbdKGqa: 128, typeK: 'f32', typeV: 'f32', nSeqMax: 2 })
  const tokens = Array.from({ length: 2048 }, (_, i) => i)
  cache.findSlot({ pos: tokens, seqIds: tokens.map(() => 0) })
  const first = store.put(cache, 0, tokens)
  const queued = new AbortController()
  const settled = Promise.allSettled([
    store.restore(cache, 1, tokens.slice(0, 32), { signal: queued.signal }),
    store.put(cache, 0, tokens, { signal: queued.signal }),
  ])
  queued.abort()
  t.like(await first, { tokens: 2048 })
  for (const r of await settled) t.is(r.reason?.code, 'ERR_KV_ABORTED')
  t.is(cache.seqCellCount(1), 0, 'the aborted restore changed nothing')
})

test('writeFile writes the stored prefix as a sequence or session file that loads, and putFile ingests it', async (t) => {
  const dir = tmp()
  const store = new PromptStore({ model: 'm', blockTokens: 16 })
  const { cache, tokens } = promptCache(KvCache, 0)
  await store.put(cache, 0, tokens.slice(0, 80))
  const seqFile = path.join(dir, 'a.ggsq')
  t.is(await store.writeFile(tokens, seqFile), 80)
  t.like(inspectState(seqFile), { format: 'sequence', version: 2, nTokens: 80, layout: 'streams', vTrans: true })
  const loaded = emptyCache()
  t.deepEqual(loaded.loadSequenceFileSync(seqFile, 1).tokens, tokens.slice(0, 80))
  t.deepEqual(rows(loaded, 80), rows(cache, 80))
  const session = path.join(dir, 'a.ggsn')
  t.is(store.writeFileSync(tokens, session, { kind: 'session', version: 9, flashAttn: true }), 80)
  t.like(inspectState(session), { format: 'session', nTokens: 80, vTrans: false })
  const fresh = new PromptStore({ model: 'm', blockTokens: 16 })
  t.like(await fresh.putFile(seqFile), { tokens: 80, blocksWritten: 5 })
  t.like(fresh.putFileSync(session), { tokens: 80, blocksWritten: 0, blocksSkipped: 5 })
  t.is(fresh.lookupSync(tokens), 80)
  // nothing stored: nothing written
  const none = path.join(dir, 'none.ggsq')
  t.is(await new PromptStore({ model: 'm' }).writeFile(tokens, none), 0)
  t.false(fs.existsSync(none))
})

test('writeFile with durable: false writes the same bytes, replacing the old file whole, and leaves no temporary file', async (t) => {
  const dir = tmp()
  const store = new PromptStore({ model: 'm', blockTokens: 16 })
  const { cache, tokens } = promptCache(KvCache, 0)
  await store.put(cache, 0, tokens)
  const synced = path.join(dir, 'synced.ggsq')
  const unsynced = path.join(dir, 'unsynced.ggsq')
  t.is(await store.writeFile(tokens, synced), 96)
  fs.writeFileSync(unsynced, 'an older file')
  t.is(await store.writeFile(tokens, unsynced, { durable: false }), 96)
  t.deepEqual(fs.readFileSync(unsynced), fs.readFileSync(synced))
  // the assembled path (a conversion) too
  const session = path.join(dir, 'unsynced.ggsn')
  t.is(store.writeFileSync(tokens, session, { kind: 'session', version: 9, durable: false }), 96)
  t.is(store.writeFileSync(tokens, path.join(dir, 'synced.ggsn'), { kind: 'session', version: 9 }), 96)
  t.deepEqual(fs.readFileSync(session), fs.readFileSync(path.join(dir, 'synced.ggsn')))
  t.deepEqual(fs.readdirSync(dir).sort(), ['synced.ggsn', 'synced.ggsq', 'unsynced.ggsn', 'unsynced.ggsq'])
  t.throws(() => store.writeFileSync(tokens, session, { durable: 'no' }), { code: 'ERR_KV_INVALID_ARG', message: /durable/ })
})

// writeFile writes the sequence files llama.node (2) and node-llama-cpp (3) read straight from the
// blocks where it converted the store's own form (a whole parse and copy of the file, most of a
// restore's writeFile): the bytes must be exactly what the conversion gives
const DIRECT_FORMS = [
  ['nlc-h32-f16.ggsq', 'unified, node-llama-cpp'],
  ['ln-h16-f16.ggsn', 'unified, a llama.node session'],
  [path.join('t161', 't161-h16-f16-fa.ggsq'), 'unified, flash attention'],
  [path.join('t161', 't161-gemma3-swa.ggsq'), 'iSWA'],
  [path.join('t161', 't161-jamba.ggsq'), 'hybrid (converted)'],
  [path.join('t161', 't161-mamba.ggsq'), 'recurrent (converted)'],
  [path.join('t161', 't161-h32-q8_0-fa.ggsq'), 'q8_0, unrotated', [true]], // quantized V: flash attention only
]
test('writeFile of a version 2 or 3 sequence file gives the bytes of converting the store\'s own form', async (t) => {
  const dir = tmp()
  for (const [name, what, layouts = [false, true]] of DIRECT_FORMS) {
    const file = path.join(HERE, 'fixtures', name)
    const store = new PromptStore({ model: `direct-${name}`, blockTokens: 16 })
    const { tokens } = await store.putFile(file).then(() => inspectState(file))
    for (const version of [2, 3]) {
      for (const flashAttn of layouts) {
        const own = path.join(dir, 'own.ggsq')
        const direct = path.join(dir, 'direct.ggsq')
        const converted = path.join(dir, 'converted.ggsq')
        const n = store.writeFileSync(tokens, direct, { kind: 'sequence', version, layout: 'streams', flashAttn })
        t.is(store.writeFileSync(tokens, own, { kind: 'sequence', version: 4, flashAttn }), n)
        convertStateFileSync(own, converted, { version, layout: 'streams' })
        t.deepEqual(fs.readFileSync(direct), fs.readFileSync(converted), `${what}: version ${version}, flashAttn ${flashAttn}`)
      }
    }
  }
})

test('a flipped byte in a stored block is a counted miss, never loaded', async (t) => {
  const dir = tmp()
  const store = new PromptStore({ model: 'm', path: dir, blockTokens: 16 })
  const { cache, tokens } = promptCache(KvCache, 0)
  await store.put(cache, 0, tokens)
  // the block files hold their tokens: find block 3 (tokens 48..63) by its header
  const files = fs.readdirSync(path.join(dir, 'blocks'), { recursive: true }).filter((f) => f.endsWith('.kvb'))
  const third = files.map((f) => path.join(dir, 'blocks', f)).find((f) => fs.readFileSync(f).readUInt32LE(72) === 3)
  const bytes = fs.readFileSync(third)
  bytes[bytes.length - 100] ^= 0x10
  fs.writeFileSync(third, bytes)
  const dst = emptyCache()
  t.is(await store.restore(dst, 0, tokens), 48)
  t.deepEqual(rows(dst, 48), rows(cache, 48))
  t.like(await store.stats(), { corrupt: 1, misses: 1 })
})

test('a byte budget keeps the directory under it and the evicted prefix is a plain miss', async (t) => {
  const dir = tmp()
  const store = new PromptStore({ model: 'm', path: dir, blockTokens: 16, maxBytes: 20_000 })
  const { cache, tokens } = promptCache(KvCache, 0)
  await store.put(cache, 0, tokens) // 6 blocks of ~9 KB
  const s = await store.gc()
  t.true(s.bytes <= 20_000 && s.evictions > 0, JSON.stringify(s))
  t.is(store.lookupSync(tokens), 0)
  t.is(store.restoreSync(emptyCache(), 0, tokens), 0)
})

const runWorker = (dir, w, n) => runScript(path.join(HERE, 'helpers', 'store-worker.mjs'), [dir, w, n])

test('four processes putting and restoring overlapping prompts in one directory: every restore exact', async (t) => {
  const dir = tmp()
  const results = await Promise.all([0, 1, 2, 3].map((w) => runWorker(dir, w, 4)))
  for (const r of results) t.is(r.corrupt, 0)
  // each worker's own prompt is restored whole at least in the rounds after its put
  t.true(results.every((r) => r.restored >= 96 * 2))
  const store = new PromptStore({ model: 'h16-test', path: dir, blockTokens: 16 })
  for (let w = 0; w < 4; w++) t.is(store.lookupSync(promptTokens(w)), 96)
  // 3 shared blocks + 3 own per prompt, + the model record
  t.is(store.statsSync().blocks, 3 + 4 * 3 + 1)
  t.deepEqual(fs.readdirSync(path.join(dir, 'tmp')), [])
})

const T161 = path.join(HERE, 'fixtures', 't161')

test("putFile ingests llama.cpp 0.1.161's files of every memory and writeFile gives each back byte for byte", async (t) => {
  // rotated q8_0, sliding window (f16 and rotated q8_0), hybrid (Jamba, LFM2), hybrid-iSWA (LFM2 with a
  // window: three parts), latent attention (no V), DeepSeek's sparse attention (latent and indexer caches),
  // recurrent, plain: 10-token prompts, so each is one checkpoint (the partial
  // block) plus whatever its memory needs
  for (const name of ['h64-q8_0-fa', 'gemma3-swa', 'gemma3-swa-q8_0-fa', 'jamba', 'lfm2', 'lfm2-swa', 'deepseek2-mla', 'deepseek32-dsa', 'mamba', 'h16-f16']) {
    for (const ext of ['ggsn', 'ggsq']) {
      const file = path.join(T161, `t161-${name}.${ext}`)
      const store = new PromptStore({ model: name, blockTokens: 16 })
      const { tokens } = inspectState(file)
      t.like(await store.putFile(file), { tokens: 10, blocksWritten: 0, checkpointsWritten: 1 }, file)
      t.is(await store.lookup(tokens), 10)
      t.is(await store.lookup(tokens.slice(0, 9)), 0, 'a prompt that ends inside the checkpoint restores nothing')
      const out = path.join(tmp(), `out.${ext}`)
      t.is(await store.writeFile(tokens, out), 10)
      t.true(fs.readFileSync(out).equals(fs.readFileSync(file)), `${name}.${ext}: the same bytes llama.cpp wrote`)
    }
  }
})

test('a store holds one shape: a file of another memory or rotation is ERR_KV_STORE_GEOMETRY naming both', async (t) => {
  const store = new PromptStore({ model: 'one-name', blockTokens: 16 })
  await store.putFile(path.join(T161, 't161-gemma3-swa.ggsn'))
  const e = await t.throwsAsync(store.putFile(path.join(T161, 't161-gemma3-swa-q8_0-fa.ggsn')), { code: 'ERR_KV_STORE_GEOMETRY' })
  t.regex(e.message, /iswa.*sliding window.*nRotK 64/)
  await t.throwsAsync(store.putFile(path.join(T161, 't161-mamba.ggsq')), { code: 'ERR_KV_STORE_GEOMETRY', message: /recurrent/ })
})

test('two GGUF files that differ in one weight byte are two models: different fingerprints, no shared block', async (t) => {
  const dir = tmp()
  const original = path.join(HERE, '..', 'interop', 'models', 'llama-h16.gguf')
  const tuned = path.join(dir, 'llama-h16-tuned.gguf')
  const bytes = fs.readFileSync(original)
  bytes[bytes.length - 3] ^= 1 // the last tensor's data
  fs.writeFileSync(tuned, bytes)
  const { modelInfoSync } = require('../index.js')
  t.is(modelInfoSync(original).fingerprint, modelInfoSync(tuned).fingerprint, 'the header alone cannot tell them apart')
  t.not(modelInfoSync(original, { hashFile: true }).fingerprint, modelInfoSync(tuned, { hashFile: true }).fingerprint)
  const storeDir = path.join(dir, 'store')
  const [a, b] = [original, tuned].map((model) => new PromptStore({ model, path: storeDir, blockTokens: 16 }))
  const { cache, tokens } = promptCache(KvCache, 0)
  t.like(await a.put(cache, 0, tokens), { blocksWritten: 6 })
  t.is(await b.lookup(tokens), 0)
  t.like(await b.put(cache, 0, tokens), { blocksWritten: 6, blocksSkipped: 0 })
})

test('the store CLI ingests files, looks up, writes, reports and collects, with no progress bar off a terminal', (t) => {
  const dir = tmp()
  const storeDir = path.join(dir, 'store')
  const cli = (...args) => spawnSync(process.execPath, [path.join(HERE, '..', 'bin', 'llama-kv-cache.js'), 'store', ...args], { encoding: 'utf8' })
  const { cache, tokens } = promptCache(KvCache, 0)
  const file = path.join(dir, 'a.ggsq')
  cache.saveSequenceFileSync(file, 0, tokens)
  const common = ['--store', storeDir, '--model', 'm', '--block-tokens', '16']
  const put = cli('put', file, ...common)
  t.is(put.status, 0, put.stderr)
  t.regex(put.stdout, /96 tokens, 6 blocks written \(\d+ bytes\), 0 already stored/)
  t.is(put.stderr, '', 'no progress bar when stderr is not a terminal')
  const other = path.join(dir, 'b.json')
  fs.writeFileSync(other, JSON.stringify(promptTokens(1)))
  t.is(cli('lookup', other, ...common).stdout, '48\n')
  t.is(cli('lookup', file, ...common).stdout, '96\n') // tokens taken from the state file
  const out = path.join(dir, 'b.ggsn')
  const write = cli('write', other, out, ...common, '--kind', 'session', '--flash-attn')
  t.is(write.stdout, '48\n', write.stderr)
  t.like(inspectState(out), { format: 'session', nTokens: 48, vTrans: false })
  const stats = JSON.parse(cli('stats', '--store', storeDir, '--json').stdout)
  t.like(stats, { backend: 'dir', blocks: 7, evictions: 0 })
  t.regex(cli('gc', '--store', storeDir, '--max-bytes', '20000').stdout, /blocks, \d+ bytes of 20000, [1-9]\d* evictions/)
  const none = cli('write', other, path.join(dir, 'none.ggsq'), '--store', path.join(dir, 'empty'), '--model', 'm')
  t.is(none.status, 3)
  t.false(fs.existsSync(path.join(dir, 'none.ggsq')))
  const noModel = cli('lookup', other, '--store', storeDir)
  t.is(noModel.status, 2)
  t.regex(noModel.stderr, /--model/)
  const bad = cli('put', path.join(dir, 'missing.ggsq'), ...common)
  t.is(bad.status, 1)
  t.regex(bad.stderr, /ERR_KV_IO: .*missing\.ggsq/)
  // --compress: the same prompt kept smaller, written back byte for byte by a plain lookup
  const packed = ['--store', path.join(dir, 'packed'), '--model', 'm', '--block-tokens', '16']
  t.is(cli('put', file, ...packed, '--compress', 'lossless').status, 0)
  const back = path.join(dir, 'back.ggsq')
  t.is(cli('write', file, back, ...packed).stdout, '96\n')
  t.deepEqual(fs.readFileSync(back), fs.readFileSync(file))
  const unknown = cli('put', file, ...packed, '--compress', 'zip')
  t.is(unknown.status, 1)
  t.regex(unknown.stderr, /ERR_KV_INVALID_ARG: compress: unknown mode "zip"/)
})

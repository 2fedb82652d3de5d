// The prompt store on a real Redis: each test starts its own redis-server (support/redis-server.mjs)
// on a loopback port, with no persistence, and stops it afterwards. A missing redis-server fails
// these tests with the command that installs it; they never skip.
import test from 'ava'
import fs from 'node:fs'
import os from 'node:os'
import path from 'node:path'
import { spawnSync } from 'node:child_process'
import { createRequire } from 'node:module'
import { promptCache, promptTokens } from './helpers/store-prompts.mjs'
import { runScript } from './helpers/run-script.mjs'
import { redisForTest } from './support/redis-server.mjs'

const require = createRequire(import.meta.url)
const { KvCache, PromptStore } = require('../index.js')
const HERE = import.meta.dirname ?? path.dirname(new URL(import.meta.url).pathname)
const ROLE = path.join(HERE, 'helpers', 'store-role.mjs')
const WORKER = path.join(HERE, 'helpers', 'store-worker.mjs')

const MODEL = 'h16-test'
const open = (url, o = {}) => new PromptStore({ model: MODEL, url, blockTokens: 16, timeoutMs: 2000, ...o })
const emptyCache = () => new KvCache({ size: 128, nLayer: 2, nEmbdKGqa: 32, nSeqMax: 2 })
const rows = (c, n, from = 0) =>
  [0, 1].flatMap((il) => [Buffer.from(c.readK(il, from, n)), Buffer.from(c.readV(il, from, n))])
const state = (c) => Buffer.from(c.stateWriteSync())
test('a fleet shares one Redis: A puts, B restores byte-exact, C looks up a longer prompt', async (t) => {
  const redis = await redisForTest(t)
  const put = await runScript(ROLE, [redis.url, 'put', 0])
  t.like(put, { tokens: 96, blocksWritten: 6 })
  t.deepEqual(await runScript(ROLE, [redis.url, 'restore', 0]), { restored: 96 })
  t.deepEqual(await runScript(ROLE, [redis.url, 'lookup', 0]), { found: 96 })
  // prompt 1 shares the first 48 tokens (3 blocks) with prompt 0
  t.deepEqual(await runScript(ROLE, [redis.url, 'lookup', 1]), { found: 48 })
  t.deepEqual(await runScript(ROLE, [redis.url, 'restore', 1]), { restored: 48 })
})

test('four processes put overlapping prompts concurrently, then every process restores every prompt exactly', async (t) => {
  const redis = await redisForTest(t)
  const results = await Promise.all([0, 1, 2, 3].map((w) => runScript(WORKER, [redis.url, w, 4])))
  for (const r of results) t.is(r.corrupt, 0)
  const restores = await Promise.all(
    [0, 1, 2, 3].flatMap((machine) => [0, 1, 2, 3].map((w) => runScript(ROLE, [redis.url, 'restore', w]).then((r) => [machine, r]))),
  )
  for (const [, r] of restores) t.is(r.restored, 96)
  // 3 shared blocks + 3 own per prompt + the model record, each stored once
  t.is((await open(redis.url).stats()).blocks, 3 + 4 * 3 + 1)
})

test('with a tiny maxmemory and allkeys-lru, evicted blocks are misses: lookups and restores stop there, no error', async (t) => {
  const redis = await redisForTest(t, { maxmemory: 1_400_000 })
  const store = open(redis.url)
  const first = promptCache(KvCache, 0)
  await store.put(first.cache, 0, first.tokens)
  t.is(await store.lookup(first.tokens), 96)
  // 3 unique blocks of ~2.6 KB per prompt: 150 prompts overflow the budget
  for (let w = 1; w <= 150; w++) {
    const { cache, tokens } = promptCache(KvCache, w)
    await store.put(cache, 0, tokens)
  }
  const found = await store.lookup(first.tokens)
  t.true(found < 96, `found ${found}`)
  const dst = emptyCache()
  const restored = await store.restore(dst, 0, first.tokens)
  t.true(restored <= found)
  t.deepEqual(rows(dst, restored), rows(first.cache, restored))
  const stats = await store.stats()
  t.true(stats.evictions > 0, JSON.stringify(stats))
  t.is(stats.corrupt, 0)
})

test('Redis killed during a put: ERR_KV_STORE_UNAVAILABLE, cache unchanged, and the same store works after a restart', async (t) => {
  const redis = await redisForTest(t)
  const store = open(redis.url, { timeoutMs: 10_000 })
  const other = promptCache(KvCache, 1)
  await store.put(other.cache, 0, other.tokens) // the model record and the shared blocks exist
  const { cache, tokens } = promptCache(KvCache, 0)
  const before = state(cache)
  redis.cli(['CLIENT', 'PAUSE', '10000', 'WRITE']) // the put's SET NX of its own blocks waits
  const put = store.put(cache, 0, tokens)
  await new Promise((resolve) => setTimeout(resolve, 150))
  await redis.kill()
  const e = await t.throwsAsync(put, { code: 'ERR_KV_STORE_UNAVAILABLE' })
  t.regex(e.message, new RegExp(`127\\.0\\.0\\.1:${redis.port}`))
  t.deepEqual(state(cache), before)
  await redis.restart()
  t.like(await store.put(cache, 0, tokens), { blocksWritten: 6 })
  const dst = emptyCache()
  t.is(await store.restore(dst, 0, tokens), 96)
  t.deepEqual(rows(dst, 96), rows(cache, 96))
  t.is((await store.stats()).corrupt, 0, 'no half block')
})

test('Redis killed during a restore: ERR_KV_STORE_UNAVAILABLE and the cache is exactly as it was', async (t) => {
  const redis = await redisForTest(t)
  const store = open(redis.url, { timeoutMs: 10_000 })
  const { cache, tokens } = promptCache(KvCache, 0)
  await store.put(cache, 0, tokens)
  const dst = promptCache(KvCache, 3).cache // holds another prompt in sequence 0
  const before = state(dst)
  redis.cli(['CLIENT', 'PAUSE', '10000', 'ALL'])
  const restore = store.restore(dst, 1, tokens)
  await new Promise((resolve) => setTimeout(resolve, 150))
  await redis.kill()
  await t.throwsAsync(restore, { code: 'ERR_KV_STORE_UNAVAILABLE' })
  t.deepEqual(state(dst), before)
  await redis.restart()
  t.is(await store.restore(dst, 1, tokens), 0, 'restarted empty: a miss, not an error')
})

test('a store created while Redis is down fails typed, then works once Redis is back, without a new PromptStore', async (t) => {
  const redis = await redisForTest(t)
  await redis.kill()
  const store = open(redis.url)
  const { cache, tokens } = promptCache(KvCache, 0)
  await t.throwsAsync(store.put(cache, 0, tokens), { code: 'ERR_KV_STORE_UNAVAILABLE' })
  t.throws(() => store.lookupSync(tokens), { code: 'ERR_KV_STORE_UNAVAILABLE' })
  await redis.restart()
  t.like(await store.put(cache, 0, tokens), { blocksWritten: 6 })
  t.is(store.lookupSync(tokens), 96)
})

test('blocks corrupted in Redis by hand (garbage, truncated, copied to another key) are counted misses, never loaded', async (t) => {
  const redis = await redisForTest(t)
  const store = open(redis.url)
  const { cache, tokens } = promptCache(KvCache, 0)
  await store.put(cache, 0, tokens)
  // each block's header says its index (bytes 72..75, after magic, version, fingerprint, key)
  const keyOf = []
  for (const key of redis.cli(['--raw', 'KEYS', 'llama-kv:*']).split('\n')) {
    const head = redis.cliBuffer(['GETRANGE', key, '0', '75'])
    if (head.subarray(0, 4).toString() === 'KVPB') keyOf[head.readUInt32LE(72)] = key
  }
  t.is(keyOf.filter(Boolean).length, 6)
  const tamper = {
    garbage: (key) => redis.cli(['SET', key], Buffer.from('not a block at all')),
    truncated: (key) => redis.cli(['SET', key], redis.cliBuffer(['GET', key]).subarray(0, 1000)),
    'copied from another key': (key) => redis.cli(['COPY', keyOf[2], key, 'REPLACE']),
  }
  for (const [what, at] of [['garbage', 2], ['truncated', 1], ['copied from another key', 4]]) {
    tamper[what](keyOf[at])
    const bad = (s) => s.corrupt + s.rejected
    const before = bad(await store.stats())
    const dst = emptyCache()
    t.is(await store.restore(dst, 0, tokens), 16 * at, `${what}: stops before block ${at}`)
    t.deepEqual(rows(dst, 16 * at), rows(cache, 16 * at), what)
    t.is(bad(await store.stats()), before + 1, `${what}: counted`)
    await store.put(cache, 0, tokens) // the bad value was removed: put stores a good one again
    t.is(await store.lookup(tokens), 96, what)
  }
})

test('requirepass and an ACL user: the right credentials work, wrong ones are ERR_KV_STORE_AUTH without the password in the message', async (t) => {
  const redis = await redisForTest(t, { requirepass: 'fleet-secret', users: [{ name: 'worker', password: 'worker-secret' }] })
  const { cache, tokens } = promptCache(KvCache, 0)
  await open(redis.urlWith('', 'fleet-secret')).put(cache, 0, tokens)
  t.is(await open(redis.urlWith('worker', 'worker-secret')).lookup(tokens), 96)
  for (const url of [redis.url, redis.urlWith('', 'guess-1'), redis.urlWith('worker', 'guess-2'), redis.urlWith('nobody', 'worker-secret')]) {
    const e = await t.throwsAsync(open(url).lookup(tokens), { code: 'ERR_KV_STORE_AUTH' })
    t.notRegex(e.message, /guess|secret/)
  }
})

test('tiers memory, dir, redis: puts write through, a hit in Redis is promoted into the nearer tiers', async (t) => {
  const redis = await redisForTest(t)
  const dirA = fs.mkdtempSync(path.join(os.tmpdir(), 'kvstore-tier-'))
  const dirB = fs.mkdtempSync(path.join(os.tmpdir(), 'kvstore-tier-'))
  t.teardown(() => [dirA, dirB].forEach((d) => fs.rmSync(d, { recursive: true, force: true })))
  const tiers = ['memory', 'dir', 'redis']
  const a = open(redis.url, { tiers, path: dirA })
  const { cache, tokens } = promptCache(KvCache, 0)
  t.like(await a.put(cache, 0, tokens), { blocksWritten: 6 })
  t.is(new PromptStore({ model: MODEL, path: dirA, blockTokens: 16 }).lookupSync(tokens), 96, 'written through to dir')
  t.is(await open(redis.url).lookup(tokens), 96, 'written through to redis')
  t.like(a.statsSync(), { backend: 'tiered' })
  // machine B has an empty memory and dir: its first restore reads Redis and promotes
  const b = open(redis.url, { tiers, path: dirB })
  const dst = emptyCache()
  t.is(await b.restore(dst, 0, tokens), 96)
  t.deepEqual(rows(dst, 96), rows(cache, 96))
  t.is(new PromptStore({ model: MODEL, path: dirB, blockTokens: 16 }).lookupSync(tokens), 96, 'promoted into dir')
  await redis.kill()
  const again = emptyCache()
  t.is(await b.restore(again, 0, tokens), 96, 'served by the nearer tiers while Redis is down')
})

test('tiers: Redis killed during a put or a restore costs no local hit: the put lands in the local tiers, the restore is served by them', async (t) => {
  const redis = await redisForTest(t)
  const dir = fs.mkdtempSync(path.join(os.tmpdir(), 'kvstore-killed-'))
  t.teardown(() => fs.rmSync(dir, { recursive: true, force: true }))
  const store = open(redis.url, { tiers: ['memory', 'dir', 'redis'], path: dir, timeoutMs: 10_000 })
  const other = promptCache(KvCache, 1)
  await store.put(other.cache, 0, other.tokens) // the model record and the shared blocks exist
  const { cache, tokens } = promptCache(KvCache, 0)
  const before = state(cache)
  redis.cli(['CLIENT', 'PAUSE', '10000', 'WRITE']) // Redis's part of the put waits
  const put = store.put(cache, 0, tokens)
  await new Promise((resolve) => setTimeout(resolve, 150))
  await redis.kill()
  const report = await put
  t.deepEqual(report.degraded, ['redis'])
  t.is(report.tokens, 96)
  t.deepEqual(state(cache), before)
  t.is(new PromptStore({ model: MODEL, path: dir, blockTokens: 16 }).lookupSync(tokens), 96, 'landed in the dir tier')
  // Redis back, but paused: a restore of what the local tiers hold does not wait for it
  await redis.restart()
  redis.cli(['CLIENT', 'PAUSE', '10000', 'ALL'])
  const dst = emptyCache()
  const restore = store.restore(dst, 0, tokens)
  await new Promise((resolve) => setTimeout(resolve, 150))
  await redis.kill()
  t.is(await restore, 96)
  t.deepEqual(rows(dst, 96), rows(cache, 96))
})

test('Redis options are checked: bad URL, tiers without their option, options without Redis', (t) => {
  t.throws(() => new PromptStore({ model: 'm', url: 'http://x' }), { code: 'ERR_KV_INVALID_ARG', message: /Redis URL "http:\/\/x"/ })
  t.throws(() => new PromptStore({ model: 'm', url: 'redis://u:pw@' }), { code: 'ERR_KV_INVALID_ARG', message: /^(?!.*pw@)/ })
  t.throws(() => new PromptStore({ model: 'm', tiers: ['memory', 'redis'] }), { code: 'ERR_KV_INVALID_ARG', message: /url/ })
  t.throws(() => new PromptStore({ model: 'm', tiers: ['memory', 'disk'], url: 'redis://h' }), { code: 'ERR_KV_INVALID_ARG', message: /disk/ })
  t.throws(() => new PromptStore({ model: 'm', tiers: ['redis', 'redis'], url: 'redis://h' }), { code: 'ERR_KV_INVALID_ARG', message: /twice/ })
  t.throws(() => new PromptStore({ model: 'm', path: '/tmp/x', url: 'redis://h' }), { code: 'ERR_KV_INVALID_ARG', message: /tiers/ })
  t.throws(() => new PromptStore({ model: 'm', prefix: 'a:' }), { code: 'ERR_KV_INVALID_ARG', message: /prefix/ })
  t.throws(() => new PromptStore({ model: 'm', url: 'redis://h', ttlSeconds: 0 }), { code: 'ERR_KV_INVALID_ARG', message: /ttlSeconds .* 0/ })
  t.throws(() => new PromptStore({ model: 'm', url: 'redis://h', timeoutMs: 1.5 }), { code: 'ERR_KV_INVALID_ARG', message: /timeoutMs/ })
  t.is(new PromptStore({ model: 'm', url: 'redis://127.0.0.1:1', prefix: 'x:', ttlSeconds: 60 }).blockTokens, 256, 'created without connecting')
})

test('ttlSeconds: blocks expire unless used, and a restore renews the expiry of what it reads', async (t) => {
  const redis = await redisForTest(t)
  const pttl = (key) => Number(redis.cli(['PTTL', key]))
  const blockKeys = () => redis.cli(['--raw', 'KEYS', 'llama-kv:*']).split('\n').filter(Boolean)
  // a long TTL and only comparisons: a stalled test machine cannot make this flaky
  const store = open(redis.url, { ttlSeconds: 60 })
  const a = promptCache(KvCache, 0)
  await store.put(a.cache, 0, a.tokens)
  const keysOfA = new Set(blockKeys())
  const b = promptCache(KvCache, 1)
  await store.put(b.cache, 0, b.tokens)
  const onlyB = blockKeys().filter((k) => !keysOfA.has(k))
  t.is(onlyB.length, 3)
  // blocks expire; the model record (which lookups without a cache need) does not
  const record = [...keysOfA].filter((k) => pttl(k) === -1)
  t.is(record.length, 1)
  const blocksOfA = [...keysOfA].filter((k) => k !== record[0])
  for (const key of [...blocksOfA, ...onlyB]) t.true(pttl(key) > 0 && pttl(key) <= 60_000, key)
  await new Promise((resolve) => setTimeout(resolve, 1000))
  t.is(await store.restore(emptyCache(), 0, a.tokens), 96)
  // A's blocks were just read: renewed to the full TTL; B's own were not: at least 1 s less
  const renewed = blocksOfA.map(pttl)
  const aging = onlyB.map(pttl)
  t.true(Math.min(...renewed) > Math.max(...aging) + 500, `${renewed} vs ${aging}`)
  t.is(pttl(record[0]), -1)

  const short = open(redis.url, { ttlSeconds: 0.2, prefix: 'short:' })
  await short.put(a.cache, 0, a.tokens)
  await new Promise((resolve) => setTimeout(resolve, 800))
  t.is(await short.lookup(a.tokens), 0, 'expired: a miss, not an error')
})

test('the store CLI works on a Redis URL, and prints it without the password', async (t) => {
  const redis = await redisForTest(t, { requirepass: 'cli-secret' })
  const url = redis.urlWith('', 'cli-secret')
  const dir = fs.mkdtempSync(path.join(os.tmpdir(), 'kvstore-cli-'))
  t.teardown(() => fs.rmSync(dir, { recursive: true, force: true }))
  const cli = (...args) => spawnSync(process.execPath, [path.join(HERE, '..', 'bin', 'llama-kv-cache.js'), 'store', ...args], { encoding: 'utf8' })
  const { cache, tokens } = promptCache(KvCache, 0)
  const file = path.join(dir, 'a.ggsq')
  cache.saveSequenceFileSync(file, 0, tokens)
  const common = ['--url', url, '--model', MODEL, '--block-tokens', '16']
  const put = cli('put', file, ...common)
  t.is(put.status, 0, put.stderr)
  t.regex(put.stdout, /96 tokens, 6 blocks written/)
  t.is(await open(url).lookup(tokens), 96, 'the JS API finds what the CLI stored')
  t.is(cli('lookup', file, ...common).stdout, '96\n')
  const stats = cli('stats', '--url', url)
  t.regex(stats.stdout, new RegExp(`^redis://127\\.0\\.0\\.1:${redis.port}: 7 blocks`))
  t.notRegex(stats.stdout + stats.stderr, /cli-secret/)
  t.like(JSON.parse(cli('stats', '--url', url, '--json').stdout), { backend: 'redis', blocks: 7 })
  const wrong = cli('lookup', file, '--url', redis.urlWith('', 'nope'), '--model', MODEL, '--block-tokens', '16')
  t.is(wrong.status, 1)
  t.regex(wrong.stderr, /ERR_KV_STORE_AUTH/)
  t.notRegex(wrong.stderr, /nope/)
})

test('two namespaces on one Redis: B sees nothing of A, and B\'s garbage under A\'s tokens leaves A\'s restore exact', async (t) => {
  const redis = await redisForTest(t)
  const [a, b] = ['tenant-a', 'tenant-b'].map((namespace) => open(redis.url, { namespace }))
  const { cache, tokens } = promptCache(KvCache, 0)
  t.like(await a.put(cache, 0, tokens), { blocksWritten: 6 })
  t.is(await b.lookup(tokens), 0)
  const garbage = promptCache(KvCache, 1).cache // other rows, A's tokens
  t.like(await b.put(garbage, 0, tokens), { blocksWritten: 6, blocksSkipped: 0 }, 'no skip tells B that A stored it')
  const dst = emptyCache()
  t.is(await a.restore(dst, 0, tokens), 96)
  t.deepEqual(rows(dst, 96), rows(cache, 96))
  t.like(await b.stats(), { hits: 0 })
})

test('a secret: values written without it, with another one, or flipped in Redis are rejected, never loaded, and replaced', async (t) => {
  const redis = await redisForTest(t)
  const secret = 'a fleet secret of more than 16 bytes'
  const { cache, tokens } = promptCache(KvCache, 0)
  const garbage = promptCache(KvCache, 1).cache
  for (const attacker of [{}, { secret: Buffer.from('another secret, 16+ bytes long') }]) {
    redis.cli(['FLUSHALL'])
    // an attacker who can write to Redis stores their rows under the prompt's keys first
    t.like(await open(redis.url, attacker).put(garbage, 0, tokens), { blocksWritten: 6 })
    const honest = open(redis.url, { secret })
    t.is(await honest.lookup(tokens), 0, 'their values do not count')
    const dst = emptyCache()
    t.is(await honest.restore(dst, 0, tokens), 0, 'and are never loaded')
    t.like(await honest.put(cache, 0, tokens), { blocksWritten: 6, blocksSkipped: 0 }, 'but replaced')
    t.true((await honest.stats()).rejected >= 6)
    t.is(await honest.restore(dst, 0, tokens), 96)
    t.deepEqual(rows(dst, 96), rows(cache, 96))
  }
  // a byte flipped in Redis
  const honest = open(redis.url, { secret })
  const keys = redis.cli(['--raw', 'KEYS', 'llama-kv:*']).split('\n').filter(Boolean)
  const victim = keys.find((k) => redis.cliBuffer(['GETRANGE', k, '0', '3']).toString() === 'KVPB')
  const value = redis.cliBuffer(['GET', victim])
  value[value.length - 200] ^= 1
  redis.cli(['SET', victim], value)
  const dst = emptyCache()
  t.true((await honest.restore(dst, 0, tokens)) < 96)
  t.like(await honest.stats(), { corrupt: 1 })
  t.throws(() => open(redis.url, { secret: 'short' }), { code: 'ERR_KV_INVALID_ARG', message: /secret must be at least 16 bytes, got 5/ })
})

/** A cache holding `tokens`, with rows as promptCache makes them (so equal tokens at equal positions have equal rows). */
function promptOf(tokens) {
  const n = tokens.length
  const cache = new KvCache({ size: 128, nLayer: 2, nEmbdKGqa: 32, nSeqMax: 2 })
  cache.findSlot({ pos: tokens.map((_, i) => i), seqIds: tokens.map(() => 0) })
  for (let il = 0; il < 2; il++) {
    for (let i = 0; i < n; i++) {
      const row = (sign) => Float32Array.from({ length: 32 }, (_, j) => sign * (tokens[i] + il + j / 64))
      cache.writeKF32(il, i, row(1))
      cache.writeVF32(il, i, row(-1))
    }
  }
  return { cache, tokens }
}

/** Prompt 0 grown to `n` tokens. */
const grownPrompt = (n) => promptOf([...promptTokens(0), ...Array.from({ length: n - 96 }, (_, i) => 5000 + i)])

test('tiers with Redis down: a grown conversation restores its local prefix, puts land in the local tiers, and reach Redis again after a restart', async (t) => {
  const redis = await redisForTest(t)
  const dir = fs.mkdtempSync(path.join(os.tmpdir(), 'kvstore-degraded-'))
  t.teardown(() => fs.rmSync(dir, { recursive: true, force: true }))
  const store = open(redis.url, { tiers: ['memory', 'dir', 'redis'], path: dir })
  const { cache, tokens } = promptCache(KvCache, 0)
  t.like(await store.put(cache, 0, tokens), { blocksWritten: 6, degraded: [] })
  await redis.kill()
  const grown = grownPrompt(120)
  t.is(await store.lookup(grown.tokens), 96, 'the locally held prefix')
  const dst = emptyCache()
  t.is(await store.restore(dst, 0, grown.tokens), 96)
  t.deepEqual(rows(dst, 96), rows(cache, 96))
  const put = await store.put(grown.cache, 0, grown.tokens)
  t.like(put, { tokens: 120, blocksWritten: 1, checkpointsWritten: 1 })
  t.deepEqual(put.degraded, ['redis'])
  const { tiers } = await store.stats()
  t.like(tiers, [{ name: 'memory', up: true }, { name: 'dir', up: true }, { name: 'redis', up: false }])
  t.regex(tiers[2].lastError, new RegExp(`127\\.0\\.0\\.1:${redis.port}`))
  t.is(new PromptStore({ model: MODEL, path: dir, blockTokens: 16 }).lookupSync(grown.tokens), 120, 'landed in the dir tier')
  await redis.restart()
  // the tier is tried again once its backoff (0.5 s, doubling while it stays down) is over:
  // any call then finds it back
  const deadline = Date.now() + 40_000
  while (!(await store.stats()).tiers[2].up && Date.now() < deadline) {
    await new Promise((resolve) => setTimeout(resolve, 200))
  }
  // a conversation the local tiers do not hold (Redis lost everything: no persistence)
  const other = promptOf(Array.from({ length: 96 }, (_, i) => 7000 + i))
  t.like(await store.put(other.cache, 0, other.tokens), { blocksWritten: 6, degraded: [] })
  t.is(await open(redis.url).lookup(other.tokens), 96, 'the same PromptStore reaches Redis again')
  t.like((await store.stats()).tiers[2], { name: 'redis', up: true })
})

test('close() releases the store\'s Redis connections', async (t) => {
  const redis = await redisForTest(t)
  const clients = () => Number(/connected_clients:(\d+)/.exec(redis.cli(['INFO', 'clients']))[1])
  const before = clients()
  const store = open(redis.url)
  const { cache, tokens } = promptCache(KvCache, 0)
  await store.put(cache, 0, tokens)
  t.true(clients() > before, 'the store holds a connection')
  await store.close()
  // the server drops a connection when it reads the client's close: wait for it, bounded
  const deadline = Date.now() + 10_000
  while (clients() > before && Date.now() < deadline) await new Promise((resolve) => setTimeout(resolve, 20))
  t.is(clients(), before)
  t.throws(() => store.lookup(tokens), { code: 'ERR_KV_DISPOSED' })
})

test('KV events name the blocks Redis expires on its own, as BlockRemoved from the redis medium', async (t) => {
  const redis = await redisForTest(t)
  const store = open(redis.url, { ttlSeconds: 1 })
  t.teardown(() => store.close())
  // listening starts the listener of the server's notifications, well before the TTL runs out
  const events = store.events()
  const { cache, tokens } = promptCache(KvCache, 0)
  await store.put(cache, 0, tokens)
  const stored = []
  const removed = new Set()
  for await (const e of events) {
    if (e.type === 'BlockStored') stored.push(...e.blockHashes)
    if (e.type === 'BlockRemoved') {
      t.is(e.medium, 'redis')
      e.blockHashes.forEach((h) => removed.add(h))
    }
    if (stored.length === 6 && stored.every((h) => removed.has(h))) break
  }
  t.is(removed.size, 6)
  t.is(await store.lookup(tokens), 0)
})

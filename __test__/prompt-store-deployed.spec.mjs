// The prompt store on Redis as it is deployed, with real servers started by each test: TLS (a CA
// and certificates made with openssl in the test), a Sentinel-managed primary and replica with a
// failover, and a three-primary cluster. The options are Node-shaped; these tests prove they reach
// the Rust client. (The Rust tests in crates/prompt-store-redis/tests/deployed.rs go deeper.)
import test from 'ava'
import fs from 'node:fs'
import net from 'node:net'
import path from 'node:path'
import { createRequire } from 'node:module'
import { promptCache } from './helpers/store-prompts.mjs'
import { certsForTest, clusterForTest, redisForTest } from './support/redis-server.mjs'

const require = createRequire(import.meta.url)
const { KvCache, PromptStore } = require('../index.js')

const MODEL = 'h16-test'
const open = (o) => new PromptStore({ model: MODEL, blockTokens: 16, timeoutMs: 2000, ...o })
const emptyCache = () => new KvCache({ size: 128, nLayer: 2, nEmbdKGqa: 32, nSeqMax: 2 })
const state = (c) => Buffer.from(c.stateWriteSync())

/** Puts prompt 0 through `store`, restores it through `other` into a fresh cache, byte-exact. */
async function roundTrip(t, store, other = store) {
  const { cache, tokens } = promptCache(KvCache, 0)
  const put = await store.put(cache, 0, tokens)
  const dst = emptyCache()
  t.is(await other.restore(dst, 0, tokens), 96)
  t.deepEqual(state(dst), state(cache), 'byte-exact')
  return put
}

test('rediss:// with the right CA works; a wrong CA or none is ERR_KV_STORE_TLS naming the server, never the password', async (t) => {
  const certs = certsForTest(t)
  const redis = await redisForTest(t, { tls: { cert: certs.path('server.pem'), key: certs.path('server.key'), ca: certs.path('ca.pem') } })
  const plainUrl = `rediss://127.0.0.1:${redis.tlsPort}`
  // the handshake fails before any AUTH: the password must still stay out of the message
  const url = `rediss://:hunter2secret@127.0.0.1:${redis.tlsPort}`
  await roundTrip(t, open({ url: plainUrl, tls: { ca: certs.read('ca.pem').toString() } }))
  for (const tls of [{ ca: certs.read('other-ca.pem') }, {}]) {
    const e = await t.throwsAsync(open({ url, tls }).lookup([1, 2, 3]), { code: 'ERR_KV_STORE_TLS' })
    t.true(e.message.includes(`127.0.0.1:${redis.tlsPort}`), e.message)
    t.false(e.message.includes('hunter2secret'), e.message)
  }
  // encrypted, not authenticated: as Node's rejectUnauthorized: false
  t.is(await open({ url: plainUrl, tls: { ca: certs.read('other-ca.pem'), rejectUnauthorized: false } }).lookup([1, 2, 3]), 0)
})

test('tls.servername is the name checked when the URL dials another host; cert and key answer a server that asks', async (t) => {
  const certs = certsForTest(t)
  const redis = await redisForTest(t, {
    tls: { cert: certs.path('server.pem'), key: certs.path('server.key'), ca: certs.path('ca.pem'), authClients: true },
  })
  const ca = certs.read('ca.pem')
  const client = { cert: certs.read('client.pem'), key: certs.read('client.key') }
  const url = `rediss://localhost:${redis.tlsPort}`
  // the certificate names redis.test and 127.0.0.1, not localhost
  await t.throwsAsync(open({ url, tls: { ca, ...client } }).lookup([1]), { code: 'ERR_KV_STORE_TLS' })
  t.is(await open({ url, tls: { ca, ...client, servername: 'redis.test' } }).lookup([1]), 0)
  // without a client certificate the server ends the handshake
  const e = await t.throwsAsync(open({ url, tls: { ca, servername: 'redis.test' } }).lookup([1]))
  t.true(['ERR_KV_STORE_TLS', 'ERR_KV_STORE_UNAVAILABLE'].includes(e.code), `${e.code}: ${e.message}`)
})

test('Sentinel: a store finds the primary, and after the primary dies it reaches the promoted replica with no new store', async (t) => {
  const primary = await redisForTest(t)
  const replica = await redisForTest(t, { replicaOf: primary.port })
  const sentinel = await redisForTest(t, { sentinelOf: { name: 'kvjs', port: primary.port } })
  // the Sentinel learns of the replica from the primary's INFO
  const deadline = Date.now() + 30_000
  while (!sentinel.cli(['SENTINEL', 'REPLICAS', 'kvjs']).includes(String(replica.port))) {
    if (Date.now() > deadline) throw new Error('the sentinel did not see the replica')
    await new Promise((resolve) => setTimeout(resolve, 100))
  }
  // and the replica has finished its initial sync: until then WAIT counts no replica
  while (!/^master_link_status:up\r?$/m.test(replica.cli(['INFO', 'replication']))) {
    if (Date.now() > deadline + 30_000) throw new Error("the replica's link to the primary did not come up")
    await new Promise((resolve) => setTimeout(resolve, 100))
  }
  const store = open({ sentinels: [{ host: '127.0.0.1', port: sentinel.port }], name: 'kvjs', timeoutMs: 1000 })
  const { cache, tokens } = promptCache(KvCache, 0)
  await roundTrip(t, store)
  t.is(primary.cli(['WAIT', '1', '5000']), '1', 'the replica has the blocks')
  await primary.kill()
  // hold the dead primary's port: a server another test starts meanwhile must not take it and
  // pass for the primary (the Sentinel would see it alive, and never fail over)
  const holder = net.createServer((socket) => socket.destroy())
  await new Promise((resolve) => holder.once('error', resolve).listen(primary.port, '127.0.0.1', resolve))
  t.teardown(() => holder.close())
  // the failover's own bound, from the kill (a Sentinel retries a failed attempt after twice
  // its failover-timeout, 6 s here); on failure, what the Sentinel saw goes into the message
  const failoverBy = Date.now() + 60_000
  let restored = 0
  while (restored !== 96) {
    if (Date.now() > failoverBy) {
      const log = fs.readFileSync(path.join(sentinel.dir, 'sentinel.log'), 'utf8').split('\n').slice(-40).join('\n')
      throw new Error(`no failover: the Sentinel names ${sentinel.cli(['SENTINEL', 'GET-MASTER-ADDR-BY-NAME', 'kvjs'])} ` +
        `(the primary was ${primary.port}, the replica ${replica.port}); last restore ${restored}; its log ends:\n${log}`)
    }
    restored = await store.restore(emptyCache(), 0, tokens).catch((e) => {
      t.is(e.code, 'ERR_KV_STORE_UNAVAILABLE', e.message)
      return 0
    })
    await new Promise((resolve) => setTimeout(resolve, 100))
  }
  const dst = emptyCache()
  t.is(await store.restore(dst, 0, tokens), 96)
  t.deepEqual(state(dst), state(cache))
})

test('Cluster: blocks spread over three primaries; dedup, restore and stats work across slots', async (t) => {
  const nodes = await clusterForTest(t, 3)
  const cluster = [{ host: '127.0.0.1', port: nodes[0].port }]
  const [a, b] = [open({ cluster }), open({ cluster })]
  const put = await roundTrip(t, a, b)
  t.like(put, { tokens: 96, blocksWritten: 6 })
  for (const node of nodes) t.true(Number(node.cli(['DBSIZE'])) > 0, `node ${node.port} holds no block`)
  const { cache, tokens } = promptCache(KvCache, 0)
  t.like(await b.put(cache, 0, tokens), { blocksWritten: 0, blocksSkipped: 6 })
  t.is((await a.stats()).blocks, 6 + 1, 'every primary is counted: 6 blocks and the model record')
})

test('deployment options are checked: one of url, sentinels and cluster, and only the options that apply', (t) => {
  const bad = [
    [{ url: 'redis://127.0.0.1:1', tls: {} }, /rediss/],
    [{ url: 'redis://127.0.0.1:1', cluster: [{ host: 'h', port: 1 }] }, /one of url, sentinels and cluster/],
    [{ sentinels: [{ host: 'h', port: 1 }] }, /name/],
    [{ sentinels: [] , name: 'x' }, /at least one/],
    [{ cluster: [{ host: 'h', port: 70000 }] }, /the port of "h"/, 'ERR_KV_OUT_OF_RANGE'],
    [{ url: 'redis://127.0.0.1:1', name: 'x' }, /name applies with sentinels/],
    [{ url: 'redis://127.0.0.1:1', password: 'p' }, /password applies with sentinels or cluster/],
    [{ cluster: [{ host: 'h', port: 1 }], tls: { servername: 'x' } }, /servername applies with url/],
    [{ cluster: [{ host: 'h', port: 1 }], tls: { cert: 'x' } }, /cert and key/],
    [{ tls: {}, timeoutMs: undefined }, /tls applies to a Redis store/],
  ]
  for (const [o, message, code = 'ERR_KV_INVALID_ARG'] of bad) {
    const e = t.throws(() => open(o), { code }, JSON.stringify(o))
    t.regex(e.message, message)
  }
})

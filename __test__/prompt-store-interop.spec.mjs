// The prompt store with the real llama.cpp peers: conversation A is saved by the peer and ingested;
// conversation B shares A's first blocks; `writeFile` writes them as a file the peer loads; the peer
// evaluates only B's suffix and its next greedy tokens equal those of a cold evaluation of B. The
// llama.node conversation also runs through Redis, with A and B on two stores standing for machines.
import test from 'ava'
import fs from 'node:fs'
import os from 'node:os'
import path from 'node:path'
import { createRequire } from 'node:module'
import { registerPeerSuite, runPeerScript } from '../interop/peers.mjs'
import { redisForTest } from './support/redis-server.mjs'

const require = createRequire(import.meta.url)
const { PromptStore, inspectState } = require('../index.js')
const HERE = import.meta.dirname ?? path.dirname(new URL(import.meta.url).pathname)
const INTEROP = path.join(HERE, '..', 'interop')
const MODEL = 'llama-h16.gguf'
// the store's model identity: the GGUF file the peers run, keyed by its fingerprint
const MODEL_FILE = path.join(INTEROP, 'models', MODEL)
const BLOCK = 16

const tmp = () => fs.mkdtempSync(path.join(os.tmpdir(), 'kvstore-peer-'))
const shared = 'the cat sat on the mat and the dog ran to the red house by the sea '.repeat(3)
const PROMPT_A = `${shared}then it rained all day`
const PROMPT_B = `${shared}but a bird flew over the hill`

// a conversation in two turns, saved after each, and one that diverges after the first turn
const TURN_1 = 'the cat sat on the mat and the dog ran to the red house by the sea then it rained'
const TURN_2 = ' all day and the bird flew over the hill to the big tree'
const DIVERGED = `${TURN_1} but the sun came out and the cat went home`

const commonPrefix = (a, b) => {
  let i = 0
  while (i < a.length && i < b.length && a[i] === b[i]) i++
  return i
}

registerPeerSuite(test, 'prompt store interop', () => {
  /**
   * Conversation A is ingested by one store and B's prefix written by another (`stores(dir)`
   * returns `{ ingest, write }`: the same store, or two machines sharing a Redis).
   */
  async function llamaNodeConversation(t, stores) {
    const dir = tmp()
    const [fileA, fileBCold, fileB] = ['a.ggsn', 'b-cold.ggsn', 'b.ggsn'].map((f) => path.join(dir, f))
    const log = (m) => t.log(m)
    await runPeerScript(path.join(INTEROP, 'store-peer.mjs'), ['llama-node', MODEL, JSON.stringify([
      { prompt: PROMPT_A, out: fileA },
      { prompt: PROMPT_B, out: fileBCold }, // only for B's token ids as llama.node evaluates them
    ])], log)
    const tokensA = inspectState(fileA).tokens
    const tokensB = inspectState(fileBCold).tokens
    const { ingest, write } = await stores(dir)
    const put = await ingest.putFile(fileA)
    t.true(put.blocksWritten >= 3, JSON.stringify(put))
    const expected = Math.floor(Math.min(commonPrefix(tokensA, tokensB), put.tokens) / BLOCK) * BLOCK
    t.true(expected >= 2 * BLOCK, `A and B share ${expected} tokens of full blocks`)
    t.is(await write.lookup(tokensB), expected)
    t.is(await write.writeFile(tokensB, fileB, { kind: 'session' }), expected)
    t.is(inspectState(fileB).nTokens, expected)
    const r = await runPeerScript(path.join(INTEROP, 'continue.mjs'), ['llama-node', MODEL, fileB, JSON.stringify({
      prompt: PROMPT_B, n_predict: 3, also: ['-'],
    })], log)
    const [warm, cold] = r.runs
    t.log(`warm: ${JSON.stringify(warm.tokens)} prompt_n ${warm.prompt_n}; cold: ${JSON.stringify(cold.tokens)} prompt_n ${cold.prompt_n}`)
    t.deepEqual(warm.tokens, cold.tokens)
    t.is(warm.prompt_n, cold.prompt_n - expected, 'the peer evaluated only the tokens after the restored prefix')
  }

  test('llama.node: B restored from A\'s blocks evaluates only its suffix and continues like a cold run', async (t) => {
    await llamaNodeConversation(t, (dir) => {
      const store = new PromptStore({ model: MODEL_FILE, path: path.join(dir, 'store'), blockTokens: BLOCK })
      return { ingest: store, write: store }
    })
  })

  test('llama.node through Redis: machine 1 ingests A, machine 2 writes B\'s prefix, the peer evaluates only the suffix', async (t) => {
    const redis = await redisForTest(t)
    await llamaNodeConversation(t, () => {
      const machine = () => new PromptStore({ model: MODEL_FILE, url: redis.url, blockTokens: BLOCK })
      return { ingest: machine(), write: machine() }
    })
  })

  test('node-llama-cpp: B restored from A\'s blocks continues from its suffix like a cold run', async (t) => {
    const dir = tmp()
    const [fileA, fileB] = ['a.ggsq', 'b.ggsq'].map((f) => path.join(dir, f))
    const log = (m) => t.log(m)
    const saved = await runPeerScript(path.join(INTEROP, 'store-peer.mjs'), ['node-llama-cpp', MODEL, JSON.stringify([
      { prompt: PROMPT_A, out: fileA },
      { prompt: PROMPT_B },
    ])], log)
    const tokensB = saved.runs[1].tokens
    const store = new PromptStore({ model: MODEL_FILE, path: path.join(dir, 'store'), blockTokens: BLOCK })
    const put = await store.putFile(fileA)
    const expected = Math.floor(Math.min(commonPrefix(saved.runs[0].tokens, tokensB), put.tokens) / BLOCK) * BLOCK
    t.true(expected >= 2 * BLOCK, `A and B share ${expected} tokens of full blocks`)
    t.is(await store.writeFile(tokensB, fileB, { kind: 'sequence', version: 3 }), expected)
    const r = await runPeerScript(path.join(INTEROP, 'continue.mjs'), ['node-llama-cpp', MODEL, fileB, JSON.stringify({
      evaluate: tokensB.slice(expected), n: 3, also: [{ file: '-', evaluate: tokensB }],
    })], log)
    const [warm, cold] = r.runs
    t.log(`warm: loaded ${warm.loaded_tokens}, then ${tokensB.length - expected} evaluated: ${JSON.stringify(warm.tokens)}; cold: ${JSON.stringify(cold.tokens)}`)
    t.is(warm.loaded_tokens, expected, "the peer's context holds the restored prefix")
    t.deepEqual(warm.tokens, cold.tokens)
  })

  // today's memories: a sliding window (gemma3), attention + Mamba (jamba), Mamba. A conversation
  // saved after each of its two turns is ingested; one that diverges after the first turn restores
  // exactly that turn (its window or recurrent state comes from the turn's checkpoint), and the
  // peer evaluates only what follows, continuing like a cold run.
  for (const model of ['gemma3-swa.gguf', 'jamba.gguf', 'mamba.gguf']) {
    const modelFile = path.join(INTEROP, 'models', model)
    test(`llama.node, ${model}: saved per turn, a conversation diverging after turn 1 restores it and evaluates only the rest`, async (t) => {
      const dir = tmp()
      const [turn1, turn2, cold] = ['t1.ggsn', 't2.ggsn', 'cold.ggsn'].map((f) => path.join(dir, f))
      const log = (m) => t.log(m)
      await runPeerScript(path.join(INTEROP, 'store-peer.mjs'), ['llama-node', model, JSON.stringify([
        { prompt: TURN_1, out: turn1 },
        { prompt: TURN_1 + TURN_2, out: turn2 },
        { prompt: DIVERGED, out: cold }, // only for the diverged token ids as llama.node evaluates them
      ])], log)
      const store = new PromptStore({ model: modelFile, path: path.join(dir, 'store'), blockTokens: BLOCK })
      for (const f of [turn1, turn2]) t.is((await store.putFile(f)).tokens, inspectState(f).nTokens, f)
      const restored = inspectState(turn1).nTokens
      const tokens = inspectState(cold).tokens
      t.true(commonPrefix(tokens, inspectState(turn1).tokens) === restored && tokens.length > restored, 'the diverged prompt goes on past turn 1')
      t.is(await store.lookup(tokens), restored)
      const out = path.join(dir, 'restored.ggsn')
      t.is(await store.writeFile(tokens, out), restored)
      t.like(inspectState(out), { format: 'session', version: inspectState(turn1).version, nTokens: restored })
      const r = await runPeerScript(path.join(INTEROP, 'continue.mjs'), ['llama-node', model, out, JSON.stringify({
        prompt: DIVERGED, n_predict: 3, also: ['-'],
      })], log)
      const [warm, coldRun] = r.runs
      t.log(`warm: ${JSON.stringify(warm.tokens)} prompt_n ${warm.prompt_n}; cold: ${JSON.stringify(coldRun.tokens)} prompt_n ${coldRun.prompt_n}`)
      t.deepEqual(warm.tokens, coldRun.tokens)
      t.is(warm.prompt_n, tokens.length - restored, 'the peer evaluated only the tokens after turn 1')
    })

    test(`node-llama-cpp, ${model}: saved per turn, a conversation diverging after turn 1 restores it and evaluates only the rest`, async (t) => {
      const dir = tmp()
      const [turn1, turn2] = ['t1.ggsq', 't2.ggsq'].map((f) => path.join(dir, f))
      const log = (m) => t.log(m)
      const saved = await runPeerScript(path.join(INTEROP, 'store-peer.mjs'), ['node-llama-cpp', model, JSON.stringify([
        { prompt: TURN_1, out: turn1 },
        { prompt: TURN_1 + TURN_2, out: turn2 },
        { prompt: DIVERGED },
      ])], log)
      const store = new PromptStore({ model: modelFile, path: path.join(dir, 'store'), blockTokens: BLOCK })
      for (const f of [turn1, turn2]) t.is((await store.putFile(f)).tokens, inspectState(f).nTokens, f)
      const restored = saved.runs[0].tokens.length
      const tokens = saved.runs[2].tokens
      t.is(await store.lookup(tokens), restored)
      const out = path.join(dir, 'restored.ggsq')
      t.is(await store.writeFile(tokens, out), restored)
      t.like(inspectState(out), { format: 'sequence', version: 3, nTokens: restored })
      const r = await runPeerScript(path.join(INTEROP, 'continue.mjs'), ['node-llama-cpp', model, out, JSON.stringify({
        evaluate: tokens.slice(restored), n: 3, also: [{ file: '-', evaluate: tokens }],
      })], log)
      const [warm, cold] = r.runs
      t.log(`warm: loaded ${warm.loaded_tokens}, then ${tokens.length - restored} evaluated: ${JSON.stringify(warm.tokens)}; cold: ${JSON.stringify(cold.tokens)}`)
      t.is(warm.loaded_tokens, restored, "the peer's context holds turn 1")
      t.deepEqual(warm.tokens, cold.tokens)
    })
  }
})

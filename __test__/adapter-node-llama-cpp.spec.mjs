// llama-kv-cache/node-llama-cpp with the real peer (node-llama-cpp 3.22.1, interop/node_modules):
// a LlamaChatSession chat whose process restarts between turns restores the previous turn from
// a dir store and evaluates only the rest, continuing exactly like a cold process, for a plain
// KV cache (llama), a sliding window (gemma3), a hybrid (Jamba) and a recurrent model (Mamba);
// two sequences of one context with an adapter each; every evaluation method under direct calls;
// the failure paths (a thrown evaluation, an abort, a failing store) and close leave no file.
// Argument checks run first, on stand-in objects, without the peer.
import test from 'ava'
import fs from 'node:fs'
import os from 'node:os'
import path from 'node:path'
import { createRequire } from 'node:module'
import { fileURLToPath } from 'node:url'
import { registerPeerSuite } from '../interop/peers.mjs'
import { runScript } from './helpers/run-script.mjs'

const require = createRequire(import.meta.url)
const { reusePrompts } = require('llama-kv-cache/node-llama-cpp')
const HERE = path.dirname(fileURLToPath(import.meta.url))
const ROOT = path.resolve(HERE, '..')
const MODELS = path.join(ROOT, 'interop', 'models')
const CHAT = path.join(HERE, 'helpers', 'nlc-chat.mjs')
const DIRECT = path.join(HERE, 'helpers', 'nlc-direct.mjs')
const METHODS = ['evaluate', 'evaluateWithMetadata', 'evaluateWithoutGeneratingNewTokens', 'controlledEvaluate']

/** A temporary folder removed when the test ends. */
const tmp = (t) => {
  const dir = fs.mkdtempSync(path.join(os.tmpdir(), 'kv-nlc-spec-'))
  t.teardown(() => fs.rmSync(dir, { recursive: true, force: true }))
  return dir
}
const commonPrefix = (a, b) => {
  let i = 0
  while (i < a.length && i < b.length && a[i] === b[i]) i++
  return i
}
const chat = (cfg) => runScript(CHAT, [JSON.stringify(cfg)])

// ---------------------------------------------------------------------------------------------
// argument checks on stand-ins shaped like a LlamaContextSequence (no peer needed)

function standIn(dir, extra = {}) {
  // not a GGUF file: the store takes the path as the model's name, as it is
  const file = path.join(dir, 'stand-in-weights')
  const seq = {
    contextTokens: [],
    disposed: false,
    context: { flashAttention: false },
    model: { filename: 'stand-in.gguf', _modelPath: file },
    saveStateToFile: async () => ({ fileSize: 0 }),
    loadStateFromFile: async () => {},
    ...extra,
  }
  for (const m of METHODS) if (!(m in extra)) seq[m] = function original() {}
  return seq
}

test('reusePrompts refuses what is not a sequence, naming the value', (t) => {
  const dir = tmp(t)
  const bad = (value, pattern) => {
    const e = t.throws(() => reusePrompts(value, { path: path.join(dir, 'store') }))
    t.is(e.code, 'ERR_KV_INVALID_ARG', e.message)
    t.regex(e.message, pattern)
  }
  bad(null, /got null/)
  bad(42, /got number 42/)
  bad('sequence', /got the string "sequence"/)
  bad({}, /an object has no method evaluate/)
  const noSave = standIn(dir)
  delete noSave.saveStateToFile
  bad(noSave, /no method saveStateToFile/)
  bad(standIn(dir, { contextTokens: 'abc' }), /contextTokens must be an array/)
  // node-llama-cpp's public `filename` is only the base name: not enough to key the store
  bad(standIn(dir, { model: { filename: 'llama-h32.gguf' } }), /gives only its file name "llama-h32.gguf"/)
  bad(standIn(dir, { model: undefined }), /does not say which file it loaded/)
  const disposed = t.throws(() => reusePrompts(standIn(dir, { disposed: true })))
  t.is(disposed.code, 'ERR_KV_DISPOSED')
  const predictor = t.throws(() => reusePrompts(standIn(dir, { tokenPredictor: {} })))
  t.is(predictor.code, 'ERR_KV_UNSUPPORTED')
  t.regex(predictor.message, /tokenPredictor/)
  const lora = t.throws(() => reusePrompts(standIn(dir, { context: { flashAttention: false, _loraAdapters: new Set([{}]) } })))
  t.is(lora.code, 'ERR_KV_UNSUPPORTED')
  t.regex(lora.message, /LoRA/)
})

test('reusePrompts refuses bad options, naming the option, and attaches nothing', (t) => {
  const dir = tmp(t)
  const seq = standIn(dir)
  const originals = Object.fromEntries(METHODS.map((m) => [m, seq[m]]))
  const bad = (options, pattern) => {
    const e = t.throws(() => reusePrompts(seq, options))
    t.is(e.code, 'ERR_KV_INVALID_ARG', e.message)
    t.regex(e.message, pattern)
  }
  bad({ model: 'other.gguf' }, /option 'model' is not accepted/)
  bad({ putAfterEvaluation: 'yes' }, /'putAfterEvaluation' must be a boolean, got string/)
  bad({ putAfterPrompt: 1 }, /'putAfterPrompt' must be a boolean, got number/)
  bad({ minRestoreTokens: 1.5 }, /'minRestoreTokens' must be an integer >= 0, got number 1.5/)
  bad({ minRestoreTokens: -1 }, /'minRestoreTokens' must be an integer >= 0, got number -1/)
  bad({ onError: 'log' }, /'onError' must be a function, got string/)
  bad({ pth: dir }, /unknown option 'pth'/)
  bad('fast', /options must be an object, got string/)
  bad(null, /options must be an object, got null/)
  bad([], /options must be an object/)
  for (const m of METHODS) t.is(seq[m], originals[m], `${m} untouched`)
})

test('an adapter wraps only its own sequence object, passes store options through, and close gives the methods back', async (t) => {
  const dir = tmp(t)
  const seq = standIn(dir)
  const other = standIn(dir)
  const originals = Object.fromEntries(METHODS.map((m) => [m, seq[m]]))
  const reuse = reusePrompts(seq, { path: path.join(dir, 'store'), blockTokens: 32 })
  t.is(reuse.store.blockTokens, 32)
  t.is(reuse.lastRestore, null)
  t.is(reuse.lastError, null)
  for (const m of METHODS) {
    t.not(seq[m], originals[m], `${m} wrapped`)
    t.is(other[m].name, 'original', `${m} of another sequence untouched`)
  }
  const twice = t.throws(() => reusePrompts(seq, {}))
  t.is(twice.code, 'ERR_KV_INVALID_ARG')
  t.regex(twice.message, /already has a reusePrompts adapter/)
  await reuse.close()
  await reuse.close() // idempotent
  t.true(reuse.closed)
  for (const m of METHODS) t.is(seq[m], originals[m], `${m} given back`)
  const again = reusePrompts(seq, {}) // a closed adapter no longer holds the sequence
  await again.close()
})

// ---------------------------------------------------------------------------------------------
// with the real peer

registerPeerSuite(test, 'node-llama-cpp adapter', () => {
  // a plain KV cache, a sliding window, attention + Mamba, Mamba alone; with node-llama-cpp's
  // default flash attention ('auto': llama.cpp decides, V untransposed here) or without it
  const models = { 'llama-h32.gguf': 'auto', 'gemma3-swa.gguf': false, 'jamba.gguf': 'auto', 'mamba.gguf': false }
  for (const [name, flashAttention] of Object.entries(models)) {
    test.serial(`${name} (flash attention ${flashAttention}): a chat restarted between turns restores turn 1 in the new process, evaluates only the rest, and continues like a cold process`, async (t) => {
      const dir = tmp(t)
      const model = path.join(MODELS, name)
      const store = { path: path.join(dir, 'store'), blockTokens: 16 }
      const history = path.join(dir, 'history.json')
      const t0 = Date.now()
      const one = await chat({ model, flashAttention, store, tmp: path.join(dir, 'tmp1'), chats: [{ prompt: 'the cat sat on the mat', saveHistory: history }] })
      const [two, cold] = await Promise.all([
        chat({ model, flashAttention, store, tmp: path.join(dir, 'tmp2'), chats: [{ prompt: 'and the dog ran to the sea', history }] }),
        chat({ model, flashAttention, store: null, chats: [{ prompt: 'and the dog ran to the sea', history }] }),
      ])
      const [t1, t2, c] = [one.chats[0], two.chats[0], cold.chats[0]]
      const prompt1 = t1.lastRestore.evaluatedTokens
      const restored = t2.lastRestore.restoredTokens
      t.log(`${Date.now() - t0} ms; turn 1: ${prompt1} prompt tokens, stored ${t1.lastPut.tokens}; turn 2: restored ${restored}, ` +
        `evaluated ${t2.lastRestore.evaluatedTokens}; peer input tokens ${t2.usedInputTokens} (cold ${c.usedInputTokens}); ` +
        `ttft ${t2.ttftMs.toFixed(1)} ms (cold ${c.ttftMs.toFixed(1)} ms)`)

      // turn 1: nothing to restore, and its state stored
      t.deepEqual(t1.lastRestore, { restoredTokens: 0, evaluatedTokens: prompt1, lookupTokens: 0, heldTokens: 0 })
      t.is(t1.lastPut.tokens, t1.contextTokens.length, 'the turn was stored at its end')
      t.is(t1.lastError, null)
      // turn 2, a new process: turn 1 (at least its prompt) comes from the store
      t.true(restored >= prompt1, `restored ${restored} of turn 1's ${prompt1} prompt tokens`)
      t.true(restored <= commonPrefix(t1.contextTokens, t2.contextTokens), 'only a prefix turn 1 shares is restored')
      t.is(t2.lastRestore.heldTokens, 0)
      t.is(t2.lastError, null)
      // the peer's own counter: it evaluated the restored tokens fewer than the cold process
      t.is(t2.usedInputTokens, c.usedInputTokens - restored)
      t.is(t2.lastRestore.evaluatedTokens + restored, c.contextTokens.length - (c.generated.length - 1), 'the prompt was split into restored + evaluated')
      // and continues as the cold process does
      t.deepEqual(t2.contextTokens, c.contextTokens)
      t.deepEqual(t2.generated, c.generated)
      t.is(t2.response, c.response)
      // no file left behind, the folder removed at close, the sequence's methods its own again
      for (const r of [one, two]) {
        t.deepEqual(r.scratchFilesBeforeClose, [])
        t.is(r.scratchBeforeClose.length, 1, 'one private folder')
        t.deepEqual(r.scratchAfterClose, [])
        t.deepEqual(r.ownAfterClose, [[]])
      }
    })
  }

  test.serial("llama-h32.gguf with compress 'q8_0': turn 1's K/V restored from q8_0 blocks, and the peer continues with the cold process's next token", async (t) => {
    const dir = tmp(t)
    const model = path.join(MODELS, 'llama-h32.gguf')
    const store = { path: path.join(dir, 'store'), blockTokens: 16, compress: 'q8_0' }
    const history = path.join(dir, 'history.json')
    const one = await chat({ model, store, tmp: path.join(dir, 'tmp1'), chats: [{ prompt: 'the cat sat on the mat', saveHistory: history }] })
    const [two, cold] = await Promise.all([
      chat({ model, store, tmp: path.join(dir, 'tmp2'), chats: [{ prompt: 'and the dog ran to the sea', history }] }),
      chat({ model, store: null, chats: [{ prompt: 'and the dog ran to the sea', history }] }),
    ])
    const [t1, t2, c] = [one.chats[0], two.chats[0], cold.chats[0]]
    const same = t2.generated.findIndex((tok, i) => tok !== c.generated[i])
    t.log(`restored ${t2.lastRestore.restoredTokens} tokens from q8_0 blocks; generated tokens equal to the cold run's: ${same < 0 ? 'all' : same} of ${c.generated.length}`)
    t.true(t2.lastRestore.restoredTokens >= t1.lastRestore.evaluatedTokens)
    t.is(t2.lastError, null)
    t.is(t2.usedInputTokens, c.usedInputTokens - t2.lastRestore.restoredTokens)
    // the rows are within half a q8_0 step of the cold ones: the peer's next token is the same
    t.is(t2.generated[0], c.generated[0])
    // and the blocks were kept as q8_0: every block file is smaller than an f16 block's rows
    const blocks = fs.readdirSync(path.join(dir, 'store', 'blocks'), { recursive: true })
      .map((f) => path.join(dir, 'store', 'blocks', f))
      .filter((f) => fs.statSync(f).isFile() && fs.readFileSync(f).subarray(0, 4).toString('latin1') === 'KVPB')
    t.true(blocks.length > 0)
    for (const f of blocks) t.is(fs.readFileSync(f).readUInt32LE(4) >>> 31, 1, `${path.basename(f)} is compact`)
  })

  test.serial('llama-h32.gguf: two sequences of one context, each with its adapter on one store, restore and continue at once', async (t) => {
    const dir = tmp(t)
    const model = path.join(MODELS, 'llama-h32.gguf')
    const store = { path: path.join(dir, 'store'), blockTokens: 16 }
    const [h1, h2] = ['a.json', 'b.json'].map((f) => path.join(dir, f))
    const base = { model, sequences: 2 }
    const one = await chat({ ...base, store, tmp: path.join(dir, 'tmp1'), chats: [
      { prompt: 'the cat sat on the mat', saveHistory: h1 },
      { prompt: 'a bird flew over the hill', saveHistory: h2 },
    ] })
    const turn2 = [{ prompt: 'and the dog ran', history: h1 }, { prompt: 'to the big tree', history: h2 }]
    const [two, cold] = await Promise.all([
      chat({ ...base, store, tmp: path.join(dir, 'tmp2'), chats: turn2 }),
      chat({ ...base, store: null, chats: turn2 }),
    ])
    for (let i = 0; i < 2; i++) {
      const [t1, t2, c] = [one.chats[i], two.chats[i], cold.chats[i]]
      const restored = t2.lastRestore.restoredTokens
      t.log(`sequence ${i}: turn 1 stored ${t1.lastPut.tokens}; turn 2 restored ${restored}, peer input tokens ${t2.usedInputTokens} (cold ${c.usedInputTokens})`)
      t.is(t1.lastPut.tokens, t1.contextTokens.length)
      t.true(restored >= t1.lastRestore.evaluatedTokens, `sequence ${i} restored its own turn 1`)
      t.true(restored <= commonPrefix(t1.contextTokens, t2.contextTokens))
      t.is(t2.usedInputTokens, c.usedInputTokens - restored)
      t.deepEqual(t2.generated, c.generated)
      t.is(t2.lastError, null)
    }
    t.notDeepEqual(two.chats[0].generated, two.chats[1].generated, 'two different conversations')
    for (const r of [one, two]) {
      t.is(r.scratchBeforeClose.length, 2, 'a private folder per adapter')
      t.deepEqual(r.scratchFilesBeforeClose, [])
      t.deepEqual(r.scratchAfterClose, [])
    }
  })

  test.serial('llama-h32.gguf: every evaluation method restores and matches a cold context; a thrown evaluation, an abort and a failing store leave no file; close detaches', async (t) => {
    const dir = tmp(t)
    const r = await runScript(DIRECT, [JSON.stringify({ model: path.join(MODELS, 'llama-h32.gguf'), storePath: path.join(dir, 'store'), tmp: path.join(dir, 'tmp') })])
    // options refused on a real sequence, nothing attached
    for (const [k, e] of Object.entries(r.badOptions)) if (k !== 'own') t.is(e?.code, 'ERR_KV_INVALID_ARG', k)
    t.regex(r.badOptions.unknown.message, /unknown option 'pth'/)
    t.regex(r.badOptions.notSequence.message, /LlamaContext has no method evaluate/)
    t.deepEqual(r.badOptions.own, [])
    t.is(r.double.code, 'ERR_KV_INVALID_ARG')
    t.deepEqual(r.ownWhileAttached, METHODS)
    t.is(r.turn1.lastPut.tokens, r.turn1.tokens)

    // each method, from an empty sequence: the stored conversation restored, the rest evaluated
    const m = r.methods
    for (const name of ['evaluate', 'evaluateWithMetadata', 'controlledEvaluate']) {
      t.is(m[name].lastRestore.restoredTokens, r.turn1.tokens, `${name} restored the stored turn`)
      t.is(m[name].lastRestore.evaluatedTokens, m.evaluateWithoutGeneratingNewTokens.expected - r.turn1.tokens, `${name} left the rest`)
    }
    t.is(m.evaluate.warm, m.evaluate.cold)
    t.is(m.evaluate.held, m.evaluateWithoutGeneratingNewTokens.expected)
    t.deepEqual(m.evaluateWithMetadata.warm, m.evaluateWithMetadata.cold)
    // controlledEvaluate: outputs at the caller's indices, as cold
    t.deepEqual(m.controlledEvaluate.warm, m.controlledEvaluate.cold)
    t.is(m.controlledEvaluate.warm.length, m.controlledEvaluate.inputLength)
    t.deepEqual(m.controlledEvaluate.indices, [m.controlledEvaluate.inputLength - 1])
    for (const [i, [token, p]] of m.controlledEvaluate.warm.probs.entries()) {
      const [coldToken, coldP] = m.controlledEvaluate.cold.probs[i]
      t.is(token, coldToken)
      t.true(Math.abs(p - coldP) <= 1e-4)
    }
    // evaluateWithoutGeneratingNewTokens stored by the earlier calls: all of it restored
    t.is(m.evaluateWithoutGeneratingNewTokens.lastRestore.restoredTokens, m.evaluateWithoutGeneratingNewTokens.expected)
    t.is(m.evaluateWithoutGeneratingNewTokens.held, m.evaluateWithoutGeneratingNewTokens.expected)
    t.deepEqual(r.filesAfterMethods, [])
    // flash attention 'auto' (on here) restoring files stored without it: the layout is found
    t.is(r.flashAuto.contextFlashAttention, 'auto')
    t.is(r.flashAuto.lastRestore.restoredTokens, r.turn1.tokens)
    t.is(r.flashAuto.lastError, null)
    // rows computed without flash attention, continued with it: close to a cold run with it,
    // not bit-equal (the deeper layers' rows carry the other kernel's rounding)
    t.is(r.flashAuto.warm.token, r.flashAuto.cold.token)
    for (const [i, [token, p]] of r.flashAuto.warm.probs.entries()) {
      t.is(token, r.flashAuto.cold.probs[i][0])
      t.true(Math.abs(p - r.flashAuto.cold.probs[i][1]) <= 2e-3, `${p} vs ${r.flashAuto.cold.probs[i][1]}`)
    }

    // the peer's error reaches the app as it threw it; nothing behind
    t.regex(r.thrown.error?.message ?? 'no error', /Eval has failed/)
    t.true(r.thrown.lastRestore.restoredTokens > 0, 'the failing evaluation had restored first')
    t.deepEqual(r.thrown.files, [])
    t.is(r.aborted.error?.message, 'stop here')
    t.deepEqual(r.aborted.files, [])
    // a failing store: the turn completes; the failure is reported, coded
    t.is(r.storeFailure.error, null)
    t.is(typeof r.storeFailure.response, 'string')
    t.is(r.storeFailure.lastError?.code, 'ERR_KV_STORE_IO')
    t.true(r.storeFailure.onError.length > 0 && r.storeFailure.onError.every((c) => c.startsWith('ERR_KV_')))
    t.deepEqual(r.storeFailure.files, [])
    // close
    t.is(r.close.scratchBeforeClose.length, 1)
    t.deepEqual(r.close.scratchAfterClose, [])
    t.deepEqual(r.close.own, [])
    t.true(r.close.closed)
    t.true(r.close.untouched, 'evaluations after close do not go through the adapter')
    t.is(r.close.held, m.evaluateWithoutGeneratingNewTokens.expected)
    t.is(r.close.again, null)
  })
})

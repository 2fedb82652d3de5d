// `llama-kv-cache/llama.node`: prompt reuse for @fugood/llama.node.
//
// Without the peer (a structural stand-in for its context, in this process): argument and model
// checks, the restore's file (a session v9 in a private 0700 folder, removed whatever happens),
// a context that refuses it (cleared, the turn runs cold), failed checkpoints, the queue, aborts,
// LoRA adapters.
//
// With the real peer (child processes, as llama.node 1.7.15 crashes now and then): for llama-h32
// (plain KV), gemma3-swa (iSWA), jamba (hybrid) and mamba (recurrent), a chat of three turns, a
// process per turn over one store directory: each turn restores the one before, llama.node's own
// `timings.prompt_n` counts only the tokens after it, and each turn equals a cold run of its
// prompt (text, pieces, and every token the context holds after it) in another process. Then a
// wrong modelPath, a failed and an aborted turn, concurrent completions, and stores written by
// contexts of another V layout or K type.
import test from 'ava'
import fs from 'node:fs'
import os from 'node:os'
import path from 'node:path'
import { spawn } from 'node:child_process'
import { createRequire } from 'node:module'
import { fileURLToPath } from 'node:url'
import { registerPeerSuite } from '../interop/peers.mjs'

const require = createRequire(import.meta.url)
const { reusePrompts } = require('../adapters/llama.node.js')
const { inspectState } = require('../index.js')

const HERE = path.dirname(fileURLToPath(import.meta.url))
const ROOT = path.resolve(HERE, '..')
const MODELS = path.join(ROOT, 'interop', 'models')
const H32 = path.join(MODELS, 'llama-h32.gguf')
const FIXTURE = path.join(HERE, 'fixtures', 'ln-h32-f16.ggsn') // llama.node's session of 'the cat sat on the mat' (llama-h32)
const FIXTURE_TOKENS = [1, 261, 264, 267, 269, 261, 272]

const made = []
const tmp = () => {
  const dir = fs.mkdtempSync(path.join(os.tmpdir(), 'lln-spec-'))
  made.push(dir)
  return dir
}
test.after.always(() => {
  for (const dir of made) fs.rmSync(dir, { recursive: true, force: true })
})

// ---------------------------------------------------------------------------------------------
// without the peer

/** What llama.node 1.7.15's getModelInfo() reports for llama-h32.gguf. */
const H32_INFO = {
  desc: 'llama ?B all F32', nEmbd: 128, nParams: 279168, size: 1116672, is_recurrent: false, is_hybrid: false,
  metadata: {
    'general.architecture': 'llama', 'general.name': 'llama-h32', 'llama.block_count': '2', 'llama.context_length': '256',
    'llama.embedding_length': '128', 'llama.rope.freq_base': '10000.000000', 'tokenizer.ggml.model': 'llama',
    'tokenizer.ggml.add_bos_token': 'true', 'tokenizer.ggml.bos_token_id': '1',
  },
}

/**
 * A stand-in for llama.node's context of llama-h32: tokenize gives the fixture's tokens for
 * 'the cat sat on the mat' and one token per further word; saveSession writes the fixture;
 * every call is recorded in `calls`.
 */
function fakeContext(over = {}) {
  const calls = []
  let inFlight = 0
  const ctx = {
    calls,
    maxInFlight: 0,
    lora: [],
    getModelInfo: () => over.info ?? H32_INFO,
    getLoadedLoraAdapters: () => ctx.lora,
    async tokenize(text) {
      const base = 'the cat sat on the mat'
      const words = text.startsWith(base) ? text.slice(base.length).split(' ').filter(Boolean) : text.split(' ')
      const head = text.startsWith(base) ? FIXTURE_TOKENS.slice(1) : []
      return { tokens: Int32Array.from([...head, ...words.map((w) => 280 + (w.length % 30))]) }
    },
    async loadSession(file) {
      const seen = { call: 'loadSession', file, exists: fs.existsSync(file), mode: fs.statSync(path.dirname(file)).mode & 0o777, info: fs.existsSync(file) ? inspectState(file) : null }
      calls.push(seen)
      if (over.loadSession) return over.loadSession(file)
    },
    async saveSession(file) {
      calls.push({ call: 'saveSession', file })
      if (over.saveSession) return over.saveSession(file)
      fs.copyFileSync(FIXTURE, file)
    },
    async completion(options, callback) {
      calls.push({ call: 'completion', prompt: options.prompt, signal: 'signal' in options })
      ctx.maxInFlight = Math.max(ctx.maxInFlight, ++inFlight)
      try {
        await new Promise((resolve) => setTimeout(resolve, over.delay ?? 5))
        if (over.completion) return await over.completion(options, callback)
        return { text: ` after ${options.prompt}`, timings: { prompt_n: 3 } }
      } finally {
        inFlight--
      }
    },
    clearCache(data) {
      calls.push({ call: 'clearCache', data })
    },
    stopCompletion() {
      calls.push({ call: 'stopCompletion' })
    },
  }
  return ctx
}

/** An adapter over an in-memory store that holds the fixture's turn (7 tokens). */
async function primed(ctx, options = {}) {
  const reuse = reusePrompts(ctx, { modelPath: H32, blockTokens: 16, ...options })
  const put = await reuse.store.putFile(FIXTURE)
  return { reuse, put }
}

const filesIn = (dir) => (fs.existsSync(dir) ? fs.readdirSync(dir) : null)

test('reusePrompts refuses what is not a llama.node context or not its options, with ERR_KV_INVALID_ARG naming the value', (t) => {
  const invalid = { code: 'ERR_KV_INVALID_ARG' }
  t.throws(() => reusePrompts(null, { modelPath: H32 }), { ...invalid, message: /context must be a llama\.node LlamaContext.*got null/ })
  t.throws(() => reusePrompts('ctx', { modelPath: H32 }), { ...invalid, message: /got string/ })
  const { saveSession: _, ...noSave } = fakeContext()
  t.throws(() => reusePrompts(noSave, { modelPath: H32 }), { ...invalid, message: /no saveSession\(\)/ })
  const ctx = fakeContext()
  t.throws(() => reusePrompts(ctx), { ...invalid, message: /'modelPath' is required/ })
  t.throws(() => reusePrompts(ctx, 'x'), { ...invalid, message: /options must be an object, got string/ })
  t.throws(() => reusePrompts(ctx, { modelPath: 42 }), { ...invalid, message: /'modelPath' must be a string, got number/ })
  t.throws(() => reusePrompts(ctx, { modelPath: '' }), { ...invalid, message: /'modelPath' must not be empty/ })
  t.throws(() => reusePrompts(ctx, { modelPath: H32, model: H32 }), { ...invalid, message: /option 'model' is not accepted/ })
  t.throws(() => reusePrompts(ctx, { modelPath: H32, checkpoints: 'yes' }), { ...invalid, message: /'checkpoints' must be a boolean, got string/ })
  t.throws(() => reusePrompts(ctx, { modelPath: H32, flashAttn: 1 }), { ...invalid, message: /'flashAttn' must be a boolean, got number/ })
  t.throws(() => reusePrompts(ctx, { modelPath: H32, pathh: '/tmp/x' }), { ...invalid, message: /unknown option 'pathh'/ })
  t.throws(() => reusePrompts(ctx, { modelPath: H32, blockTokens: 'many' }), { ...invalid, message: /blockTokens/ })
  t.throws(() => reusePrompts(ctx, { modelPath: '/nonexistent/model.gguf' }), { code: 'ERR_KV_IO', message: /nonexistent\/model\.gguf/ })
  t.throws(() => reusePrompts(ctx, { modelPath: path.join(ROOT, 'README.md') }), { code: 'ERR_KV_INVALID_MODEL', message: /README\.md/ })
  t.is(ctx.calls.length, 0, 'nothing ran on the context')
})

test('a modelPath that is not the context\'s model is refused with ERR_KV_STORE_GEOMETRY naming the field', (t) => {
  const geometry = (field) => ({ code: 'ERR_KV_STORE_GEOMETRY', message: new RegExp(`is not the model this context loaded: ${field.replaceAll('.', '\\.')} is`) })
  const ctx = fakeContext()
  let e = t.throws(() => reusePrompts(ctx, { modelPath: path.join(MODELS, 'gemma3-swa.gguf') }), geometry('general.architecture'))
  t.like(e, { field: 'general.architecture', file: 'gemma3', context: 'llama' })
  e = t.throws(() => reusePrompts(ctx, { modelPath: path.join(MODELS, 'llama-h16.gguf') }), geometry('general.name'))
  t.like(e, { file: 'llama-h16', context: 'llama-h32' })
  const noName = { ...H32_INFO, metadata: { ...H32_INFO.metadata } }
  delete noName.metadata['general.name']
  t.throws(() => reusePrompts(fakeContext({ info: { ...noName, nEmbd: 64 } }), { modelPath: H32 }), geometry('nEmbd'))
  t.throws(() => reusePrompts(fakeContext({ info: { ...noName, metadata: { ...noName.metadata, 'llama.block_count': '3' } } }), { modelPath: H32 }), geometry('llama.block_count'))
  t.throws(() => reusePrompts(fakeContext({ info: { ...noName, is_recurrent: true } }), { modelPath: H32 }), geometry('recurrent'))
  t.throws(() => reusePrompts(fakeContext({ info: { ...noName, size: H32_INFO.size + 4096 } }), { modelPath: H32 }), geometry('size'))
  // llama.node's own GGUF reader, where the context exposes it, compares every metadata value
  const withReader = fakeContext()
  class Native {
    static loadModelInfo(file) {
      t.is(file, H32)
      return { ...H32_INFO.metadata, 'llama.rope.freq_base': '500000.000000' }
    }
  }
  withReader.ctx = new Native()
  e = t.throws(() => reusePrompts(withReader, { modelPath: H32 }), geometry('llama.rope.freq_base'))
  t.like(e, { file: '500000.000000', context: '10000.000000' })
  // and the right file passes every check
  t.truthy(reusePrompts(fakeContext(), { modelPath: H32 }).store)
})

test('completion checks its arguments (ERR_KV_INVALID_ARG) and refuses calls after close (ERR_KV_DISPOSED)', async (t) => {
  const ctx = fakeContext()
  const reuse = reusePrompts(ctx, { modelPath: H32 })
  await t.throwsAsync(reuse.completion(null), { code: 'ERR_KV_INVALID_ARG', message: /options must be an object, got null/ })
  await t.throwsAsync(reuse.completion({ prompt: 7 }), { code: 'ERR_KV_INVALID_ARG', message: /'prompt' must be a string, got number/ })
  await t.throwsAsync(reuse.completion({ prompt: 'x' }, 'cb'), { code: 'ERR_KV_INVALID_ARG', message: /callback must be a function, got string/ })
  await t.throwsAsync(reuse.completion({ prompt: 'x', signal: {} }), { code: 'ERR_KV_INVALID_ARG', message: /'signal' must be an AbortSignal/ })
  t.is(ctx.calls.length, 0)
  await reuse.close()
  t.true(reuse.closed)
  await t.throwsAsync(reuse.completion({ prompt: 'x' }), { code: 'ERR_KV_DISPOSED' })
  t.is(ctx.calls.length, 0)
})

test('a restore loads the stored prefix as a session v9 from a private folder, removed after the turn and the folder on close', async (t) => {
  const ctx = fakeContext()
  const { reuse, put } = await primed(ctx)
  t.is(put.tokens, 7)
  t.is(reuse.lastRestore, null)
  const result = await reuse.completion({ prompt: 'the cat sat on the mat and then', n_predict: 2 })
  t.is(result.text, ' after the cat sat on the mat and then', "llama.node's own result")
  const load = ctx.calls.find((c) => c.call === 'loadSession')
  t.truthy(load, 'the stored prefix was loaded')
  t.true(load.exists)
  t.is(load.mode, 0o700, 'a private folder')
  t.like(load.info, { format: 'session', magic: 'ggsn', version: 9, nTokens: 7 })
  t.deepEqual(load.info.tokens, FIXTURE_TOKENS)
  t.deepEqual(ctx.calls.map((c) => c.call), ['loadSession', 'completion', 'saveSession'])
  t.false(ctx.calls[1].signal, 'the adapter\'s own options do not reach llama.node')
  t.like(reuse.lastRestore, { restoredTokens: 7, evaluatedTokens: 3, lookupTokens: 7, promptTokens: 9, reusedTokens: 0, error: null })
  t.is(reuse.lastError, null)
  t.is(reuse.lastCheckpoint.tokens, 7)
  const dir = path.dirname(load.file)
  t.deepEqual(filesIn(dir), [], 'no file left after the turn')
  t.is(path.dirname(ctx.calls[2].file), dir, 'the checkpoint went through the same folder')
  // the context now holds the fixture's 7 tokens: a prompt going on from them needs no restore
  await reuse.completion({ prompt: 'the cat sat on the mat and so' })
  t.like(reuse.lastRestore, { restoredTokens: 0, reusedTokens: 7, lookupTokens: 7 })
  t.is(ctx.calls.filter((c) => c.call === 'loadSession').length, 1)
  await reuse.close()
  t.is(filesIn(dir), null, 'the folder is gone')
})

test('a context that refuses the restored file (both V layouts) is cleared and the turn runs cold; no file is left', async (t) => {
  const ctx = fakeContext({ loadSession: async () => { throw new Error('Failed to load session') } })
  const { reuse } = await primed(ctx)
  const result = await reuse.completion({ prompt: 'the cat sat on the mat and then' })
  t.truthy(result, 'the turn still ran')
  const loads = ctx.calls.filter((c) => c.call === 'loadSession')
  t.is(loads.length, 2, 'the store\'s layout, then the other')
  t.not(loads[0].info.vTrans, loads[1].info.vTrans)
  t.deepEqual(ctx.calls.map((c) => c.call), ['loadSession', 'loadSession', 'clearCache', 'completion', 'saveSession'],
    'cleared before the completion: llama.node keeps its token list after a failed load')
  t.like(reuse.lastRestore, { restoredTokens: 0, lookupTokens: 7 })
  t.is(reuse.lastRestore.error.code, 'ERR_KV_BACKEND')
  t.is(reuse.lastRestore.error.cause.message, 'Failed to load session')
  t.deepEqual(filesIn(path.dirname(loads[0].file)), [])
  await reuse.close()
  t.is(filesIn(path.dirname(loads[0].file)), null)
})

test('flashAttn: the files are written in that V layout, and a refused one is not tried the other way', async (t) => {
  for (const flashAttn of [true, false]) {
    const ctx = fakeContext({ loadSession: async () => { throw new Error('Failed to load session') } })
    const { reuse } = await primed(ctx, { flashAttn })
    await reuse.completion({ prompt: 'the cat sat on the mat and then' })
    const loads = ctx.calls.filter((c) => c.call === 'loadSession')
    t.is(loads.length, 1)
    t.is(loads[0].info.vTrans, !flashAttn)
    t.is(reuse.lastRestore.error.code, 'ERR_KV_BACKEND')
    await reuse.close()
  }
})

test('a completion that fails after a restore rejects with ERR_KV_BACKEND (llama.node\'s error as cause) and leaves no file', async (t) => {
  const peerFailure = new TypeError('Another thing went wrong')
  const ctx = fakeContext({ completion: async () => { throw peerFailure } })
  const { reuse } = await primed(ctx)
  const e = await t.throwsAsync(reuse.completion({ prompt: 'the cat sat on the mat and then' }), { code: 'ERR_KV_BACKEND', message: /completion\(\) failed: Another thing went wrong/ })
  t.is(e.cause, peerFailure)
  const load = ctx.calls.find((c) => c.call === 'loadSession')
  t.true(load.exists)
  t.deepEqual(filesIn(path.dirname(load.file)), [])
  t.false(ctx.calls.some((c) => c.call === 'saveSession'), 'no checkpoint of a failed turn')
  // the context reports a completion in progress: ERR_KV_BUSY, saying how to recover
  const busy = fakeContext({ completion: () => { throw new TypeError('Another completion is in progress') } })
  const reuseBusy = reusePrompts(busy, { modelPath: H32 })
  await t.throwsAsync(reuseBusy.completion({ prompt: 'x y' }), { code: 'ERR_KV_BUSY', message: /new context/ })
  await reuse.close()
  await reuseBusy.close()
})

test('a failed checkpoint does not fail the turn: lastError says why', async (t) => {
  const garbage = fakeContext({ saveSession: (file) => fs.writeFileSync(file, 'not a state') })
  const a = reusePrompts(garbage, { modelPath: H32 })
  const r = await a.completion({ prompt: 'the cat sat' })
  t.truthy(r)
  t.is(a.lastError.code, 'ERR_KV_INVALID_STATE')
  t.is(a.lastCheckpoint, null)
  const refusing = fakeContext({ saveSession: async () => { throw new Error('Failed to save session') } })
  const b = reusePrompts(refusing, { modelPath: H32 })
  t.truthy(await b.completion({ prompt: 'the cat sat' }))
  t.is(b.lastError.code, 'ERR_KV_BACKEND')
  t.regex(b.lastError.message, /saveSession\(\) failed: Failed to save session/)
  const dirs = [garbage, refusing].map((c) => path.dirname(c.calls.find((x) => x.call === 'saveSession').file))
  for (const d of dirs) t.deepEqual(filesIn(d), [])
  await a.close()
  await b.close()
  // without checkpoints nothing is stored
  const c = reusePrompts(fakeContext(), { modelPath: H32, checkpoints: false })
  await c.completion({ prompt: 'the cat sat on the mat' })
  t.is(c.lastCheckpoint, null)
  t.is(await c.store.lookup(FIXTURE_TOKENS), 0)
  await c.close()
})

test('completions on one adapter run one at a time, in order; an abort while queued never reaches llama.node', async (t) => {
  const ctx = fakeContext({ delay: 20 })
  const reuse = reusePrompts(ctx, { modelPath: H32 })
  const ac = new AbortController()
  const order = []
  const runs = ['a', 'b', 'c'].map((w) => reuse.completion({ prompt: `the cat sat on the mat ${w}` }).then((r) => order.push(r.text)))
  const aborted = reuse.completion({ prompt: 'the cat sat on the mat d', signal: ac.signal })
  ac.abort()
  await t.throwsAsync(aborted, { code: 'ERR_KV_ABORTED', name: 'AbortError' })
  await Promise.all(runs)
  t.is(ctx.maxInFlight, 1)
  t.deepEqual(order, ['a', 'b', 'c'].map((w) => ` after the cat sat on the mat ${w}`))
  t.false(ctx.calls.some((c) => c.prompt?.endsWith(' d')))
  await t.throwsAsync(reuse.completion({ prompt: 'x', signal: AbortSignal.abort() }), { code: 'ERR_KV_ABORTED' })
  await reuse.close()
})

test('LoRA adapters are part of the store\'s model, and a change of them keeps the turn away from the store', async (t) => {
  // the same model under a LoRA adapter shares no value with the plain model in one store directory
  const withLora = fakeContext()
  withLora.lora = [{ path: path.join(MODELS, 'llama-h16.gguf'), scaled: 0.5 }] // any GGUF file stands for an adapter here
  const dir = tmp()
  const d1 = reusePrompts(fakeContext(), { modelPath: H32, path: dir, blockTokens: 16 })
  await d1.store.putFile(FIXTURE)
  const d2 = reusePrompts(withLora, { modelPath: H32, path: dir, blockTokens: 16 })
  t.is(await d1.store.lookup(FIXTURE_TOKENS), 7)
  t.is(await d2.store.lookup(FIXTURE_TOKENS), 0)
  await d2.store.putFile(FIXTURE)
  t.is(await d2.store.lookup(FIXTURE_TOKENS), 7)
  // adapters applied after reusePrompts: no restore, no checkpoint, and lastError says why
  const plain = fakeContext()
  const { reuse } = await primed(plain)
  plain.lora = [{ path: path.join(MODELS, 'llama-h16.gguf'), scaled: 1 }]
  await reuse.completion({ prompt: 'the cat sat on the mat and then' })
  t.is(reuse.lastError.code, 'ERR_KV_STORE_GEOMETRY')
  t.false(plain.calls.some((c) => c.call === 'loadSession'))
  t.is(reuse.lastCheckpoint, null)
  for (const r of [reuse, d1, d2]) await r.close()
})

// ---------------------------------------------------------------------------------------------
// with the real peer

/**
 * Runs a helper in a child process whose TMPDIR is a fresh folder (the adapter's private folder
 * goes there). llama.node 1.7.15 crashes now and then (SIGSEGV): a run that dies by a signal
 * before printing its result is run again, with the store directory as it was before it.
 */
async function child(t, script, args, { store } = {}) {
  const before = store && fs.existsSync(store) ? `${store}.before` : null
  if (before) {
    fs.rmSync(before, { recursive: true, force: true })
    fs.cpSync(store, before, { recursive: true })
  }
  for (let attempt = 1; ; attempt++) {
    const tmpdir = tmp()
    const r = await new Promise((resolve) => {
      const p = spawn(process.execPath, [path.join(HERE, 'helpers', script), ...args], {
        cwd: ROOT, stdio: ['ignore', 'pipe', 'pipe'], env: { ...process.env, TMPDIR: tmpdir },
      })
      let stdout = ''
      let stderr = ''
      p.stdout.on('data', (d) => (stdout += d))
      p.stderr.on('data', (d) => (stderr = (stderr + d).slice(-8000)))
      const timer = setTimeout(() => p.kill('SIGKILL'), 120_000)
      p.on('close', (code, signal) => {
        clearTimeout(timer)
        resolve({ code, signal, stdout, stderr })
      })
    })
    const line = r.stdout.split('\n').find((l) => l.startsWith('@@RESULT '))
    if (line && (r.code === 0 || r.signal)) return JSON.parse(line.slice('@@RESULT '.length))
    if (r.signal && attempt < 3) {
      t.log(`${script} died by ${r.signal} (llama.node); run again`)
      if (before) {
        fs.rmSync(store, { recursive: true, force: true })
        fs.cpSync(before, store, { recursive: true })
      } else if (store) fs.rmSync(store, { recursive: true, force: true })
      continue
    }
    throw new Error(`${script} ${args.join(' ')}: exit ${r.code} signal ${r.signal}\n${r.stderr.split('\n').slice(-20).join('\n')}`)
  }
}

const chat = (t, spec, store) => child(t, 'lln-chat.mjs', [JSON.stringify(spec)], { store })
/** One turn through the adapter in a process of its own. */
async function turn(t, spec, store) {
  const r = await chat(t, spec, store)
  return { ...r.turns[0], tmpAfterClose: r.tmpAfterClose }
}
/** The adapter's private folders in a listing (files in them are listed as `folder/file`). */
const ownFolders = (list) => list.filter((f) => /^llama-node-kv-[^/]+\/$/.test(f))
/** Files in any folder of a listing. */
const filesOf = (list) => list.filter((f) => /\/./.test(f))

const P1 = 'the cat sat on the mat and the dog ran to the red house by the sea'
const NEXT = [' then it rained all day', ' and the bird flew over the hill']

registerPeerSuite(test, 'llama.node adapter', () => {
  for (const model of ['llama-h32.gguf', 'gemma3-swa.gguf', 'jamba.gguf', 'mamba.gguf']) {
    test.serial(`${model}: a chat of three turns, a process each, restores each turn, evaluates only what follows it, and equals cold runs`, async (t) => {
      const store = path.join(tmp(), 'store')
      const turns = []
      let prompt = P1
      for (let i = 0; i < 3; i++) {
        if (i > 0) prompt = prompt + turns[i - 1].text + NEXT[i - 1]
        const r = await turn(t, { model, turn: { prompt, store } }, store)
        r.prompt = prompt
        turns.push(r)
        const { restoredTokens, evaluatedTokens, promptTokens } = r.lastRestore
        t.log(`turn ${i + 1}: ${promptTokens} prompt tokens, ${restoredTokens} restored, llama.node evaluated ${r.prompt_n} (${r.turnMs.toFixed(0)} ms)`)
        t.is(r.lastError, null, JSON.stringify(r.lastError))
        t.is(r.lastRestore.error, null)
        t.is(evaluatedTokens, r.prompt_n)
        if (i === 0) {
          t.is(restoredTokens, 0, 'an empty store restores nothing')
        } else {
          const previous = turns[i - 1].contextTokens
          t.is(restoredTokens, previous.length, 'the previous turn, whole (its prompt and the reply tokens llama.node evaluated)')
          t.deepEqual(r.contextTokens.slice(0, previous.length), previous)
          t.is(r.prompt_n, promptTokens - restoredTokens, "llama.node's own count: only the tokens after the restored turn")
        }
        t.is(r.lastCheckpoint.tokens, r.contextTokens.length, 'a checkpoint of the whole turn')
        t.is(ownFolders(r.tmpAfterTurn).length, 1, 'one private folder')
        t.deepEqual(r.tmpAfterTurn, ownFolders(r.tmpAfterTurn), 'with no file in it after the turn')
        t.deepEqual(r.tmpAfterClose, [], 'and gone after close()')
      }
      const cold = await chat(t, { model, cold: turns.slice(1).map((r) => r.prompt) })
      for (let i = 1; i < 3; i++) {
        const warm = turns[i]
        const c = cold.cold[i - 1]
        t.log(`turn ${i + 1}: warm ${JSON.stringify(warm.text)} (prompt_n ${warm.prompt_n}), cold ${JSON.stringify(c.text)} (prompt_n ${c.prompt_n})`)
        t.is(warm.text, c.text)
        t.deepEqual(warm.pieces, c.pieces)
        t.deepEqual(warm.contextTokens, c.contextTokens, 'every token the context holds: the prompt and the reply')
        t.true(c.prompt_n >= warm.lastRestore.promptTokens - 1, 'the cold run evaluated the whole prompt')
      }
    })
  }

  test.serial('llama-h32.gguf: a chat of `messages` across processes restores the previous turn as llama.node formats it, and equals a cold run', async (t) => {
    const store = path.join(tmp(), 'store')
    const m1 = [{ role: 'system', content: 'you are a cat' }, { role: 'user', content: P1 }]
    const first = await turn(t, { model: 'llama-h32.gguf', turn: { prompts: [m1], store } }, store)
    t.is(first.lastRestore.promptTokens, first.prompt_n, 'the tokens looked up are those llama.node evaluated')
    const m2 = [...m1, { role: 'assistant', content: first.text }, { role: 'user', content: NEXT[0] }]
    const r = await turn(t, { model: 'llama-h32.gguf', turn: { prompts: [m2], store } }, store)
    const cold = (await chat(t, { model: 'llama-h32.gguf', cold: [m2] })).cold[0]
    t.log(`${r.lastRestore.promptTokens} prompt tokens, ${r.lastRestore.restoredTokens} restored, llama.node evaluated ${r.prompt_n}; cold ${cold.prompt_n}`)
    t.is(r.lastRestore.error, null)
    t.is(r.lastRestore.promptTokens, cold.prompt_n)
    t.true(r.lastRestore.restoredTokens >= 16 * Math.floor(first.lastRestore.promptTokens / 16), 'at least the system and first user message')
    t.is(r.prompt_n, r.lastRestore.promptTokens - r.lastRestore.restoredTokens)
    t.is(r.text, cold.text)
    t.deepEqual(r.contextTokens, cold.contextTokens)
  })

  test.serial('a modelPath that is not the model the context loaded is refused; the right one works', async (t) => {
    const wrong = ['gemma3-swa.gguf', 'llama-h16.gguf', 'llama-h64.gguf', 'mamba.gguf'].map((m) => path.join(MODELS, m))
    const r = await child(t, 'lln-cases.mjs', ['refuse', JSON.stringify({ model: 'llama-h32.gguf', wrong: [...wrong, '/nonexistent/x.gguf'] })])
    const fields = ['general.architecture', 'general.name', 'general.name', 'general.architecture']
    for (let i = 0; i < wrong.length; i++) {
      t.like(r.refused[i].error, { code: 'ERR_KV_STORE_GEOMETRY', field: fields[i] }, wrong[i])
      t.regex(r.refused[i].error.message, new RegExp(`modelPath ${wrong[i].replaceAll('.', '\\.')} is not the model this context loaded`))
    }
    t.is(r.refused[4].error.code, 'ERR_KV_IO')
    t.is(r.right.lastError, null)
    t.is(r.right.checkpoint.tokens, 8, 'the right model: a turn and its checkpoint')
  })

  test.serial('a turn llama.node fails and an aborted turn leave no file; the adapter goes on; close removes the folder', async (t) => {
    const store = path.join(tmp(), 'store')
    const r = await child(t, 'lln-cases.mjs', ['failed-turn', JSON.stringify({ model: 'llama-h32.gguf', store })], { store })
    const folder = ownFolders(r.turn1.tmp)
    t.is(folder.length, 1)
    t.like(r.failed.error, { code: 'ERR_KV_BACKEND', cause: 'Multimodal support must be enabled via initMultimodal to use media_paths' })
    t.deepEqual(r.failed.tmp, folder, 'no file after the failed turn')
    t.like(r.aborted.error, { code: 'ERR_KV_ABORTED', name: 'AbortError' })
    t.true(r.aborted.checkpoint.tokens > r.turn1.restore.promptTokens, 'what the aborted completion evaluated is checkpointed')
    t.deepEqual(r.aborted.tmp, folder, 'no file after the aborted turn')
    t.is(r.after.restore.error, null)
    t.is(r.after.text, r.cold.text, 'a turn after them equals a cold run')
    t.is(r.after.prompt_n, r.after.restore.promptTokens - Math.max(r.after.restore.reusedTokens, r.after.restore.restoredTokens))
    t.true(r.after.prompt_n < r.cold.prompt_n)
    if (r.recovered.length === 0) t.deepEqual(r.beforeClose, folder)
    else {
      // llama.node left the context busy: the app's recovery (a new context and adapter)
      t.log(`llama.node left a context busy; recovered with a new context: ${r.recovered[0]}`)
      t.false(r.beforeClose.includes(folder[0]), 'closing the first adapter removed its folder')
      t.is(ownFolders(r.beforeClose).length, 1)
      t.deepEqual(filesOf(r.beforeClose), [], 'with no file in it')
    }
    t.deepEqual(r.afterClose, [], 'close() removed the folder')
    t.is(r.afterCloseCall.code, 'ERR_KV_DISPOSED')
  })

  test.serial('completions at once on one adapter are queued, and two contexts with an adapter each share one store; all equal cold runs', async (t) => {
    const store = path.join(tmp(), 'store')
    const prompts = [P1, `${P1} then it rained`]
    const pair = [`${P1} and a bird flew`, `${P1} but the sun came out`]
    const r = await child(t, 'lln-cases.mjs', ['concurrent', JSON.stringify({ model: 'llama-h32.gguf', store, prompts, pair })], { store })
    if (r.recovered.length) t.log(`llama.node left a context busy ${r.recovered.length} time(s); recovered with a new context: ${r.recovered[0]}`)
    t.is(r.queued.maxInFlight, 1, 'one completion at a time on the context')
    const texts = [...r.queued.results, ...r.pair].map((x) => x.text)
    t.deepEqual(texts, r.cold.map((x) => x.text))
    if (r.recovered.length === 0) {
      t.like(r.queued.lastRestore, { reusedTokens: 26, restoredTokens: 0 }, 'the second kept what the first left in the context')
      t.is(r.queued.results[1].prompt_n, r.queued.lastRestore.promptTokens - 26)
    }
    for (const p of r.pair) {
      t.is(p.error, null)
      t.true(p.restore.restoredTokens >= 16, 'each context restored the shared block from the store')
      t.is(p.prompt_n, p.restore.promptTokens - p.restore.restoredTokens)
    }
    t.deepEqual(r.tmp, [], 'every folder removed')
  })

  test.serial('a store written by a flash-attention context restores into one without: the file is written the other way', async (t) => {
    const store = path.join(tmp(), 'store')
    const first = await turn(t, { model: 'llama-h32.gguf', ctx: { flash_attn_type: 'on' }, turn: { prompt: P1, store } }, store)
    const prompt = P1 + first.text + NEXT[0]
    const r = await turn(t, { model: 'llama-h32.gguf', turn: { prompt, store } }, store)
    t.is(r.lastRestore.error, null)
    t.is(r.lastRestore.restoredTokens, first.contextTokens.length)
    t.is(r.prompt_n, r.lastRestore.promptTokens - r.lastRestore.restoredTokens)
    const cold = await chat(t, { model: 'llama-h32.gguf', cold: [prompt] })
    t.is(r.text, cold.cold[0].text)
    t.deepEqual(r.contextTokens, cold.cold[0].contextTokens)
  })

  test.serial('a restore the context refuses (another K type) clears it: the turn equals a cold run, and the refused put is reported', async (t) => {
    const store = path.join(tmp(), 'store')
    const first = await turn(t, { model: 'llama-h32.gguf', ctx: { cache_type_k: 'q8_0' }, turn: { prompt: P1, store } }, store)
    const prompt = P1 + first.text + NEXT[0]
    // an f16 context that holds a short prompt's turn when the store offers the q8_0 one: after
    // the refused load llama.node still lists the short turn's tokens, with its memory gone
    const short = 'the cat sat on the mat'
    const run = await chat(t, { model: 'llama-h32.gguf', turn: { prompts: [short, prompt], store } }, store)
    const [held, r] = run.turns
    t.is(held.lastRestore.restoredTokens, 0)
    t.like(r.lastRestore, { restoredTokens: 0, lookupTokens: first.contextTokens.length })
    if (run.recovered.length === 0) t.true(r.lastRestore.reusedTokens > 0, 'the context held a prefix of the prompt')
    t.is(r.lastRestore.error.code, 'ERR_KV_BACKEND')
    t.regex(r.lastRestore.error.message, /loadSession\(\) failed/)
    t.is(r.lastError.code, 'ERR_KV_STORE_GEOMETRY', 'the f16 checkpoint does not fit the q8_0 store, and the turn still succeeded')
    const cold = await chat(t, { model: 'llama-h32.gguf', cold: [prompt] })
    t.is(r.prompt_n, cold.cold[0].prompt_n, 'evaluated from the start')
    t.is(r.text, cold.cold[0].text, 'not a continuation of a memory llama.node had already dropped')
    t.deepEqual(r.contextTokens, cold.cold[0].contextTokens)
    t.deepEqual(filesOf(r.tmpAfterTurn), [], 'no file left')
    t.is(ownFolders(r.tmpAfterTurn).length, 1)
    t.deepEqual(run.tmpAfterClose, [])
})
})

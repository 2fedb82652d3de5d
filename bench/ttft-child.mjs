// One process of the time-to-first-token bench (bench/ttft.mjs runs it; each measurement gets a
// process of its own, as an app after a restart). The model is loaded and every context is created
// before a clock starts. Prints one line `@@RESULT {json}` on stdout; progress goes to stderr.
//
//   node bench/ttft-child.mjs '<json>'    json: { mode, model, promptFile, tokens, suffix, batchSize,
//                                                  store?: PromptStore options but model, stateFile? }
//
// modes:
//   cold        a fresh context evaluates the prompt and samples one token: { ms, token }
//   store       a fresh context evaluates the prompt's first tokens - suffix (the previous turn)
//               through the adapter, which puts its state in `store`; with `stateFile`, the
//               sequence's state is also saved there (for `components`): { ms, fileBytes? }
//   restored    the adapter restores the stored prefix, the context evaluates the suffix and
//               samples one token: { ms, token, totalMs, lastRestore, parts: { lookup, writeFile,
//               load, evaluate } } (ms: until the token is sampled; totalMs: until the call returns)
//   components  (a) reading the blocks: `lookup` + `restore` of the prefix from `store` into a
//               `KvCache.fromModel` cache of the context's geometry; (b) the suffix alone: after
//               `loadStateFromFile(stateFile)` (untimed), the context evaluates the suffix and
//               samples one token: { readMs, restoredTokens, suffixMs, token }
import fs from 'node:fs'
import path from 'node:path'
import { createRequire } from 'node:module'
import { fileURLToPath, pathToFileURL } from 'node:url'

const HERE = path.dirname(fileURLToPath(import.meta.url))
const ROOT = path.dirname(HERE)
const require = createRequire(import.meta.url)
const spec = JSON.parse(process.argv[2])
const log = (m) => process.stderr.write(`  [${spec.mode} ${path.basename(spec.model, '.gguf')}${spec.tier ? ` ${spec.tier}` : ''}] ${m}\n`)
const now = () => process.hrtime.bigint()
const msSince = (t0) => Number(process.hrtime.bigint() - t0) / 1e6

const { getLlama, LlamaLogLevel } = await import(pathToFileURL(path.join(ROOT, 'interop', 'node_modules', 'node-llama-cpp', 'dist', 'index.js')).href)
const llama = await getLlama({ gpu: false, build: 'never', skipDownload: true, logLevel: LlamaLogLevel.error })
const model = await llama.loadModel({ modelPath: spec.model, gpuLayers: 0 })
const prompt = JSON.parse(fs.readFileSync(spec.promptFile, 'utf8')).slice(0, spec.tokens)
const prefixLength = prompt.length - spec.suffix
const contextOptions = {
  contextSize: spec.tokens + 64,
  batchSize: spec.batchSize,
  sequences: 1,
  threads: 2,
  flashAttention: spec.flashAttn,
}

/** The items of `controlledEvaluate` for `tokens`, sampling one token after the last. */
const items = (tokens, sample = true) =>
  sample ? [...tokens.slice(0, -1), [tokens[tokens.length - 1], { generateNext: { token: true } }]] : [...tokens]

/** The token sampled after the last item (results are indexed like the input). */
function sampled(results, n) {
  const last = results[n - 1]
  if (!last || last.next?.token == null) throw new Error(`no token was sampled after the last of ${n} items`)
  return last.next.token
}

/**
 * `controlledEvaluate(input)` on the clock: resolves to `{ ms, token, totalMs }`, `ms` being the
 * time until the token after the last item is sampled (its `onTokenResult`), before anything that
 * runs after the evaluation (an adapter's put), and `totalMs` until the call resolves.
 */
async function timedEvaluate(sequence, input) {
  const last = input.length - 1
  let tokenAt = null
  let token = null
  const t0 = now()
  const out = await sequence.controlledEvaluate(input, {
    onTokenResult(index, output) {
      if (index === last && tokenAt === null) {
        tokenAt = process.hrtime.bigint()
        token = output.next?.token ?? null
      }
    },
  })
  const totalMs = msSince(t0)
  if (tokenAt === null) throw new Error(`onTokenResult was not called for the last of ${input.length} items`)
  const resolved = sampled(out, input.length)
  if (resolved !== token) throw new Error(`onTokenResult gave token ${token}, the results ${resolved}`)
  return { ms: Number(tokenAt - t0) / 1e6, token, totalMs }
}

let result
const adapterModule = () => require('llama-kv-cache/node-llama-cpp')

if (spec.mode === 'cold') {
  const context = await model.createContext(contextOptions)
  const sequence = context.getSequence()
  const { ms, token } = await timedEvaluate(sequence, items(prompt))
  result = { ms, token, contextSize: context.contextSize }
  log(`cold: ${prompt.length} tokens in ${ms.toFixed(0)} ms`)
} else if (spec.mode === 'store') {
  const { reusePrompts } = adapterModule()
  const context = await model.createContext(contextOptions)
  const sequence = context.getSequence()
  const reuse = reusePrompts(sequence, spec.store)
  const previous = prompt.slice(0, prefixLength)
  const t0 = now()
  await sequence.controlledEvaluate(items(previous, false))
  const ms = msSince(t0)
  result = { ms, lastRestore: reuse.lastRestore ?? null }
  if (spec.stateFile) result.fileBytes = (await sequence.saveStateToFile(spec.stateFile)).fileSize
  await reuse.close()
  const held = sequence.contextTokens.length
  if (held !== previous.length) throw new Error(`the sequence holds ${held} tokens after the previous turn, not ${previous.length}`)
  log(`previous turn: ${previous.length} tokens evaluated and put in ${ms.toFixed(0)} ms`)
} else if (spec.mode === 'restored') {
  const { reusePrompts } = adapterModule()
  const context = await model.createContext(contextOptions)
  const sequence = context.getSequence()
  // where the time goes: the adapter's store calls and the peer's state load, timed by wrappers
  // on these two objects (microseconds of their own)
  const parts = { lookup: 0, writeFile: 0, load: 0 }
  const timeCalls = (object, name, key) => {
    const original = object[name]
    object[name] = async function (...args) {
      const t = now()
      try {
        return await original.apply(this, args)
      } finally {
        parts[key] += msSince(t)
      }
    }
  }
  timeCalls(sequence, 'loadStateFromFile', 'load')
  const reuse = reusePrompts(sequence, spec.store)
  timeCalls(reuse.store, 'lookup', 'lookup')
  timeCalls(reuse.store, 'writeFile', 'writeFile')
  const { ms, token, totalMs } = await timedEvaluate(sequence, items(prompt))
  const lastRestore = { ...reuse.lastRestore }
  const lastError = reuse.lastError
  parts.evaluate = ms - parts.lookup - parts.writeFile - parts.load
  result = { ms, token, totalMs, lastRestore, parts }
  await reuse.close()
  if (!(lastRestore.restoredTokens > 0)) throw new Error(`the adapter restored nothing: ${JSON.stringify(lastRestore)}${lastError ? ` (${lastError.code}: ${lastError.message})` : ''}`)
  log(`restored ${lastRestore.restoredTokens}, evaluated ${lastRestore.evaluatedTokens}, first token in ${ms.toFixed(0)} ms: ` +
    `lookup ${parts.lookup.toFixed(1)}, writeFile ${parts.writeFile.toFixed(1)}, loadStateFromFile ${parts.load.toFixed(1)}, evaluation ${parts.evaluate.toFixed(0)} ms (the call returned after ${totalMs.toFixed(0)} ms)`)
} else if (spec.mode === 'components') {
  const { KvCache, PromptStore } = require(path.join(ROOT, 'index.js'))
  const context = await model.createContext(contextOptions)
  const sequence = context.getSequence()
  const swa = model.fileInsights.swaSize != null && model.fileInsights.swaSize > 0
  // the memory node-llama-cpp's context has: its cells, f16 K/V, its flash attention, n_ubatch
  // = its batch size (+1 with a window, as node-llama-cpp sizes it)
  const cache = KvCache.fromModel(spec.model, {
    nCtx: context.contextSize, typeK: 'f16', typeV: 'f16', flashAttn: spec.flashAttn, nUbatch: spec.batchSize + (swa ? 1 : 0),
  })
  const store = new PromptStore({ ...spec.store, model: spec.model })
  const tokens = Int32Array.from(prompt)
  // (a) reading the blocks
  const t0 = now()
  const found = await store.lookup(tokens)
  const restoredTokens = await store.restore(cache, 0, tokens)
  const readMs = msSince(t0)
  if (found !== prefixLength || restoredTokens !== prefixLength) {
    throw new Error(`the store gave lookup ${found}, restore ${restoredTokens}, not the previous turn's ${prefixLength} tokens`)
  }
  const cacheKind = cache.kind
  cache.dispose()
  // (b) the suffix after a state load
  await sequence.loadStateFromFile(spec.stateFile, { acceptRisk: true })
  if (sequence.contextTokens.length !== prefixLength) throw new Error(`the state file holds ${sequence.contextTokens.length} tokens, not ${prefixLength}`)
  const { ms: suffixMs, token } = await timedEvaluate(sequence, items(prompt.slice(prefixLength)))
  result = { readMs, restoredTokens, suffixMs, token }
  log(`read ${restoredTokens} tokens in ${readMs.toFixed(1)} ms (${cacheKind}); suffix of ${spec.suffix} in ${suffixMs.toFixed(0)} ms`)
} else {
  throw new Error(`unknown mode ${spec.mode}`)
}

process.stdout.write(`@@RESULT ${JSON.stringify(result)}\n`)
// the peer's contexts and model are not disposed one by one: the process ends here
process.exit(0)

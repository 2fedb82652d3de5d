// The adapter under direct calls of a node-llama-cpp sequence, in one process: every evaluation
// method restores and stores (outputs compared with a cold context of the same process), and the
// failure paths: a thrown evaluation, an aborted turn, a failing store, close, bad options.
//
//   node __test__/helpers/nlc-direct.mjs '<json { model, storePath, tmp }>'
//
// Prints `@@RESULT { ... }` (see the fields below); the spec asserts on them.
import fs from 'node:fs'
import { loadNodeLlamaCpp, loadAdapter, listTree, filesUnder, errorInfo } from './nlc-peer.mjs'

const cfg = JSON.parse(process.argv[2])
fs.mkdirSync(cfg.tmp, { recursive: true })
process.env.TMPDIR = cfg.tmp
const { getLlama, LlamaLogLevel, LlamaChatSession } = await loadNodeLlamaCpp()
const { reusePrompts } = loadAdapter()
const METHODS = ['evaluate', 'evaluateWithMetadata', 'evaluateWithoutGeneratingNewTokens', 'controlledEvaluate']
const ownMethods = (seq) => METHODS.filter((m) => Object.hasOwn(seq, m))
const tryCode = (fn) => {
  try {
    fn()
    return null
  } catch (e) {
    return errorInfo(e)
  }
}

const llama = await getLlama({ gpu: false, build: 'never', skipDownload: true, logLevel: LlamaLogLevel.error })
const model = await llama.loadModel({ modelPath: cfg.model, gpuLayers: 0 })
const ctxOptions = { contextSize: 256, batchSize: 256, sequences: 1, threads: 1, flashAttention: false }
const context = await model.createContext(ctxOptions)
const coldContext = await model.createContext(ctxOptions)
const seq = context.getSequence()
const cold = coldContext.getSequence()
const out = {}

// bad options on a real sequence: refused before anything is attached
out.badOptions = {
  model: tryCode(() => reusePrompts(seq, { model: cfg.model })),
  putAfterEvaluation: tryCode(() => reusePrompts(seq, { putAfterEvaluation: 'yes' })),
  minRestoreTokens: tryCode(() => reusePrompts(seq, { minRestoreTokens: -1 })),
  unknown: tryCode(() => reusePrompts(seq, { pth: cfg.storePath })),
  notObject: tryCode(() => reusePrompts(seq, 'fast')),
  notSequence: tryCode(() => reusePrompts(context, {})),
  own: ownMethods(seq),
}

const onErrorCodes = []
const reuse = reusePrompts(seq, { path: cfg.storePath, blockTokens: 16, onError: (e) => onErrorCodes.push(e.code) })
out.double = tryCode(() => reusePrompts(seq, { path: cfg.storePath }))
out.ownWhileAttached = ownMethods(seq)

// a chat turn stores the conversation
const session = new LlamaChatSession({ contextSequence: seq, systemPrompt: 'the red house' })
await session.prompt('the cat sat on the mat', { maxTokens: 4 })
const held = seq.contextTokens
out.turn1 = { tokens: held.length, lastPut: reuse.lastPut }
const next = [...held, ...model.tokenize(' and the dog ran to the sea', false)]

// each evaluation method, from an empty sequence: restores the stored prefix, outputs as cold
async function fresh() {
  await seq.clearHistory()
  await cold.clearHistory()
}
const firstOf = async (it) => {
  const r = await it.next()
  await it.return()
  return r.value
}
out.methods = {}
await fresh()
{
  const warm = await firstOf(seq.evaluate(next, { temperature: 0 }))
  const c = await firstOf(cold.evaluate(next, { temperature: 0 }))
  out.methods.evaluate = { warm, cold: c, lastRestore: reuse.lastRestore, meterWarm: seq.tokenMeter.usedInputTokens, meterCold: cold.tokenMeter.usedInputTokens, held: seq.contextTokens.length }
}
await fresh()
{
  const warm = await firstOf(seq.evaluateWithMetadata(next, { confidence: true }, { temperature: 0 }))
  const c = await firstOf(cold.evaluateWithMetadata(next, { confidence: true }, { temperature: 0 }))
  out.methods.evaluateWithMetadata = { warm, cold: c, lastRestore: reuse.lastRestore }
}
await fresh()
{
  const input = [...next.slice(0, -1), [next.at(-1), { generateNext: { token: true, probabilities: true } }]]
  const indices = []
  const warm = await seq.controlledEvaluate(input, { onTokenResult: (i) => indices.push(i) })
  const c = await cold.controlledEvaluate(input)
  const pick = (r) => ({ length: r.length, at: r.findIndex((x) => x !== undefined), token: r.at(-1)?.next?.token, probs: r.at(-1)?.next?.probabilities ? [...r.at(-1).next.probabilities].slice(0, 5) : null })
  out.methods.controlledEvaluate = { warm: pick(warm), cold: pick(c), indices, inputLength: input.length, lastRestore: reuse.lastRestore }
}
await fresh()
{
  await seq.evaluateWithoutGeneratingNewTokens(next)
  await cold.evaluateWithoutGeneratingNewTokens(next)
  out.methods.evaluateWithoutGeneratingNewTokens = { lastRestore: reuse.lastRestore, held: seq.contextTokens.length, expected: next.length }
}
out.filesAfterMethods = filesUnder(cfg.tmp)

// a context with node-llama-cpp's default flash attention ('auto': llama.cpp decides, here on)
// restores from a store filled by contexts without it: the V layout is found by trying
{
  const autoOptions = { ...ctxOptions }
  delete autoOptions.flashAttention
  const autoContext = await model.createContext(autoOptions)
  const autoCold = await model.createContext(autoOptions)
  const s = autoContext.getSequence()
  const c = autoCold.getSequence()
  const r = reusePrompts(s, { path: cfg.storePath, blockTokens: 16 })
  const input = [...next.slice(0, -1), [next.at(-1), { generateNext: { token: true, probabilities: true } }]]
  const warm = (await s.controlledEvaluate(input)).at(-1).next
  const coldOut = (await c.controlledEvaluate(input)).at(-1).next
  out.flashAuto = {
    contextFlashAttention: autoContext.flashAttention,
    lastRestore: r.lastRestore,
    lastError: errorInfo(r.lastError),
    warm: { token: warm.token, probs: [...warm.probabilities].slice(0, 5) },
    cold: { token: coldOut.token, probs: [...coldOut.probabilities].slice(0, 5) },
  }
  await r.close()
  await autoContext.dispose()
  await autoCold.dispose()
}

// a thrown evaluation (an invalid token id) after a restore: the error reaches the app as the
// peer threw it, and no file stays behind
await fresh()
try {
  await seq.evaluateWithoutGeneratingNewTokens([...held, 10 ** 7])
  out.thrown = { error: null }
} catch (e) {
  out.thrown = { error: errorInfo(e), lastRestore: reuse.lastRestore, files: filesUnder(cfg.tmp) }
}

// an aborted turn: the app's AbortError, no file behind
await fresh()
{
  const ac = new AbortController()
  try {
    await session.prompt('the bird flew', { maxTokens: 8, signal: ac.signal, onToken: () => ac.abort(new Error('stop here')) })
    out.aborted = { error: null }
  } catch (e) {
    out.aborted = { error: errorInfo(e), files: filesUnder(cfg.tmp) }
  }
}

// the store fails (its folder replaced by a file): the turn still completes, cold, and the
// failure is reported in lastError and onError
fs.rmSync(cfg.storePath, { recursive: true, force: true })
fs.writeFileSync(cfg.storePath, 'not a folder')
await fresh()
{
  const before = onErrorCodes.length
  let response = null
  let error = null
  try {
    response = await session.prompt('the sun came out', { maxTokens: 4 })
  } catch (e) {
    error = errorInfo(e)
  }
  out.storeFailure = { response, error, lastError: errorInfo(reuse.lastError), onError: onErrorCodes.slice(before), files: filesUnder(cfg.tmp) }
}

// close: the sequence's methods are its own again, the private folder is gone, and further
// evaluations do not touch the adapter
const scratchBeforeClose = listTree(cfg.tmp)
await reuse.close()
const restoreAtClose = reuse.lastRestore
await seq.clearHistory()
await seq.evaluateWithoutGeneratingNewTokens(next)
out.close = {
  scratchBeforeClose,
  scratchAfterClose: listTree(cfg.tmp),
  own: ownMethods(seq),
  closed: reuse.closed,
  untouched: reuse.lastRestore === restoreAtClose,
  held: seq.contextTokens.length,
  again: errorInfo(await reuse.close().then(() => null, (e) => e)),
}
await context.dispose()
await coldContext.dispose()
await model.dispose()
await llama.dispose()
console.log('@@RESULT ' + JSON.stringify(out))

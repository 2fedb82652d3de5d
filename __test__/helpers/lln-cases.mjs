// Cases of `llama-kv-cache/llama.node` with a real @fugood/llama.node context, for
// adapter-llama-node.spec.mjs. Run in a child process whose TMPDIR is a fresh folder.
//
//   node __test__/helpers/lln-cases.mjs <case> '<json>'
//     refuse       { model, wrong: [path, ...] }   reusePrompts with each wrong modelPath
//     failed-turn  { model, store }                a turn, a turn the peer fails, an aborted turn, a turn
//     concurrent   { model, store, prompts: [p1, p2], pair: [q1, q2] }
//                  p1 and p2 at once on one adapter; q1 and q2 at once on two contexts, one adapter
//                  each, over one store; then each prompt cold in a fresh context
//
// Prints `@@RESULT <json>`.
import fs from 'node:fs'
import os from 'node:os'
import path from 'node:path'
import { createRequire } from 'node:module'
import { fileURLToPath } from 'node:url'
import { listTree } from './tree.mjs'

const HERE = path.dirname(fileURLToPath(import.meta.url))
const ROOT = path.resolve(HERE, '..', '..')
const requireInterop = createRequire(path.join(ROOT, 'interop', 'package.json'))
const require = createRequire(import.meta.url)
const { reusePrompts } = require('../../adapters/llama.node.js')
const { loadModel } = requireInterop('@fugood/llama.node')

const [kase, json] = process.argv.slice(2)
const spec = JSON.parse(json)
const MODELS = path.join(ROOT, 'interop', 'models')
const model = path.join(MODELS, spec.model)
const ctxOptions = {
  model, n_ctx: 256, n_batch: 256, n_gpu_layers: 0, n_threads: 2, n_parallel: 1,
  flash_attn_type: 'off', cache_type_k: 'f16', cache_type_v: 'f16', ctx_shift: false,
}
const GREEDY = { temperature: 0, top_k: 1, seed: 42, n_probs: 1 }
const errorOf = (e) => (e ? { code: e.code ?? null, name: e.name, message: e.message, field: e.field, cause: e.cause ? String(e.cause.message ?? e.cause) : undefined } : null)
const summary = (r) => ({ text: r.text, pieces: (r.completion_probabilities ?? []).map((p) => p.content), prompt_n: r.timings?.prompt_n })


const out = { case: kase, recovered: [] }

/**
 * A completion through a fresh adapter; llama.node 1.7.15 can leave a context marked busy
 * ("Another completion is in progress", ERR_KV_BUSY): that is its bug, not the adapter's, and
 * the recovery is what an app does: a new context, whose new adapter restores the conversation
 * from the store.
 */
async function withRecovery(state, prompt) {
  try {
    return await state.reuse.completion({ prompt, n_predict: 4, ...GREEDY })
  } catch (e) {
    if (e?.code !== 'ERR_KV_BUSY') throw e
    out.recovered.push(e.message)
    state.context = await loadModel(ctxOptions)
    state.reuse = reusePrompts(state.context, { modelPath: model, path: spec.store, blockTokens: 16 })
    return await state.reuse.completion({ prompt, n_predict: 4, ...GREEDY })
  }
}

if (kase === 'refuse') {
  const ctx = await loadModel(ctxOptions)
  out.refused = []
  for (const wrong of spec.wrong) {
    try {
      reusePrompts(ctx, { modelPath: wrong, blockTokens: 16 })
      out.refused.push({ wrong, error: null })
    } catch (e) {
      out.refused.push({ wrong, error: errorOf(e) })
    }
  }
  const right = reusePrompts(ctx, { modelPath: model, blockTokens: 16 })
  const r = await right.completion({ prompt: 'the cat sat on the mat', n_predict: 2, ...GREEDY })
  out.right = { ...summary(r), lastError: errorOf(right.lastError), checkpoint: right.lastCheckpoint }
  await right.close()
} else if (kase === 'failed-turn') {
  const ctx = await loadModel(ctxOptions)
  const reuse = reusePrompts(ctx, { modelPath: model, path: spec.store, blockTokens: 16 })
  const P1 = 'the cat sat on the mat and the dog ran to the red house by the sea'
  const r1 = await reuse.completion({ prompt: P1, n_predict: 4, ...GREEDY })
  out.turn1 = { ...summary(r1), restore: reuse.lastRestore, tmp: listTree(os.tmpdir()) }
  // the peer fails the turn (media without a projector): after a restore of turn 1 was possible
  try {
    await reuse.completion({ prompt: `${P1} and then`, media_paths: ['/nonexistent/image.png'], n_predict: 4, ...GREEDY })
    out.failed = { error: null }
  } catch (e) {
    out.failed = { error: errorOf(e), tmp: listTree(os.tmpdir()) }
  }
  // an abort once the completion produces its first token: the state is still checkpointed
  const ac = new AbortController()
  try {
    await reuse.completion({ prompt: `${P1} but the bird`, n_predict: 8, ...GREEDY, signal: ac.signal }, () => ac.abort())
    out.aborted = { error: null }
  } catch (e) {
    out.aborted = { error: errorOf(e), checkpoint: reuse.lastCheckpoint, tmp: listTree(os.tmpdir()) }
  }
  // the adapter still works: a diverging prompt (a restore of turn 1 from the store, or the
  // context's own prefix) continues as a cold run of it would. llama.node 1.7.15 may leave the
  // context marked busy after the failed or aborted completion: then, as an app would, a new
  // context with a new adapter (the old one closed) restores from the store
  const P4 = `${P1} and it rained all day`
  const state = { context: ctx, reuse }
  const r4 = await withRecovery(state, P4)
  if (state.reuse !== reuse) await reuse.close()
  const last = state.reuse
  out.after = { ...summary(r4), restore: { ...last.lastRestore, error: errorOf(last.lastRestore.error) } }
  out.beforeClose = listTree(os.tmpdir())
  await last.close()
  out.afterClose = listTree(os.tmpdir())
  try {
    await last.completion({ prompt: P4 })
    out.afterCloseCall = null
  } catch (e) {
    out.afterCloseCall = errorOf(e)
  }
  const cold = await loadModel(ctxOptions)
  out.cold = summary(await cold.completion({ prompt: P4, n_predict: 4, ...GREEDY }))
} else if (kase === 'concurrent') {
  // two completions at once on one adapter: its queue runs them one after the other
  const one = { context: await loadModel(ctxOptions) }
  one.reuse = reusePrompts(one.context, { modelPath: model, path: spec.store, blockTokens: 16 })
  let inFlight = 0
  let maxInFlight = 0
  const completion = one.context.completion.bind(one.context)
  one.context.completion = async (...args) => {
    maxInFlight = Math.max(maxInFlight, ++inFlight)
    try {
      return await completion(...args)
    } finally {
      inFlight--
    }
  }
  const [a, b] = await Promise.all(spec.prompts.map((p) => withRecovery(one, p)))
  out.queued = { results: [summary(a), summary(b)], maxInFlight, lastRestore: one.reuse.lastRestore }
  await one.reuse.close()
  // two contexts, an adapter each, over one store path, at once
  const states = []
  for (let i = 0; i < 2; i++) {
    const s = { context: await loadModel(ctxOptions) }
    s.reuse = reusePrompts(s.context, { modelPath: model, path: spec.store, blockTokens: 16 })
    states.push(s)
  }
  const pair = await Promise.all(spec.pair.map((p, i) => withRecovery(states[i], p)))
  out.pair = pair.map((r, i) => ({ ...summary(r), restore: states[i].reuse.lastRestore, error: errorOf(states[i].reuse.lastError) }))
  for (const s of states) await s.reuse.close()
  out.cold = []
  for (const p of [...spec.prompts, ...spec.pair]) {
    const ctx = await loadModel(ctxOptions)
    out.cold.push(summary(await ctx.completion({ prompt: p, n_predict: 4, ...GREEDY })))
  }
  out.tmp = listTree(os.tmpdir())
} else {
  console.error(`unknown case ${kase}`)
  process.exit(2)
}
console.log('@@RESULT ' + JSON.stringify(out))
process.exit(0)

// One process of a conversation with @fugood/llama.node, for adapter-llama-node.spec.mjs: a turn
// through `llama-kv-cache/llama.node` (a process per turn stands for a restarted app), or cold
// runs of prompts in fresh contexts without the adapter.
//
//   node __test__/helpers/lln-chat.mjs '<json>'
//     { model: 'llama-h32.gguf',          // under interop/models
//       ctx: { ... },                     // loadModel overrides (flash_attn_type, cache_type_k, ...)
//       turn: { prompt | prompts: [...], store, storeOptions?, n_predict? }
//                                         // turns through the adapter, on one context
//       cold: [prompt, ...], n_predict? } // or: each prompt cold, in a fresh context
//   A prompt that is an array is chat messages (completion's `messages`).
//
// Prints `@@RESULT <json>`: per completion its text, pieces (greedy, n_probs 1), the peer's
// prompt_n and the tokens the context holds after it; for turns (`turns: [...]`) also the
// adapter's lastRestore / lastCheckpoint / lastError and what this process's TMPDIR (where the
// adapter's private folder goes) held after each turn and after close(); `recovered` lists the
// times llama.node left the context busy and a new context took over.
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
const { inspectState } = require('../../index.js')
const { reusePrompts } = require('../../adapters/llama.node.js')
const { loadModel } = requireInterop('@fugood/llama.node')

const spec = JSON.parse(process.argv[2])
const model = path.join(ROOT, 'interop', 'models', spec.model)
const ctxOptions = {
  model, n_ctx: 256, n_batch: 256, n_gpu_layers: 0, n_threads: 2, n_parallel: 1,
  flash_attn_type: 'off', cache_type_k: 'f16', cache_type_v: 'f16', ctx_shift: false, ...spec.ctx,
}
const GREEDY = { temperature: 0, top_k: 1, seed: 42, n_probs: 1 }
const nPredict = spec.n_predict ?? spec.turn?.n_predict ?? 4
/** A prompt, or chat messages (an array), as completion options. */
const input = (p) => (Array.isArray(p) ? { messages: p } : { prompt: p })
const errorOf = (e) => (e ? { code: e.code ?? null, message: e.message } : null)


/** The tokens a context holds: those of its saved session. */
async function heldTokens(ctx) {
  const file = path.join(fs.mkdtempSync(path.join(os.tmpdir(), 'lln-held-')), 's.ggsn')
  await ctx.saveSession(file)
  const tokens = inspectState(file).tokens
  fs.rmSync(path.dirname(file), { recursive: true, force: true })
  return tokens
}

const summary = (r) => ({
  text: r.text,
  pieces: (r.completion_probabilities ?? []).map((p) => p.content),
  prompt_n: r.timings?.prompt_n,
  interrupted: r.interrupted,
})

const out = { model: spec.model }
if (spec.turn) {
  const { store, storeOptions } = spec.turn
  const prompts = spec.turn.prompts ?? [spec.turn.prompt]
  let ctx = await loadModel(ctxOptions)
  let reuse = reusePrompts(ctx, { modelPath: model, path: store, blockTokens: 16, ...storeOptions })
  out.turns = []
  out.recovered = []
  for (const prompt of prompts) {
    const t0 = performance.now()
    let r
    try {
      r = await reuse.completion({ ...input(prompt), n_predict: nPredict, ...GREEDY })
    } catch (e) {
      if (e?.code !== 'ERR_KV_BUSY') throw e
      // llama.node 1.7.15 can leave a context marked busy (its bug): a new context, whose new
      // adapter restores the conversation's last turn from the store
      out.recovered.push(e.message)
      await reuse.close()
      ctx = await loadModel(ctxOptions)
      reuse = reusePrompts(ctx, { modelPath: model, path: store, blockTokens: 16, ...storeOptions })
      r = await reuse.completion({ ...input(prompt), n_predict: nPredict, ...GREEDY })
    }
    out.turns.push({
      turnMs: performance.now() - t0,
      ...summary(r),
      contextTokens: reuse.contextTokens,
      lastRestore: { ...reuse.lastRestore, error: errorOf(reuse.lastRestore.error) },
      lastCheckpoint: reuse.lastCheckpoint,
      lastError: errorOf(reuse.lastError),
      tmpAfterTurn: listTree(os.tmpdir()),
    })
  }
  await reuse.close()
  out.tmpAfterClose = listTree(os.tmpdir())
} else {
  out.cold = []
  for (const prompt of spec.cold) {
    // a fresh context per prompt: nothing of an earlier run is reused
    const ctx = await loadModel(ctxOptions)
    const r = await ctx.completion({ ...input(prompt), n_predict: nPredict, ...GREEDY })
    out.cold.push({ ...summary(r), contextTokens: await heldTokens(ctx) })
  }
}
// no ctx.release(): llama.node 1.7.15 sometimes crashes in it (see interop/continue.mjs)
console.log('@@RESULT ' + JSON.stringify(out))
process.exit(0)

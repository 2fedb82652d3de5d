// llama.node runs with context shifting, for the K-shift fixtures and spec (one child process per call).
//
//   node interop/kshift-peer.mjs '<json>'
//
//   json: { model: 'llama-h16.gguf',
//           ctx:  { n_ctx, flash_attn_type, cache_type_k, cache_type_v, ctx_shift },   // loadModel options
//           runs: [ { prompt, n_predict, n_keep?, load?: file, save?: file }, ... ] }
//
// Every run gets a fresh context: `load` → ctx.loadSession(file) first; then ctx.completion({prompt, n_predict,
// greedy}); then `save` → ctx.saveSession(file) (llama_state_save_file(ctx, file, completion->embd)).
// Prints one line `@@RESULT {"runs":[{tokens, pieces, prompt_n, truncated, context_full, tokens_evaluated, ...}]}`
// and exits 0; a run's error is reported in that run (exit 0). The contexts are never released: llama.node 1.7.15
// segfaults in ~1 of 10 releases (see interop/README.md). Callers retry a run that dies by a signal.
import path from 'node:path'
import fs from 'node:fs'
import { MODELS, tokenIdOfPiece } from './lib.mjs'

const opts = JSON.parse(process.argv[2] ?? '{}')
const model = path.join(MODELS, opts.model ?? 'llama-h16.gguf')
if (!fs.existsSync(model)) {
  console.error(`${model} missing: run python3 interop/make_models.py`)
  process.exit(2)
}
const { loadModel } = await import('@fugood/llama.node')
const c = opts.ctx ?? {}
const ctxOptions = {
  model,
  n_ctx: c.n_ctx ?? 32,
  n_batch: c.n_batch ?? 256,
  n_gpu_layers: 0,
  n_threads: 2,
  n_parallel: 1,
  flash_attn_type: c.flash_attn_type ?? 'off',
  cache_type_k: c.cache_type_k ?? 'f16',
  cache_type_v: c.cache_type_v ?? 'f16',
  ctx_shift: c.ctx_shift ?? true,
}
const GREEDY = { temperature: 0, top_k: 1, seed: 42 }

const runs = []
for (const o of opts.runs ?? []) {
  const run = { load: o.load, save: o.save }
  try {
    const ctx = await loadModel(ctxOptions)
    run.prompt_tokens = Array.from((await ctx.tokenize(o.prompt)).tokens)
    if (o.load) await ctx.loadSession(o.load)
    const r = await ctx.completion({
      prompt: o.prompt,
      n_predict: o.n_predict,
      n_probs: 1,
      ...(o.n_keep === undefined ? {} : { n_keep: o.n_keep }),
      ...GREEDY,
    })
    // token ids from completion_probabilities (the streaming callback can arrive after the promise resolves)
    const pieces = (r.completion_probabilities ?? []).map((p) => p.content)
    Object.assign(run, {
      tokens: pieces.map(tokenIdOfPiece),
      pieces,
      prompt_n: r.timings?.prompt_n,
      tokens_evaluated: r.tokens_evaluated,
      tokens_predicted: r.tokens_predicted,
      truncated: r.truncated,
      context_full: r.context_full,
    })
    if (o.save) await ctx.saveSession(o.save)
  } catch (e) {
    run.error = String(e?.message ?? e)
  }
  runs.push(run)
}
console.log('@@RESULT ' + JSON.stringify({ ctx: { ...ctxOptions, model: path.basename(model) }, runs }))
process.exit(0)

// Fixtures from @fugood/llama.node:
//   ctx.saveSession(path)                       -> llama_state_save_file      ('ggsn')
//   parallel completion with save_state_path    -> llama_state_seq_save_file  ('ggsq', rnllama slot save_state)
// Run: node interop/fixtures-llama-node.mjs   (after make_models.py and npm ci in interop/)
import { loadModel, BuildInfo } from '@fugood/llama.node'
import path from 'node:path'
import fs from 'node:fs'
import { FIXTURES, N_CTX, PROMPT, modelPath, pkgVersion, tokenIdOfPiece, sha256, writeFixture } from './lib.mjs'

const SESSIONS = [
  { name: 'ln-h16-f16.ggsn', model: 'llama-h16.gguf', fa: 'off', k: 'f16', v: 'f16' },
  { name: 'ln-h16-f32.ggsn', model: 'llama-h16.gguf', fa: 'off', k: 'f32', v: 'f32' },
  { name: 'ln-h16-f16-fa.ggsn', model: 'llama-h16.gguf', fa: 'on', k: 'f16', v: 'f16' },
  { name: 'ln-h32-f16.ggsn', model: 'llama-h32.gguf', fa: 'off', k: 'f16', v: 'f16' },
  { name: 'ln-h32-q8_0-fa.ggsn', model: 'llama-h32.gguf', fa: 'on', k: 'q8_0', v: 'q8_0' },
  { name: 'ln-h32-q4_0-fa.ggsn', model: 'llama-h32.gguf', fa: 'on', k: 'q4_0', v: 'q4_0' },
  { name: 'ln-mamba.ggsn', model: 'mamba.gguf', fa: 'off', k: 'f16', v: 'f16', recurrent: true },
]
const PARALLEL = [
  { name: 'ln-h16-f16-par2.ggsq', model: 'llama-h16.gguf', fa: 'off', k: 'f16', v: 'f16', n_parallel: 2 },
  { name: 'ln-h16-f16-par2-unified.ggsq', model: 'llama-h16.gguf', fa: 'off', k: 'f16', v: 'f16', n_parallel: 2, kv_unified: true },
  { name: 'ln-h32-q8_0-fa-par2.ggsq', model: 'llama-h32.gguf', fa: 'on', k: 'q8_0', v: 'q8_0', n_parallel: 2 },
  { name: 'ln-mamba-par2.ggsq', model: 'mamba.gguf', fa: 'off', k: 'f16', v: 'f16', n_parallel: 2, recurrent: true },
]

function ctxOptions(cfg) {
  const o = {
    model: modelPath(cfg.model),
    n_ctx: N_CTX,
    n_batch: N_CTX,
    n_gpu_layers: 0,
    n_threads: 2,
    n_parallel: cfg.n_parallel ?? 1,
    flash_attn_type: cfg.fa,
    cache_type_k: cfg.k,
    cache_type_v: cfg.v,
    ctx_shift: false,
  }
  if (cfg.kv_unified !== undefined) o.kv_unified = cfg.kv_unified
  return o
}
const GREEDY = { temperature: 0, top_k: 1, seed: 42 }

const common = (cfg) => ({
  peer: '@fugood/llama.node',
  peer_version: pkgVersion('@fugood/llama.node'),
  binary_package: `@fugood/node-llama-linux-x64@${pkgVersion('@fugood/node-llama-linux-x64')}`,
  llama_cpp: `b${BuildInfo.number} (${BuildInfo.commit})`,
  model: cfg.model,
  model_sha256: sha256(modelPath(cfg.model)),
  recurrent: !!cfg.recurrent,
  n_ctx: N_CTX,
  n_seq_max: cfg.n_parallel ?? 1,
  kv_unified: cfg.kv_unified ?? null,
  kv_type_k: cfg.k,
  kv_type_v: cfg.v,
  flash_attn: cfg.fa,
  prompt: PROMPT,
})

async function complete(ctx, nPredict, extra = {}) {
  // token ids from the result's completion_probabilities (the streaming callback can arrive after the promise resolves)
  const r = await ctx.completion({ prompt: PROMPT, n_predict: nPredict, n_probs: 1, ...GREEDY, ...extra })
  const pieces = (r.completion_probabilities ?? []).map((p) => p.content)
  return { ids: pieces.map(tokenIdOfPiece), pieces, prompt_n: r.timings?.prompt_n, tokens_evaluated: r.tokens_evaluated }
}

fs.mkdirSync(FIXTURES, { recursive: true })
for (const cfg of SESSIONS) {
  const file = path.join(FIXTURES, cfg.name)
  const ctx = await loadModel(ctxOptions(cfg))
  const promptTokens = Array.from((await ctx.tokenize(PROMPT)).tokens)
  const first = await complete(ctx, 1) // decodes the prompt, samples one token (not decoded)
  await ctx.saveSession(file)
  await ctx.release()

  const ref = await loadModel(ctxOptions(cfg))
  const two = await complete(ref, 2) // same prompt, two tokens: [next, then]
  await ref.release()

  const verify = {}
  try {
    const v = await loadModel(ctxOptions(cfg))
    await v.loadSession(file)
    const r = await complete(v, 2)
    Object.assign(verify, { tokens: r.ids, prompt_n: r.prompt_n, ok: r.ids.join() === two.ids.join() })
    await v.release()
  } catch (e) {
    Object.assign(verify, { ok: false, error: String(e.message ?? e) })
  }
  writeFixture(cfg.name, {
    ...common(cfg),
    prompt_tokens: promptTokens,
    generated_tokens: [],
    next_token: { id: first.ids[0], piece: first.pieces[0] },
    then_token: { id: two.ids[1], piece: two.pieces[1], note: 'second greedy token of a fresh run with n_predict 2' },
    api: [
      `loadModel(${JSON.stringify({ ...ctxOptions(cfg), model: cfg.model })})`,
      `ctx.completion({prompt, n_predict:1, temperature:0, top_k:1}) // prompt decoded, 1 token sampled (not decoded)`,
      'ctx.saveSession(file)  // llama_state_save_file(ctx, file, completion->embd)',
      'verify: fresh context, ctx.loadSession(file), ctx.completion({prompt, n_predict:2}) == fresh run (prompt_n = tokens it had to evaluate)',
    ],
    verify,
  })
}

async function parallelRun(cfg, nPredict, extra) {
  const ctx = await loadModel(ctxOptions(cfg))
  if (!(await ctx.parallel.enable({ n_parallel: cfg.n_parallel, n_batch: N_CTX }))) throw new Error('enable parallel failed')
  const pieces = []
  const { promise } = await ctx.parallel.completion(
    { prompt: PROMPT, n_predict: nPredict, ...GREEDY, ...extra },
    (_id, t) => pieces.push(t.token),
  )
  const r = await promise
  ctx.parallel.disable()
  await ctx.release()
  return { ids: pieces.map(tokenIdOfPiece), pieces, timings: r.timings }
}

let promptNoBos
{
  const c = await loadModel(ctxOptions(SESSIONS[0]))
  promptNoBos = Array.from((await c.tokenize(PROMPT)).tokens).filter((t, i) => !(i === 0 && t === 1))
  await c.release()
}
for (const cfg of PARALLEL) {
  const file = path.join(FIXTURES, cfg.name)
  try {
    const first = await parallelRun(cfg, 1, { save_state_path: file })
    const two = await parallelRun(cfg, 2, {})
    const verify = {}
    try {
      const r = await parallelRun(cfg, 2, { load_state_path: file })
      Object.assign(verify, { tokens: r.ids, cache_n: r.timings?.cache_n, prompt_n: r.timings?.prompt_n, ok: r.ids.join() === two.ids.join() })
    } catch (e) {
      Object.assign(verify, { ok: false, error: String(e.message ?? e) })
    }
    writeFixture(cfg.name, {
      ...common(cfg),
      prompt_tokens: promptNoBos,
      prompt_note: 'parallel slots tokenize the prompt WITHOUT BOS: cell positions start at 0 with the first word; for attention models the file token list omits the last prompt token although its cell is saved',
      generated_tokens: [],
      next_token: { id: first.ids[0], piece: first.pieces[0] },
      then_token: { id: two.ids[1], piece: two.pieces[1], note: 'second greedy token of a fresh parallel run with n_predict 2' },
      api: [
        `loadModel(${JSON.stringify({ ...ctxOptions(cfg), model: cfg.model })})`,
        `ctx.parallel.enable({n_parallel:${cfg.n_parallel}, n_batch:${N_CTX}})`,
        `ctx.parallel.completion({prompt, n_predict:1, temperature:0, top_k:1, save_state_path:file}) // rnllama slot -> llama_state_seq_save_file(ctx, file, slot seq id, ...)`,
        'verify: fresh context, parallel completion({prompt, n_predict:2, load_state_path:file}) == fresh run',
      ],
      verify,
    })
  } catch (e) {
    console.log(`FAILED ${cfg.name}: ${e.message ?? e}`)
  }
}

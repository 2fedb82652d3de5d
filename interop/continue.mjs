// Continue a saved KV state with a real llama.cpp peer and report the greedy tokens that follow.
//
//   node interop/continue.mjs <peer> <model> <state-file> '<json options>'
//
//   peer        llama-node | node-llama-cpp
//   model       file name under interop/models/ (llama-h16.gguf, llama-h32.gguf, mamba.gguf) or a path
//   state-file  the file to load; '-' loads nothing (control run)
//   options     JSON (all optional):
//     common:          { also: [file | '-' | { file, ...overrides }, ...] }  more runs in this process, each with
//                      the options above merged with its overrides (e.g. another prompt or seqIndex)
//     llama-node:      { mode: 'session' | 'parallel',            // ctx.loadSession(file) | parallel load_state_path
//                        ctx: { n_parallel, flash_attn_type, cache_type_k, cache_type_v, kv_unified },
//                        prompt: 'text', n_predict: 2 }
//     node-llama-cpp:  { ctx: { sequences, flashAttention, k: 'F16', v: 'F16' }, seqIndex: 0,
//                        evaluate: [token ids], n: 1 }
//
// Prints one line `@@RESULT <json>`: { peer, model, runs: [{ file, tokens, ... }] } and exits 0. A peer that
// refuses a file is reported in that run's `error` (exit 0): the caller decides. Anything else exits 1.
// The peers print logs of their own; only the @@RESULT line is meant to be parsed.
// @fugood/llama.node 1.7.15 segfaults now and then (SIGSEGV inside the addon): callers retry on a signal.
import path from 'node:path'
import fs from 'node:fs'
import { MODELS, N_CTX, tokenIdOfPiece } from './lib.mjs'

const [peer, modelArg, stateFile, json] = process.argv.slice(2)
if (!peer || !modelArg || !stateFile) {
  console.error("usage: node interop/continue.mjs <llama-node|node-llama-cpp> <model> <state-file|-> ['<json options>']")
  process.exit(2)
}
const opts = json ? JSON.parse(json) : {}
const model = fs.existsSync(modelArg) ? path.resolve(modelArg) : path.join(MODELS, modelArg)
if (!fs.existsSync(model)) {
  console.error(`${model} missing: run python interop/make_models.py`)
  process.exit(2)
}
const runSpecs = [stateFile, ...(opts.also ?? [])].map((a) => {
  const { also: _, ...base } = opts
  return typeof a === 'string' ? { ...base, file: a } : { ...base, ...a }
})
const errText = (e) => String(e?.message ?? e)

async function llamaNode() {
  const { loadModel } = await import('@fugood/llama.node')
  const runs = []
  for (const o of runSpecs) runs.push(await llamaNodeRun(loadModel, o))
  return runs
}

async function llamaNodeRun(loadModel, o) {
  const c = o.ctx ?? {}
  const file = o.file
  const ctxOptions = {
    model,
    n_ctx: N_CTX,
    n_batch: N_CTX,
    n_gpu_layers: 0,
    n_threads: 2,
    n_parallel: c.n_parallel ?? 1,
    flash_attn_type: c.flash_attn_type ?? 'off',
    cache_type_k: c.cache_type_k ?? 'f16',
    cache_type_v: c.cache_type_v ?? 'f16',
    ctx_shift: false,
    ...(c.kv_unified === undefined ? {} : { kv_unified: c.kv_unified }),
  }
  const prompt = o.prompt ?? 'the cat sat on the mat'
  const nPredict = o.n_predict ?? 2
  const greedy = { temperature: 0, top_k: 1, seed: 42 }
  const run = { file, mode: o.mode ?? 'session' }
  // a fresh context per run: nothing from an earlier run can leak into this one
  const ctx = await loadModel(ctxOptions)
  try {
    run.prompt_tokens = Array.from((await ctx.tokenize(prompt)).tokens)
    if (run.mode === 'session') {
      // llama_state_load_file; the completion then reuses the common prefix of the file's tokens and the prompt
      if (file !== '-') await ctx.loadSession(file)
      // token ids from completion_probabilities (the streaming callback can arrive after the promise resolves)
      const r = await ctx.completion({ prompt, n_predict: nPredict, n_probs: 1, ...greedy })
      const pieces = (r.completion_probabilities ?? []).map((p) => p.content)
      Object.assign(run, { tokens: pieces.map(tokenIdOfPiece), pieces, prompt_n: r.timings?.prompt_n })
    } else {
      // rnllama slot: llama_state_seq_load_file into the slot's sequence. A file it cannot load is NOT an
      // error here: the completion just produces no tokens (prompt_n 0).
      if (!(await ctx.parallel.enable({ n_parallel: ctxOptions.n_parallel, n_batch: N_CTX }))) throw new Error('parallel.enable failed')
      const pieces = []
      const { promise } = await ctx.parallel.completion(
        { prompt, n_predict: nPredict, ...greedy, ...(file === '-' ? {} : { load_state_path: file }) },
        (_id, t) => pieces.push(t.token),
      )
      const r = await promise
      ctx.parallel.disable()
      Object.assign(run, { tokens: pieces.map(tokenIdOfPiece), pieces, prompt_n: r.timings?.prompt_n, cache_n: r.timings?.cache_n })
    }
  } catch (e) {
    run.error = errText(e)
  }
  // No ctx.release(): llama.node 1.7.15 segfaults in roughly 1 of 10 releases (inside ~llama_context, on its
  // worker thread). The contexts are tiny; the process exits right after printing the result.
  return run
}

async function nodeLlamaCpp() {
  const { getLlama, LlamaLogLevel } = await import('node-llama-cpp')
  const llama = await getLlama({ gpu: false, build: 'never', logLevel: LlamaLogLevel.error })
  const m = await llama.loadModel({ modelPath: model, gpuLayers: 0 })
  const runs = []
  for (const o of runSpecs) {
    const c = o.ctx ?? {}
    const sequences = c.sequences ?? 1
    const seqIndex = o.seqIndex ?? 0
    const run = { file: o.file, seqIndex }
    const ctx = await m.createContext({
      contextSize: N_CTX,
      batchSize: N_CTX,
      sequences,
      threads: 2,
      flashAttention: c.flashAttention ?? false,
      experimentalKvCacheKeyType: c.k ?? 'F16',
      experimentalKvCacheValueType: c.v ?? 'F16',
    })
    try {
      const seqs = []
      for (let i = 0; i < sequences; i++) seqs.push(ctx.getSequence())
      const seq = seqs[seqIndex]
      // llama_state_seq_load_file into this sequence; contextTokens = the file's token list
      if (o.file !== '-') await seq.loadStateFromFile(o.file, { acceptRisk: true })
      run.loaded_tokens = seq.contextTokens.length
      const it = seq.evaluate(o.evaluate, { temperature: 0 })
      run.tokens = []
      for (let i = 0; i < (o.n ?? 1); i++) run.tokens.push((await it.next()).value)
      await it.return()
    } catch (e) {
      run.error = errText(e)
    }
    await ctx.dispose()
    runs.push(run)
  }
  await m.dispose()
  await llama.dispose()
  return runs
}

let runs
if (peer === 'llama-node') runs = await llamaNode()
else if (peer === 'node-llama-cpp') runs = await nodeLlamaCpp()
else {
  console.error(`unknown peer ${peer}`)
  process.exit(2)
}
console.log('@@RESULT ' + JSON.stringify({ peer, model: path.basename(model), runs }))
process.exit(0)

// Save conversations with a real llama.cpp peer, for the prompt store's interop tests.
//
//   node interop/store-peer.mjs <peer> <model> '<json [{ prompt | tokens, out? }, ...]>'
//
//   llama-node       evaluates `prompt` (ctx.completion, n_predict 1, greedy) and saves the context with
//                    ctx.saveSession(out) ('ggsn', llama_state_save_file)
//   node-llama-cpp   evaluates [bos, ...tokenize(prompt)] (or `tokens` as given) without generating and, with
//                    `out`, saves the sequence with seq.saveStateToFile(out) ('ggsq', llama_state_seq_save_file)
//
// Prints `@@RESULT { peer, model, runs: [{ out, tokens }] }`: `tokens` are the ids the peer evaluated (for
// node-llama-cpp; llama.node's are in the saved file's header). Flash attention off, f16 K/V, as the peers'
// defaults.
import path from 'node:path'
import fs from 'node:fs'
import { MODELS, N_CTX } from './lib.mjs'

const [peer, modelArg, json] = process.argv.slice(2)
const model = fs.existsSync(modelArg) ? path.resolve(modelArg) : path.join(MODELS, modelArg)
const specs = JSON.parse(json)
const runs = []

if (peer === 'llama-node') {
  const { loadModel } = await import('@fugood/llama.node')
  for (const s of specs) {
    const ctx = await loadModel({
      model, n_ctx: N_CTX, n_batch: N_CTX, n_gpu_layers: 0, n_threads: 2, n_parallel: 1,
      flash_attn_type: 'off', cache_type_k: 'f16', cache_type_v: 'f16', ctx_shift: false,
    })
    await ctx.completion({ prompt: s.prompt, n_predict: 1, temperature: 0, top_k: 1, seed: 42 })
    await ctx.saveSession(s.out)
    // no release: see continue.mjs (llama.node 1.7.15 sometimes crashes in it)
    runs.push({ out: s.out })
  }
} else if (peer === 'node-llama-cpp') {
  const { getLlama, LlamaLogLevel } = await import('node-llama-cpp')
  const llama = await getLlama({ gpu: false, build: 'never', logLevel: LlamaLogLevel.error })
  const m = await llama.loadModel({ modelPath: model, gpuLayers: 0 })
  for (const s of specs) {
    const tokens = s.tokens ?? [m.tokens.bos, ...m.tokenize(s.prompt, false)]
    if (s.out) {
      const ctx = await m.createContext({ contextSize: N_CTX, batchSize: N_CTX, sequences: 1, threads: 2, flashAttention: false })
      const seq = ctx.getSequence()
      await seq.evaluateWithoutGeneratingNewTokens(tokens)
      await seq.saveStateToFile(s.out)
      await ctx.dispose()
    }
    runs.push({ out: s.out ?? null, tokens: Array.from(tokens) })
  }
  await m.dispose()
  await llama.dispose()
} else {
  console.error(`unknown peer ${peer}`)
  process.exit(2)
}
console.log('@@RESULT ' + JSON.stringify({ peer, model: path.basename(model), runs }))
process.exit(0)

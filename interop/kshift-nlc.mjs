// node-llama-cpp shifts a sequence's context by the ranges it is given, for the K-shift spec (a child process).
//
//   node interop/kshift-nlc.mjs '<json>'
//   json: { model: 'llama-h16.gguf', ctx: { flashAttention, k: 'F16', v: 'F16' }, prompt, generate: 24,
//           erase: [{ start, end }, ...], extra: 4, pre: file, post: file }
//
// 1. seq.evaluate([BOS, ...prompt]) greedy, `generate` tokens: the last one (`pending`) is sampled, not decoded
//    → saveStateToFile(pre) (llama_state_seq_save_file; contextTokens = the cells).
// 2. seq.eraseContextTokenRanges(erase): per range llama_memory_seq_rm at the original positions, then
//    llama_memory_seq_add for each kept run after a range, by minus the tokens erased before it (node-llama-cpp's
//    _eraseContextTokenRanges); the K-shift is pending until the next decode.
// 3. seq.evaluate([pending]) greedy: that decode applies the K-shift first; the token it samples is `after[0]`
//    → saveStateToFile(post) (the shifted cells + the cell of pending).
// 4. `extra` more greedy tokens: after[1..].
// Prints `@@RESULT {"runs":[{pre_tokens, post_tokens, pending, after, ...}]}` and exits 0.
import path from 'node:path'
import fs from 'node:fs'
import { getLlama, LlamaLogLevel } from 'node-llama-cpp'
import { MODELS } from './lib.mjs'

const o = JSON.parse(process.argv[2] ?? '{}')
const modelPath = path.join(MODELS, o.model ?? 'llama-h16.gguf')
if (!fs.existsSync(modelPath)) {
  console.error(`${modelPath} missing: run python3 interop/make_models.py`)
  process.exit(2)
}
const run = {}
const llama = await getLlama({ gpu: false, build: 'never', logLevel: LlamaLogLevel.error })
const model = await llama.loadModel({ modelPath, gpuLayers: 0 })
const c = o.ctx ?? {}
const ctx = await model.createContext({
  contextSize: 256,
  batchSize: 256,
  sequences: 1,
  threads: 2,
  flashAttention: c.flashAttention ?? false,
  experimentalKvCacheKeyType: c.k ?? 'F16',
  experimentalKvCacheValueType: c.v ?? 'F16',
})
try {
  const seq = ctx.getSequence()
  const greedy = async (tokens, n) => {
    const it = seq.evaluate(tokens, { temperature: 0 })
    const out = []
    for (let i = 0; i < n; i++) out.push((await it.next()).value)
    await it.return()
    return out
  }
  run.prompt_tokens = [model.tokens.bos, ...model.tokenize(o.prompt, false)]
  run.generated = await greedy(run.prompt_tokens, o.generate)
  run.pending = run.generated[run.generated.length - 1]
  run.pre_tokens = [...seq.contextTokens]
  await seq.saveStateToFile(o.pre)
  await seq.eraseContextTokenRanges(o.erase)
  run.shifted_tokens = [...seq.contextTokens]
  run.after = await greedy([run.pending], 1)
  run.post_tokens = [...seq.contextTokens]
  await seq.saveStateToFile(o.post)
  run.after.push(...(await greedy([run.after[0]], o.extra ?? 4)))
  run.kv = { k: ctx.kvCacheKeyType, v: ctx.kvCacheValueType, flashAttention: ctx.flashAttention, contextSize: ctx.contextSize }
} catch (e) {
  run.error = String(e?.message ?? e)
}
await ctx.dispose()
await model.dispose()
await llama.dispose()
console.log('@@RESULT ' + JSON.stringify({ runs: [run] }))
process.exit(0)

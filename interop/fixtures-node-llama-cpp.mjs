// Fixtures from node-llama-cpp (v3): LlamaContextSequence.saveStateToFile -> llama_state_seq_save_file ('ggsq').
// Run: node interop/fixtures-node-llama-cpp.mjs   (after make_models.py and npm ci in interop/)
import { getLlama, LlamaLogLevel } from 'node-llama-cpp'
import path from 'node:path'
import fs from 'node:fs'
import { FIXTURES, N_CTX, PROMPT, modelPath, pkgVersion, pieceOf, sha256, writeFixture } from './lib.mjs'

const GEN = 3 // tokens sampled; the first GEN-1 are decoded into the state, the last is next_token

const CONFIGS = [
  { name: 'nlc-h16-f16.ggsq', model: 'llama-h16.gguf', flashAttention: false, k: 'F16', v: 'F16' },
  { name: 'nlc-h16-f32.ggsq', model: 'llama-h16.gguf', flashAttention: false, k: 'F32', v: 'F32' },
  { name: 'nlc-h16-f16-fa.ggsq', model: 'llama-h16.gguf', flashAttention: true, k: 'F16', v: 'F16' },
  { name: 'nlc-h32-f16.ggsq', model: 'llama-h32.gguf', flashAttention: false, k: 'F16', v: 'F16' },
  { name: 'nlc-h32-q8_0-fa.ggsq', model: 'llama-h32.gguf', flashAttention: true, k: 'Q8_0', v: 'Q8_0' },
  { name: 'nlc-h32-q4_0-fa.ggsq', model: 'llama-h32.gguf', flashAttention: true, k: 'Q4_0', v: 'Q4_0' },
  // two sequences, kv_unified is always false in node-llama-cpp -> n_stream 2; saves sequence 1
  { name: 'nlc-h16-f16-seq1of2.ggsq', model: 'llama-h16.gguf', flashAttention: false, k: 'F16', v: 'F16', sequences: 2, seqIndex: 1 },
  { name: 'nlc-mamba.ggsq', model: 'mamba.gguf', flashAttention: false, k: 'F16', v: 'F16', recurrent: true },
]

const GGML = { 0: 'f32', 1: 'f16', 2: 'q4_0', 8: 'q8_0' }

const llama = await getLlama({ gpu: false, build: 'never', logLevel: LlamaLogLevel.error })
const models = new Map()
async function model(name) {
  if (!models.has(name)) models.set(name, await llama.loadModel({ modelPath: modelPath(name), gpuLayers: 0 }))
  return models.get(name)
}

async function makeContext(cfg) {
  const m = await model(cfg.model)
  const ctx = await m.createContext({
    contextSize: N_CTX,
    batchSize: N_CTX,
    sequences: cfg.sequences ?? 1,
    threads: 2,
    flashAttention: cfg.flashAttention,
    experimentalKvCacheKeyType: cfg.k,
    experimentalKvCacheValueType: cfg.v,
  })
  const seqs = []
  for (let i = 0; i < (cfg.sequences ?? 1); i++) seqs.push(ctx.getSequence())
  return { m, ctx, seq: seqs[cfg.seqIndex ?? 0], seqs }
}

async function firstToken(seq, tokens) {
  const it = seq.evaluate(tokens, { temperature: 0 })
  const { value } = await it.next()
  await it.return()
  return value
}

fs.mkdirSync(FIXTURES, { recursive: true })
for (const cfg of CONFIGS) {
  const { m, ctx, seq, seqs } = await makeContext(cfg)
  const promptTokens = [m.tokens.bos, ...m.tokenize(PROMPT, false)]
  if (cfg.sequences === 2) {
    // put something different into sequence 0 so the other stream is not empty
    await seqs[0].evaluateWithoutGeneratingNewTokens([m.tokens.bos, ...m.tokenize('a big red dog', false)])
  }
  const gen = []
  const it = seq.evaluate(promptTokens, { temperature: 0 })
  for (let i = 0; i < GEN; i++) gen.push((await it.next()).value)
  await it.return()
  const stateTokens = [...seq.contextTokens]
  const file = path.join(FIXTURES, cfg.name)
  const { fileSize } = await seq.saveStateToFile(file)
  const next = gen[GEN - 1]
  const then = await firstToken(seq, [next])
  const info = {
    kv_type_k: GGML[ctx.kvCacheKeyType] ?? ctx.kvCacheKeyType,
    kv_type_v: GGML[ctx.kvCacheValueType] ?? ctx.kvCacheValueType,
    flash_attn: ctx.flashAttention,
  }
  await ctx.dispose()

  // reload into a fresh context and check the continuation
  const verify = {}
  try {
    const f = await makeContext(cfg)
    await f.seq.loadStateFromFile(file, { acceptRisk: true })
    verify.loaded_tokens = f.seq.contextTokens.length
    verify.then_token = await firstToken(f.seq, [next])
    verify.ok = verify.then_token === then && verify.loaded_tokens === stateTokens.length
    await f.ctx.dispose()
    // control: the same token decoded with no state at all (if this equals then_token, the check is weak)
    const c = await makeContext(cfg)
    verify.control_no_state_token = await firstToken(c.seq, [next])
    await c.ctx.dispose()
  } catch (e) {
    verify.ok = false
    verify.error = String(e.message ?? e)
  }
  if (cfg.sequences === 2) {
    // extra observation: load sequence 1's file into sequence 0 of a fresh context
    try {
      const f = await makeContext({ ...cfg, seqIndex: 0 })
      await f.seq.loadStateFromFile(file, { acceptRisk: true })
      verify.into_seq0_then_token = await firstToken(f.seq, [next])
      verify.into_seq0_ok = verify.into_seq0_then_token === then
      await f.ctx.dispose()
    } catch (e) {
      verify.into_seq0_ok = false
      verify.into_seq0_error = String(e.message ?? e)
    }
  }

  writeFixture(cfg.name, {
    peer: 'node-llama-cpp',
    peer_version: pkgVersion('node-llama-cpp'),
    binary_package: `@node-llama-cpp/linux-x64@${pkgVersion('@node-llama-cpp/linux-x64')}`,
    llama_cpp: `ggml-org/llama.cpp ${llama.llamaCppRelease.release} (node-llama-cpp's own tag)`,
    model: cfg.model,
    model_sha256: sha256(modelPath(cfg.model)),
    recurrent: !!cfg.recurrent,
    n_ctx: N_CTX,
    n_seq_max: cfg.sequences ?? 1,
    kv_unified: false,
    seq_id: cfg.seqIndex ?? 0,
    ...info,
    prompt: PROMPT,
    prompt_tokens: promptTokens,
    generated_tokens: gen.slice(0, GEN - 1),
    state_n_cells_expected: stateTokens.length,
    next_token: { id: next, piece: pieceOf(next) },
    then_token: { id: then, piece: pieceOf(then), note: 'greedy token after decoding next_token on top of the state' },
    file_size_reported: fileSize,
    api: [
      "getLlama({gpu:false, build:'never'})",
      'llama.loadModel({modelPath, gpuLayers:0})',
      `model.createContext({contextSize:${N_CTX}, batchSize:${N_CTX}, sequences:${cfg.sequences ?? 1}, flashAttention:${cfg.flashAttention}, experimentalKvCacheKeyType:'${cfg.k}', experimentalKvCacheValueType:'${cfg.v}'})`,
      'ctx.getSequence()',
      `seq.evaluate([bos, ...model.tokenize(prompt)], {temperature:0}) -> ${GEN} tokens, then iterator.return()`,
      'seq.saveStateToFile(file)  // llama_state_seq_save_file(ctx, file, seq_id, contextTokens)',
      'verify: fresh context, seq.loadStateFromFile(file, {acceptRisk:true}), seq.evaluate([next_token]) -> then_token',
    ],
    verify,
  })
}
for (const m of models.values()) await m.dispose()
await llama.dispose()

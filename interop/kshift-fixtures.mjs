// K-shift fixtures: @fugood/llama.node shifts its context on the tiny llama model; the state just before and
// just after the shift go to __test__/fixtures/kshift-<case>.{pre,post}.ggsn, each with a JSON sidecar.
// __test__/kshift-interop.spec.mjs applies the same shift with our cache and compares.
//
// Run from anywhere (after python3 interop/make_models.py and the peers' npm install, see interop/README.md):
//   node interop/kshift-fixtures.mjs          exit 0 = every fixture verified with the peer
//
// llama.node runs in child processes (interop/kshift-peer.mjs), retried on a crash (see kshift-lib.mjs).
import fs from 'node:fs'
import os from 'node:os'
import path from 'node:path'
import { createRequire } from 'node:module'
import { FIXTURES, modelPath, pkgVersion, sha256, pieceOf, readStateHeader, writeFixture } from './lib.mjs'
import { HERE, deriveShift, shiftCalls, llamaNode, ropeOfModel, shiftWithLlamaNode, textOf, withoutBos } from './kshift-lib.mjs'

export const PROMPT = 'the cat sat on the mat'
export const N_CTX = 32 // the context llama.node shifts (its KV cache is padded to 256 cells by llama.cpp)
export const CASES = [
  { name: 'kshift-h16-f16', model: 'llama-h16.gguf', fa: 'off', k: 'f16', v: 'f16' },
  { name: 'kshift-h16-f16-fa', model: 'llama-h16.gguf', fa: 'on', k: 'f16', v: 'f16' },
  { name: 'kshift-h16-f32', model: 'llama-h16.gguf', fa: 'off', k: 'f32', v: 'f32' },
]
const EXTRA = 4 // tokens of the peer's own continuation recorded after the first post-shift token

const require = createRequire(path.join(HERE, 'package.json'))
const { BUILD_NUMBER, BUILD_COMMIT } = require('@fugood/llama.node/lib/version.js')
// the RoPE recorded in the sidecars is read from the GGUF by the addon's own reader (npm run build first)
const { modelInfoSync } = require('../index.js')
const tok = (id) => ({ id, piece: pieceOf(id) })

function check(cond, what) {
  if (!cond) throw new Error(`check failed: ${what}`)
}

async function makeCase(cfg) {
  const dir = fs.mkdtempSync(path.join(os.tmpdir(), 'kshift-fx-'))
  const ctx = { n_ctx: N_CTX, n_batch: 256, flash_attn_type: cfg.fa, cache_type_k: cfg.k, cache_type_v: cfg.v, ctx_shift: true }
  const s = await shiftWithLlamaNode({ model: cfg.model, ctx, prompt: PROMPT, extra: EXTRA }, dir, console.log)
  const { nA, a, b, c } = s
  check(a.truncated === false && b.truncated === true, `run A not truncated, run B truncated (${a.truncated}, ${b.truncated})`)
  check(a.tokens.length === nA && b.tokens.length === nA + 1 && c.tokens.length === nA + 1 + EXTRA, 'token counts')
  check(b.tokens.slice(0, nA).join() === a.tokens.join() && c.tokens.slice(0, nA + 1).join() === b.tokens.join(), 'runs agree on common tokens')
  const pending = a.tokens[nA - 1] // sampled by A, decoded by B right after the shift
  const after = c.tokens.slice(nA) // the peer's tokens after its shift: after[0] sampled right after decoding `pending`
  const preH = readStateHeader(s.pre)
  const postH = readStateHeader(s.post)
  check(preH.n_tokens === N_CTX - 1, `pre state holds n_ctx - 1 tokens (${preH.n_tokens})`)
  const shifts = deriveShift(preH.tokens, postH.tokens, pending)
  check(shifts.length === 1 && shifts[0].formula, `one n_keep/n_discard explains the token lists: ${JSON.stringify(shifts)}`)
  const shift = shifts[0]
  const calls = shiftCalls(shift)

  // verify the files with the peer itself (fresh contexts, loadSession, decode one token on top: prompt_n 1)
  const ctx256 = { ...ctx, n_ctx: 256 } // no shift there: continuing the pre state as it is
  const prePrompt = textOf([...preH.tokens, pending])
  const postPrompt = textOf([...postH.tokens, after[0]])
  const [own256, preRun] = await llamaNode(cfg.model, ctx256, [
    { prompt: PROMPT, n_predict: nA + 2 },
    { prompt: prePrompt, n_predict: 2, load: s.pre },
  ], console.log)
  const [postRun] = await llamaNode(cfg.model, ctx, [{ prompt: postPrompt, n_predict: 2, load: s.post }], console.log)
  const preVerify = {
    what: 'fresh context (n_ctx 256: no shift), loadSession(pre), completion(text(state tokens + pending), n_predict 2) == the same peer continuing its prompt without a shift (n_predict nA+2, last 2 tokens)',
    tokens: preRun.tokens,
    expected: own256.tokens.slice(nA),
    prompt_n: preRun.prompt_n,
    tokenizes_back: preRun.prompt_tokens.join() === [...withoutBos(preH.tokens), pending].join(),
  }
  preVerify.ok = preVerify.tokens.join() === preVerify.expected.join() && preVerify.prompt_n === 1 && preVerify.tokenizes_back
  const postVerify = {
    what: 'fresh context (same n_ctx), loadSession(post), completion(text(state tokens + after[0]), n_predict 2) == after[1..2] (run C)',
    tokens: postRun.tokens,
    expected: after.slice(1, 3),
    prompt_n: postRun.prompt_n,
    tokenizes_back: postRun.prompt_tokens.join() === [...withoutBos(postH.tokens), after[0]].join(),
  }
  postVerify.ok = postVerify.tokens.join() === postVerify.expected.join() && postVerify.prompt_n === 1 && postVerify.tokenizes_back

  const rope = ropeOfModel(modelPath(cfg.model), modelInfoSync)
  const ctxDoc = { model: cfg.model, ...ctx, n_gpu_layers: 0, n_threads: 2, n_parallel: 1 }
  const kshift = {
    case: cfg.name,
    pre: `${cfg.name}.pre.ggsn`,
    post: `${cfg.name}.post.ggsn`,
    n_ctx: N_CTX,
    kv_size: 256,
    prompt_n: s.P,
    n_predict_pre: nA,
    n_keep: shift.nKeep,
    n_discard: shift.nDiscard,
    n_past: shift.nPast,
    calls: {
      seq_rm: calls.seqRm,
      seq_add: calls.seqAdd,
      note: "rn-llama's completion loop when embd reaches n_ctx: llama_memory_seq_rm(kv, 0, n_keep+1, n_keep+n_discard+1); llama_memory_seq_add(kv, 0, n_keep+1+n_discard, n_past, -n_discard); n_discard = (n_past-n_keep-1)/2; the K-shift runs at the start of the next llama_decode (the one of `pending`)",
    },
    n_keep_note: 'llama.node 1.7.15 ignores completion({n_keep}) (LlamaCompletionWorker does not copy it into the context params): n_keep is 0, only BOS is kept; derived from the saved token lists',
    rope: { ...rope, source: `GGUF metadata of ${cfg.model} (llama → rope type NORM)` },
    pending_token: tok(pending),
    pending_pos: shift.nPast - shift.nDiscard,
    after_shift_tokens: after,
    after_shift_pieces: after.map(pieceOf),
    generated_pre: a.tokens.slice(0, nA - 1),
    post_extra_cell: `the post state also holds the cell of pending_token (position ${shift.nPast - shift.nDiscard}), decoded by the llama_decode that applied the shift; compare positions 0..${shift.nPast - shift.nDiscard - 1}`,
  }
  const common = {
    peer: '@fugood/llama.node',
    peer_version: pkgVersion('@fugood/llama.node'),
    binary_package: `@fugood/node-llama-linux-x64@${pkgVersion('@fugood/node-llama-linux-x64')}`,
    llama_cpp: `b${BUILD_NUMBER} (${BUILD_COMMIT})`,
    model: cfg.model,
    model_sha256: sha256(modelPath(cfg.model)),
    recurrent: false,
    n_ctx: N_CTX,
    n_seq_max: 1,
    kv_unified: null,
    kv_type_k: cfg.k,
    kv_type_v: cfg.v,
    flash_attn: cfg.fa,
    prompt: PROMPT,
    prompt_tokens: s.promptTokens,
  }
  const api = [
    `loadModel(${JSON.stringify(ctxDoc)})`,
    `pre:  ctx.completion({prompt, n_predict: ${nA}, n_probs: 1, temperature: 0, top_k: 1, seed: 42}); ctx.saveSession(pre)`,
    `post: fresh context, ctx.completion({... n_predict: ${nA + 1}}) -> result.truncated true; ctx.saveSession(post)`,
    `continuation: fresh context, ctx.completion({... n_predict: ${nA + 1 + EXTRA}})`,
  ]
  fs.copyFileSync(s.pre, path.join(FIXTURES, kshift.pre))
  fs.copyFileSync(s.post, path.join(FIXTURES, kshift.post))
  writeFixture(kshift.pre, {
    ...common,
    generated_tokens: a.tokens.slice(0, nA - 1),
    next_token: tok(pending),
    then_token: { ...tok(own256.tokens[nA]), note: 'greedy token after next_token WITHOUT a shift (n_ctx 256)' },
    api,
    kshift: { ...kshift, role: 'pre' },
    verify: preVerify,
  })
  writeFixture(kshift.post, {
    ...common,
    generated_tokens: b.tokens.slice(0, nA), // all decoded; the shift discarded some of them (and of the prompt)
    next_token: tok(after[0]),
    then_token: { ...tok(after[1]), note: 'greedy token after next_token, run C' },
    api,
    kshift: { ...kshift, role: 'post' },
    verify: postVerify,
  })
  fs.rmSync(dir, { recursive: true, force: true })
  console.log(`${cfg.name}: n_keep ${shift.nKeep} n_discard ${shift.nDiscard} n_past ${shift.nPast}; pending ${pending}; after shift ${JSON.stringify(after)}; verify pre ${preVerify.ok} post ${postVerify.ok}`)
  return preVerify.ok && postVerify.ok
}

if (process.argv[1] && path.resolve(process.argv[1]) === path.join(HERE, 'kshift-fixtures.mjs')) {
  fs.mkdirSync(FIXTURES, { recursive: true })
  let ok = true
  for (const cfg of CASES) ok = (await makeCase(cfg)) && ok
  const files = fs.readdirSync(FIXTURES).filter((f) => f.startsWith('kshift-'))
  const bytes = files.reduce((n, f) => n + fs.statSync(path.join(FIXTURES, f)).size, 0)
  console.log(`${files.length} kshift files, ${bytes} bytes; all verified: ${ok}`)
  process.exit(ok ? 0 : 1)
}

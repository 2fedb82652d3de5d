// K-shift proven against real llama.cpp. @fugood/llama.node 1.7.15 (llama.cpp b10257) shifts its context on the
// tiny llama model (interop/models/llama-h16.gguf: 2 layers, 2 KV heads, head_dim 16, rope NORM, n_rot 16,
// freq_base from the GGUF): we load its state from BEFORE the shift, apply the same seq_rm + seq_add and our K-shift
// (`update({ rope })`), and compare with its state AFTER the shift, position by position (positions, cell
// placement, K within one f16 ulp, V byte for byte). Then the peers continue OUR shifted state exactly as llama.node
// continued after its own shift. node-llama-cpp 3.22.1 (llama.cpp v0.5.0) is checked the same way with a shift of
// two gaps (eraseContextTokenRanges), live only.
//
// Fixtures: __test__/fixtures/kshift-<case>.{pre,post}.ggsn + sidecars, made by `node interop/kshift-fixtures.mjs`
// (see interop/kshift-lib.mjs for how llama.node is made to shift and what it does). The fixture comparisons need
// only our addon. The peer tests need the interop setup (`node scripts/setup.mjs`, run by `npm test` first); the
// spec installs nothing: without it they fail naming that command (off linux-x64: one skipped test saying why).
// Peers run in child processes (interop/kshift-peer.mjs, kshift-nlc.mjs, continue.mjs), at most 2 at a time; a
// llama.node run that dies by a signal is retried.
import test from 'ava'
import fs from 'node:fs'
import crypto from 'node:crypto'
import os from 'node:os'
import path from 'node:path'
import { createRequire } from 'node:module'
import { fileURLToPath } from 'node:url'
import { registerPeerSuite } from '../interop/peers.mjs'
import {
  applyOps,
  cellsByPos,
  compareK,
  compareV,
  deriveShift,
  llamaNode,
  llamaNodeOps,
  nlcEraseOps,
  nodeLlamaCpp,
  runPeerScript,
  ropeOfModel,
  shiftWithLlamaNode,
  simulateOps,
  textOf,
  withoutBos,
} from '../interop/kshift-lib.mjs'

const require = createRequire(import.meta.url)
const { KvCache, inspectState, modelInfoSync } = require('../index.js')

const HERE = path.dirname(fileURLToPath(import.meta.url))
const ROOT = path.resolve(HERE, '..')
const INTEROP = path.join(ROOT, 'interop')
const FIXTURES = path.join(HERE, 'fixtures')
const NLC_SCRIPT = path.join(INTEROP, 'kshift-nlc.mjs')

// K tolerance: one f16 ulp relative to max(1, |peer|) (2^-10) plus 1e-6. Observed so far: 0 (bit-identical).
const TOL = { tolAbs: 2 ** -10, eps: 1e-6 }


const tmpDir = fs.mkdtempSync(path.join(os.tmpdir(), 'kv-kshift-'))
test.after.always(() => fs.rmSync(tmpDir, { recursive: true, force: true }))
const tmp = (name) => path.join(tmpDir, name)
const sha = (file) => crypto.createHash('sha256').update(fs.readFileSync(file)).digest('hex')
const sidecar = (file) => JSON.parse(fs.readFileSync(path.join(FIXTURES, `${file}.json`), 'utf8'))
const range = (a, b) => Array.from({ length: b - a }, (_, i) => a + i)

// ---- the fixtures ---------------------------------------------------------------------------------------------

const CASES = fs
  .readdirSync(FIXTURES)
  .filter((f) => /^kshift-.*\.post\.ggsn$/.test(f))
  .map((post) => {
    const side = sidecar(post)
    return { name: side.kshift.case, side, pre: path.join(FIXTURES, side.kshift.pre), post: path.join(FIXTURES, post), preSide: sidecar(side.kshift.pre) }
  })
  .sort((a, b) => (a.name < b.name ? -1 : a.name > b.name ? 1 : 0))

/** A cache shaped like the peer's: 256 cells (llama.cpp pads n_ctx 32 to 256), the model's K width (2 layers). */
function cacheFor(k, { typeK, typeV, flashAttn }) {
  return new KvCache({ size: k.kv_size, nLayer: 2, nEmbdKGqa: k.rope.headDim * k.rope.nHead, typeK, typeV, flashAttn })
}

const ropeOf = (k) => {
  const { source: _, ...rope } = k.rope
  return rope
}

const loadInto = (c, file) => (inspectState(file).format === 'session' ? c.loadSessionFileSync(file) : c.loadSequenceFileSync(file, 0))

/**
 * Loads `preFile` (llama.cpp's state before its shift) into our cache, applies the peer's shift `ops` (the seq_rm /
 * seq_add calls it made, in order) and our K-shift with the model's `rope`, and compares with `postFile` (the
 * peer's state after its shift + the cell of the token it decoded next) loaded into a second cache: positions,
 * cell placement, K (within TOL), V (bytes). Returns the K statistics.
 */
async function checkShift(t, { preFile, postFile, ops, nPast, rope, kvSize, types, asyncUpdate = false }) {
  const geometry = { kv_size: kvSize, rope }
  const ours = cacheFor(geometry, types)
  const peer = cacheFor(geometry, types)
  const unrotated = cacheFor(geometry, types) // control: the same seq_rm / seq_add, no K-shift
  const lPre = loadInto(ours, preFile)
  loadInto(unrotated, preFile)
  const lPost = loadInto(peer, postFile)
  t.is(lPre.cells, nPast, 'the pre-shift state holds n_past cells')
  t.deepEqual(range(0, nPast).map((i) => ours.cell(i).pos), range(0, nPast), 'loaded: cell i holds position i')

  const { newPos, delta } = simulateOps(ops, nPast)
  const keptOrig = range(0, nPast).filter((p) => newPos[p] >= 0)
  const pendingPos = keptOrig.length // where the peer decoded its next token after the shift
  t.deepEqual(keptOrig.map((p) => newPos[p]), range(0, pendingPos), 'the shift closes the gaps')
  t.is(lPost.cells, pendingPos + 1, 'the post-shift state: the kept and shifted cells + the cell decoded after the shift')

  for (const c of [ours, unrotated]) {
    applyOps(c, ops)
    t.true(c.hasShift)
  }
  const report = asyncUpdate ? await ours.update({ rope }) : ours.updateSync({ rope })
  const shifted = keptOrig.filter((p) => delta[p] !== 0)
  t.deepEqual([report.shiftedCells, report.shiftPending, ours.hasShift], [shifted.length, false, false], `our update rotated the ${shifted.length} shifted cells`)

  // positions (view): ours = 0..pendingPos-1, the peer's = the same + pendingPos; one sequence, one cell per position
  const posOf = (c) => {
    const v = c.view()
    return Array.from(v.pos).filter((p, i) => v.seqIds[i].length > 0).sort((a, b) => a - b)
  }
  t.deepEqual(posOf(ours), range(0, pendingPos), 'our positions after the shift')
  t.deepEqual(posOf(peer), range(0, pendingPos + 1), "the peer's positions after the shift")
  // llama.cpp does not move cells: ours neither
  const oursCells = cellsByPos(ours)
  t.deepEqual(range(0, pendingPos).map((q) => oursCells.get(q)), keptOrig, 'cells stay where they were')

  // K: every position, every layer, within one f16 ulp; V: byte for byte (V is not rotated)
  const positions = range(0, pendingPos)
  const kStats = compareK(ours, peer, positions, TOL)
  t.is(kStats.outside, 0, `K rows within tolerance (worst ${JSON.stringify(kStats.worst)})`)
  t.is(kStats.rows, positions.length * ours.nLayer)
  const unmoved = keptOrig.filter((p) => delta[p] === 0).map((p) => newPos[p])
  const kept = compareK(ours, peer, unmoved, TOL)
  t.is(kept.rowsBitIdentical, kept.rows, 'the cells that did not move are not rotated')
  const vStats = compareV(ours, peer, positions)
  t.is(vStats.differ, 0, 'V rows byte-identical')
  // control: without the K-shift the shifted rows are far off, so the comparison does see the rotation
  const control = compareK(unrotated, peer, shifted.map((p) => newPos[p]), TOL)
  t.true(control.outside > control.elements / 4, `control: unrotated K differs (${control.outside}/${control.elements} outside)`)

  // the same cell placement as llama.cpp: the token decoded after the shift went to the first freed cell (the
  // peer's file lists cells in cell order); with the peer's K/V for it our cache writes the peer's post-shift
  // file again (bit-identical when K is)
  const firstFree = range(0, nPast).find((p) => newPos[p] < 0)
  const slot = ours.prepareBatch({ pos: [pendingPos], seqIds: [0] })
  t.is(slot.head, firstFree, 'our slot search places the next token where llama.cpp did (first freed cell)')
  const cellOrder = [...keptOrig, firstFree].sort((a, b) => a - b).map((i) => (i === firstFree ? pendingPos : newPos[i]))
  t.deepEqual(range(0, peer.cellEnd).map((i) => peer.cell(i).pos), cellOrder, "the peer's cells in cell order")
  const peerCells = cellsByPos(peer)
  for (let il = 0; il < ours.nLayer; il++) {
    ours.writeK(il, slot.head, peer.readK(il, peerCells.get(pendingPos), 1))
    ours.writeV(il, slot.head, peer.readV(il, peerCells.get(pendingPos), 1))
  }
  const info = inspectState(postFile)
  const again = tmp(`again-${Math.random().toString(36).slice(2)}-${path.basename(postFile)}`)
  if (info.format === 'session') ours.saveSessionFileSync(again, lPost.tokens, { version: info.version, layout: 'streams', nStream: 1, arch: 'llama' })
  else ours.saveSequenceFileSync(again, 0, lPost.tokens, { version: info.version, layout: 'streams', nStream: 1 })
  const sameFile = fs.readFileSync(again).equals(fs.readFileSync(postFile))
  if (kStats.rowsBitIdentical === kStats.rows) t.true(sameFile, "with bit-identical K our file is the peer's post-shift file byte for byte")

  t.log(
    `${ops.map(([op, ...a]) => `seq${op === 'rm' ? 'Rm' : 'Add'}(${a})`).join(' ')}: ` +
      `K max |err| ${kStats.maxAbs} (max rel ${kStats.maxRel}), ${kStats.rowsBitIdentical}/${kStats.rows} rows bit-identical, ` +
      `${kStats.elementsEqual}/${kStats.elements} elements equal; V ${vStats.rows - vStats.differ}/${vStats.rows} rows identical; ` +
      `unrotated control max |err| ${control.maxAbs.toFixed(3)}; our file == peer's post file: ${sameFile}`,
  )
  ours.dispose()
  peer.dispose()
  unrotated.dispose()
  return { kStats, lPre, lPost, sameFile }
}

const typesOf = (side) => ({ typeK: side.kv_type_k, typeV: side.kv_type_v, flashAttn: side.flash_attn === 'on' })

test('kshift fixtures: the set, their sidecars and the shift they record', (t) => {
  t.deepEqual(CASES.map((c) => c.name), ['kshift-h16-f16', 'kshift-h16-f16-fa', 'kshift-h16-f32'])
  const bytes = fs.readdirSync(FIXTURES).filter((f) => f.startsWith('kshift-')).reduce((n, f) => n + fs.statSync(path.join(FIXTURES, f)).size, 0)
  t.true(bytes < 100_000, `kshift fixtures are small (${bytes} B)`)
  for (const c of CASES) {
    const k = c.side.kshift
    for (const [file, side] of [[c.pre, c.preSide], [c.post, c.side]]) {
      t.is(sha(file), side.file.sha256, path.basename(file))
      t.true(side.verify.ok, `${path.basename(file)} was verified with the peer`)
      const info = inspectState(file)
      t.deepEqual([info.magic, info.version, info.vTrans, info.layers[0].kType], ['ggsn', 9, side.flash_attn !== 'on', side.kv_type_k])
    }
    // the shift llama.node did, from its token lists: only (n_keep 0, n_discard 15) explains them
    const preTokens = inspectState(c.pre).tokens
    const postTokens = inspectState(c.post).tokens
    t.deepEqual(deriveShift(preTokens, postTokens, k.pending_token.id), [{ nKeep: k.n_keep, nDiscard: k.n_discard, nPast: k.n_past, formula: true }])
    t.deepEqual([k.n_keep, k.n_discard, k.n_past], [0, 15, 31])
    t.deepEqual(k.rope, { headDim: 16, nHead: 2, nRot: 16, type: 'norm', freqBase: 10000, freqScale: 1, nCtxOrig: 256, source: k.rope.source })
  }
})

for (const c of CASES) {
  test(`our K-shift of llama.node's pre-shift state equals llama.node's own shift: ${c.name} (${c.side.kv_type_k}, FA ${c.side.flash_attn})`, async (t) => {
    const k = c.side.kshift
    const ops = llamaNodeOps({ nKeep: k.n_keep, nDiscard: k.n_discard, nPast: k.n_past })
    const { lPre, lPost } = await checkShift(t, { preFile: c.pre, postFile: c.post, ops, nPast: k.n_past, rope: ropeOf(k), kvSize: k.kv_size, types: typesOf(c.side), asyncUpdate: c.name.endsWith('-fa') })
    t.deepEqual(lPost.tokens, [...lPre.tokens.slice(0, k.n_keep + 1), ...lPre.tokens.slice(k.n_keep + 1 + k.n_discard), k.pending_token.id])
  })
}

// ---- the peers ------------------------------------------------------------------------------------------------

registerPeerSuite(test, 'kshift interop', registerPeerTests)

function registerPeerTests() {
  const pkg = (name) => JSON.parse(fs.readFileSync(path.join(INTEROP, 'node_modules', name, 'package.json'), 'utf8')).version
  const ctxOf = (side, nCtx = side.n_ctx) => ({
    n_ctx: nCtx,
    n_batch: 256,
    flash_attn_type: side.flash_attn,
    cache_type_k: side.kv_type_k,
    cache_type_v: side.kv_type_v,
    ctx_shift: true,
  })

  test('kshift interop: models and peer versions are the ones the fixtures were made with; rope from the GGUF', (t) => {
    for (const c of CASES) {
      t.is(sha(path.join(INTEROP, 'models', c.side.model)), c.side.model_sha256, `interop/models/${c.side.model}: rerun python3 interop/make_models.py`)
      t.is(pkg(c.side.peer), c.side.peer_version)
      const { source: _, ...rope } = c.side.kshift.rope
      t.deepEqual(ropeOfModel(path.join(INTEROP, 'models', c.side.model), modelInfoSync), rope, 'the sidecar rope = the GGUF metadata')
    }
  })

  // 1. llama.node shifts again, now: the same tokens and shift as the fixtures, and our K-shift matches it
  const LIVE = [
    ...CASES.map((c) => ({ name: c.name, model: c.side.model, side: c.side })),
    // live only (no fixture): head_dim 32, a 64-token context (n_past 63, n_discard 31); completion({ n_keep: 4 })
    // to show that llama.node 1.7.15 ignores it (LlamaCompletionWorker does not pass n_keep on: it stays 0)
    { name: 'live-h32-f16-ctx64', model: 'llama-h32.gguf', nKeep: 4, side: { flash_attn: 'off', kv_type_k: 'f16', kv_type_v: 'f16', n_ctx: 64 } },
  ]
  for (const live of LIVE) {
    test(`llama.node shifts its context now and our K-shift matches: ${live.name}`, async (t) => {
      const dir = fs.mkdtempSync(path.join(tmpDir, `${live.name}-`))
      const prompt = live.side.prompt ?? 'the cat sat on the mat'
      const s = await shiftWithLlamaNode({ model: live.model, ctx: ctxOf(live.side), prompt, nKeep: live.nKeep }, dir, (m) => t.log(m))
      t.false(s.a.truncated)
      t.true(s.b.truncated, 'llama.node reports the shift (truncated) in the run that goes past n_ctx')
      const preTokens = inspectState(s.pre).tokens
      const postTokens = inspectState(s.post).tokens
      const pending = s.a.tokens[s.nA - 1]
      const shifts = deriveShift(preTokens, postTokens, pending)
      t.is(shifts.length, 1, JSON.stringify(shifts))
      const [{ nKeep, nDiscard, nPast }] = shifts
      t.is(nKeep, 0, `llama.node 1.7.15 keeps only BOS (n_keep 0${live.nKeep ? `, although completion() got n_keep ${live.nKeep}` : ''})`)
      t.is(nDiscard, (nPast - nKeep - 1) >> 1)
      t.is(nPast, live.side.n_ctx - 1)
      const rope = ropeOfModel(path.join(INTEROP, 'models', live.model), modelInfoSync)
      const ops = llamaNodeOps({ nKeep, nDiscard, nPast })
      if (live.side.kshift) {
        const f = live.side.kshift
        t.deepEqual([nKeep, nDiscard, nPast, pending], [f.n_keep, f.n_discard, f.n_past, f.pending_token.id], 'the same shift as the fixture')
        t.deepEqual(s.c.tokens.slice(s.nA), f.after_shift_tokens, 'the same tokens after the shift as the fixture')
        t.log(`live files == fixtures: pre ${sha(s.pre) === CASES.find((c) => c.name === live.name).preSide.file.sha256}, post ${sha(s.post) === live.side.file.sha256}`)
      }
      await checkShift(t, { preFile: s.pre, postFile: s.post, ops, nPast, rope, kvSize: 256, types: typesOf(live.side), asyncUpdate: true })
    })
  }

  /**
   * Our shifted cache (from a peer's pre-shift state, the peer's shift `ops`) in the peers' formats: ggsn 9 for
   * llama.node, ggsq 3 for node-llama-cpp; the same with unrotated K as the control. `tokens` = the token list to
   * store (the cells' tokens after the shift).
   */
  function oursShiftedFrom(tag, { preFile, ops, rope, kvSize, types, tokens }) {
    const files = {}
    for (const rotate of [true, false]) {
      const ours = cacheFor({ kv_size: kvSize, rope }, types)
      loadInto(ours, preFile)
      applyOps(ours, ops)
      // without rope the shift stays pending and the file holds the shifted positions with unrotated K
      if (rotate) ours.updateSync({ rope })
      const kind = rotate ? 'ours' : 'unrotated'
      files[kind] = { session: tmp(`${kind}-${tag}.ggsn`), sequence: tmp(`${kind}-${tag}.ggsq`), tokens }
      ours.saveSessionFileSync(files[kind].session, tokens, { version: 9, layout: 'streams', nStream: 1, arch: 'llama' })
      ours.saveSequenceFileSync(files[kind].sequence, 0, tokens, { version: 3, layout: 'streams', nStream: 1 })
      ours.dispose()
    }
    return files
  }

  function oursShifted(c) {
    const k = c.side.kshift
    const tokens = inspectState(c.pre).tokens
    return oursShiftedFrom(c.name, {
      preFile: c.pre,
      ops: llamaNodeOps({ nKeep: k.n_keep, nDiscard: k.n_discard, nPast: k.n_past }),
      rope: ropeOf(k),
      kvSize: k.kv_size,
      types: typesOf(c.side),
      tokens: [...tokens.slice(0, k.n_keep + 1), ...tokens.slice(k.n_keep + 1 + k.n_discard)],
    })
  }

  // 2. the peers continue our shifted state exactly as llama.node continued after its own shift
  for (const c of CASES) {
    const k = c.side.kshift
    const after = k.after_shift_tokens // llama.node after its shift: decode pending_token, then these greedy tokens
    test(`llama.node continues OUR shifted ${c.name} like its own shift (${c.side.kv_type_k}, FA ${c.side.flash_attn})`, async (t) => {
      const { ours, unrotated } = oursShifted(c)
      t.is(ours.tokens.length, k.n_past - k.n_discard)
      // prompt = the state's tokens + pending: llama.node reuses every loaded cell and decodes only pending_token
      const prompt = textOf([...ours.tokens, k.pending_token.id])
      const postTokens = inspectState(c.post).tokens
      const [o, z, own] = await llamaNode(c.side.model, ctxOf(c.side), [
        { prompt, n_predict: after.length, load: ours.session },
        { prompt, n_predict: after.length, load: unrotated.session },
        // the peer's own post-shift file: the same, one token later (pending is already decoded there)
        { prompt: textOf([...postTokens, after[0]]), n_predict: after.length - 1, load: c.post },
      ], (m) => t.log(m))
      t.deepEqual(o.prompt_tokens, [...withoutBos(ours.tokens), k.pending_token.id], 'the prompt tokenizes to the state tokens + pending_token')
      t.is(o.prompt_n, 1, 'llama.node decoded only pending_token on top of our cells')
      t.is(o.tokens[0], after[0], `the next greedy token after the shift (got ${JSON.stringify(o.pieces)})`)
      t.deepEqual(o.tokens, after, "the same continuation as after llama.node's own shift")
      t.deepEqual(own.tokens, after.slice(1), "control: llama.node's own post-shift file continues the same way")
      t.is(own.prompt_n, 1)
      t.is(z.prompt_n, 1)
      t.notDeepEqual(z.tokens, after, 'control: without the rotation (K-shift) llama.node continues differently')
      t.log(`ours: ${JSON.stringify(o.pieces)}; llama.node after its shift: ${JSON.stringify(k.after_shift_pieces)}; unrotated: ${JSON.stringify(z.pieces)}`)
    })

    test(`node-llama-cpp continues OUR shifted ${c.name} as a ggsq 3 like llama.node after its shift`, async (t) => {
      const { ours, unrotated } = oursShifted(c)
      const opts = { flashAttention: c.side.flash_attn === 'on', k: c.side.kv_type_k.toUpperCase(), v: c.side.kv_type_v.toUpperCase(), evaluate: [k.pending_token.id], n: after.length }
      const [o, z] = await nodeLlamaCpp(c.side.model, [ours.sequence, unrotated.sequence], opts, (m) => t.log(m))
      t.is(o.loaded_tokens, ours.tokens.length)
      t.is(o.tokens[0], after[0], 'the next greedy token after the shift')
      t.deepEqual(o.tokens, after, 'the same continuation as llama.node after its own shift')
      t.notDeepEqual(z.tokens, after, 'control: without the rotation node-llama-cpp continues differently')
      t.log(`node-llama-cpp on ours: ${JSON.stringify(o.tokens)}; llama.node after its shift: ${JSON.stringify(after)}; unrotated: ${JSON.stringify(z.tokens)}`)
    })
  }

  // 3. node-llama-cpp shifts by the ranges it is given (LlamaContextSequence.eraseContextTokenRanges, the same
  //    calls as its context-shift strategies): two gaps, so positions 0..2 stay, one run moves by -3 and the rest
  //    by -10 (llama.node only ever keeps BOS). Live only: no fixture.
  const ERASE = [{ start: 3, end: 6 }, { start: 10, end: 17 }]
  const NLC = [
    { name: 'h16-f16', flashAttention: false, k: 'F16', v: 'F16', types: { typeK: 'f16', typeV: 'f16', flashAttn: false } },
    { name: 'h16-f16-fa', flashAttention: true, k: 'F16', v: 'F16', types: { typeK: 'f16', typeV: 'f16', flashAttn: true } },
  ]
  for (const n of NLC) {
    test(`node-llama-cpp erases two ranges and shifts: our K-shift matches, and both peers continue ours like its own (${n.name})`, async (t) => {
      const model = 'llama-h16.gguf'
      const pre = tmp(`nlc-${n.name}-pre.ggsq`)
      const post = tmp(`nlc-${n.name}-post.ggsq`)
      const ctx = { flashAttention: n.flashAttention, k: n.k, v: n.v }
      const prompt = 'the cat sat on the mat'
      const [r] = (await runPeerScript(NLC_SCRIPT, [JSON.stringify({ model, ctx, prompt, generate: 24, erase: ERASE, extra: 4, pre, post })], (m) => t.log(m))).runs
      const nPast = r.pre_tokens.length
      t.is(nPast, 30)
      const ops = nlcEraseOps(ERASE, nPast)
      t.deepEqual(ops, [['rm', 0, 3, 6], ['rm', 0, 10, 17], ['add', 0, 6, 10, -3], ['add', 0, 17, 30, -10]])
      const { newPos } = simulateOps(ops, nPast)
      t.deepEqual(r.shifted_tokens, r.pre_tokens.filter((_, p) => newPos[p] >= 0), "node-llama-cpp's token list after the erase")
      t.deepEqual(r.post_tokens, [...r.shifted_tokens, r.pending])
      t.deepEqual([inspectState(pre).tokens, inspectState(post).tokens], [r.pre_tokens, r.post_tokens])
      const rope = ropeOfModel(path.join(INTEROP, 'models', model), modelInfoSync)
      await checkShift(t, { preFile: pre, postFile: post, ops, nPast, rope, kvSize: 256, types: n.types })

      const files = oursShiftedFrom(`nlc-${n.name}`, { preFile: pre, ops, rope, kvSize: 256, types: n.types, tokens: r.shifted_tokens })
      const after = r.after // node-llama-cpp after its shift: decode pending, then these greedy tokens
      const opts = { ...ctx, evaluate: [r.pending], n: after.length }
      const [o, z] = await nodeLlamaCpp(model, [files.ours.sequence, files.unrotated.sequence], opts, (m) => t.log(m))
      t.is(o.loaded_tokens, r.shifted_tokens.length)
      t.deepEqual(o.tokens, after, 'node-llama-cpp continues our shifted state exactly as its own')
      t.notDeepEqual(z.tokens, after, 'control: without the rotation it continues differently')
      // llama.node (another llama.cpp build) continues our ggsn 9 the same way
      const lnCtx = { n_ctx: 256, n_batch: 256, flash_attn_type: n.flashAttention ? 'on' : 'off', cache_type_k: n.types.typeK, cache_type_v: n.types.typeV, ctx_shift: false }
      const textPrompt = textOf([...r.shifted_tokens, r.pending])
      const [ln] = await llamaNode(model, lnCtx, [{ prompt: textPrompt, n_predict: after.length, load: files.ours.session }], (m) => t.log(m))
      t.deepEqual(ln.prompt_tokens, [...withoutBos(r.shifted_tokens), r.pending], 'the prompt tokenizes to the state tokens + pending')
      t.is(ln.prompt_n, 1, 'llama.node decoded only pending on top of our cells')
      t.deepEqual(ln.tokens, after, 'llama.node continues our shifted state as node-llama-cpp continued its own')
      t.log(`node-llama-cpp after its shift: ${JSON.stringify(after)}; on ours: ${JSON.stringify(o.tokens)}; llama.node on ours: ${JSON.stringify(ln.tokens)}; unrotated: ${JSON.stringify(z.tokens)}`)
    })
  }
}

// Shared by interop/kshift-fixtures.mjs and __test__/kshift-interop.spec.mjs: llama.node's context shift on the
// tiny llama model, and the comparison of OUR K-shift with it. No native code of ours here: the KvCache class
// is passed in.
import fs from 'node:fs'
import os from 'node:os'
import path from 'node:path'
import { fileURLToPath } from 'node:url'

export const HERE = path.dirname(fileURLToPath(import.meta.url))
export const MODELS = path.join(HERE, 'models')
export const FIXTURES = path.resolve(HERE, '..', '__test__', 'fixtures')
export const PEER = path.join(HERE, 'kshift-peer.mjs')
export const CONTINUE = path.join(HERE, 'continue.mjs')
export const BOS = 1

// ---- RoPE of a model ---------------------------------------------------------------------------------------

/**
 * The K-shift RoPE of a tiny llama model, from the addon's `modelInfoSync` (passed in, like the KvCache class:
 * this file loads no native code): the GGUF is read by the same reader the library ships.
 */
export function ropeOfModel(file, modelInfoSync) {
  const m = modelInfoSync(file)
  if (m.rope.type !== 'norm' && m.rope.type !== 'neox') throw new Error(`${file}: rope type ${m.rope.type} not handled here`)
  if (!['none', 'linear'].includes(m.rope.scalingType)) throw new Error(`${file}: rope scaling ${m.rope.scalingType} not handled here`)
  return {
    headDim: m.nEmbdHeadK,
    nHead: m.layers[0].nHeadKv,
    nRot: m.rope.nRot,
    type: m.rope.type,
    freqBase: m.rope.freqBase,
    freqScale: m.rope.scalingType === 'none' ? 1 : m.rope.freqScale,
    nCtxOrig: m.rope.nCtxOrigYarn,
  }
}

// ---- tokens ------------------------------------------------------------------------------------------------

let vocab = null
function vocabTokens() {
  vocab ??= JSON.parse(fs.readFileSync(path.join(MODELS, 'vocab.json'), 'utf8')).tokens
  return vocab
}
/** Prompt text whose SPM tokenization is `ids` ('▁' is a space, the leading one is the dummy prefix; BOS dropped). */
export function textOf(ids) {
  const v = vocabTokens()
  return ids.filter((id, i) => !(i === 0 && id === BOS)).map((id) => v[id].replaceAll('\u2581', ' ')).join('').replace(/^ /, '')
}
export const withoutBos = (ids) => (ids[0] === BOS ? ids.slice(1) : ids)

// ---- peers in child processes: see peers.mjs

import { runPeerScript } from './peers.mjs'

export { runPeerScript }

/** llama.node: kshift-peer.mjs `{ model, ctx, runs }` → its runs. */
export async function llamaNode(model, ctx, runs, log) {
  return (await runPeerScript(PEER, [JSON.stringify({ model, ctx, runs })], log)).runs
}

/**
 * node-llama-cpp through continue.mjs: per file (one process, a fresh context each), load the sequence file into
 * sequence 0, evaluate `evaluate`, n greedy tokens. Returns the runs in the order of `files`.
 */
export async function nodeLlamaCpp(model, files, { flashAttention, k, v, evaluate, n }, log) {
  const opts = { ctx: { sequences: 1, flashAttention, k, v }, seqIndex: 0, evaluate, n, also: files.slice(1) }
  return (await runPeerScript(CONTINUE, ['node-llama-cpp', model, files[0], JSON.stringify(opts)], log)).runs
}

// ---- the context shift -------------------------------------------------------------------------------------

/**
 * Lets llama.node shift its context (rn-llama's completion loop, `ctx_shift: true`):
 *   A: completion with n_predict = n_ctx - P (P = prompt tokens with BOS): the last sampled token (`pending`) is not
 *      decoded, the cache holds n_ctx - 1 cells (positions 0..n_ctx-2) → saveSession(pre).
 *   B: a fresh context, same prompt, n_predict one more: at the next token embd reaches n_ctx, so llama.node shifts
 *      (seq_rm(0, n_keep+1, n_keep+n_discard+1); seq_add(0, n_keep+1+n_discard, n_past, -n_discard)), then decodes
 *      `pending` — that llama_decode applies the K-shift first — and samples one token → saveSession(post).
 *      The post state = the shifted cells + the cell of `pending` (no earlier save point exists: the shift and
 *      the decode that applies it happen inside one completion step).
 *   C: same prompt, `extra` more tokens: the peer's own continuation after its shift.
 * Greedy and deterministic: A's state is B's state just before the shift.
 */
export async function shiftWithLlamaNode({ model, ctx, prompt, extra = 4, nKeep }, dir, log) {
  const [probe] = await llamaNode(model, ctx, [{ prompt, n_predict: 1 }], log)
  const P = probe.prompt_n // prompt tokens decoded from an empty cache, BOS included
  const nA = ctx.n_ctx - P
  const pre = path.join(dir, 'pre.ggsn')
  const post = path.join(dir, 'post.ggsn')
  const keep = nKeep === undefined ? {} : { n_keep: nKeep } // completion({ n_keep }): llama.node 1.7.15 ignores it
  const [a, b, c] = await llamaNode(model, ctx, [
    { prompt, n_predict: nA, save: pre, ...keep },
    { prompt, n_predict: nA + 1, save: post, ...keep },
    { prompt, n_predict: nA + 1 + extra, ...keep },
  ], log)
  return { P, nA, pre, post, a, b, c, promptTokens: probe.prompt_tokens }
}

/**
 * n_keep / n_discard from the token lists llama.node saved: post = pre[0, n_keep+1) + pre[n_keep+1+n_discard, n_past)
 * + [pending], with rn-llama's n_discard = (n_past - n_keep - 1) / 2. Returns every (n_keep, n_discard) the lists
 * allow (the caller requires exactly one).
 */
export function deriveShift(preTokens, postTokens, pending) {
  const nPast = preTokens.length
  const found = []
  for (let nKeep = 0; nKeep < nPast - 1; nKeep++) {
    for (let nDiscard = 1; nKeep + 1 + nDiscard <= nPast; nDiscard++) {
      const expect = [...preTokens.slice(0, nKeep + 1), ...preTokens.slice(nKeep + 1 + nDiscard), pending]
      if (expect.length === postTokens.length && expect.every((t, i) => t === postTokens[i])) {
        found.push({ nKeep, nDiscard, nPast, formula: nDiscard === (nPast - nKeep - 1) >> 1 })
      }
    }
  }
  return found
}

/** The llama.cpp calls of llama.node's shift, as our cache takes them. */
export function shiftCalls({ nKeep, nDiscard, nPast }) {
  return {
    seqRm: [0, nKeep + 1, nKeep + nDiscard + 1],
    seqAdd: [0, nKeep + 1 + nDiscard, nPast, -nDiscard],
  }
}

/** llama.node's shift as an ordered op list: ['rm', seq, p0, p1] / ['add', seq, p0, p1, delta]. */
export function llamaNodeOps(shift) {
  const c = shiftCalls(shift)
  return [['rm', ...c.seqRm], ['add', ...c.seqAdd]]
}

/**
 * node-llama-cpp's LlamaContextSequence.eraseContextTokenRanges(ranges) as llama.cpp calls, in order (its
 * _eraseContextTokenRanges: ranges normalized, sorted and merged; per range llama_memory_seq_rm at the original
 * positions, then llama_memory_seq_add of the run since the previous range by minus the tokens erased so far; the
 * run after the last range up to `nextTokenIndex` last).
 */
export function nlcEraseOps(ranges, nextTokenIndex) {
  const resolved = ranges
    .map(({ start, end }) => {
      if (start === end) return null
      if (start > end) [start, end] = [end, start]
      if (end > nextTokenIndex) end = nextTokenIndex
      if (start >= nextTokenIndex) return null
      return { start, end }
    })
    .filter((r) => r != null)
    .sort((a, b) => a.start - b.start)
    .reduce((acc, r) => {
      const last = acc[acc.length - 1]
      if (last && last.end >= r.start) last.end = Math.max(last.end, r.end)
      else acc.push({ ...r })
      return acc
    }, [])
  const ops = []
  let removed = 0
  let lastEnd = null
  for (const r of resolved) {
    ops.push(['rm', 0, r.start, r.end])
    if (lastEnd != null && removed > 0 && lastEnd !== r.start) ops.push(['add', 0, lastEnd, r.start, -removed])
    removed += r.end - r.start
    lastEnd = r.end
  }
  if (lastEnd != null && removed > 0 && lastEnd !== nextTokenIndex) ops.push(['add', 0, lastEnd, nextTokenIndex, -removed])
  return ops
}

/** Applies ops to our cache (seqRm must succeed). */
export function applyOps(cache, ops) {
  for (const [op, ...args] of ops) {
    if (op === 'rm') {
      if (!cache.seqRm(...args)) throw new Error(`seqRm(${args}) refused`)
    } else cache.seqAdd(...args)
  }
}

/**
 * What the ops do to positions 0..nPast-1 (one cell per position, cell i at position i, as a loaded state):
 * `newPos[p]` = the position of the cell that held p (-1: removed), `delta[p]` = newPos - p.
 */
export function simulateOps(ops, nPast) {
  const pos = Array.from({ length: nPast }, (_, i) => i)
  for (const [op, , p0, p1, d] of ops) {
    for (let i = 0; i < nPast; i++) {
      if (pos[i] < 0 || pos[i] < p0 || pos[i] >= p1) continue
      if (op === 'rm') pos[i] = -1
      else pos[i] += d
    }
  }
  return { newPos: pos, delta: pos.map((p, i) => (p < 0 ? 0 : p - i)) }
}

/** Cell index of every position of sequence 0 (one cell per position). */
export function cellsByPos(cache) {
  const m = new Map()
  for (let i = 0; i < cache.size; i++) {
    const c = cache.cell(i)
    if (c.pos < 0) continue
    if (!c.seqIds.includes(0) || c.seqIds.length !== 1) throw new Error(`cell ${i}: sequences ${c.seqIds}`)
    if (m.has(c.pos)) throw new Error(`position ${c.pos} in cells ${m.get(c.pos)} and ${i}`)
    m.set(c.pos, i)
  }
  return m
}

/**
 * K rows of `ours` vs `peer`, position by position. An element passes when |a - b| <= tolAbs * max(1, |b|) + eps
 * (one f16 ulp at 1 is 2^-10). Returns the statistics over every compared element.
 */
export function compareK(ours, peer, positions, { tolAbs = 2 ** -10, eps = 1e-6 } = {}) {
  const po = cellsByPos(ours)
  const pp = cellsByPos(peer)
  const s = { rows: 0, rowsBitIdentical: 0, elements: 0, elementsEqual: 0, outside: 0, maxAbs: 0, maxRel: 0, worst: null }
  for (const pos of positions) {
    for (let il = 0; il < ours.nLayer; il++) {
      const a = ours.readKF32(il, po.get(pos), 1)
      const b = peer.readKF32(il, pp.get(pos), 1)
      s.rows++
      if (ours.readK(il, po.get(pos), 1).equals(peer.readK(il, pp.get(pos), 1))) s.rowsBitIdentical++
      for (let j = 0; j < a.length; j++) {
        const d = Math.abs(a[j] - b[j])
        s.elements++
        if (d === 0) s.elementsEqual++
        if (d > tolAbs * Math.max(1, Math.abs(b[j])) + eps) s.outside++
        if (d > s.maxAbs) {
          s.maxAbs = d
          s.worst = { pos, layer: il, index: j, ours: a[j], peer: b[j] }
        }
        s.maxRel = Math.max(s.maxRel, d / Math.max(1, Math.abs(b[j])))
      }
    }
  }
  return s
}

/** V rows byte for byte, position by position: how many rows differ. */
export function compareV(ours, peer, positions) {
  const po = cellsByPos(ours)
  const pp = cellsByPos(peer)
  let rows = 0
  let differ = 0
  for (const pos of positions) {
    for (let il = 0; il < ours.nLayer; il++) {
      rows++
      if (!ours.readV(il, po.get(pos), 1).equals(peer.readV(il, pp.get(pos), 1))) differ++
    }
  }
  return { rows, differ }
}

// A llama.cpp-style server session driven through the cache: four parallel slots share a system
// prompt, decode in one batch per step, one slot finishes and is rolled back, the context fills,
// and a context shift plus a defrag make room. Prints the cache view at the end.
'use strict'

const { KvCache } = require('..')

const N_CTX = 256
const N_SLOTS = 4
const cache = new KvCache({ size: N_CTX, nLayer: 2, nEmbdKGqa: 64, nSeqMax: N_SLOTS, typeK: 'f16', typeV: 'f16' })

// deterministic fake K/V rows so that data moves are visible
const row = (pos, seq) => Float32Array.from({ length: 64 }, (_, j) => pos + seq / 10 + j / 1000)

function decode(tokens) {
  const slot = cache.prepareBatch({ pos: tokens.map((t) => t.pos), seqIds: tokens.map((t) => t.seqIds) })
  if (!slot) throw new Error(`no room for ${tokens.length} tokens`)
  tokens.forEach((t, k) => {
    for (let il = 0; il < 2; il++) {
      cache.writeKF32(il, slot.head + k, row(t.pos, t.seqIds[0]))
      cache.writeVF32(il, slot.head + k, row(t.pos, t.seqIds[0]))
    }
  })
  return slot
}

// 1. shared system prompt of 32 tokens, owned by every slot at once
const prompt = Array.from({ length: 32 }, (_, p) => ({ pos: p, seqIds: [0, 1, 2, 3] }))
decode(prompt)
console.log(`prompt: ${cache.usedCells} cells, ${cache.nTokens} tokens (shared by ${N_SLOTS} slots)`)

// 2. each slot gets its own user turn, then all decode together
let next = Array(N_SLOTS).fill(32)
for (let s = 0; s < N_SLOTS; s++) {
  const n = 8 + 4 * s
  decode(Array.from({ length: n }, (_, k) => ({ pos: next[s] + k, seqIds: [s] })))
  next[s] += n
}
for (let step = 0; step < 20; step++) {
  decode(Array.from({ length: N_SLOTS }, (_, s) => ({ pos: next[s]++, seqIds: [s] })))
}
console.log(`after 20 parallel steps: used ${cache.usedCells}/${N_CTX}, seqPosMax ${[0, 1, 2, 3].map((s) => cache.seqPosMax(s)).join(', ')}`)

// 3. slot 2 finishes: free its cells; slot 1 rejects 3 speculative tokens
cache.seqRm(2)
cache.seqRm(1, next[1] - 3)
next[1] -= 3
console.log(`slot 2 done, slot 1 rolled back: used ${cache.usedCells}, largest hole ${cache.view().maxContiguous}`)

// 4. slot 0 runs until the context is full, then shifts like llama.node (keep 4, discard half)
while (decode([{ pos: next[0], seqIds: [0] }]) && cache.usedCells < N_CTX - 1) next[0]++
next[0]++
const nKeep = 4
const nDiscard = Math.floor((cache.seqPosMax(0) - nKeep) / 2)
cache.seqRm(0, nKeep + 1, nKeep + nDiscard + 1)
cache.seqAdd(0, nKeep + 1 + nDiscard, next[0], -nDiscard)
next[0] -= nDiscard
cache.defrag()
const report = cache.updateSync({ rope: { headDim: 16, nHead: 4, type: 'norm' } })
console.log(`context shift of ${nDiscard}: rotated ${report.shiftedCells} K rows, defrag moved ${report.defrag.cellsMoved} cells in ${report.defrag.moves.length} runs (${report.defrag.bytesCopied} bytes)`)

// 5. the view
const view = cache.view(4)
console.log(`view: used ${view.usedCells}, tokens ${view.tokenCount}, largest free run ${view.maxContiguous} at ${view.maxContiguousIdx}`)
let line = ''
for (let i = 0; i < N_CTX; i++) {
  const ids = view.seqIds[i]
  line += ids.length === 0 ? '.' : ids.length > 1 ? '+' : String(ids[0])
  if (i % 64 === 63) {
    console.log(`  ${String(i - 63).padStart(3)} ${line}`)
    line = ''
  }
}
cache.dispose()

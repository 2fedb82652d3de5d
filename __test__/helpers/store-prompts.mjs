// Prompts shared by the prompt store specs and their worker processes: prompt `w` has 96 tokens;
// the first 48 are common to all prompts, and so are their K/V rows.
export function promptTokens(w) {
  return Array.from({ length: 96 }, (_, i) => (i < 48 ? i : 1000 * (w + 1) + i))
}

export function promptCache(KvCache, w, o = {}) {
  const cache = new KvCache({ size: 128, nLayer: 2, nEmbdKGqa: 32, nSeqMax: 2, ...o })
  const tokens = promptTokens(w)
  cache.findSlot({ pos: tokens.map((_, i) => i), seqIds: tokens.map(() => 0) })
  for (let il = 0; il < 2; il++) {
    const row = (i, sign) => Float32Array.from({ length: 32 }, (_, j) => sign * (tokens[i] + il + j / 64))
    for (let i = 0; i < tokens.length; i++) {
      cache.writeKF32(il, i, row(i, 1))
      cache.writeVF32(il, i, row(i, -1))
    }
  }
  return { cache, tokens }
}

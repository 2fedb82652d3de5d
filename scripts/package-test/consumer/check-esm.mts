// (c) The same declarations seen from an ES module under `module: nodenext`.
import { KvCache } from 'llama-kv-cache'
import type { Slot } from 'llama-kv-cache'

const cache: KvCache = new KvCache({ size: 8, nLayer: 1, nEmbdKGqa: 4 })
const slot: Slot | null = cache.prepareBatch({ pos: [0], seqIds: [0] }, { advanceHead: false })
// @ts-expect-error size is required
const bad = new KvCache({ nLayer: 1, nEmbdKGqa: 4 })
export const used: number = cache.usedCells + (slot?.len ?? 0) + (bad ? 0 : 1)

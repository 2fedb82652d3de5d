// (c) TypeScript, compiled with `tsc --strict --noEmit` against the shipped index.d.ts.
import {
  KvCache,
  inspectState,
  type CacheView,
  type Inspection,
  type KvCacheOptions,
  type LoadedFile,
  type Slot,
  type UBatchInput,
  type UpdateReport,
} from 'llama-kv-cache'
import { reusePrompts, type NodeLlamaCppSequenceLike } from 'llama-kv-cache/node-llama-cpp'
import { reusePrompts as reuseLlamaNode, type LlamaNodeContextLike } from 'llama-kv-cache/llama.node'

const options: KvCacheOptions = { size: 64, nLayer: 2, nEmbdKGqa: [32, 64], typeK: 'q8_0', typeV: 'f16', nSeqMax: 4 }
const cache = new KvCache(options)
const ubatch: UBatchInput = { pos: Int32Array.from([0, 1, 2]), seqIds: [[0, 1], 0, 0] }
const slot: Slot | null = cache.findSlot(ubatch)
const head: number = slot === null ? -1 : slot.head
const removed: boolean = cache.seqRm(0, 1)
const view: CacheView = cache.view(2)
const positions: Int32Array = view.pos
const owners: number[][] = view.seqIds
const k: Buffer = cache.readK(0, 0, 1)
const kf: Float32Array = cache.readKF32(1, 0, 1)
cache.writeVF32(0, 0, new Float32Array(32))
const tensor: 'k' | 'v' = 'v'
const rowBytes: number = cache.rowSize(1, tensor)

async function shift(signal: AbortSignal): Promise<number> {
  cache.seqAdd(0, 0, -1, -1)
  const report: UpdateReport = await cache.update({ rope: { headDim: 16, nHead: 2, type: 'neox' }, signal })
  return report.shiftedCells + (report.defrag?.cellsMoved ?? 0)
}

async function roundTrip(path: string): Promise<number> {
  const state: Buffer = await cache.stateWrite(0, { layout: 'seed', onProgress: (done: number, total: number) => void (done <= total) })
  cache.stateReadSync(state, 1)
  await cache.saveSequenceFile(path, 0, Int32Array.from([1, 2, 3]), { version: 3 })
  const info: Inspection = inspectState(path)
  const loaded: LoadedFile = cache.loadSequenceFileSync(path, 1, { allowScattered: true })
  return info.nLayer + loaded.tokens.length
}

// Proves the declarations are really checked: this line must be an error, or tsc reports an unused directive.
// @ts-expect-error seqId is a number, not a string
cache.seqRm('0')

void [head, removed, positions, owners, k, kf, rowBytes, shift(AbortSignal.timeout(1000)), roundTrip('/tmp/x.ggsq')]
cache[Symbol.dispose]()

// the adapters' types: store options pass through, the model comes from the peer
declare const sequence: NodeLlamaCppSequenceLike
declare const context: LlamaNodeContextLike
const reuse = reusePrompts(sequence, { path: '/var/cache/prompts', blockTokens: 64 })
const restored: number | undefined = reuse.lastRestore?.restoredTokens
const nodeReuse = reuseLlamaNode(context, { modelPath: '/models/x.gguf', url: 'redis://cache:6379' })
// @ts-expect-error the store's model is the peer's own model file
reusePrompts(sequence, { model: 'other.gguf' })
void [restored, nodeReuse.close()]

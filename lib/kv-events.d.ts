import type { PromptStore } from '../index'

export interface PublishKvEventsOptions {
  /** The PUB socket's address: bound when it has a wildcard (`tcp://*:5557`, the default) or is
   * `ipc://` / `inproc://`, connected otherwise (vLLM's rule). `tcp://127.0.0.1:*` binds a free
   * port: read it from `endpoint` of the result. */
  endpoint?: string
  /** The first frame of every message (default ''). */
  topic?: string
  /** A ROUTER address that replays buffered batches from a sequence number (vLLM's replay). */
  replayEndpoint?: string
  /** How many past batches a replay can serve (default 10,000). */
  bufferSteps?: number
  /** Set as the batches' `data_parallel_rank`. */
  dataParallelRank?: number
  /** The PUB socket's send high-water mark (default 100,000). */
  hwm?: number
  /** The medium names to publish for each tier, e.g. `{ memory: 'CPU', dir: 'DISK' }`
   * (default: the tier names). */
  media?: Partial<Record<'memory' | 'dir' | 'redis', string>>
}

export interface KvEventsPublisher {
  /** The PUB socket's address as bound (the port a `*` picked). */
  readonly endpoint: string
  /** The replay socket's address, or null. */
  readonly replayEndpoint: string | null
  /** Batches published so far (the next sequence number). */
  readonly published: number
  /** Stops listening, sends what is queued and closes the sockets. */
  close(): Promise<void>
}

/**
 * Publishes `store.events()` in vLLM's wire format over ZeroMQ: per batch the frames `topic`,
 * an 8-byte big-endian sequence number and a msgpack `KVEventBatch`, so a router that reads
 * vLLM's KV events reads a prompt store's unchanged. Needs the optional peer dependencies
 * `zeromq` and `@msgpack/msgpack` (ERR_KV_UNSUPPORTED naming them otherwise).
 */
export function publishKvEvents(store: PromptStore, options?: PublishKvEventsOptions): Promise<KvEventsPublisher>

'use strict'
// `llama-kv-cache/kv-events`: a prompt store's KV events published in vLLM's wire format, so a
// cache-aware router that consumes vLLM's events (llm-d's precise prefix-cache scorer, NVIDIA
// Dynamo's KV router through its ZeroMQ relay) consumes ours unchanged:
// - a ZeroMQ PUB socket; each message is three frames: the topic, an 8-byte big-endian sequence
//   number (from 0, so a subscriber can detect gaps) and the msgpack `KVEventBatch`;
// - the batch and its events are msgspec structs as vLLM declares them: maps, the events tagged
//   by a `type` field, the fields without defaults always present (null where unknown);
// - an optional ROUTER socket replays buffered batches from a sequence number (vLLM's replay
//   protocol: a request `[identity, '', start]`, replies `[identity, '', seq, payload]`, then
//   `[identity, '', -1, '']`).
// `zeromq` and `@msgpack/msgpack` are optional peer dependencies: only this module loads them.

const { listen } = require('./store-events.js')
const { checkOptions, codedError } = require('./options.js')

function peer(name) {
  try {
    return require(name)
  } catch (e) {
    throw codedError('ERR_KV_UNSUPPORTED', `publishKvEvents needs the optional peer dependency '${name}': npm install ${name} (${e.message})`)
  }
}

// how long closed sockets keep delivering what was sent (a store's last events, its
// AllBlocksCleared among them); an exiting process waits at most this long for a slow peer
const LINGER_MS = 1000

const END_SEQ = Buffer.from([0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff])

function seqBytes(seq) {
  const b = Buffer.alloc(8)
  b.writeBigUInt64BE(BigInt(seq))
  return b
}

// vLLM's ExternalBlockHash is `bytes | int`: our 32-byte chain keys go as bytes
const hash = (hex) => Buffer.from(hex, 'hex')

// one event as vLLM's msgspec struct (tag first, as msgspec writes it)
function vllmEvent(e, media) {
  switch (e.type) {
    case 'BlockStored':
      return {
        type: 'BlockStored',
        block_hashes: e.blockHashes.map(hash),
        parent_block_hash: e.parentBlockHash === null ? null : hash(e.parentBlockHash),
        token_ids: e.tokenIds,
        block_size: e.blockSize,
        lora_id: null,
        medium: media[e.medium] ?? e.medium,
        lora_name: null,
      }
    case 'BlockRemoved':
      return { type: 'BlockRemoved', block_hashes: e.blockHashes.map(hash), medium: media[e.medium] ?? e.medium }
    default:
      return { type: 'AllBlocksCleared' }
  }
}

// vLLM's heuristic: a wildcard address or a local transport binds, anything else connects
function binds(endpoint) {
  return endpoint.includes('*') || endpoint.includes('::') || endpoint.startsWith('ipc://') || endpoint.startsWith('inproc://')
}

const OPTIONS = {
  endpoint: 'string',
  topic: 'string',
  replayEndpoint: 'string',
  bufferSteps: 'number',
  dataParallelRank: 'number',
  hwm: 'number',
  media: 'object',
}

async function publishKvEvents(store, options) {
  const o = checkOptions(options, OPTIONS, 'publishKvEvents')
  const endpoint = o.endpoint ?? 'tcp://*:5557'
  const bufferSteps = o.bufferSteps ?? 10_000
  if (!Number.isInteger(bufferSteps) || bufferSteps < 0) {
    throw codedError('ERR_KV_INVALID_ARG', `publishKvEvents: bufferSteps must be a non-negative integer, got ${bufferSteps}`)
  }
  const media = { ...(o.media ?? {}) }
  const zmq = peer('zeromq')
  const { Encoder } = peer('@msgpack/msgpack')
  const encoder = new Encoder()
  const topic = Buffer.from(o.topic ?? '', 'utf8')

  const pub = new zmq.Publisher({ sendHighWaterMark: o.hwm ?? 100_000, linger: LINGER_MS })
  let replay = null
  try {
    if (binds(endpoint)) await pub.bind(endpoint)
    else pub.connect(endpoint)
    if (o.replayEndpoint !== undefined) {
      replay = new zmq.Router({ linger: LINGER_MS })
      await replay.bind(o.replayEndpoint)
    }
  } catch (e) {
    pub.close()
    replay?.close()
    throw codedError('ERR_KV_INVALID_ARG', `publishKvEvents: cannot open ${endpoint}: ${e.message}`)
  }

  // batches go out one send at a time, in order; the last bufferSteps stay for replays
  const buffer = []
  const outbox = []
  let seq = 0
  let sending = null
  let closed = false
  const drain = async () => {
    while (outbox.length > 0 && !closed) {
      const [s, payload] = outbox.shift()
      await pub.send([topic, seqBytes(s), payload])
    }
  }
  const publish = (batch) => {
    const msg = { ts: Date.now() / 1000, events: batch.map((e) => vllmEvent(e, media)) }
    if (o.dataParallelRank !== undefined) msg.data_parallel_rank = o.dataParallelRank
    const payload = Buffer.from(encoder.encode(msg))
    const s = seq++
    if (bufferSteps > 0) {
      buffer.push([s, payload])
      if (buffer.length > bufferSteps) buffer.shift()
    }
    outbox.push([s, payload])
    if (sending === null) sending = drain().finally(() => (sending = null)).catch(() => {})
  }
  const serveReplays = async () => {
    for await (const frames of replay) {
      if (frames.length !== 3) continue
      const [id, , start] = frames
      const from = start.length === 8 ? start.readBigUInt64BE() : 0n
      for (const [s, payload] of buffer) {
        if (BigInt(s) >= from) await replay.send([id, '', seqBytes(s), payload])
      }
      await replay.send([id, '', END_SEQ, ''])
    }
  }
  const replaying = replay === null ? null : serveReplays().catch(() => {})

  let ended = null
  const whenEnded = new Promise((resolve) => (ended = resolve))
  const stop = listen(store, publish, () => ended())
  const close = async () => {
    if (closed) return
    stop()
    ended()
    await sending
    closed = true
    pub.close()
    replay?.close()
    await replaying
  }
  // a store that is gone publishes nothing more: what it sent last (its AllBlocksCleared) is
  // flushed, and the sockets close
  whenEnded.then(close)
  return {
    endpoint: pub.lastEndpoint ?? endpoint,
    replayEndpoint: replay?.lastEndpoint ?? null,
    get published() {
      return seq
    },
    close,
  }
}

module.exports = { publishKvEvents }

'use strict'
// `PromptStore.prototype.events()`: the store's KV events as an async iterator, on the native
// subscription (src/store_events.rs). Events are queued from the moment of the call; the
// iterator ends when the loop breaks, its signal aborts, or the store is gone (closed and its
// last call settled). index.js calls `attach(PromptStore)`.

const { abortError } = require('./state-stream.js')
const { checkOptions } = require('./options.js')

// the binding's flat record, shaped by its type
function shape(e) {
  switch (e.type) {
    case 'BlockStored':
      return {
        type: e.type,
        blockHashes: e.blockHashes,
        parentBlockHash: e.parentBlockHash ?? null,
        tokenIds: e.tokenIds,
        blockSize: e.blockSize,
        medium: e.medium,
      }
    case 'BlockRemoved':
      return { type: e.type, blockHashes: e.blockHashes, medium: e.medium }
    default:
      return { type: e.type }
  }
}

/**
 * Calls `onBatch(events)` with each batch of shaped events and `onEnd()` once the store is
 * gone; returns the function that stops listening.
 */
function listen(store, onBatch, onEnd) {
  let ended = false
  const id = store.subscribeEvents((batch) => {
    if (ended) return
    if (batch.length === 0) {
      ended = true
      onEnd()
      return
    }
    onBatch(batch.map(shape))
  })
  return () => {
    if (!ended) {
      ended = true
      store.unsubscribeEvents(id)
    }
  }
}

function events(options) {
  const { signal } = checkOptions(options, { signal: 'object' }, 'events')
  const queue = []
  let head = 0
  let waiter = null
  let failure = null
  let done = false
  const settle = () => {
    if (waiter === null) return
    const w = waiter
    if (head < queue.length) {
      waiter = null
      w.resolve({ value: queue[head++], done: false })
    } else if (failure !== null) {
      waiter = null
      w.reject(failure)
      failure = null
    } else if (done) {
      waiter = null
      w.resolve({ value: undefined, done: true })
    }
  }
  const finish = () => {
    done = true
    stop()
    signal?.removeEventListener('abort', onAbort)
    settle()
  }
  const onAbort = () => {
    failure = abortError(signal)
    queue.length = head = 0
    finish()
  }
  const stop = listen(
    this,
    (batch) => {
      if (head > 1024 && head * 2 > queue.length) {
        queue.splice(0, head)
        head = 0
      }
      queue.push(...batch)
      settle()
    },
    finish,
  )
  if (signal?.aborted) onAbort()
  else signal?.addEventListener('abort', onAbort, { once: true })
  return {
    next() {
      if (head < queue.length) return Promise.resolve({ value: queue[head++], done: false })
      if (failure !== null) {
        const f = failure
        failure = null
        return Promise.reject(f)
      }
      if (done) return Promise.resolve({ value: undefined, done: true })
      return new Promise((resolve, reject) => {
        waiter = { resolve, reject }
      })
    },
    return() {
      queue.length = head = 0
      finish()
      return Promise.resolve({ value: undefined, done: true })
    },
    [Symbol.asyncIterator]() {
      return this
    },
  }
}

function attach(PromptStore) {
  Object.defineProperty(PromptStore.prototype, 'events', { value: events, writable: true, configurable: true })
}

module.exports = { attach, listen }

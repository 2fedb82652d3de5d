'use strict'
// The state streams of KvCache (`createStateReadStream` / `createStateWriteStream`): Node
// streams around a native session (src/state_stream.rs), which holds the cache's queue slot
// and copies each chunk. The stream machinery (backpressure, `pipeline`, `destroy`) is Node's
// own. index.js calls `attach(KvCache)`.

const { Readable, Writable } = require('node:stream')

// the error every abort of this addon rejects or fails with
function abortError(signal) {
  const e = new Error('the operation was aborted', { cause: signal.reason })
  e.code = 'ERR_KV_ABORTED'
  e.name = 'AbortError'
  return e
}

// destroys the stream with a coded abort error when the signal fires; one listener, removed
// when the stream closes
function watch(stream, signal) {
  if (signal == null) return
  const onAbort = () => stream.destroy(abortError(signal))
  if (signal.aborted) {
    process.nextTick(onAbort)
    return
  }
  signal.addEventListener('abort', onAbort, { once: true })
  stream.once('close', () => signal.removeEventListener('abort', onAbort))
}

// the session's own close: releases the cache (and rolls back an unfinished load)
function close(session, err, callback) {
  try {
    session.close()
  } catch (e) {
    err ??= e
  }
  callback(err)
}

class KvStateReadStream extends Readable {
  #session
  #chunk
  #done = 0

  constructor(session) {
    super({ highWaterMark: session.chunkSize })
    this.#session = session
    this.#chunk = session.chunkSize
    // size of the whole state in bytes (stateSize); known once the stream holds the cache
    this.size = session.size()
    session.opened.catch(() => {})
    watch(this, session.signal)
  }

  _construct(callback) {
    this.#session.opened.then(() => {
      this.size = this.#session.size()
      callback()
    }, callback)
  }

  _read() {
    const n = Math.min(this.#chunk, this.size - this.#done)
    if (n === 0) {
      this.push(null)
      return
    }
    const chunk = Buffer.allocUnsafe(n)
    let got
    try {
      got = this.#session.readInto(chunk)
    } catch (e) {
      this.destroy(e)
      return
    }
    this.#done += got
    this.push(got === n ? chunk : chunk.subarray(0, got))
    if (this.#done === this.size) {
      // release the cache with the last byte, not when the consumer gets to 'end'
      try {
        this.#session.close()
      } catch (e) {
        this.destroy(e)
        return
      }
      this.push(null)
    }
  }

  _destroy(err, callback) {
    close(this.#session, err, callback)
  }
}

class KvStateWriteStream extends Writable {
  #session

  constructor(session) {
    super({ highWaterMark: session.chunkSize })
    this.#session = session
    // what the load did (a ReadResult), once 'finish' is emitted
    this.result = null
    session.opened.catch(() => {})
    watch(this, session.signal)
  }

  _construct(callback) {
    this.#session.opened.then(() => callback(), callback)
  }

  _write(chunk, _encoding, callback) {
    try {
      this.#session.write(chunk)
    } catch (e) {
      callback(e)
      return
    }
    callback()
  }

  _final(callback) {
    try {
      this.result = this.#session.finish()
      this.#session.close()
    } catch (e) {
      callback(e)
      return
    }
    callback()
  }

  _destroy(err, callback) {
    close(this.#session, err, callback)
  }
}

// Adds the two public methods to the class; the native `open*Session` methods check the
// arguments (coded errors thrown here, before any stream exists) and queue the session.
function attach(KvCache) {
  Object.defineProperties(KvCache.prototype, {
    createStateReadStream: {
      value: function createStateReadStream(seqId, options) {
        return new KvStateReadStream(this.openStateReadSession(seqId, options))
      },
      writable: true,
      configurable: true,
    },
    createStateWriteStream: {
      value: function createStateWriteStream(seqId, options) {
        return new KvStateWriteStream(this.openStateWriteSession(seqId, options))
      },
      writable: true,
      configurable: true,
    },
  })
}

module.exports = { attach, abortError }

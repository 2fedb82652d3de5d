'use strict'
// llama-kv-cache/node-llama-cpp: a node-llama-cpp (3.22+) context sequence that keeps its prompts
// in a PromptStore across restarts and processes.
//
//   const reuse = reusePrompts(sequence, { path: '/var/cache/prompts' })
//   const session = new LlamaChatSession({ contextSequence: sequence })
//   await session.prompt('Hello')   // restores the longest stored prefix, evaluates the rest, stores the turn
//   await reuse.close()
//
// The adapter wraps the evaluation methods of this one sequence object (never the class):
// `evaluate`, `evaluateWithMetadata`, `evaluateWithoutGeneratingNewTokens` and
// `controlledEvaluate`, which are what LlamaChatSession, LlamaChat, LlamaCompletion and direct
// callers use. Before an evaluation it looks the tokens the sequence will hold (the prefix it
// holds + the input) up in the store; when the store holds a longer prefix than the sequence, it
// writes that prefix as a sequence file (ggsq v3, what node-llama-cpp's llama.cpp reads) into a
// private folder, loads it with `loadStateFromFile`, and hands node-llama-cpp only the rest.
// After the evaluation it saves the sequence (`saveStateToFile`) and ingests the file
// (`putFile`): a checkpoint per turn, plus one at the end of each prompt (see putAfterPrompt).
// node-llama-cpp is never imported: the app hands its own objects in.

const path = require('node:path')
const { codedError, splitOptions, openStore, ScratchFolder, commonPrefix, flashAttnOf } = require('./common.js')
const { inspectState } = require('../index.js')

const WHO = 'reusePrompts'

/** The adapter's own options and their types; every other option goes to PromptStore. */
const OWN_OPTIONS = {
  putAfterEvaluation: 'boolean',
  putAfterPrompt: 'boolean',
  minRestoreTokens: 'number',
  onError: 'function',
}

/** The sequence's methods the adapter wraps. */
const WRAPPED = ['evaluate', 'evaluateWithMetadata', 'evaluateWithoutGeneratingNewTokens', 'controlledEvaluate']
/** ...and the ones it calls. */
const NEEDED = [...WRAPPED, 'saveStateToFile', 'loadStateFromFile']

/** Sequences with an open adapter (two adapters on one sequence would restore and put twice). */
const attached = new WeakMap()

/** A short description of a bad value for error messages. */
function describe(value) {
  if (value === null) return 'null'
  if (Array.isArray(value)) return 'an array'
  if (typeof value === 'object') {
    const name = value.constructor && value.constructor.name
    return name && name !== 'Object' ? `a ${name}` : 'an object'
  }
  if (typeof value === 'string') return `the string ${JSON.stringify(value.length > 40 ? value.slice(0, 40) + '...' : value)}`
  return typeof value === 'undefined' ? 'undefined' : `${typeof value} ${String(value)}`
}

/** Whether an item of `controlledEvaluate`'s input asks for an output after its token. */
function wantsOutput(item) {
  if (!Array.isArray(item)) return false
  const next = item[1] && item[1].generateNext
  if (next === null || typeof next !== 'object') return false
  return Object.keys(next).some((k) => k !== 'options' && next[k] != null && next[k] !== false)
}

/** The absolute path of the model file the peer loaded. */
function modelFileOf(sequence) {
  const model = sequence.model
  // node-llama-cpp keeps the resolved path in `_modelPath`; its public `filename` is only the
  // file's base name, which would key the store by whatever file of that name the cwd holds
  const file = model && (typeof model._modelPath === 'string' ? model._modelPath : model.filename)
  if (typeof file !== 'string' || file.length === 0) {
    throw codedError('ERR_KV_INVALID_ARG', `${WHO}: the sequence's model does not say which file it loaded (model.filename is ${describe(model && model.filename)})`)
  }
  if (!path.isAbsolute(file)) {
    throw codedError(
      'ERR_KV_INVALID_ARG',
      `${WHO}: the sequence's model gives only its file name ${JSON.stringify(file)}, not the file's path, so the store cannot be keyed by the weights`,
    )
  }
  return file
}

function checkSequence(sequence) {
  if (sequence === null || typeof sequence !== 'object') {
    throw codedError('ERR_KV_INVALID_ARG', `${WHO}: sequence must be a node-llama-cpp LlamaContextSequence (context.getSequence()), got ${describe(sequence)}`)
  }
  for (const name of NEEDED) {
    if (typeof sequence[name] !== 'function') {
      throw codedError(
        'ERR_KV_INVALID_ARG',
        `${WHO}: sequence must be a node-llama-cpp LlamaContextSequence (context.getSequence()): ${describe(sequence)} has no method ${name}`,
      )
    }
  }
  if (!Array.isArray(sequence.contextTokens)) {
    throw codedError('ERR_KV_INVALID_ARG', `${WHO}: sequence.contextTokens must be an array of token ids, got ${describe(sequence.contextTokens)}`)
  }
  if (sequence.disposed === true) throw codedError('ERR_KV_DISPOSED', `${WHO}: the sequence is disposed`)
  if (attached.has(sequence)) {
    throw codedError('ERR_KV_INVALID_ARG', `${WHO}: the sequence already has a reusePrompts adapter; close() it before attaching another`)
  }
  if (sequence.tokenPredictor != null) {
    // a predictor's draft tokens sit in the sequence's cells beyond contextTokens, so a saved
    // file's cells and tokens would disagree
    throw codedError('ERR_KV_UNSUPPORTED', `${WHO}: sequences with a tokenPredictor (speculative decoding) are not supported`)
  }
  const loras = sequence.context && sequence.context._loraAdapters
  if (loras && typeof loras.size === 'number' && loras.size > 0) {
    // LoRA adapters change K/V, and the store is keyed by the model file alone
    throw codedError('ERR_KV_UNSUPPORTED', `${WHO}: contexts with LoRA adapters are not supported (their K/V differ from the model file's)`)
  }
}

function checkOptions(own) {
  const m = own.minRestoreTokens
  if (m !== undefined && !(Number.isInteger(m) && m >= 0)) {
    throw codedError('ERR_KV_INVALID_ARG', `${WHO}: option 'minRestoreTokens' must be an integer >= 0, got ${describe(m)}`)
  }
  return {
    putAfterEvaluation: own.putAfterEvaluation ?? true,
    putAfterPrompt: own.putAfterPrompt ?? true,
    minRestoreTokens: m ?? 16,
    onError: own.onError ?? null,
  }
}

/** An error the adapter absorbed, as an Error with an ERR_KV_* code. */
function asCoded(e, stage) {
  if (e instanceof Error && typeof e.code === 'string' && e.code.startsWith('ERR_KV_')) return e
  const code = stage === 'restore' ? 'ERR_KV_INVALID_STATE' : 'ERR_KV_IO'
  const err = codedError(code, `${WHO}: ${stage} failed: ${e instanceof Error ? e.message : String(e)}`)
  err.cause = e
  return err
}

/** Whether the file's V rows are untransposed (flash attention), or null when it does not say. */
function layoutOf(file) {
  try {
    return flashAttnOf(inspectState(file))
  } catch {
    return null
  }
}

const sameTokens = (a, b) => a !== null && b !== null && a.length === b.length && commonPrefix(a, b) === a.length

/**
 * What `reusePrompts` returns. The sequence evaluates as before, with the store's prefixes
 * restored before each evaluation and its state stored after it.
 */
class PromptReuse {
  #seq
  #store
  #opts
  #scratch = new ScratchFolder('llama-kv-nlc-')
  #fileOptions
  #flashAttn
  #nStream
  #originals = new Map()
  #wrappers = new Map()
  #queue = Promise.resolve()
  #pending = new Set()
  #passThrough = new WeakSet()
  #lastPutTokens = null
  #lastRestore = null
  #lastPut = null
  #lastError = null
  #closed = false
  #closing = null
  #disposeListener = null

  constructor(sequence, store, opts) {
    this.#seq = sequence
    this.#store = store
    this.#opts = opts
    const context = sequence.context
    // `durable: false`: the file is loaded at once and thrown away, no fsync needed
    this.#fileOptions = { kind: 'sequence', version: 3, durable: false }
    // llama.cpp gives each sequence of a context of several its own KV stream (n_stream =
    // n_seq_max; node-llama-cpp does not unify them), and reads a sequence file only with as many
    // streams as it has: the store writes them (`nStream`). A recurrent memory (Mamba) has no
    // streams.
    const insights = sequence.model && sequence.model.fileInsights
    const recurrentOnly = !!(insights && insights.isRecurrent === true && insights.isHybrid !== true)
    const total = context && Number.isInteger(context.totalSequences) ? context.totalSequences : 1
    this.#nStream = recurrentOnly ? 1 : Math.max(1, total)
    // the V layout of the files (transposed without flash attention): node-llama-cpp's default
    // 'auto' lets llama.cpp decide, so it is learned from the first file saved or loaded
    const fa = context ? context.flashAttention : undefined
    this.#flashAttn = recurrentOnly ? false : typeof fa === 'boolean' ? fa : null
    for (const name of WRAPPED) {
      this.#originals.set(name, {
        own: Object.getOwnPropertyDescriptor(sequence, name),
        fn: sequence[name],
      })
    }
    const self = this
    const orig = (name) => this.#originals.get(name).fn
    this.#wrappers.set('evaluate', function evaluate(tokens, options) {
      if (self.#closed || !Array.isArray(tokens) || tokens.length === 0) return orig('evaluate').call(sequence, tokens, options)
      return self.#generate(tokens, (rest) => {
        // the original evaluate calls this.evaluateWithMetadata(rest, ...), which must not restore again
        self.#passThrough.add(rest)
        return orig('evaluate').call(sequence, rest, options)
      })
    })
    this.#wrappers.set('evaluateWithMetadata', function evaluateWithMetadata(tokens, metadata, options) {
      if (self.#closed || self.#passThrough.has(tokens) || !Array.isArray(tokens) || tokens.length === 0) {
        self.#passThrough.delete(tokens)
        return orig('evaluateWithMetadata').call(sequence, tokens, metadata, options)
      }
      return self.#generate(tokens, (rest) => orig('evaluateWithMetadata').call(sequence, rest, metadata, options))
    })
    this.#wrappers.set('evaluateWithoutGeneratingNewTokens', function evaluateWithoutGeneratingNewTokens(tokens, options) {
      // `_skipLock`: node-llama-cpp re-evaluating inside its own evaluation (a context shift)
      if (self.#closed || (options && options._skipLock) || !Array.isArray(tokens) || tokens.length === 0) {
        return orig('evaluateWithoutGeneratingNewTokens').call(sequence, tokens, options)
      }
      return self.#evaluateOnly(tokens, options)
    })
    this.#wrappers.set('controlledEvaluate', function controlledEvaluate(input, options) {
      if (self.#closed || !Array.isArray(input) || input.length === 0) return orig('controlledEvaluate').call(sequence, input, options)
      return self.#controlled(input, options)
    })
    for (const [name, fn] of this.#wrappers) {
      Object.defineProperty(sequence, name, { value: fn, writable: true, configurable: true, enumerable: false })
    }
    const onDispose = sequence.onDispose
    if (onDispose && typeof onDispose.createListener === 'function') {
      this.#disposeListener = onDispose.createListener(() => {
        this.close().catch(() => {})
      })
    }
  }

  /** The PromptStore this adapter restores from and puts into. */
  get store() {
    return this.#store
  }

  /**
   * The latest evaluation's restore: `{ restoredTokens, evaluatedTokens, lookupTokens,
   * heldTokens }`, or null before the first one.
   */
  get lastRestore() {
    return this.#lastRestore
  }

  /** What the latest successful put stored (PromptStore's `putFile` result), or null. */
  get lastPut() {
    return this.#lastPut
  }

  /**
   * The latest error the adapter absorbed (a failed lookup, write, load, save or put; the
   * evaluation went on without it), or null. Every one has an `ERR_KV_*` code.
   */
  get lastError() {
    return this.#lastError
  }

  /** Whether `close()` was called. */
  get closed() {
    return this.#closed
  }

  /**
   * Detaches from the sequence (its methods are its own again), waits for the puts in flight,
   * and removes the adapter's private folder. Idempotent.
   */
  close() {
    if (this.#closing !== null) return this.#closing
    this.#closed = true
    const seq = this.#seq
    for (const [name, fn] of this.#wrappers) {
      // a wrapper someone installed over ours stays; ours then passes every call through
      if (seq[name] !== fn) continue
      const { own } = this.#originals.get(name)
      if (own) Object.defineProperty(seq, name, own)
      else delete seq[name]
    }
    if (attached.get(seq) === this) attached.delete(seq)
    if (this.#disposeListener !== null) {
      if (typeof this.#disposeListener.dispose === 'function') this.#disposeListener.dispose()
      this.#disposeListener = null
    }
    this.#closing = (async () => {
      await this.#queue
      await Promise.allSettled([...this.#pending])
      this.#scratch.remove()
    })()
    return this.#closing
  }

  /** Runs `work` alone among this adapter's restores and puts. */
  async #exclusive(work) {
    let release
    const mine = new Promise((resolve) => (release = resolve))
    const before = this.#queue
    this.#queue = before.then(() => mine)
    await before
    try {
      return await work()
    } finally {
      release()
    }
  }

  #record(e, stage) {
    const err = asCoded(e, stage)
    this.#lastError = err
    if (this.#opts.onError !== null) {
      try {
        this.#opts.onError(err)
      } catch {
        // the app's handler failing must not fail its evaluation either
      }
    }
    return err
  }

  /**
   * Restores the longest stored prefix of (held tokens + `input`), at most `limit` tokens, when
   * it is worth it. Returns `{ all, held, now }`: the tokens the sequence will hold, how many it
   * held, and how many it holds now (the rest, `all.slice(now)`, is left to evaluate).
   */
  async #prepare(input, limitFromEnd) {
    const seq = this.#seq
    const heldTokens = seq.contextTokens
    const held = heldTokens.length
    const all = heldTokens.concat(Array.from(input))
    const contextSize = typeof seq.contextSize === 'number' ? seq.contextSize : Infinity
    const limit = Math.min(all.length - limitFromEnd, contextSize - 1)
    let lookup = 0
    let restored = 0
    if (limit - held >= Math.max(1, this.#opts.minRestoreTokens)) {
      try {
        lookup = await this.#store.lookup(all.slice(0, limit))
        if (this.#worth(lookup, held)) restored = await this.#restore(all.slice(0, lookup))
      } catch (e) {
        this.#record(e, 'restore')
      }
    }
    let now = seq.contextTokens
    if (commonPrefix(now, all) !== now.length) {
      // cannot happen with a file the store wrote; evaluate from scratch rather than continue a
      // state that is not a prefix of the input
      this.#record(codedError('ERR_KV_INTERNAL', `${WHO}: the restored sequence holds tokens that are not a prefix of its input`), 'restore')
      if (typeof seq.clearHistory !== 'function') throw codedError('ERR_KV_INTERNAL', `${WHO}: the restored sequence holds tokens that are not a prefix of its input`)
      await seq.clearHistory()
      now = seq.contextTokens
      restored = 0
    }
    this.#lastRestore = { restoredTokens: restored, evaluatedTokens: all.length - now.length, lookupTokens: lookup, heldTokens: held }
    return { all, held, now: now.length }
  }

  /**
   * Writes the longest stored prefix of `prefix` as a sequence file of the context's streams and
   * loads it; returns the tokens loaded (0: none, or too few to be worth it). While the V layout
   * is unknown (flash attention 'auto'), the store's own layout is tried, then each; a context of
   * several sequences that does not take a file of a stream each (a node-llama-cpp that unifies
   * their cache) is tried with one. What loads is kept.
   */
  async #restore(prefix) {
    const seq = this.#seq
    const layouts = this.#flashAttn === null ? [undefined, true, false] : [this.#flashAttn]
    const streams = this.#nStream === 1 ? [1] : [this.#nStream, 1]
    let failure = null
    for (const flashAttn of layouts) {
      for (const nStream of streams) {
        const held = seq.contextTokens.length // a failed load empties the sequence
        try {
          return await this.#scratch.withFile('.ggsq', async (file) => {
            const options = { ...this.#fileOptions }
            if (flashAttn !== undefined) options.flashAttn = flashAttn
            if (nStream > 1) options.nStream = nStream
            const n = await this.#store.writeFile(prefix, file, options)
            if (!this.#worth(n, held)) return 0 // evicted since the lookup
            await seq.loadStateFromFile(file, { acceptRisk: true })
            if (this.#flashAttn === null) this.#flashAttn = flashAttn ?? layoutOf(file)
            this.#nStream = nStream
            return n
          })
        } catch (e) {
          failure = e
        }
      }
    }
    throw failure
  }

  /** Learns the V layout from a file the peer saved, while it is unknown. */
  #learnLayout(file) {
    if (this.#flashAttn === null) this.#flashAttn = layoutOf(file)
  }

  /** Whether restoring `n` tokens into a sequence holding `held` spares enough evaluation. */
  #worth(n, held) {
    const gain = n - held
    if (gain <= 0 || gain < this.#opts.minRestoreTokens) return false
    // a restore writes and loads the whole prefix: over a long held prefix, only for a real gain
    return held === 0 || gain * 16 >= n
  }

  /** Saves the sequence and ingests the file; skipped when nothing changed since the last put. */
  async #putNow() {
    const seq = this.#seq
    if (!this.#opts.putAfterEvaluation || this.#closed || seq.disposed === true) return
    const tokens = seq.contextTokens
    if (tokens.length === 0 || sameTokens(tokens, this.#lastPutTokens)) return
    try {
      await this.#scratch.withFile('.ggsq', async (file) => {
        await seq.saveStateToFile(file)
        this.#learnLayout(file)
        this.#lastPut = await this.#store.putFile(file)
      })
      this.#lastPutTokens = tokens
    } catch (e) {
      this.#record(e, 'put')
    }
  }

  /**
   * Saves the sequence now and ingests the file in the background (awaited before the next put
   * and by close): the prompt's checkpoint, taken while a generation is paused.
   */
  async #putInBackground() {
    const seq = this.#seq
    if (!this.#opts.putAfterEvaluation || this.#closed || seq.disposed === true) return
    const tokens = seq.contextTokens
    if (tokens.length === 0 || sameTokens(tokens, this.#lastPutTokens)) return
    let saved
    const savedPromise = new Promise((resolve) => (saved = resolve))
    const work = this.#scratch
      .withFile('.ggsq', async (file) => {
        try {
          await seq.saveStateToFile(file)
        } finally {
          saved()
        }
        this.#learnLayout(file)
        this.#lastPut = await this.#store.putFile(file)
        this.#lastPutTokens = tokens
      })
      .catch((e) => {
        this.#record(e, 'put')
      })
    this.#pending.add(work)
    work.finally(() => this.#pending.delete(work))
    await savedPromise
  }

  async #settlePending() {
    if (this.#pending.size > 0) await Promise.allSettled([...this.#pending])
  }

  async #evaluateOnly(tokens, options) {
    const original = this.#originals.get('evaluateWithoutGeneratingNewTokens').fn
    return this.#exclusive(async () => {
      const { all, now } = await this.#prepare(tokens, 0)
      const result = await original.call(this.#seq, all.slice(now), options)
      await this.#settlePending()
      await this.#putNow()
      return result
    })
  }

  async #controlled(input, options) {
    const original = this.#originals.get('controlledEvaluate').fn
    return this.#exclusive(async () => {
      let firstOutput = input.findIndex(wantsOutput)
      if (firstOutput < 0) firstOutput = input.length
      const tokens = input.map((item) => (Array.isArray(item) ? item[0] : item))
      // never restore past a token whose output is asked for: it must be evaluated
      const { all, held, now } = await this.#prepare(tokens, input.length - firstOutput)
      const shift = now - held // > 0: input items now held; < 0: held tokens lost by a failed load
      const rest = shift >= 0 ? input.slice(shift) : [...all.slice(now, held), ...input]
      let callOptions = options
      if (shift !== 0 && options && typeof options.onTokenResult === 'function') {
        const onTokenResult = options.onTokenResult
        callOptions = { ...options, onTokenResult: (index, output) => onTokenResult(index + shift, output) }
      }
      const result = await original.call(this.#seq, rest, callOptions)
      let mapped = result
      if (shift !== 0 && Array.isArray(result)) {
        mapped = []
        for (let i = 0; i < result.length; i++) if (i in result && i + shift >= 0) mapped[i + shift] = result[i]
      }
      await this.#settlePending()
      await this.#putNow()
      return mapped
    })
  }

  /**
   * A generator evaluation (`evaluate`, `evaluateWithMetadata`): restore, then the original
   * generator over the rest of the input. The prompt's checkpoint is saved when the app asks
   * for the second token (the sequence then holds exactly the prompt), so the first token is
   * not delayed; the state is put when the generator finishes or is returned early.
   */
  async *#generate(tokens, start) {
    let inner = null
    let first
    let failed = false
    try {
      await this.#exclusive(async () => {
        const { all, now } = await this.#prepare(tokens, 1)
        inner = start(all.slice(now))
        first = await inner.next()
      })
    } catch (e) {
      if (inner !== null) await inner.return()
      throw e
    }
    try {
      let step = first
      let given = 0
      while (!step.done) {
        const input = yield step.value
        if (given++ === 0 && this.#opts.putAfterPrompt) await this.#putInBackground()
        step = await inner.next(input)
      }
      return step.value
    } catch (e) {
      failed = true
      throw e
    } finally {
      await inner.return()
      if (!failed) {
        await this.#exclusive(async () => {
          await this.#settlePending()
          await this.#putNow()
        })
      }
    }
  }
}

/**
 * Keeps the prompts of a node-llama-cpp context sequence in a PromptStore: before each
 * evaluation the longest stored prefix is restored, after it the sequence's state is stored.
 * `options`: PromptStore's (`path`, `url`, `tiers`, `blockTokens`, ...; not `model`: the store
 * is keyed by the sequence's own model file) and the adapter's own (`putAfterEvaluation`,
 * `putAfterPrompt`, `minRestoreTokens`, `onError`).
 */
function reusePrompts(sequence, options) {
  checkSequence(sequence)
  const { own, store: storeOptions } = splitOptions(options, OWN_OPTIONS, WHO)
  const opts = checkOptions(own)
  const store = openStore(modelFileOf(sequence), storeOptions, WHO, Object.keys(OWN_OPTIONS))
  const reuse = new PromptReuse(sequence, store, opts)
  attached.set(sequence, reuse)
  return reuse
}

module.exports = { reusePrompts }

'use strict'
// `llama-kv-cache/llama.node`: prompt reuse for @fugood/llama.node (1.7.15 and later).
//
//   const { loadModel } = require('@fugood/llama.node')
//   const { reusePrompts } = require('llama-kv-cache/llama.node')
//   const context = await loadModel({ model: '/models/x.gguf', n_ctx: 4096 })
//   const reuse = reusePrompts(context, { modelPath: '/models/x.gguf', path: '/var/cache/prompts' })
//   const result = await reuse.completion({ prompt, n_predict: 64 })   // as context.completion
//
// Each turn: the prompt's tokens as llama.node will evaluate them (its BOS + `tokenize`, or the
// chat template's text for `messages`) are looked up in the store; when the store holds a longer
// prefix than the context can keep, that prefix is written as a session file (ggsn v9) into a
// private folder and loaded with `context.loadSession`, so llama.node evaluates only the rest.
// After the completion, `context.saveSession` + `store.putFile` leave a checkpoint of the turn for
// every process sharing the store. The store's work never fails the app's turn: a failed lookup,
// restore or put falls back to what llama.node alone does and is kept in `lastError`. A predicted
// token list that is wrong costs reuse, never correctness: llama.node compares a loaded file's
// tokens with the prompt it evaluates and keeps only their common prefix.
//
// What llama.node 1.7.15 does that the adapter works around:
// - after a failed `loadSession` its memory is gone but its token list is not, so the next
//   completion would continue from a state it no longer holds: the adapter clears the context;
// - the V layout (flash attention or not) of a context is not exposed: a file the context
//   refuses is written once more in the other layout, and the layout is learned from the
//   context's own checkpoint;
// - a context does not say which model file it loaded: `modelPath` is checked against what it
//   reports (see verifyModel).
// This module never loads @fugood/llama.node: it receives the app's context.

const { codedError, splitOptions, openStore, ScratchFolder, commonPrefix, flashAttnOf } = require('./common.js')
const { modelInfoSync, inspectState } = require('../index.js')

const WHO = 'reusePrompts'

/** The adapter's own options (name -> typeof); everything else goes to the PromptStore. */
const OWN = { modelPath: 'string', checkpoints: 'boolean', flashAttn: 'boolean' }

/** What a llama.node context must offer (the wrapper `loadModel` resolves to). */
const CONTEXT_METHODS = ['completion', 'tokenize', 'saveSession', 'loadSession', 'getModelInfo', 'clearCache']

/** Memories whose cells the peer can cut back to any common prefix (no recurrent state). */
const ROLLBACK_MEMORIES = new Set(['unified', 'iswa', 'dsa', 'dsa-iswa', 'msa'])

/** llama.node 1.7.15 reads session files of version 9. */
const SESSION = { kind: 'session', version: 9 }

const noop = () => {}

function abortError(signal) {
  const e = codedError('ERR_KV_ABORTED', `${WHO}: the completion was aborted${signal?.reason?.message ? `: ${signal.reason.message}` : ''}`)
  e.name = 'AbortError'
  return e
}

function messageOf(e) {
  return e && typeof e.message === 'string' ? e.message : String(e)
}

/**
 * An error of the peer as one of the package's: `ERR_KV_BUSY` when the context says another
 * completion is in progress (the adapter runs one at a time, so the app used the context
 * directly, or llama.node 1.7.15 left it marked busy: it sets the flag's reset after queueing
 * the work, and never resets it after a failed completion), else `ERR_KV_BACKEND`. The peer's
 * own error is the `cause`.
 */
function peerError(call, e) {
  const msg = messageOf(e)
  const busy = /another completion is in progress/i.test(msg)
  const err = codedError(
    busy ? 'ERR_KV_BUSY' : 'ERR_KV_BACKEND',
    busy
      ? `${WHO}: llama.node's context.${call} failed: ${msg} (nothing of this adapter runs on it; llama.node 1.7.15 can leave a context marked busy: a new context with a new adapter restores the conversation from the store)`
      : `${WHO}: llama.node's context.${call} failed: ${msg}`,
  )
  err.cause = e
  return err
}

function hasMedia(options) {
  const m = options.media_paths
  if (typeof m === 'string' ? m.length > 0 : Array.isArray(m) && m.length > 0) return true
  if (!Array.isArray(options.messages)) return false
  return options.messages.some((msg) => Array.isArray(msg?.content) && msg.content.some((part) => part && part.type !== 'text'))
}

function sameLora(a, b) {
  return a.length === b.length && a.every((x, i) => x.path === b[i].path && x.scaled === b[i].scaled)
}

function loraList(context) {
  if (typeof context.getLoadedLoraAdapters !== 'function') return []
  const list = context.getLoadedLoraAdapters() ?? []
  return Array.from(list, (a) => ({ path: String(a.path), scaled: Number(a.scaled) }))
}

/**
 * Checks that `modelPath` is the model `context` loaded: llama.node does not say which file it
 * loaded, so what it reports (`getModelInfo()`) is compared with the file's header
 * (`modelInfoSync`), and, where the context exposes llama.node's own GGUF reader, every metadata
 * value with the file's. Returns the file's `modelInfoSync`.
 */
function verifyModel(context, modelPath) {
  const file = modelInfoSync(modelPath)
  let peer
  try {
    peer = context.getModelInfo()
  } catch (e) {
    throw peerError('getModelInfo()', e)
  }
  const meta = peer?.metadata ?? {}
  const arch = meta['general.architecture']
  const mismatch = (field, fileValue, contextValue) => {
    const e = codedError(
      'ERR_KV_STORE_GEOMETRY',
      `${WHO}: modelPath ${modelPath} is not the model this context loaded: ${field} is ${JSON.stringify(fileValue)} in the file, ${JSON.stringify(contextValue)} in the context`,
    )
    e.field = field
    e.file = fileValue
    e.context = contextValue
    return e
  }
  const checks = [
    ['general.architecture', file.arch, arch],
    ['general.name', file.name, meta['general.name']],
    ['nEmbd', file.nEmbd, peer?.nEmbd],
    [`${file.arch}.block_count`, file.nLayer, meta[`${arch}.block_count`] === undefined ? undefined : Number(meta[`${arch}.block_count`])],
    [`${file.arch}.context_length`, file.nCtxTrain, meta[`${arch}.context_length`] === undefined ? undefined : Number(meta[`${arch}.context_length`])],
  ]
  for (const [field, fileValue, contextValue] of checks) {
    if (fileValue === undefined || fileValue === null || contextValue === undefined || contextValue === null) continue
    if (fileValue !== contextValue) throw mismatch(field, fileValue, contextValue)
  }
  if (['unified', 'iswa', 'recurrent', 'hybrid', 'hybrid-iswa'].includes(file.memory)) {
    const recurrent = file.memory === 'recurrent'
    const hybrid = file.memory.startsWith('hybrid')
    if (typeof peer?.is_recurrent === 'boolean' && peer.is_recurrent !== recurrent) throw mismatch('recurrent', recurrent, peer.is_recurrent)
    if (typeof peer?.is_hybrid === 'boolean' && peer.is_hybrid !== hybrid) throw mismatch('hybrid', hybrid, peer.is_hybrid)
  }
  // The weights' bytes: llama.cpp's model size sums the tensors, the file's data section also
  // holds their alignment padding. A split model's first file holds only part of them.
  const split = Number(meta['split.count'] ?? 0) > 1
  if (!split && typeof peer?.size === 'number' && peer.size > 0) {
    const align = Number(meta['general.alignment'] ?? 32) || 32
    if (peer.size > file.dataSize || file.dataSize - peer.size >= align * Math.max(1, file.nTensors)) {
      throw mismatch('size', file.dataSize, peer.size)
    }
  }
  // llama.node's own reader (the native class of the wrapper's `ctx`): every metadata value.
  const read = context.ctx?.constructor?.loadModelInfo
  if (typeof read === 'function') {
    let values = null
    try {
      values = read.call(context.ctx.constructor, modelPath, ['tokenizer.ggml.tokens', 'tokenizer.ggml.token_type', 'tokenizer.ggml.merges', 'tokenizer.ggml.scores'])
    } catch {
      values = null // an older reader: the checks above stand
    }
    if (values && typeof values === 'object') {
      for (const [key, value] of Object.entries(meta)) {
        if (Object.hasOwn(values, key) && String(values[key]) !== String(value)) throw mismatch(key, values[key], value)
      }
    }
  }
  return file
}

/** How the peer turns a prompt into tokens: the vocabulary's BOS / EOS around `tokenize`. */
function tokenRule(peerInfo) {
  const meta = peerInfo?.metadata ?? {}
  const model = meta['tokenizer.ggml.model']
  const flag = (key, dflt) => (meta[key] === undefined ? dflt : meta[key] === 'true')
  // llama.cpp's defaults where the file has no flag: SPM and WPM add BOS, UGM adds EOS
  const addBos = flag('tokenizer.ggml.add_bos_token', model === 'llama' || model === 'bert')
  const addEos = flag('tokenizer.ggml.add_eos_token', model === 't5')
  const bos = Number(meta['tokenizer.ggml.bos_token_id'] ?? (model === 'llama' ? 1 : NaN))
  const eos = Number(meta['tokenizer.ggml.eos_token_id'] ?? NaN)
  return {
    prefix: addBos && Number.isInteger(bos) ? [bos] : [],
    suffix: addEos && Number.isInteger(eos) ? [eos] : [],
  }
}

/**
 * Prompt reuse for one llama.node context. Made by `reusePrompts`; see llama.node.d.ts.
 */
class LlamaNodePromptReuse {
  constructor(context, store, { modelPath, memory, rule, checkpoints, flashAttn, lora }) {
    this._context = context
    this._store = store
    this._modelPath = modelPath
    this._rollback = ROLLBACK_MEMORIES.has(memory)
    this._rule = rule
    this._checkpoints = checkpoints
    this._flashAttn = flashAttn // undefined: learned from the first checkpoint, or tried both ways
    this._lora = lora
    this._scratch = new ScratchFolder('llama-node-kv-')
    this._held = [] // the tokens the context holds, as far as this adapter knows
    this._tail = Promise.resolve()
    this._closed = false
    this._closing = null
    this.lastRestore = null
    this.lastCheckpoint = null
    this.lastError = null
  }

  /** The PromptStore. */
  get store() {
    return this._store
  }

  /** The llama.node context. */
  get context() {
    return this._context
  }

  /** The model file the store is keyed by. */
  get modelPath() {
    return this._modelPath
  }

  /** The tokens the context holds after this adapter's latest turn (a copy). */
  get contextTokens() {
    return this._held.slice()
  }

  /** Whether `close()` was called. */
  get closed() {
    return this._closed
  }

  completion(options, callback) {
    if (this._closed) return Promise.reject(codedError('ERR_KV_DISPOSED', `${WHO}: completion() after close()`))
    if (options === null || typeof options !== 'object' || Array.isArray(options)) {
      return Promise.reject(codedError('ERR_KV_INVALID_ARG', `${WHO}: completion options must be an object, got ${options === null ? 'null' : Array.isArray(options) ? 'an array' : typeof options}`))
    }
    if (callback !== undefined && typeof callback !== 'function') {
      return Promise.reject(codedError('ERR_KV_INVALID_ARG', `${WHO}: completion callback must be a function, got ${callback === null ? 'null' : typeof callback}`))
    }
    if (options.prompt !== undefined && typeof options.prompt !== 'string') {
      return Promise.reject(codedError('ERR_KV_INVALID_ARG', `${WHO}: option 'prompt' must be a string, got ${options.prompt === null ? 'null' : typeof options.prompt}`))
    }
    const { signal, ...peerOptions } = options
    if (signal !== undefined && !(signal && typeof signal.aborted === 'boolean' && typeof signal.addEventListener === 'function')) {
      return Promise.reject(codedError('ERR_KV_INVALID_ARG', `${WHO}: option 'signal' must be an AbortSignal, got ${signal === null ? 'null' : typeof signal}`))
    }
    return new Promise((resolve, reject) => {
      let started = false
      const onAbort = () => {
        if (!started) reject(abortError(signal))
      }
      signal?.addEventListener('abort', onAbort, { once: true })
      // one turn at a time: each waits for the one before it, whatever its outcome
      this._tail = this._tail.then(async () => {
        started = true
        try {
          if (signal?.aborted) throw abortError(signal)
          resolve(await this._turn(peerOptions, callback, signal))
        } catch (e) {
          reject(e)
        } finally {
          signal?.removeEventListener('abort', onAbort)
        }
      })
    })
  }

  close() {
    if (!this._closing) {
      this._closed = true
      this._closing = this._tail.then(() => this._scratch.remove())
    }
    return this._closing
  }

  /** The prompt's tokens as the peer will evaluate them, or null when they cannot be known. */
  async _predictTokens(options) {
    let text = null
    if (Array.isArray(options.messages)) {
      // llama.node formats `messages` (which win over `prompt`) with the chat template first
      if (typeof this._context.getFormattedChat !== 'function') return null
      const formatted = this._context.getFormattedChat(options.messages, options.chat_template, {
        jinja: options.jinja,
        response_format: options.response_format,
        tools: options.tools,
        parallel_tool_calls: options.parallel_tool_calls,
        tool_choice: options.tool_choice,
        enable_thinking: options.enable_thinking,
        reasoning_format: options.reasoning_format,
        add_generation_prompt: options.add_generation_prompt,
        now: options.now,
        chat_template_kwargs: options.chat_template_kwargs,
        force_pure_content: options.force_pure_content,
      })
      text = typeof formatted === 'string' ? formatted : formatted?.prompt
    } else if (typeof options.prompt === 'string') {
      text = options.prompt
    }
    if (typeof text !== 'string' || text.length === 0) return null
    let body
    try {
      body = Array.from((await this._context.tokenize(text)).tokens)
    } catch (e) {
      throw peerError('tokenize()', e)
    }
    return { body, tokens: [...this._rule.prefix, ...body, ...this._rule.suffix] }
  }

  /** Tokens of `tokens` the context can keep without a restore. */
  _reusable(tokens) {
    const held = this._held
    if (held.length === 0) return 0
    const common = commonPrefix(held, tokens)
    if (this._rollback) return Math.min(common, tokens.length - 1)
    // a recurrent state cannot go back: only a context holding a prefix of the prompt keeps it
    return common === held.length && held.length < tokens.length ? held.length : 0
  }

  async _turn(options, callback, signal) {
    const context = this._context
    const report = { restoredTokens: 0, evaluatedTokens: 0, lookupTokens: 0, promptTokens: 0, reusedTokens: 0, error: null }
    this.lastRestore = report
    this.lastCheckpoint = null
    this.lastError = null
    // a failure of the store's work: kept, never thrown (the turn goes on as llama.node alone would)
    const fail = (e) => {
      this.lastError = e
    }
    const failRestore = (e) => {
      report.error ??= e
      fail(e)
    }
    // the store is keyed by the model with the LoRA adapters of construction: others skip it
    const loraNow = loraList(context)
    const storeUsable = sameLora(loraNow, this._lora)
    if (!storeUsable) {
      failRestore(codedError('ERR_KV_STORE_GEOMETRY', `${WHO}: the context's LoRA adapters changed since reusePrompts() (${JSON.stringify(this._lora)} -> ${JSON.stringify(loraNow)}): this turn neither restores nor stores`))
    }
    let predicted = null
    if (storeUsable && !hasMedia(options)) {
      try {
        predicted = await this._predictTokens(options)
      } catch (e) {
        failRestore(e) // the turn goes on without a restore
      }
    }

    if (predicted && predicted.tokens.length > 1) {
      const tokens = predicted.tokens
      report.promptTokens = tokens.length
      report.reusedTokens = this._reusable(tokens)
      // the peer evaluates at least the prompt's last token
      const want = tokens.slice(0, tokens.length - 1)
      if (report.reusedTokens < want.length) {
        try {
          report.lookupTokens = await this._store.lookup(want, signal ? { signal } : undefined)
          if (report.lookupTokens > report.reusedTokens) await this._restore(want, report, signal)
        } catch (e) {
          if (e?.code === 'ERR_KV_ABORTED' || e?.fatal) throw e
          failRestore(e)
        }
      }
    }
    if (signal?.aborted) throw abortError(signal)

    // the app's completion, as it asked for it
    let result
    const stop = () => {
      try {
        context.stopCompletion?.()
      } catch {
        // nothing to stop
      }
    }
    signal?.addEventListener('abort', stop, { once: true })
    try {
      result = await context.completion(options, callback)
    } catch (e) {
      this._held = [] // unknown now
      throw peerError('completion()', e)
    } finally {
      signal?.removeEventListener('abort', stop)
    }
    report.evaluatedTokens = result?.timings?.prompt_n ?? 0

    await this._checkpoint(predicted, storeUsable, fail)
    if (signal?.aborted) throw abortError(signal)
    return result
  }

  /**
   * Writes the stored prefix of `want` as a session file and loads it. A file the context
   * refuses (another V layout) is written once more the other way; a context that still
   * refuses is cleared, since llama.node keeps its token list after a failed load while its
   * memory is gone, and the turn goes on cold.
   */
  async _restore(want, report, signal) {
    const context = this._context
    // undefined: as the store's first file had it; then, if the context refuses it, the other way
    let flashAttn = this._flashAttn
    let written = null // the layout of the first file written: flash attention's (V not transposed) or not
    let failure = null
    for (let attempt = 0; attempt < 2; attempt++) {
      const loaded = await this._scratch.withFile('.ggsn', async (file) => {
        const options = { ...SESSION, durable: false, ...(flashAttn === undefined ? {} : { flashAttn }), ...(signal ? { signal } : {}) }
        const n = await this._store.writeFile(want, file, options)
        if (n <= report.reusedTokens) return 0
        if (attempt === 0) written = flashAttnOf(inspectState(file))
        try {
          await context.loadSession(file)
        } catch (e) {
          failure = peerError('loadSession()', e)
          return -1
        }
        return n
      })
      if (loaded === 0) return // the store lost the prefix meanwhile: the context is as it was
      if (loaded > 0) {
        if (this._flashAttn === undefined && typeof written === 'boolean') this._flashAttn = attempt === 0 ? written : !written
        report.restoredTokens = loaded
        this._held = want.slice(0, loaded)
        return
      }
      // refused: a file of the other V layout, once, unless the layout was known or has none
      if (this._flashAttn !== undefined || typeof written !== 'boolean') break
      flashAttn = !written
    }
    // llama.node keeps its token list after a failed load while its memory is gone: clear both
    this._held = []
    try {
      context.clearCache(false)
    } catch (e) {
      const err = peerError('clearCache()', e)
      err.fatal = true // the context would continue from a state it no longer holds
      throw err
    }
    throw failure
  }

  /** Saves the context after the turn and stores it: a checkpoint per turn. */
  async _checkpoint(predicted, storeUsable, fail) {
    const context = this._context
    await this._scratch.withFile('.ggsn', async (file) => {
      try {
        await context.saveSession(file)
      } catch (e) {
        this._held = []
        fail(peerError('saveSession()', e))
        return
      }
      let info
      try {
        info = inspectState(file)
      } catch (e) {
        this._held = []
        fail(e)
        return
      }
      this._held = info.tokens
      if (this._flashAttn === undefined) this._flashAttn = flashAttnOf(info) ?? undefined
      // learn how the peer adds BOS from what it evaluated
      if (predicted) {
        const body = predicted.body
        const held = info.tokens
        const at = (off) => body.length > 0 && held.length >= off + body.length && commonPrefix(held.slice(off), body) === body.length
        if (!at(this._rule.prefix.length)) {
          if (at(0)) this._rule = { ...this._rule, prefix: [] }
          else if (at(1)) this._rule = { ...this._rule, prefix: [held[0]] }
        }
      }
      if (!this._checkpoints || !storeUsable) return
      if (info.tokens.some((t) => t < 0)) {
        // media positions carry no token id of their own: two images would share a prefix
        fail(codedError('ERR_KV_UNSUPPORTED', `${WHO}: a state with media (image or audio) positions is not stored: their tokens do not identify the media`))
        return
      }
      try {
        this.lastCheckpoint = await this._store.putFile(file)
      } catch (e) {
        fail(e)
      }
    })
  }
}

/**
 * Prompt reuse for a @fugood/llama.node context: `reusePrompts(context, { modelPath, path, ... })`.
 * See llama.node.d.ts.
 */
function reusePrompts(context, options) {
  if (context === null || typeof context !== 'object') {
    throw codedError('ERR_KV_INVALID_ARG', `${WHO}: context must be a llama.node LlamaContext (what loadModel resolves to), got ${context === null ? 'null' : typeof context}`)
  }
  for (const m of CONTEXT_METHODS) {
    if (typeof context[m] !== 'function') {
      throw codedError('ERR_KV_INVALID_ARG', `${WHO}: context must be a llama.node LlamaContext (what loadModel resolves to): it has no ${m}()`)
    }
  }
  const { own, store } = splitOptions(options, OWN, WHO)
  if (own.modelPath === undefined) {
    throw codedError('ERR_KV_INVALID_ARG', `${WHO}: option 'modelPath' is required: llama.node's context does not say which model file it loaded (pass the path given to loadModel)`)
  }
  if (own.modelPath.length === 0) throw codedError('ERR_KV_INVALID_ARG', `${WHO}: option 'modelPath' must not be empty`)
  const file = verifyModel(context, own.modelPath)
  let peerInfo
  try {
    peerInfo = context.getModelInfo()
  } catch (e) {
    throw peerError('getModelInfo()', e)
  }
  const lora = loraList(context)
  let key = own.modelPath
  if (lora.length > 0) {
    // LoRA adapters change K/V: their files and scales are part of the store's model
    const base = modelInfoSync(own.modelPath, { hashFile: true }).fingerprint
    const parts = lora.map((a) => `${modelInfoSync(a.path, { hashFile: true }).fingerprint}*${a.scaled}`)
    key = `${base}+lora:${parts.join('+')}`
  }
  const promptStore = openStore(key, store, WHO, Object.keys(OWN))
  return new LlamaNodePromptReuse(context, promptStore, {
    modelPath: own.modelPath,
    memory: file.memory,
    rule: tokenRule(peerInfo),
    checkpoints: own.checkpoints ?? true,
    flashAttn: own.flashAttn,
    lora,
  })
}

module.exports = { reusePrompts }

'use strict'
// What both peer adapters share: the store, built from the peer's own model path so an adapter
// can never feed a store another model's state; one private folder for the files a peer needs
// (it takes only paths), removed with everything in it on close and at process exit; and option
// checking with the package's error codes. No peer is imported here: an adapter receives the
// peer's objects from the app.

const fs = require('node:fs')
const os = require('node:os')
const path = require('node:path')
const { PromptStore } = require('../index.js')

/** An `Error` with one of the package's stable codes. */
function codedError(code, message) {
  const e = new Error(message)
  e.code = code
  return e
}

/**
 * Splits `options` into the adapter's own (`known`: name -> expected `typeof`) and the
 * `PromptStore` options; a `model` option is refused, since the model comes from the peer.
 */
function splitOptions(options, known, who) {
  if (options === undefined) options = {}
  if (options === null || typeof options !== 'object' || Array.isArray(options)) {
    throw codedError('ERR_KV_INVALID_ARG', `${who}: options must be an object, got ${options === null ? 'null' : typeof options}`)
  }
  const own = {}
  const store = {}
  for (const [key, value] of Object.entries(options)) {
    if (key === 'model') {
      throw codedError(
        'ERR_KV_INVALID_ARG',
        `${who}: option 'model' is not accepted: the store's model is the peer's own model file, so no other model's state can reach it`,
      )
    }
    if (Object.hasOwn(known, key)) {
      if (value !== undefined && typeof value !== known[key]) {
        throw codedError('ERR_KV_INVALID_ARG', `${who}: option '${key}' must be a ${known[key]}, got ${typeof value}`)
      }
      own[key] = value
    } else {
      store[key] = value
    }
  }
  return { own, store }
}

/**
 * A store for the model file at `modelPath` (its fingerprint keys every block, and every state
 * put is checked against it). PromptStore refuses an option it does not know; the message then
 * names the adapter's own options too (`ownNames`).
 */
function openStore(modelPath, storeOptions, who, ownNames = []) {
  if (typeof modelPath !== 'string' || modelPath.length === 0) {
    throw codedError('ERR_KV_INVALID_ARG', `${who}: the peer does not say which model file it loaded (got ${JSON.stringify(modelPath)})`)
  }
  try {
    return new PromptStore({ ...storeOptions, model: modelPath })
  } catch (e) {
    if (e && e.code === 'ERR_KV_INVALID_ARG' && /^unknown option/.test(e.message)) {
      const own = ownNames.length > 0 ? `; the adapter's own are ${ownNames.join(', ')}` : ''
      throw codedError(e.code, `${who}: ${e.message.replace(/\)$/, '')}${own}, and model comes from the peer)`)
    }
    throw e
  }
}

/** Folders still to remove when the process exits (an app that never closes its adapter). */
const liveFolders = new Set()
let exitHook = false

function removeAtExit(dir) {
  liveFolders.add(dir)
  if (!exitHook) {
    exitHook = true
    process.once('exit', () => {
      for (const d of liveFolders) fs.rmSync(d, { recursive: true, force: true })
    })
  }
}

/**
 * One private folder (mode 0700, made on first use) for the state files handed to a peer. Each
 * file has its own name, so concurrent turns never share one, and `withFile` removes it however
 * the work ends.
 */
class ScratchFolder {
  constructor(prefix) {
    this.prefix = prefix
    this.dir = null
    this.next = 0
  }

  /** Runs `work(file)` with a fresh path in the folder, removing the file afterwards. */
  async withFile(ext, work) {
    if (this.dir === null) {
      this.dir = fs.mkdtempSync(path.join(os.tmpdir(), this.prefix))
      fs.chmodSync(this.dir, 0o700)
      removeAtExit(this.dir)
    }
    const file = path.join(this.dir, `${this.next++}${ext}`)
    try {
      return await work(file)
    } finally {
      fs.rmSync(file, { force: true })
    }
  }

  /** Removes the folder and anything in it. */
  remove() {
    if (this.dir !== null) {
      fs.rmSync(this.dir, { recursive: true, force: true })
      liveFolders.delete(this.dir)
      this.dir = null
    }
  }
}

/** The length of the common prefix of two token lists. */
function commonPrefix(a, b) {
  const n = Math.min(a.length, b.length)
  let i = 0
  while (i < n && a[i] === b[i]) i++
  return i
}

module.exports = { codedError, splitOptions, openStore, ScratchFolder, commonPrefix }

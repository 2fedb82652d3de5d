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

const { codedError, optionsObject, checkType } = require('../lib/options.js')

/**
 * Splits `options` into the adapter's own (`known`: name -> expected `typeof`) and the
 * `PromptStore` options; a `model` option is refused, since the model comes from the peer.
 */
function splitOptions(options, known, who) {
  options = optionsObject(options, who)
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
      checkType(key, value, known[key], who)
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

/** Free bytes a memory-backed folder must have for the adapters to use it. */
const SHM_MIN_FREE = 1 << 30

/**
 * Where the adapters' private folders go, best first. An explicit `TMPDIR` is the app's choice
 * and is used as it is. Else, on Linux, `/dev/shm` when it is writable and has room: a file a
 * peer loads at once and removes never needs a disk, and writing a 48 MiB state to a fresh file
 * on this project's ext4 disk took 90-110 ms against 21 ms into memory (docs/benchmarks.md).
 * The system's temporary directory comes last: a container's `/dev/shm` is often 64 MiB, and a
 * file that finds no room there is written again in it.
 */
function scratchRoots() {
  const fallback = os.tmpdir()
  if (process.env.TMPDIR || process.platform !== 'linux') return [fallback]
  try {
    fs.accessSync('/dev/shm', fs.constants.W_OK)
    const { bavail, bsize } = fs.statfsSync('/dev/shm')
    if (bavail * bsize >= SHM_MIN_FREE) return ['/dev/shm', fallback]
  } catch {
    // no /dev/shm here
  }
  return [fallback]
}

/** Whether an error says the file system had no room for a file. */
function noRoom(e) {
  return !!e && (e.code === 'ENOSPC' || e.code === 'ERR_KV_STORE_FULL' || /ENOSPC|No space left on device/.test(String(e.message)))
}

/**
 * One private folder (mode 0700, made on first use) for the state files handed to a peer, in
 * the first of `scratchRoots()`. Each file has its own name, so concurrent turns never share
 * one, and `withFile` removes it however the work ends; work that finds no room is done once
 * more in a folder of the next root.
 */
class ScratchFolder {
  constructor(prefix) {
    this.prefix = prefix
    this.roots = null
    this.dir = null
    this.next = 0
  }

  /** The folder, made on first use. */
  folder() {
    if (this.dir === null) {
      if (this.roots === null) this.roots = scratchRoots()
      this.dir = fs.mkdtempSync(path.join(this.roots[0], this.prefix))
      fs.chmodSync(this.dir, 0o700)
      removeAtExit(this.dir)
    }
    return this.dir
  }

  /** Runs `work(file)` with a fresh path in the folder, removing the file afterwards. */
  async withFile(ext, work) {
    const file = path.join(this.folder(), `${this.next++}${ext}`)
    try {
      return await work(file)
    } catch (e) {
      if (!noRoom(e) || this.roots.length < 2) throw e
      // no room in memory: from now on, and for this file, the next root
      this.remove()
      this.roots.shift()
      return this.withFile(ext, work)
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

/**
 * Whether a state's V rows are untransposed (the file of a flash-attention context): from the
 * inspection's first part, or the first part that says when that one is empty (a hybrid-iSWA
 * memory's base cache of no layer); null when no part says.
 */
function flashAttnOf(info) {
  let vTrans = info.vTrans
  if (typeof vTrans !== 'boolean' && Array.isArray(info.parts)) {
    const part = info.parts.find((p) => typeof p.vTrans === 'boolean')
    vTrans = part ? part.vTrans : undefined
  }
  return typeof vTrans === 'boolean' ? !vTrans : null
}

/** The length of the common prefix of two token lists. */
function commonPrefix(a, b) {
  const n = Math.min(a.length, b.length)
  let i = 0
  while (i < n && a[i] === b[i]) i++
  return i
}

module.exports = { codedError, splitOptions, openStore, ScratchFolder, commonPrefix, flashAttnOf }

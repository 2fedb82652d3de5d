// The JS surface's names and twins: the async twins of modelInfo and convertStateFile (same
// result as the sync one, coded errors, abort), the deprecated names kept for one minor version,
// and PromptStore.close.

import test from 'ava'
import fs from 'node:fs'
import os from 'node:os'
import path from 'node:path'
import { createRequire } from 'node:module'
import { fileURLToPath } from 'node:url'

const require = createRequire(import.meta.url)
const { KvCache, PromptStore, modelInfo, modelInfoSync, convertStateFile, convertStateFileSync, inspectState } = require('../index.js')

const HERE = path.dirname(fileURLToPath(import.meta.url))
const MODEL = path.join(HERE, '..', 'interop', 'models', 'llama-h16.gguf')
const FIXTURES = path.join(HERE, 'fixtures')

const tmpDir = fs.mkdtempSync(path.join(os.tmpdir(), 'kv-surface-'))
test.after.always(() => fs.rmSync(tmpDir, { recursive: true, force: true }))
let files = 0
const tmp = (ext = '') => path.join(tmpDir, `f${files++}${ext}`)
const code = (code, message) => ({ code, ...(message ? { message } : {}) })

// ---- modelInfo ----------------------------------------------------------------------------------

test('modelInfo resolves to what modelInfoSync returns, with and without hashFile', async (t) => {
  t.deepEqual(await modelInfo(MODEL), modelInfoSync(MODEL))
  const hashed = await modelInfo(MODEL, { hashFile: true })
  t.is(hashed.fingerprint, modelInfoSync(MODEL, { hashFile: true }).fingerprint)
  t.not(hashed.fingerprint, modelInfoSync(MODEL).fingerprint, 'hashFile hashes the whole file')
})

test('modelInfo rejects a missing file with ERR_KV_IO naming it, and throws for bad arguments at once', async (t) => {
  await t.throwsAsync(modelInfo(tmp('-absent.gguf')), code('ERR_KV_IO', /absent\.gguf/))
  t.throws(() => modelInfo(42), code('ERR_KV_INVALID_ARG', /ggufPath/))
  t.throws(() => modelInfo(MODEL, { hashfile: true }), code('ERR_KV_INVALID_ARG', /hashfile/))
})

// ---- convertStateFile ---------------------------------------------------------------------------

const SOURCE = path.join(FIXTURES, 't161', 't161-gemma3-swa.ggsn')

test('convertStateFile writes the bytes convertStateFileSync writes, reporting progress up to the output size', async (t) => {
  const [a, b] = [tmp('.ggsn'), tmp('.ggsn')]
  convertStateFileSync(SOURCE, a, { version: 10 })
  const seen = []
  t.is(await convertStateFile(SOURCE, b, { version: 10, onProgress: (done, total) => seen.push([done, total]) }), undefined)
  t.deepEqual(fs.readFileSync(b), fs.readFileSync(a))
  t.is(inspectState(b).memory, 'iswa')
  // progress arrives on the JS thread, at the latest before the promise settles' next turn
  await new Promise((resolve) => setImmediate(resolve))
  t.true(seen.length >= 1, `${seen.length} progress calls`)
  t.true(seen.every(([done, total]) => total === fs.statSync(b).size && done <= total))
})

test('convertStateFile rejects with coded errors: a missing input (ERR_KV_IO), a bad option value; bad options throw at once', async (t) => {
  await t.throwsAsync(convertStateFile(tmp('-absent.ggsq'), tmp()), code('ERR_KV_IO', /absent\.ggsq/))
  t.throws(() => convertStateFile(SOURCE, tmp(), { typeK: 'q9' }), code('ERR_KV_INVALID_ARG', /q9/))
  t.throws(() => convertStateFile(SOURCE, tmp(), { onProgress: 3 }), code('ERR_KV_INVALID_ARG', /onProgress must be a function/))
  t.throws(() => convertStateFile(SOURCE, tmp(), { sigal: null }), code('ERR_KV_INVALID_ARG', /sigal/))
})

test('convertStateFile with an aborted signal rejects with ERR_KV_ABORTED and writes nothing', async (t) => {
  const out = tmp('.ggsn')
  const e = await t.throwsAsync(convertStateFile(SOURCE, out, { signal: AbortSignal.abort() }), code('ERR_KV_ABORTED'))
  t.is(e.name, 'AbortError')
  t.false(fs.existsSync(out))
})

// ---- deprecated names ---------------------------------------------------------------------------

test('the deprecated totalSize and cellMax() still answer, as totalBytes and cellEnd', (t) => {
  const c = new KvCache({ size: 64, nLayer: 2, nEmbdKGqa: 32 })
  c.prepareBatch({ pos: [0, 1, 2], seqIds: [0, 0, 0] })
  t.is(c.totalSize, c.totalBytes)
  t.is(c.totalBytes, c.sizeKBytes + c.sizeVBytes)
  t.is(c.cellEnd, 3)
  t.is(c.cellMax(), c.cellEnd)
  c.dispose()
  t.throws(() => c.cellEnd, code('ERR_KV_DISPOSED'))
})

// ---- PromptStore.close --------------------------------------------------------------------------

test('PromptStore.close: later calls throw ERR_KV_DISPOSED, closing again resolves, a running call completes', async (t) => {
  const store = new PromptStore({ model: 'surface-test', path: tmp(), blockTokens: 16 })
  const tokens = Array.from({ length: 32 }, (_, i) => i)
  const running = store.lookup(tokens)
  t.is(await store.close(), undefined)
  t.is(await running, 0, 'a call made before close completes with the store it started with')
  t.throws(() => store.lookupSync(tokens), code('ERR_KV_DISPOSED', /prompt store was closed/))
  t.throws(() => store.lookup(tokens), code('ERR_KV_DISPOSED'))
  t.throws(() => store.blockTokens, code('ERR_KV_DISPOSED'))
  const cache = new KvCache({ size: 64, nLayer: 1, nEmbdKGqa: 32 })
  t.throws(() => store.putSync(cache, 0, tokens), code('ERR_KV_DISPOSED'))
  await store.close()
})

test('PromptStore has Symbol.asyncDispose: leaving an `await using` scope closes it', async (t) => {
  const store = new PromptStore({ model: 'surface-test' })
  t.is(typeof store[Symbol.asyncDispose], 'function')
  await store[Symbol.asyncDispose]()
  t.throws(() => store.statsSync(), code('ERR_KV_DISPOSED'))
})

// Shared by the nlc-*.mjs helpers: node-llama-cpp from interop/node_modules (the pinned peer,
// loaded without downloads or builds), the adapter through the package's own export, and the
// scratch-folder listing the tests check.
import path from 'node:path'
import { createRequire } from 'node:module'
import { fileURLToPath, pathToFileURL } from 'node:url'

export { listTree, filesUnder } from './tree.mjs'

export const ROOT = path.resolve(path.dirname(fileURLToPath(import.meta.url)), '..', '..')
export const MODELS = path.join(ROOT, 'interop', 'models')

/** node-llama-cpp as the interop set-up installed it (`node scripts/setup.mjs`). */
export async function loadNodeLlamaCpp() {
  let entry
  try {
    entry = createRequire(path.join(ROOT, 'interop', 'package.json')).resolve('node-llama-cpp')
  } catch (e) {
    throw new Error(`node-llama-cpp is not installed in interop/node_modules: run node scripts/setup.mjs (${e.message})`)
  }
  return import(pathToFileURL(entry).href)
}

/** The adapter, through `llama-kv-cache/node-llama-cpp` (the package's exports map). */
export function loadAdapter() {
  return createRequire(import.meta.url)('llama-kv-cache/node-llama-cpp')
}


export const errorInfo = (e) => (e ? { code: e.code ?? null, name: e.name, message: String(e.message ?? e) } : null)

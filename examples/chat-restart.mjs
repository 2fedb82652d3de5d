// A node-llama-cpp chat whose process restarts between turns: every turn runs in a new process
// (this script spawning itself), which loads the model, gets the conversation back from a JSON
// file, and sends the next message through a LlamaChatSession whose sequence keeps its prompts
// in a prompt store directory (`llama-kv-cache/node-llama-cpp`). The first turn starts cold; each
// later one restores the conversation so far and evaluates only the new message. Prints each
// turn's time to first token.
//
//   node examples/chat-restart.mjs [model.gguf]        (default: interop/models/llama-h32.gguf,
//                                                       a tiny random-weight model: the replies
//                                                       are noise, the timings are real)
//   LLAMA_THREADS=4 node examples/chat-restart.mjs ~/models/Llama-3.2-1B-Instruct-Q4_K_M.gguf
//
// node-llama-cpp comes from the app (`npm install node-llama-cpp`) or, in this repository, from
// interop/node_modules (`node scripts/setup.mjs`).
import fs from 'node:fs'
import os from 'node:os'
import path from 'node:path'
import { spawnSync } from 'node:child_process'
import { createRequire } from 'node:module'
import { fileURLToPath, pathToFileURL } from 'node:url'

const SELF = fileURLToPath(import.meta.url)
const ROOT = path.resolve(path.dirname(SELF), '..')
const require = createRequire(import.meta.url)

// a long system prompt (a document the app sends every turn): what a restore spares
const BREADS = ['rye', 'wheat', 'spelt', 'sourdough', 'oat', 'barley', 'seeded', 'potato', 'milk', 'corn']
const SHAPES = ['loaf', 'roll', 'bun', 'baguette', 'braid']
const MENU = BREADS.flatMap((b, i) => SHAPES.map((s, j) => `${b} ${s}: ${(1 + ((i * 5 + j) % 7) * 0.35).toFixed(2)} euros`))
const SYSTEM = 'You are a concise assistant for a small bakery. The bakery opens at seven and takes orders by ' +
  `phone until noon. Croissants are sold on weekends only. The menu:\n${MENU.join('\n')}`
const MESSAGES = [
  'When do you open?',
  'Do you have croissants on a Tuesday?',
  'Can I order rye bread by phone at three in the afternoon?',
  'Thanks. What else do you sell?',
]

if (process.argv[2] === '--turn') await turn(JSON.parse(process.argv[3]))
else main(process.argv[2])

/** The parent: one process per turn, then the timings. */
function main(modelArg) {
  const model = path.resolve(modelArg ?? path.join(ROOT, 'interop', 'models', 'llama-h32.gguf'))
  if (!fs.existsSync(model)) {
    console.error(`${model} not found${modelArg ? '' : ' (run node scripts/setup.mjs, or pass a .gguf)'}`)
    process.exit(2)
  }
  const dir = fs.mkdtempSync(path.join(os.tmpdir(), 'chat-restart-'))
  const store = path.join(dir, 'prompts')
  const history = path.join(dir, 'chat.json')
  console.log(`model ${path.basename(model)}, prompt store ${store}\n`)
  const rows = []
  try {
    for (const [i, message] of MESSAGES.entries()) {
      const r = spawnSync(process.execPath, [SELF, '--turn', JSON.stringify({ model, store, history, message })], {
        encoding: 'utf8',
        stdio: ['ignore', 'pipe', 'inherit'],
      })
      const line = (r.stdout ?? '').split('\n').find((l) => l.startsWith('@@TURN '))
      if (r.status !== 0 || !line) {
        console.error(`turn ${i + 1} failed (exit ${r.status}):\n${r.stdout}`)
        process.exit(1)
      }
      const t = JSON.parse(line.slice(7))
      rows.push(t)
      console.log(`turn ${i + 1} (pid ${t.pid}): > ${message}`)
      console.log(`  ${JSON.stringify(t.reply.trim().slice(0, 120))}`)
      console.log(`  time to first token ${t.ttftMs.toFixed(1)} ms: ${t.restored ? `restored ${t.restored} tokens from the store, ` : 'cold, '}` +
        `evaluated ${t.evaluated} (model load ${t.loadMs.toFixed(0)} ms)${t.error ? `; store error ${t.error}` : ''}\n`)
    }
  } finally {
    fs.rmSync(dir, { recursive: true, force: true })
  }
  const [first, ...rest] = rows
  const avg = rest.reduce((s, t) => s + t.ttftMs, 0) / Math.max(1, rest.length)
  console.log(`time to first token: ${first.ttftMs.toFixed(1)} ms cold (turn 1), ${avg.toFixed(1)} ms on average restored (turns 2-${rows.length})`)
}

/** node-llama-cpp: the app's own, else this repository's interop copy. */
async function importNodeLlamaCpp() {
  try {
    return await import('node-llama-cpp')
  } catch (e) {
    if (e.code !== 'ERR_MODULE_NOT_FOUND') throw e
  }
  try {
    const entry = createRequire(path.join(ROOT, 'interop', 'package.json')).resolve('node-llama-cpp')
    return await import(pathToFileURL(entry).href)
  } catch {
    console.error('node-llama-cpp is not installed: npm install node-llama-cpp (in this repository: node scripts/setup.mjs)')
    process.exit(2)
  }
}

/** A child: one turn of the conversation, in a fresh process. */
async function turn({ model: modelPath, store, history, message }) {
  const { getLlama, LlamaLogLevel, LlamaChatSession } = await importNodeLlamaCpp()
  const { reusePrompts } = require('llama-kv-cache/node-llama-cpp')

  const t0 = performance.now()
  const llama = await getLlama({ gpu: false, build: 'never', skipDownload: true, logLevel: LlamaLogLevel.error })
  const model = await llama.loadModel({ modelPath, gpuLayers: 0 })
  const threads = Number(process.env.LLAMA_THREADS) || 1
  const context = await model.createContext({ contextSize: 2048, threads })
  const sequence = context.getSequence()
  // the conversation's KV comes back from the store: whatever of it this process has to evaluate,
  // it evaluates; the rest is loaded
  const reuse = reusePrompts(sequence, { path: store })
  const session = new LlamaChatSession({ contextSequence: sequence, systemPrompt: SYSTEM })
  if (fs.existsSync(history)) session.setChatHistory(JSON.parse(fs.readFileSync(history, 'utf8')))
  const loadMs = performance.now() - t0

  const start = performance.now()
  let ttftMs = null
  const reply = await session.prompt(message, {
    maxTokens: 24,
    onToken: () => {
      if (ttftMs === null) ttftMs = performance.now() - start
    },
  })
  fs.writeFileSync(history, JSON.stringify(session.getChatHistory()))
  const report = reuse.lastRestore
  const error = reuse.lastError?.code ?? null
  await reuse.close() // waits for this turn's put: the next process restores it
  await context.dispose()
  await model.dispose()
  await llama.dispose()
  console.log('@@TURN ' + JSON.stringify({
    pid: process.pid,
    reply,
    ttftMs: ttftMs ?? performance.now() - start,
    restored: report?.restoredTokens ?? 0,
    evaluated: report?.evaluatedTokens ?? 0,
    loadMs,
    error,
  }))
}

// One process = one chat turn with node-llama-cpp's LlamaChatSession, through the adapter or cold.
//
//   node __test__/helpers/nlc-chat.mjs '<json>'
//
// json: { model, store: { path, blockTokens, ... } | null (cold: no adapter), tmp (this process's
//         TMPDIR, so its scratch folder can be checked), sequences (default 1), threads (default 1: llama.cpp's spinning
//         threads crawl on a busy 2-core machine), contextSize
//         (default 256), flashAttention (false, true or 'auto'; default false), maxTokens
//         (default 8), systemPrompt,
//         chats: [{ history: file | null, prompt, saveHistory: file | null }] (one per sequence,
//         all at once) }
// Prints `@@RESULT { chats: [{ response, generated, contextTokens, usedInputTokens, ttftMs,
// lastRestore, lastError, lastPut }], scratchBeforeClose, scratchAfterClose, ownAfterClose }`.
import fs from 'node:fs'
import { loadNodeLlamaCpp, loadAdapter, listTree, filesUnder, errorInfo } from './nlc-peer.mjs'

const cfg = JSON.parse(process.argv[2])
if (cfg.tmp) {
  fs.mkdirSync(cfg.tmp, { recursive: true })
  process.env.TMPDIR = cfg.tmp
}
const { getLlama, LlamaLogLevel, LlamaChatSession } = await loadNodeLlamaCpp()
const { reusePrompts } = loadAdapter()

const llama = await getLlama({ gpu: false, build: 'never', skipDownload: true, logLevel: LlamaLogLevel.error })
const model = await llama.loadModel({ modelPath: cfg.model, gpuLayers: 0 })
const context = await model.createContext({
  contextSize: cfg.contextSize ?? 256,
  batchSize: cfg.contextSize ?? 256,
  sequences: cfg.sequences ?? 1,
  threads: cfg.threads ?? 1,
  // 'auto' (node-llama-cpp's default: llama.cpp decides) leaves the option out
  ...(cfg.flashAttention === 'auto' ? {} : { flashAttention: cfg.flashAttention ?? false }),
})

async function turn(chat) {
  const sequence = context.getSequence()
  const reuse = cfg.store ? reusePrompts(sequence, cfg.store) : null
  const session = new LlamaChatSession({ contextSequence: sequence, systemPrompt: cfg.systemPrompt ?? 'the red house' })
  if (chat.history && fs.existsSync(chat.history)) session.setChatHistory(JSON.parse(fs.readFileSync(chat.history, 'utf8')))
  const generated = []
  const t0 = performance.now()
  let ttftMs = null
  const response = await session.prompt(chat.prompt, {
    maxTokens: cfg.maxTokens ?? 8,
    onToken: (tokens) => {
      if (ttftMs === null) ttftMs = performance.now() - t0
      generated.push(...tokens)
    },
  })
  if (chat.saveHistory) fs.writeFileSync(chat.saveHistory, JSON.stringify(session.getChatHistory()))
  return {
    session,
    sequence,
    reuse,
    result: {
      response,
      generated,
      contextTokens: sequence.contextTokens,
      usedInputTokens: sequence.tokenMeter.usedInputTokens,
      ttftMs,
      lastRestore: reuse?.lastRestore ?? null,
      lastError: errorInfo(reuse?.lastError),
      lastPut: reuse?.lastPut ?? null,
    },
  }
}

const done = await Promise.all(cfg.chats.map(turn))
const scratchBeforeClose = cfg.tmp ? listTree(cfg.tmp) : null
for (const d of done) await d.reuse?.close()
const scratchAfterClose = cfg.tmp ? listTree(cfg.tmp) : null
const ownAfterClose = done.map((d) => ['evaluate', 'evaluateWithMetadata', 'evaluateWithoutGeneratingNewTokens', 'controlledEvaluate'].filter((m) => Object.hasOwn(d.sequence, m)))
await context.dispose()
await model.dispose()
await llama.dispose()
console.log('@@RESULT ' + JSON.stringify({
  chats: done.map((d) => d.result),
  scratchBeforeClose,
  scratchFilesBeforeClose: cfg.tmp ? filesUnder(cfg.tmp) : null,
  scratchAfterClose,
  ownAfterClose,
}))

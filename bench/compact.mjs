// Compact blocks on K/V captured from a peer (issue 40, item 3): node-llama-cpp 3.22.1 evaluates a
// prompt and the adapter puts its state into a dir store per `compress` mode; then, per mode, the
// bytes the store keeps, a restore through the adapter in a new process (does the peer continue
// with the token a cold run samples?), and for the plain llama model the largest difference of a
// restored K/V value from the uncompressed store's.
//
//   npm run bench:compact                # = npm run build && node bench/compact.mjs
//   node bench/compact.mjs [--tokens 2048] [--kinds kv,iswa,hybrid] [--rounds 3]
//
// Models: bench/ttft_models.py's random-weight GGUFs at a realistic small geometry (f16 K/V);
// node-llama-cpp on the CPU, 2 threads, no flash attention. Rounds interleave the restores of
// the three modes; times are medians. Goals: 'lossless' at least 1.2x smaller than 'none';
// 'q8_0' continues with the cold run's token.
import fs from 'node:fs'
import os from 'node:os'
import path from 'node:path'
import { createRequire } from 'node:module'
import { fileURLToPath } from 'node:url'
import { median } from './timing.mjs'
import { models, promptTokens, child } from './ttft-lib.mjs'

const ROOT = path.dirname(path.dirname(fileURLToPath(import.meta.url)))
const require = createRequire(import.meta.url)
const { KvCache, PromptStore } = require(path.join(ROOT, 'index.js'))
const MODES = ['none', 'lossless', 'q8_0']
const SUFFIX = 32

const opts = { tokens: 2048, kinds: ['kv', 'iswa', 'hybrid'], rounds: 3 }
for (let i = 2; i < process.argv.length; i += 2) {
  const [flag, v] = [process.argv[i], process.argv[i + 1]]
  if (flag === '--tokens') opts.tokens = Number(v)
  else if (flag === '--rounds') opts.rounds = Number(v)
  else if (flag === '--kinds') opts.kinds = v.split(',')
  else {
    process.stderr.write(`bench/compact.mjs: unknown argument ${flag}\n`)
    process.exit(2)
  }
}
const log = (m) => process.stderr.write(`${m}\n`)
const mib = (b) => (b / 2 ** 20).toFixed(1)

/** Bytes of a dir store's files: all, and the blocks' alone (the values compress compacts). */
function storeBytes(dir) {
  const files = fs.readdirSync(path.join(dir, 'blocks'), { recursive: true })
    .map((f) => path.join(dir, 'blocks', f))
    .filter((f) => fs.statSync(f).isFile())
  const isBlock = (f) => fs.readFileSync(f).subarray(0, 4).toString('latin1') === 'KVPB'
  const size = (list) => list.reduce((sum, f) => sum + fs.statSync(f).size, 0)
  return { all: size(files), blocks: size(files.filter(isBlock)) }
}

/** The largest |q8_0 - exact| of the restored K/V values, absolute and over its 32 values' max. */
async function q8Error(modelPath, dirs, prompt, memory) {
  const prefix = prompt.slice(0, prompt.length - SUFFIX)
  const restored = {}
  for (const mode of ['none', 'q8_0']) {
    const store = new PromptStore({ model: modelPath, path: dirs[mode] })
    const cache = KvCache.fromModel(modelPath, memory)
    const n = await store.restore(cache, 0, prefix)
    restored[mode] = { cache, n }
    await store.close()
  }
  const { cache: a, n } = restored.none
  const b = restored.q8_0.cache
  let abs = 0
  let rel = 0
  for (let il = 0; il < a.nLayer; il++) {
    for (const read of ['readKF32', 'readVF32']) {
      const x = a[read](il, 0, n)
      const y = b[read](il, 0, n)
      const width = x.length / n
      for (let r = 0; r < n; r++) {
        for (let c0 = 0; c0 < width; c0 += 32) {
          let amax = 0
          for (let c = c0; c < c0 + 32; c++) amax = Math.max(amax, Math.abs(x[r * width + c]))
          for (let c = c0; c < c0 + 32; c++) {
            const d = Math.abs(x[r * width + c] - y[r * width + c])
            abs = Math.max(abs, d)
            if (amax > 0) rel = Math.max(rel, d / amax)
          }
        }
      }
    }
  }
  return { abs, rel, n }
}

const tmp = fs.mkdtempSync(path.join(os.tmpdir(), 'kv-compact-bench-'))
const rows = []
try {
  const meta = models()
  const promptFile = path.join(tmp, 'prompt.json')
  const prompt = promptTokens(opts.tokens, meta.vocab)
  fs.writeFileSync(promptFile, JSON.stringify(prompt))
  for (const kind of opts.kinds) {
    const g = meta.models[kind]
    const modelPath = path.join(ROOT, g.file)
    const base = { kind, model: modelPath, promptFile, tokens: opts.tokens, suffix: SUFFIX, batchSize: 512, flashAttn: false }
    const dirs = Object.fromEntries(MODES.map((m) => [m, path.join(tmp, `${kind}-${m}`)]))
    log(`${kind}: ${g.arch}, ${g.n_layer} layers`)
    // one evaluation of the previous turn per mode (each a new process: the same K/V each time)
    for (const mode of MODES) await child({ ...base, mode: 'store', store: { path: dirs[mode], compress: mode } })
    const cold = await child({ ...base, mode: 'cold' })
    const samples = Object.fromEntries(MODES.map((m) => [m, { ms: [], tokens: [] }]))
    for (let r = 0; r < opts.rounds; r++) {
      const order = r % 2 === 0 ? MODES : [...MODES].reverse()
      for (const mode of order) {
        const x = await child({ ...base, mode: 'restored', store: { path: dirs[mode], putAfterEvaluation: false } })
        samples[mode].ms.push(x.ms)
        samples[mode].tokens.push(x.token)
      }
    }
    // the memory node-llama-cpp's context has (as bench/ttft-child.mjs's components)
    const memory = { nCtx: cold.contextSize, typeK: 'f16', typeV: 'f16', flashAttn: false, nUbatch: 512 }
    const error = kind === 'kv' ? await q8Error(modelPath, dirs, prompt, memory) : null
    const plain = storeBytes(dirs.none)
    for (const mode of MODES) {
      const bytes = storeBytes(dirs[mode])
      rows.push({
        kind,
        mode,
        bytes: bytes.all,
        smaller: plain.all / bytes.all,
        blocks: bytes.blocks,
        blocksSmaller: plain.blocks / bytes.blocks,
        restoredMs: median(samples[mode].ms),
        sameToken: samples[mode].tokens.every((t) => t === cold.token),
        error: mode === 'q8_0' ? error : null,
      })
    }
  }
} finally {
  fs.rmSync(tmp, { recursive: true, force: true })
}

const out = []
out.push(`# Compact blocks on K/V captured from node-llama-cpp 3.22.1 (${opts.tokens.toLocaleString('en-US')}-token prompt, ${(opts.tokens - SUFFIX).toLocaleString('en-US')} stored; restores: medians of ${opts.rounds} interleaved rounds, each in a new process)`)
out.push('')
out.push('| kind | compress | dir store MiB | smaller than none | blocks MiB | blocks smaller than none | restored first token, ms | same token as the cold run | q8_0 error: max abs, max / block max |')
out.push('|---|---|---|---|---|---|---|---|---|')
for (const r of rows) {
  const err = r.error ? `${r.error.abs.toExponential(2)}, ${r.error.rel.toFixed(4)} (${r.error.n} tokens)` : ''
  out.push(`| ${r.kind} | ${r.mode} | ${mib(r.bytes)} | ${r.smaller.toFixed(2)}x | ${mib(r.blocks)} | ${r.blocksSmaller.toFixed(2)}x | ${r.restoredMs.toFixed(0)} | ${r.sameToken ? 'yes' : 'no'} | ${err} |`)
}
process.stdout.write(out.join('\n') + '\n')

// inspect and convert of a large state file: time and peak RSS growth, each run in a fresh
// process, at the 8B geometry (32 layers, 1,024-wide f16 K/V, flash attention, 8,000 tokens:
// a 0.98 GiB sequence file).
//
//   npm run build && node bench/files.mjs
//   BENCH_BASELINE=/path/to/older/llama-kv-cache.linux-x64-gnu.node node bench/files.mjs
//
// With BENCH_BASELINE, every row is measured with that addon too, in the same run (interleaved
// rounds), and the table shows both. Needs about 3 GiB of disk (and, for an addon that reads the
// whole file, about 3 GiB of memory).
import fs from 'node:fs'
import os from 'node:os'
import path from 'node:path'
import { spawnSync } from 'node:child_process'
import { createRequire } from 'node:module'
import { BIG_TOKENS, bigCache, median } from './timing.mjs'

const require = createRequire(import.meta.url)
const HERE = import.meta.dirname ?? path.dirname(new URL(import.meta.url).pathname)
const OURS = path.join(HERE, '..', 'index.js')
const ROUNDS = Number(process.env.BENCH_ROUNDS ?? 3)
const pad = (s, n) => String(s).padStart(n)
const padEnd = (s, n) => String(s).padEnd(n)

/** The 0.98 GiB sequence file of the issue's 8B geometry. */
function makeFile(file) {
  const c = bigCache(require(OURS).KvCache)
  try {
    c.saveSequenceFileSync(file, 0, Int32Array.from({ length: BIG_TOKENS }, (_, i) => i % 300))
  } finally {
    c.dispose()
  }
}

/** Runs `call` (JS using `addon`) in a fresh node with the given addon; returns ms and peak RSS growth in bytes. */
function measure(addonPath, call) {
  const script = `
    const addon = require(${JSON.stringify(OURS)})
    const before = process.resourceUsage().maxRSS
    const t0 = process.hrtime.bigint()
    ${call}
    const ms = Number(process.hrtime.bigint() - t0) / 1e6
    process.stdout.write(JSON.stringify({ ms, grew: (process.resourceUsage().maxRSS - before) * 1024 }))`
  const env = { ...process.env }
  if (addonPath) env.NAPI_RS_NATIVE_LIBRARY_PATH = addonPath
  const r = spawnSync(process.execPath, ['-e', script], { encoding: 'utf8', env })
  if (r.status !== 0) throw new Error(r.stderr)
  return JSON.parse(r.stdout)
}

const dir = fs.mkdtempSync(path.join(os.tmpdir(), 'kv-bench-files-'))
try {
  const file = path.join(dir, 'big.ggsq')
  const out = path.join(dir, 'out.ggsq')
  makeFile(file)
  const size = fs.statSync(file).size
  const rows = [
    ['inspect', `addon.inspectState(${JSON.stringify(file)})`],
    ['convert --type-k q8_0 --type-v q8_0', `addon.convertStateFileSync(${JSON.stringify(file)}, ${JSON.stringify(out)}, { typeK: 'q8_0', typeV: 'q8_0' })`],
    ['convert --version 3', `addon.convertStateFileSync(${JSON.stringify(file)}, ${JSON.stringify(out)}, { version: 3 })`],
  ]
  const addons = [['ours', undefined]]
  if (process.env.BENCH_BASELINE) addons.unshift(['baseline', process.env.BENCH_BASELINE])
  const results = {}
  for (let r = 0; r < ROUNDS; r++) {
    for (const [name, call] of rows) {
      for (const [who, addon] of addons) {
        const m = measure(addon, call)
        ;((results[name] ??= {})[who] ??= []).push(m)
      }
    }
  }
  console.log(`## inspect and convert of a ${(size / 2 ** 30).toFixed(2)} GiB sequence file (32 layers, 1,024-wide f16 K/V, ${BIG_TOKENS.toLocaleString('en')} tokens); median of ${ROUNDS}, fresh process each`)
  console.log()
  const who = addons.map(([w]) => w)
  console.log(`| ${padEnd('operation', 36)} | ${who.map((w) => `${pad(`${w} ms`, 12)} | ${pad(`${w} RSS+`, 14)}`).join(' | ')} |`)
  console.log(`|${'-'.repeat(38)}|${who.map(() => `${'-'.repeat(14)}|${'-'.repeat(16)}`).join('|')}|`)
  for (const [name] of rows) {
    const cells = who.map((w) => {
      const ms = median(results[name][w].map((m) => m.ms))
      const grew = median(results[name][w].map((m) => m.grew))
      return `${pad(ms.toFixed(ms < 100 ? 1 : 0), 12)} | ${pad(`${(grew / 2 ** 20).toFixed(1)} MiB`, 14)}`
    })
    console.log(`| ${padEnd(name, 36)} | ${cells.join(' | ')} |`)
  }
} finally {
  fs.rmSync(dir, { recursive: true, force: true })
}

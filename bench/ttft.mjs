// Time to first token after a restart (issue 37, item 6): a prompt restored from the prompt store
// through the node-llama-cpp adapter (`llama-kv-cache/node-llama-cpp`) against a cold prefill of
// the same prompt, per memory kind (kv, iswa, hybrid, recurrent) and store tier (dir, redis).
//
//   npm run bench:ttft                   # = npm run build && node bench/ttft.mjs
//   node bench/ttft.mjs [--rounds 3] [--tokens 4096] [--kinds kv,iswa,hybrid,recurrent]
//                       [--tiers dir,redis] [--batch 512] [--flash-attn off|on] [--json]
//
// Models: random-weight GGUFs at a realistic small geometry with f16 weights, written by
// bench/ttft_models.py (interop/.venv's python, gguf + numpy) into bench/models/ when missing or
// when that script changed. Peer: node-llama-cpp 3.22.1 from interop/node_modules, on the CPU,
// 2 threads, no flash attention, f16 K/V, a context of --tokens + 64 cells, batches of --batch.
//
// Per kind:
//   stored      once, before the rounds: a fresh context evaluates the first tokens - 32 tokens
//               of the prompt (the previous turn) with the adapter attached, which puts its
//               state into the tier's store (dir and Redis are separate stores, each filled by
//               its own run); the first run also saves the sequence's state file for (b) below
//   cold        a new process: a fresh context evaluates the whole prompt and samples one token
//   restored    a new process, per tier: the adapter restores the stored prefix (lookup,
//               writeFile, loadStateFromFile), the context evaluates the last 32 tokens and
//               samples one; the clock stops when the token is sampled (onTokenResult), before
//               anything the adapter does after the evaluation (its put is off in these runs,
//               so every round restores from the same store)
//   components  a new process, per tier, measuring alone: (a) reading the blocks: `lookup` +
//               `restore` of the prefix from the same store into a `KvCache.fromModel` cache of
//               the context's memory; (b) the suffix: after `loadStateFromFile` of the prefix's
//               state file (untimed), evaluating the 32 tokens and sampling one
// In every process the model is loaded and the contexts (and the adapter, and the component's
// cache and store object) are created before a clock starts. Rounds are interleaved (cold first
// in even rounds, the restores first in odd ones); the figures are medians over the rounds.
// Goals, per row: restored <= cold / 25, and restored <= 1.2 x (read + suffix).
//
// --json prints only a JSON array of rows { kind, model, promptTokens, tier, coldMs, restoredMs,
// readMs, suffixMs } on stdout; progress goes to stderr.
import fs from 'node:fs'
import os from 'node:os'
import path from 'node:path'
import { fileURLToPath } from 'node:url'
import { median } from './timing.mjs'
import { models, promptTokens, child } from './ttft-lib.mjs'

const HERE = path.dirname(fileURLToPath(import.meta.url))
const ROOT = path.dirname(HERE)
const SUFFIX = 32
const ALL_KINDS = ['kv', 'iswa', 'hybrid', 'recurrent']
const ALL_TIERS = ['dir', 'redis']
const GOAL_SPEEDUP = 25
const GOAL_OVERHEAD = 1.2

function parseArgs(argv) {
  const o = { rounds: 3, tokens: 4096, kinds: ALL_KINDS, tiers: ALL_TIERS, batch: 512, flashAttn: false, json: false }
  const int = (name, v, min) => {
    const n = Number(v)
    if (!Number.isInteger(n) || n < min) throw new Error(`--${name} must be an integer >= ${min}, got ${v}`)
    return n
  }
  const list = (name, v, allowed) => {
    const xs = String(v ?? '').split(',').map((s) => s.trim()).filter(Boolean)
    const bad = xs.filter((x) => !allowed.includes(x))
    if (xs.length === 0 || bad.length > 0) throw new Error(`--${name} takes a comma-separated list of ${allowed.join(', ')}; got ${v}`)
    return [...new Set(xs)]
  }
  for (let i = 0; i < argv.length; i++) {
    const [flag, inline] = argv[i].split('=', 2)
    const value = () => inline ?? argv[++i]
    if (flag === '--json') o.json = true
    else if (flag === '--rounds') o.rounds = int('rounds', value(), 1)
    else if (flag === '--tokens') o.tokens = int('tokens', value(), SUFFIX + 16)
    else if (flag === '--batch') o.batch = int('batch', value(), 1)
    else if (flag === '--kinds') o.kinds = list('kinds', value(), ALL_KINDS)
    else if (flag === '--tiers') o.tiers = list('tiers', value(), ALL_TIERS)
    else if (flag === '--flash-attn') {
      const v = value()
      if (v !== 'on' && v !== 'off') throw new Error(`--flash-attn takes on or off; got ${v}`)
      o.flashAttn = v === 'on'
    }
    else if (flag === '--help' || flag === '-h') {
      process.stdout.write(fs.readFileSync(fileURLToPath(import.meta.url), 'utf8').split('\nimport ')[0].replace(/^\/\/ ?/gm, '') + '\n')
      process.exit(0)
    } else throw new Error(`unknown argument ${argv[i]} (see --help)`)
  }
  return o
}

let opts
try {
  opts = parseArgs(process.argv.slice(2))
} catch (e) {
  process.stderr.write(`bench/ttft.mjs: ${e.message}\n`)
  process.exit(2)
}
const log = (m) => process.stderr.write(`${m}\n`)

const fmtMs = (ms) => (ms >= 100 ? ms.toFixed(0) : ms >= 10 ? ms.toFixed(1) : ms.toFixed(2)).replace(/\B(?=(\d{3})+(?!\d))/g, ',')
const fmtX = (x) => (x >= 100 ? x.toFixed(0) : x >= 10 ? x.toFixed(1) : x.toFixed(2))
const mib = (b) => (b / 2 ** 20).toFixed(0)

function describeModel(g) {
  const heads = g.n_head ? `, ${g.n_head} heads (${g.n_head_kv} KV)` : ''
  const extra = {
    iswa: () => `, window ${g.window} on all but layers ${g.global_layers.join(', ')}`,
    hybrid: () => `, attention at layers ${g.attention_layers.join(', ')}, Mamba elsewhere (d_inner ${g.d_inner}, d_state ${g.d_state})`,
    recurrent: () => `, Mamba (d_inner ${g.d_inner}, d_state ${g.d_state})`,
  }
  return `${g.arch}: ${g.n_layer} layers, ${g.n_embd} wide${heads}${extra[g.kind]?.() ?? ''}, ` +
    `${(g.params / 1e6).toFixed(1)}M params f16, ${mib(g.bytes)} MiB`
}

let redis = null
const tmp = fs.mkdtempSync(path.join(os.tmpdir(), 'kv-ttft-bench-'))
const cleanup = () => {
  fs.rmSync(tmp, { recursive: true, force: true })
}
for (const sig of ['SIGINT', 'SIGTERM']) {
  process.once(sig, async () => {
    if (redis) await redis.stop().catch(() => {})
    cleanup()
    process.exit(130)
  })
}

const loadStart = os.loadavg()
const started = Date.now()
const rows = []
try {
  const meta = models()
  const promptFile = path.join(tmp, 'prompt.json')
  fs.writeFileSync(promptFile, JSON.stringify(promptTokens(opts.tokens, meta.vocab)))
  if (opts.tiers.includes('redis')) {
    const { startRedis } = await import('../__test__/support/redis-server.mjs')
    redis = await startRedis()
    log(`redis-server on 127.0.0.1:${redis.port} (${redis.dir})`)
  }
  const storeOf = (kind, tier) => (tier === 'dir' ? { path: path.join(tmp, `store-${kind}`) } : { url: redis.url, prefix: `ttft-${kind}:` })

  for (const kind of opts.kinds) {
    const g = { ...meta.models[kind], kind }
    const base = { kind, model: path.join(ROOT, g.file), promptFile, tokens: opts.tokens, suffix: SUFFIX, batchSize: opts.batch, flashAttn: opts.flashAttn }
    const stateFile = path.join(tmp, `${kind}-prefix.ggsq`)
    log(`${kind}: ${describeModel(g)}`)
    const stored = {}
    for (const [i, tier] of opts.tiers.entries()) {
      stored[tier] = await child({ ...base, mode: 'store', tier, store: storeOf(kind, tier), stateFile: i === 0 ? stateFile : undefined })
    }
    const samples = { cold: [], coldToken: [] }
    for (const tier of opts.tiers) Object.assign(samples, { [`restored ${tier}`]: [], [`read ${tier}`]: [], [`suffix ${tier}`]: [], [`token ${tier}`]: [], [`last ${tier}`]: [], [`parts ${tier}`]: [] })
    for (let r = 0; r < opts.rounds; r++) {
      log(`${kind}: round ${r + 1} of ${opts.rounds}`)
      const cold = async () => {
        const c = await child({ ...base, mode: 'cold' })
        samples.cold.push(c.ms)
        samples.coldToken.push(c.token)
      }
      const restores = async () => {
        for (const tier of opts.tiers) {
          const store = { ...storeOf(kind, tier), putAfterEvaluation: false }
          const x = await child({ ...base, mode: 'restored', tier, store })
          samples[`restored ${tier}`].push(x.ms)
          samples[`token ${tier}`].push(x.token)
          samples[`last ${tier}`].push(x.lastRestore)
          samples[`parts ${tier}`].push(x.parts)
          const c = await child({ ...base, mode: 'components', tier, store: storeOf(kind, tier), stateFile })
          samples[`read ${tier}`].push(c.readMs)
          samples[`suffix ${tier}`].push(c.suffixMs)
        }
      }
      if (r % 2 === 0) {
        await cold()
        await restores()
      } else {
        await restores()
        await cold()
      }
    }
    for (const tier of opts.tiers) {
      const last = samples[`last ${tier}`]
      rows.push({
        kind,
        model: describeModel(g),
        promptTokens: opts.tokens,
        tier,
        coldMs: median(samples.cold),
        restoredMs: median(samples[`restored ${tier}`]),
        readMs: median(samples[`read ${tier}`]),
        suffixMs: median(samples[`suffix ${tier}`]),
        // for the table only
        _restoredTokens: last.map((l) => l.restoredTokens),
        _evaluatedTokens: last.map((l) => l.evaluatedTokens),
        _parts: Object.fromEntries(['lookup', 'writeFile', 'load', 'evaluate'].map((k) => [k, median(samples[`parts ${tier}`].map((p) => p[k]))])),
        _sameToken: samples[`token ${tier}`].every((t, i) => t === samples.coldToken[i % samples.coldToken.length]),
        _storeMs: stored[tier].ms,
        _fileBytes: stored[opts.tiers[0]].fileBytes,
        _geometry: g,
      })
    }
  }
} finally {
  if (redis) await redis.stop().catch(() => {})
  cleanup()
}

const loadEnd = os.loadavg()
if (opts.json) {
  process.stdout.write(JSON.stringify(rows.map(({ kind, model, promptTokens, tier, coldMs, restoredMs, readMs, suffixMs }) =>
    ({ kind, model, promptTokens, tier, flashAttn: opts.flashAttn, coldMs, restoredMs, readMs, suffixMs })), null, 1) + '\n')
} else {
  const cpus = os.cpus()
  const pass = (ok) => (ok ? 'pass' : 'FAIL')
  const out = []
  out.push(`# Time to first token after a restart: restored through the prompt store's node-llama-cpp adapter against a cold prefill`)
  out.push('')
  out.push(`node-llama-cpp 3.22.1 (CPU, 2 threads, ${opts.flashAttn ? 'flash attention (V rows)' : 'no flash attention (V transposed)'}, f16 K/V, batches of ${opts.batch}); ` +
    `a ${opts.tokens.toLocaleString('en-US')}-token prompt whose first ${(opts.tokens - SUFFIX).toLocaleString('en-US')} tokens were stored by an earlier turn; ` +
    `medians of ${opts.rounds} interleaved round${opts.rounds === 1 ? '' : 's'}, each measurement in a new process. ` +
    `Machine: ${cpus[0]?.model?.trim() ?? 'unknown CPU'}, ${cpus.length} cores, node ${process.version}; ` +
    `load average ${loadStart.map((x) => x.toFixed(1)).join(' ')} at the start, ${loadEnd.map((x) => x.toFixed(1)).join(' ')} at the end ` +
    `(${((Date.now() - started) / 60000).toFixed(1)} min).`)
  out.push('')
  out.push('| kind | model (random weights) | state of the prefix |')
  out.push('|---|---|---|')
  for (const r of rows.filter((r, i) => rows.findIndex((x) => x.kind === r.kind) === i)) {
    out.push(`| ${r.kind} | ${r.model} | ${r._fileBytes ? `${mib(r._fileBytes)} MiB sequence file` : ''} |`)
  }
  out.push('')
  out.push(`| kind | tier | cold ms | restored ms | cold / restored (goal >= ${GOAL_SPEEDUP}) | read ms | suffix ms | restored / (read + suffix) (goal <= ${GOAL_OVERHEAD}) | restored: lookup + writeFile + load + evaluation, ms | tokens restored + evaluated | same first token |`)
  out.push('|---|---|---|---|---|---|---|---|---|---|---|')
  for (const r of rows) {
    const speedup = r.coldMs / r.restoredMs
    const overhead = r.restoredMs / (r.readMs + r.suffixMs)
    const counts = [...new Set(r._restoredTokens.map((n, i) => `${n} + ${r._evaluatedTokens[i]}`))].join(', ')
    out.push(`| ${r.kind} | ${r.tier} | ${fmtMs(r.coldMs)} | ${fmtMs(r.restoredMs)} | ${fmtX(speedup)}x ${pass(speedup >= GOAL_SPEEDUP)} | ` +
      `${fmtMs(r.readMs)} | ${fmtMs(r.suffixMs)} | ${fmtX(overhead)} ${pass(overhead <= GOAL_OVERHEAD)} | ` +
      `${['lookup', 'writeFile', 'load', 'evaluate'].map((k) => fmtMs(r._parts[k])).join(' + ')} | ${counts} | ${r._sameToken ? 'yes' : 'no'} |`)
  }
  out.push('')
  out.push('cold: a fresh context evaluates the prompt and samples one token. restored: in a new process, the adapter restores the stored prefix ' +
    '(lookup, writeFile, loadStateFromFile) and the context evaluates the rest and samples one token (clock stopped at the sampled token). ' +
    'read: `lookup` + `restore` of the prefix from the same store into a `KvCache.fromModel` cache of the same memory. ' +
    `suffix: the last ${SUFFIX} tokens and one sampled token after a \`loadStateFromFile\` of the prefix (untimed). ` +
    'The restored time split (medians of each part) comes from wrappers on the adapter\'s store calls and the sequence\'s `loadStateFromFile`; ' +
    'evaluation is the rest. same first token: the restored runs sampled the token the cold runs did.')
  process.stdout.write(out.join('\n') + '\n')
}

// What the benches that run node-llama-cpp in child processes share (bench/ttft.mjs,
// bench/compact.mjs): the random-weight models, a deterministic prompt, and one child process
// of bench/ttft-child.mjs per measurement.
import fs from 'node:fs'
import path from 'node:path'
import { spawn, spawnSync } from 'node:child_process'
import { fileURLToPath } from 'node:url'

const HERE = path.dirname(fileURLToPath(import.meta.url))
const ROOT = path.dirname(HERE)
const CHILD = path.join(HERE, 'ttft-child.mjs')
const PYTHON = path.join(ROOT, 'interop', '.venv', 'bin', 'python')
const log = (m) => process.stderr.write(`${m}\n`)

/** The models (bench/ttft_models.py), written when missing or stale; their geometry. */
export function models() {
  if (!fs.existsSync(PYTHON)) throw new Error(`${PYTHON} is missing: run \`node scripts/setup.mjs\` (it makes interop/.venv with gguf and numpy)`)
  const r = spawnSync(PYTHON, [path.join(HERE, 'ttft_models.py')], { cwd: ROOT, stdio: ['ignore', 'pipe', 'inherit'], encoding: 'utf8' })
  if (r.status !== 0) throw new Error(`bench/ttft_models.py failed (exit ${r.status ?? r.signal})`)
  return JSON.parse(r.stdout.trim().split('\n').pop())
}

/** A deterministic prompt: BOS, then word and letter pieces of the tiny models' vocabulary. */
export function promptTokens(n, vocab) {
  const first = 3 + 256 // <unk> <s> </s> and the byte tokens come first
  let x = 0x9e3779b9
  const t = [1]
  while (t.length < n) {
    x = (Math.imul(x, 1103515245) + 12345) >>> 0
    t.push(first + ((x >>> 16) % (vocab - first)))
  }
  return t
}

/** Runs one child process; resolves to its `@@RESULT` object. A child killed by a signal is run once more. */
export async function child(spec, attempt = 1) {
  const out = await new Promise((resolve, reject) => {
    const p = spawn(process.execPath, [CHILD, JSON.stringify(spec)], { cwd: ROOT, stdio: ['ignore', 'pipe', 'inherit'] })
    let stdout = ''
    p.stdout.on('data', (d) => (stdout += d))
    p.on('error', reject)
    p.on('close', (code, signal) => resolve({ code, signal, stdout }))
  })
  const line = out.stdout.split('\n').find((l) => l.startsWith('@@RESULT '))
  const other = out.stdout.split('\n').filter((l) => l && !l.startsWith('@@RESULT ')).join('\n')
  if (other) log(other)
  if (out.code === 0 && line) return JSON.parse(line.slice('@@RESULT '.length))
  if (out.signal && attempt < 2) {
    log(`  ${spec.mode} ${spec.kind}: the process died by ${out.signal}; running it again`)
    return child(spec, attempt + 1)
  }
  throw new Error(`bench/ttft-child.mjs ${spec.mode} (${spec.kind}${spec.tier ? `, ${spec.tier}` : ''}) failed: exit ${out.code ?? out.signal}`)
}


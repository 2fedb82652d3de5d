// Running the real llama.cpp peers from tests: whether they are set up, and one peer script run
// in a child process with retries for @fugood/llama.node's occasional crashes.
import fs from 'node:fs'
import os from 'node:os'
import path from 'node:path'
import { spawn } from 'node:child_process'
import { fileURLToPath } from 'node:url'

const HERE = path.dirname(fileURLToPath(import.meta.url))
const ROOT = path.resolve(HERE, '..')

/** How to set the peers up, from the repository root (`npm test` runs it first, as `pretest`). */
export const SETUP = ['node scripts/setup.mjs']

/** What a set-up checkout has. */
export const REQUIRED = [
  'interop/node_modules/@fugood/llama.node/package.json',
  'interop/node_modules/@fugood/node-llama-linux-x64/package.json',
  'interop/node_modules/node-llama-cpp/package.json',
  'interop/node_modules/@node-llama-cpp/linux-x64/package.json',
  'interop/models/llama-h16.gguf',
  'interop/models/llama-h32.gguf',
  'interop/models/mamba.gguf',
  'interop/models/llama-h64.gguf',
  'interop/models/gemma3-swa.gguf',
  'interop/models/jamba.gguf',
  'interop/models/qwen2-h64.gguf',
  'interop/models/qwen2-h64-yarn.gguf',
  'interop/models/llama-h64-yarn.gguf',
  'interop/models/vocab.json',
]

/** Where the pinned peer binaries (the linux-x64 packages in REQUIRED) can run. */
export const PEER_PLATFORM = 'linux-x64'

/**
 * Registers the peer tests of a spec through `register()`. There is no switch that turns them off:
 * - on linux-x64 with something of REQUIRED missing: one failing test naming what is missing and the set-up
 *   command (`node scripts/setup.mjs`, which `npm test` runs first as `pretest`);
 * - on any other platform, where the pinned binaries cannot run: one skipped test whose title says why, so
 *   the run reports a skip, never a pass;
 * - otherwise the peer tests themselves.
 */
export function registerPeerSuite(test, label, register, { platform = process.platform, arch = process.arch, root = ROOT } = {}) {
  const here = `${platform}-${arch}`
  if (here !== PEER_PLATFORM) {
    test.skip(`${label}: skipped: the pinned llama.cpp peer binaries are ${PEER_PLATFORM} only (this is ${here})`, () => {})
    return
  }
  const missing = REQUIRED.filter((p) => !fs.existsSync(path.join(root, p)))
  if (missing.length > 0) {
    test(`${label}: the llama.cpp peers and models are set up`, (t) => {
      t.fail(`missing: ${missing.join(', ')}.\nSet up from the repository root with:\n  ${SETUP.join('\n  ')}\n(\`npm test\` runs it first, as pretest)`)
    })
    return
  }
  register()
}

const MAX_PARALLEL = Math.max(1, Math.min(2, os.availableParallelism?.() ?? 2))
let active = 0
const waiting = []
async function limited(fn) {
  while (active >= MAX_PARALLEL) await new Promise((resolve) => waiting.push(resolve))
  active++
  try {
    return await fn()
  } finally {
    active--
    waiting.shift()?.()
  }
}

function spawnOnce(script, args) {
  return new Promise((resolve) => {
    const child = spawn(process.execPath, [script, ...args], { cwd: HERE, stdio: ['ignore', 'pipe', 'pipe'] })
    let stdout = ''
    let stderr = ''
    child.stdout.on('data', (d) => (stdout += d))
    child.stderr.on('data', (d) => (stderr = (stderr + d).slice(-20000)))
    let timedOut = false
    const timer = setTimeout(() => {
      timedOut = true
      child.kill('SIGKILL')
      // a hang detector, not a time limit: a peer run takes seconds, but several ava workers each
      // running peers on a 2-core machine under other load took over a minute
    }, 180_000)
    child.on('close', (code, signal) => {
      clearTimeout(timer)
      resolve({ code, signal, stdout, stderr, timedOut })
    })
  })
}

/**
 * Runs a peer script (kshift-peer.mjs or continue.mjs) and returns its @@RESULT. @fugood/llama.node 1.7.15
 * segfaults now and then: a run that dies by a signal is retried (up to 4 attempts), never a wrong result.
 * A run reporting `error` throws.
 */
export async function runPeerScript(script, args, log = () => {}) {
  for (let attempt = 1; ; attempt++) {
    const r = await limited(() => spawnOnce(script, args))
    const crashed = !r.timedOut && (r.signal !== null || r.code > 128)
    if (crashed && attempt < 4) {
      log(`${path.basename(script)} crashed (${r.signal ?? `exit ${r.code}`}) on attempt ${attempt}; retrying`)
      continue
    }
    const line = r.stdout.split('\n').find((l) => l.startsWith('@@RESULT '))
    if (r.code !== 0 || !line) {
      throw new Error(
        `node interop/${path.basename(script)} ${args.map((a) => `'${a}'`).join(' ')}: ` +
          (r.timedOut ? 'timed out' : `exit ${r.code} signal ${r.signal}`) +
          ` after ${attempt} attempt(s)\n${r.stderr.split('\n').slice(-15).join('\n')}`,
      )
    }
    const result = JSON.parse(line.slice('@@RESULT '.length))
    for (const run of result.runs) if (run.error) throw new Error(`${path.basename(script)} failed on ${JSON.stringify(run)}`)
    return result
  }
}

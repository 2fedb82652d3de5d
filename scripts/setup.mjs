#!/usr/bin/env node
// `npm test`'s own set-up (run as `pretest`): provides everything the tests need that a fresh clone
// lacks, and skips each step whose result is already there and up to date.
//
//   node scripts/setup.mjs            set up what is missing
//   node scripts/setup.mjs --check    only list what is missing (exit 1 when something is)
//
// Steps, each keyed by a stamp (a hash of the files it was made from) so an edit re-runs it:
//   python   interop/.venv: a private virtual environment with interop/requirements.txt (gguf,
//            numpy, cmake from PyPI: no system cmake needed for the llama.cpp reference builds)
//   models   interop/models/*.gguf: tiny random-weight models written by interop/make_models.py
//   peers    interop/node_modules: @fugood/llama.node and node-llama-cpp with their linux-x64 binaries
//   redis    redis-server, redis-cli and openssl (Debian packages) for the Redis tests (servers,
//            clusters, TLS certificates): installed with
//            apt-get when running as root and non-interactively (CI, fresh containers); otherwise the
//            set-up stops and prints the one command to run
import crypto from 'node:crypto'
import fs from 'node:fs'
import path from 'node:path'
import { spawnSync } from 'node:child_process'
import { fileURLToPath } from 'node:url'

const ROOT = path.resolve(path.dirname(fileURLToPath(import.meta.url)), '..')

/** Where the virtual environment's programs are, relative to the repository root. */
export const VENV_BIN = process.platform === 'win32' ? 'interop/.venv/Scripts' : 'interop/.venv/bin'
const STAMP = '.setup-stamp'

function sha256(root, files) {
  const h = crypto.createHash('sha256')
  for (const f of files) {
    h.update(f)
    h.update(fs.readFileSync(path.join(root, f)))
  }
  return h.digest('hex')
}

function readStamp(dir) {
  try {
    return fs.readFileSync(path.join(dir, STAMP), 'utf8').trim()
  } catch {
    return null
  }
}

function which(cmd) {
  const r = spawnSync('sh', ['-c', `command -v ${cmd}`], { encoding: 'utf8' })
  return r.status === 0 ? r.stdout.trim() : null
}

/**
 * The set-up steps for the checkout at `root`, each with `missing` (why it must run, or null when its
 * result is present and current) and `run()`.
 */
export function plan(root = ROOT, env = process.env) {
  const venv = path.join(root, 'interop', '.venv')
  const python = path.join(root, VENV_BIN, process.platform === 'win32' ? 'python.exe' : 'python')
  const models = path.join(root, 'interop', 'models')
  const peers = path.join(root, 'interop', 'node_modules')
  const venvStamp = sha256(root, ['interop/requirements.txt'])
  const modelStamp = sha256(root, ['interop/make_models.py', 'interop/requirements.txt'])
  const peerStamp = sha256(root, ['interop/package.json', 'interop/package-lock.json'])
  const peerFiles = [
    '@fugood/llama.node/package.json',
    '@fugood/node-llama-linux-x64/package.json',
    'node-llama-cpp/package.json',
    '@node-llama-cpp/linux-x64/package.json',
  ]
  return [
    {
      name: 'python',
      missing: !fs.existsSync(python)
        ? `${path.relative(root, venv)} does not exist`
        : readStamp(venv) !== venvStamp
          ? 'interop/requirements.txt changed since the environment was made'
          : null,
      run() {
        const py = which('python3') ?? which('python')
        if (!py) stop('Python 3 is needed to write the test models', 'apt-get install -y python3 python3-venv')
        if (!fs.existsSync(python)) {
          const r = spawnSync(py, ['-m', 'venv', venv], { stdio: 'inherit' })
          if (r.status !== 0) {
            installSystemPackages(['python3-venv'], env)
            sh(py, ['-m', 'venv', venv])
          }
        }
        sh(python, ['-m', 'pip', 'install', '--quiet', '--disable-pip-version-check', '-r', path.join(root, 'interop', 'requirements.txt')])
        fs.writeFileSync(path.join(venv, STAMP), venvStamp + '\n')
      },
    },
    {
      name: 'models',
      missing: !fs.existsSync(models)
        ? 'interop/models does not exist'
        : readStamp(models) !== modelStamp
          ? 'interop/make_models.py changed since the models were written'
          : null,
      run() {
        sh(python, [path.join(root, 'interop', 'make_models.py')])
        fs.writeFileSync(path.join(models, STAMP), modelStamp + '\n')
      },
    },
    {
      name: 'peers',
      missing: peerFiles.some((f) => !fs.existsSync(path.join(peers, f)))
        ? 'the llama.cpp peers are not installed in interop/node_modules'
        : readStamp(peers) !== peerStamp
          ? 'interop/package.json or its lock changed since the peers were installed'
          : null,
      run() {
        const npm = process.platform === 'win32' ? 'npm.cmd' : 'npm'
        // `install`, not `ci`: the lock cannot list node-llama-cpp's platform packages that this
        // registry lacks (interop/README.md); with the committed lock it installs the pinned versions
        sh(npm, ['install', '--omit=optional', '--no-audit', '--no-fund'], {
          cwd: path.join(root, 'interop'),
          env: { ...env, NODE_LLAMA_CPP_SKIP_DOWNLOAD: 'true' },
        })
        fs.writeFileSync(path.join(peers, STAMP), peerStamp + '\n')
      },
    },
    {
      // redis-cli (redis-tools, which redis-server depends on) forms the test clusters; openssl
      // makes the TLS tests' certificates
      name: 'redis',
      missing: ['redis-server', 'redis-cli', 'openssl'].filter((bin) => !which(bin)).map((bin) => `${bin} is not installed`).join('; ') || null,
      run() {
        installSystemPackages(['redis-server', 'redis-tools', 'openssl'], env)
      },
    },
  ]
}

/** Whether a system package may be installed here without asking anyone: root, not interactive. */
export function mayInstallSystemPackages(env = process.env, isTTY = process.stdin.isTTY) {
  const root = typeof process.getuid === 'function' && process.getuid() === 0
  const interactive = Boolean(isTTY) && env.CI !== 'true' && env.CI !== '1'
  return root && !interactive && Boolean(which('apt-get'))
}

function installSystemPackages(pkgs, env) {
  const command = `sudo apt-get install -y ${pkgs.join(' ')}`
  if (!mayInstallSystemPackages(env)) stop(`${pkgs.join(', ')} (a Debian package) is needed by the tests`, command)
  const aptEnv = { ...env, DEBIAN_FRONTEND: 'noninteractive' }
  sh('apt-get', ['update', '-qq'], { env: aptEnv })
  sh('apt-get', ['install', '-y', '-qq', ...pkgs], { env: aptEnv })
}

class SetupStop extends Error {}

function stop(what, command) {
  throw new SetupStop(`${what}. Run:\n  ${command}\nthen run npm test again.`)
}

function sh(cmd, args, opts = {}) {
  const r = spawnSync(cmd, args, { stdio: 'inherit', ...opts })
  if (r.error || r.status !== 0) {
    throw new Error(`set-up step failed: ${cmd} ${args.join(' ')} (${r.error?.message ?? `exit ${r.status}`})`)
  }
}

function main() {
  const checkOnly = process.argv.includes('--check')
  const steps = plan()
  const todo = steps.filter((s) => s.missing)
  if (todo.length === 0) {
    console.log('set-up: everything the tests need is present')
    return 0
  }
  for (const s of todo) {
    console.log(`set-up: ${s.name}: ${s.missing}${checkOnly ? '' : ' -> setting up'}`)
    if (!checkOnly) s.run()
  }
  return checkOnly ? 1 : 0
}

if (process.argv[1] && path.resolve(process.argv[1]) === fileURLToPath(import.meta.url)) {
  try {
    process.exitCode = main()
  } catch (e) {
    console.error(`set-up: ${e.message}`)
    process.exitCode = 1
  }
}

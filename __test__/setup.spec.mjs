// `npm test` does its own set-up (scripts/setup.mjs, run as `pretest`): a fresh clone needs no other
// command. These tests drive the set-up's plan on scratch checkouts made in a temp directory.
import test from 'ava'
import fs from 'node:fs'
import os from 'node:os'
import path from 'node:path'
import { fileURLToPath } from 'node:url'

import { plan, mayInstallSystemPackages, VENV_BIN } from '../scripts/setup.mjs'

const ROOT = path.resolve(path.dirname(fileURLToPath(import.meta.url)), '..')
const SOURCES = ['interop/make_models.py', 'interop/requirements.txt', 'interop/package.json', 'interop/package-lock.json']

/** A scratch checkout holding only the files the set-up reads. */
function scratchCheckout(t) {
  const dir = fs.mkdtempSync(path.join(os.tmpdir(), 'kv-setup-'))
  t.teardown(() => fs.rmSync(dir, { recursive: true, force: true }))
  for (const f of SOURCES) {
    fs.mkdirSync(path.dirname(path.join(dir, f)), { recursive: true })
    fs.copyFileSync(path.join(ROOT, f), path.join(dir, f))
  }
  return dir
}

const missingSteps = (root) => plan(root).filter((s) => s.missing && s.name !== 'redis').map((s) => s.name)

test('regression: a fresh clone lacks every set-up step and the plan names each reason', (t) => {
  const root = scratchCheckout(t)
  const steps = plan(root)
  t.deepEqual(missingSteps(root), ['python', 'models', 'peers'])
  t.regex(steps.find((s) => s.name === 'python').missing, /interop[/\\].venv does not exist/)
  t.regex(steps.find((s) => s.name === 'models').missing, /interop\/models does not exist/)
  t.regex(steps.find((s) => s.name === 'peers').missing, /not installed/)
})

test('regression: missing models are written by the set-up, then the step is skipped', (t) => {
  const realSteps = plan(ROOT)
  t.is(realSteps.find((s) => s.name === 'python').missing, null, 'this checkout is set up (npm test ran the set-up first)')
  const root = scratchCheckout(t)
  // reuse this checkout's environment and peers: only the models are missing
  fs.symlinkSync(path.join(ROOT, 'interop', '.venv'), path.join(root, 'interop', '.venv'))
  fs.symlinkSync(path.join(ROOT, 'interop', 'node_modules'), path.join(root, 'interop', 'node_modules'))
  t.deepEqual(missingSteps(root), ['models'])
  plan(root)
    .find((s) => s.name === 'models')
    .run()
  t.deepEqual(missingSteps(root), [])
  for (const m of ['llama-h16.gguf', 'llama-h32.gguf', 'mamba.gguf']) {
    t.deepEqual(
      fs.readFileSync(path.join(root, 'interop', 'models', m)),
      fs.readFileSync(path.join(ROOT, 'interop', 'models', m)),
      `${m} is written byte-identically`,
    )
  }
})

test('an edited model script makes the set-up write the models again', (t) => {
  const root = scratchCheckout(t)
  fs.symlinkSync(path.join(ROOT, 'interop', '.venv'), path.join(root, 'interop', '.venv'))
  fs.symlinkSync(path.join(ROOT, 'interop', 'models'), path.join(root, 'interop', 'models'))
  t.false(missingSteps(root).includes('models'))
  fs.appendFileSync(path.join(root, 'interop', 'make_models.py'), '\n# edited\n')
  t.regex(plan(root).find((s) => s.name === 'models').missing, /make_models\.py changed/)
})

test('system packages are installed only as root and non-interactively, otherwise the set-up asks', (t) => {
  const isRoot = typeof process.getuid === 'function' && process.getuid() === 0
  t.false(mayInstallSystemPackages({}, true), 'never from an interactive terminal')
  t.is(mayInstallSystemPackages({ CI: 'true' }, true), isRoot && fs.existsSync('/usr/bin/apt-get'))
  t.is(mayInstallSystemPackages({}, false), isRoot && fs.existsSync('/usr/bin/apt-get'))
})

test('regression: CI does no set-up of its own that a fresh clone\'s npm test lacks', (t) => {
  const ci = fs.readFileSync(path.join(ROOT, '.ci', 'run'), 'utf8')
  const setupLines = ci
    .split('\n')
    .filter((l) => !l.trim().startsWith('#'))
    .filter((l) => /pip3? install|-m pip|make_models|apt-get|npm install|redis-server/.test(l))
  t.deepEqual(setupLines, [])
  const pkg = JSON.parse(fs.readFileSync(path.join(ROOT, 'package.json'), 'utf8'))
  t.is(pkg.scripts.pretest, 'node scripts/setup.mjs')
  t.true(fs.existsSync(path.join(ROOT, VENV_BIN)), 'the set-up made interop/.venv')
})

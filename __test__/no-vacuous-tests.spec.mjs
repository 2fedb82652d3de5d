// Tests fail when they cannot test. This spec pins the rules on the test sources themselves:
// - no environment switch turns the peer suites off (the variable that once did is named nowhere);
// - no test passes by calling t.pass: each asserts what it proves;
// - every test.skip is called directly with a title that says `skipped: <why>`, so a skip is reported with its reason,
//   and a skip chosen at run time (`cond ? test : test.skip`) cannot hide one;
// and checks registerPeerSuite's behaviour: a failing test naming the set-up command when something is missing, a
// skip with the reason off linux-x64, never a pass.
import test from 'ava'
import fs from 'node:fs'
import os from 'node:os'
import path from 'node:path'
import { fileURLToPath } from 'node:url'
import { REQUIRED, registerPeerSuite } from '../interop/peers.mjs'

const HERE = path.dirname(fileURLToPath(import.meta.url))
const ROOT = path.resolve(HERE, '..')

// built from parts so that this file does not match its own rules
const SWITCH = ['KV', 'INTEROP'].join('_')
const PASS_CALL = new RegExp(['\\bt', 'pass\\s*\\('].join('\\.'))
const SKIP = ['test', 'skip'].join('.')

const listed = (dir, re) => fs.readdirSync(path.join(ROOT, dir)).filter((f) => re.test(f)).map((f) => path.join(dir, f))
const SPECS = listed('__test__', /\.spec\.mjs$/)
const SOURCES = [
  ...SPECS,
  ...listed('__test__/helpers', /\.m?js$/),
  ...listed('__test__/support', /\.m?js$/),
  ...listed('interop', /\.mjs$/),
  'interop/README.md',
  '.github/workflows/CI.yml',
  '.ci/run',
  'package.json',
]
const text = (file) => fs.readFileSync(path.join(ROOT, file), 'utf8')
const lineOf = (s, index) => s.slice(0, index).split('\n').length

/** The string literal that starts at `s[i]` ('...', "..." or `...`), or null when none does. */
function literalAt(s, i) {
  const quote = s[i]
  if (!`'"\``.includes(quote)) return null
  for (let j = i + 1; j < s.length; j++) {
    if (s[j] === '\\') j++
    else if (s[j] === quote) return s.slice(i + 1, j)
  }
  return null
}

/** Every `test.skip` in `s`: where, and the title literal it is called with (null when it is not called with one). */
function skipsIn(s) {
  const found = []
  for (let at = s.indexOf(SKIP); at !== -1; at = s.indexOf(SKIP, at + 1)) {
    const before = s[at - 1]
    if (before && /[\w$.]/.test(before)) continue // e.g. `mytest.skip`, not ava's
    const lineStart = s.lastIndexOf('\n', at) + 1
    const head = s.slice(lineStart, at)
    if (head.includes('//') || /^\s*(\/\*|\*)/.test(head)) continue // in a comment
    const rest = s.slice(at + SKIP.length)
    const call = /^\s*\(\s*/.exec(rest)
    found.push({ line: lineOf(s, at), title: call ? literalAt(rest, call[0].length) : null })
  }
  return found
}

/** Whether a skip title says why: `skipped: ` then a reason of a few words. */
const namesReason = (title) => /\bskipped: \S+( \S+){2,}/.test(title ?? '')

test('the rules catch what they are meant to catch', (t) => {
  t.deepEqual(skipsIn(`const x = cond ? test : ${SKIP}\n`).map((s) => s.title), [null])
  t.deepEqual(skipsIn(`// a comment on ${SKIP}\n/**\n * ${SKIP} in a doc comment\n */`), [])
  t.deepEqual(skipsIn(`${SKIP}('no reason', (t) => {})`).map((s) => namesReason(s.title)), [false])
  t.deepEqual(skipsIn(`${SKIP}(name, (t) => {})`).map((s) => s.title), [null])
  t.deepEqual(skipsIn(`${SKIP}(\`\${title}: skipped: needs Linux's /proc (this is \${p})\`, fn)`).map((s) => namesReason(s.title)), [true])
  t.true(PASS_CALL.test(['t', 'pass()'].join('.')))
  t.true(PASS_CALL.test(['t', "pass('done')"].join('.')))
  t.false(PASS_CALL.test('t.passed'))
})

test(`no test source, workflow or CI script mentions ${SWITCH}: nothing turns the peer suites into passes`, (t) => {
  t.true(SPECS.length >= 10, `found ${SPECS.length} specs`)
  const offenders = SOURCES.filter((f) => text(f).includes(SWITCH))
  t.deepEqual(offenders, [], `remove ${SWITCH} from ${offenders.join(', ')}: a missing peer must fail, naming node scripts/setup.mjs`)
})

test('no test ends in t.pass: every test asserts something it measured (allow-list: none)', (t) => {
  const offenders = []
  for (const f of SPECS) {
    const s = text(f)
    const re = new RegExp(PASS_CALL.source, 'g')
    for (let m; (m = re.exec(s)); ) offenders.push(`${f}:${lineOf(s, m.index)}`)
  }
  t.deepEqual(offenders, [])
})

test(`every ${SKIP} is called directly with a title that says "skipped: <reason>"`, (t) => {
  const offenders = []
  let skips = 0
  for (const f of [...SPECS, ...listed('interop', /\.mjs$/)]) {
    for (const s of skipsIn(text(f))) {
      skips++
      if (s.title === null) offenders.push(`${f}:${s.line}: ${SKIP} not called with a title literal (a skip chosen at run time hides its reason)`)
      else if (!namesReason(s.title)) offenders.push(`${f}:${s.line}: title "${s.title}" does not say "skipped: <reason>"`)
    }
  }
  t.true(skips > 0, 'the scan found the platform skips it is meant to check')
  t.deepEqual(offenders, [])
})

/** A stand-in for ava's `test` that records what a suite registers. */
function recorder() {
  const calls = []
  const fake = (title, fn) => calls.push({ kind: 'test', title, fn })
  fake.skip = (title, fn) => calls.push({ kind: 'skip', title, fn })
  return { fake, calls }
}

/** Runs a recorded test body against a minimal `t` and returns what it failed with (null if it did not fail). */
function failureOf(fn) {
  let failed = null
  fn({ fail: (message) => (failed = message), log() {} })
  return failed
}

test('registerPeerSuite: with the peers missing on linux-x64 it registers one failing test naming node scripts/setup.mjs', (t) => {
  const root = fs.mkdtempSync(path.join(os.tmpdir(), 'kv-peers-'))
  t.teardown(() => fs.rmSync(root, { recursive: true, force: true }))
  const { fake, calls } = recorder()
  let registered = false
  registerPeerSuite(fake, 'demo', () => (registered = true), { platform: 'linux', arch: 'x64', root })
  t.false(registered)
  t.is(calls.length, 1)
  t.is(calls[0].kind, 'test')
  const message = failureOf(calls[0].fn)
  t.truthy(message, 'the test fails')
  t.regex(message, /node scripts\/setup\.mjs/)
  t.regex(message, /interop\/models\/llama-h16\.gguf/)
})

test('registerPeerSuite: off linux-x64 it registers one skip whose title gives the reason, and no peer test', (t) => {
  for (const [platform, arch] of [['darwin', 'arm64'], ['win32', 'x64'], ['linux', 'arm64']]) {
    const { fake, calls } = recorder()
    let registered = false
    registerPeerSuite(fake, 'demo', () => (registered = true), { platform, arch, root: ROOT })
    t.false(registered)
    t.deepEqual(calls.map((c) => c.kind), ['skip'])
    t.true(namesReason(calls[0].title), calls[0].title)
    t.true(calls[0].title.includes(`${platform}-${arch}`), calls[0].title)
  }
})

test('registerPeerSuite: on linux-x64 with everything present it registers the peer tests, whatever the environment says', (t) => {
  const root = fs.mkdtempSync(path.join(os.tmpdir(), 'kv-peers-'))
  t.teardown(() => fs.rmSync(root, { recursive: true, force: true }))
  for (const f of REQUIRED) {
    fs.mkdirSync(path.dirname(path.join(root, f)), { recursive: true })
    fs.writeFileSync(path.join(root, f), '')
  }
  const saved = process.env[SWITCH]
  process.env[SWITCH] = '0'
  try {
    const { fake, calls } = recorder()
    let registered = false
    registerPeerSuite(fake, 'demo', () => (registered = true), { platform: 'linux', arch: 'x64', root })
    t.true(registered)
    t.deepEqual(calls, [])
  } finally {
    if (saved === undefined) delete process.env[SWITCH]
    else process.env[SWITCH] = saved
  }
})

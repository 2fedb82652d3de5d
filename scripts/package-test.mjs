#!/usr/bin/env node
// Packaging test: builds the release packages the way the CI publish job does (`napi artifacts`, then
// `napi prepublish -t npm`), packs them, installs the tarballs into a fresh project outside the repository
// and uses the package from CommonJS, ESM, TypeScript, jest, ava and worker threads.
//
// Needs `npm run build` first (the addon of this platform at the repository root) and registry access
// for typescript, jest, ava and @types/node. Leaves nothing in the tree: everything happens in a
// temporary directory, removed at the end unless KEEP_PACKAGE_TEST=1.
//
// Prints one line per check and ends with `<n> passed, <m> failed`; exits 1 on any failure.

import { spawnSync } from 'node:child_process'
import { cpSync, existsSync, mkdirSync, mkdtempSync, readFileSync, readdirSync, realpathSync, rmSync, writeFileSync } from 'node:fs'
import { tmpdir } from 'node:os'
import { dirname, join, relative, resolve } from 'node:path'
import { fileURLToPath } from 'node:url'

const ROOT = resolve(dirname(fileURLToPath(import.meta.url)), '..')
const CONSUMER = join(ROOT, 'scripts', 'package-test', 'consumer')
const NAPI_CLI = join(ROOT, 'node_modules', '@napi-rs', 'cli', 'dist', 'cli.js')
const isWindows = process.platform === 'win32'

// The package.json `napi.targets` of this project and the npm/<dir> each one publishes to.
const PLATFORM_DIRS = {
  'x86_64-unknown-linux-gnu': 'linux-x64-gnu',
  'aarch64-unknown-linux-gnu': 'linux-arm64-gnu',
  'x86_64-unknown-linux-musl': 'linux-x64-musl',
  'aarch64-unknown-linux-musl': 'linux-arm64-musl',
  'x86_64-apple-darwin': 'darwin-x64',
  'aarch64-apple-darwin': 'darwin-arm64',
  'x86_64-pc-windows-msvc': 'win32-x64-msvc',
  'aarch64-pc-windows-msvc': 'win32-arm64-msvc',
}
// What must never reach the root tarball: Rust sources and build files, tests, tooling, build outputs.
const ROOT_FILES_FORBIDDEN = [
  /\.rs$/,
  /(^|\/)Cargo\.(toml|lock)$/,
  /^(src|crates|target|node_modules|__test__|tests?|interop|bench|benches|examples|scripts|npm|artifacts|\.github|\.ci)\//,
  /\.(spec|test)\.[cm]?[jt]s$/,
  /\.(node|tgz)$/,
  /^(package-lock\.json|build\.rs|\.gitignore)$/,
]

const pkg = JSON.parse(readFileSync(join(ROOT, 'package.json'), 'utf8'))
const { binaryName } = pkg.napi

function hostPlatformDir() {
  const { platform, arch } = process
  if (platform === 'linux') {
    const glibc = process.report.getReport().header.glibcVersionRuntime
    return `linux-${arch}-${glibc ? 'gnu' : 'musl'}`
  }
  if (platform === 'win32') return `win32-${arch}-msvc`
  return `${platform}-${arch}`
}
const platformDir = hostPlatformDir()
const triple = Object.keys(PLATFORM_DIRS).find((t) => PLATFORM_DIRS[t] === platformDir)
const nodeFile = `${binaryName}.${platformDir}.node`
const platformPackage = `${pkg.name}-${platformDir}`

// ---- running commands -------------------------------------------------------------------------------

const childEnv = Object.fromEntries(
  Object.entries(process.env).filter(([k]) => !/^npm_(package|lifecycle)_/i.test(k) && k !== 'NAPI_RS_NATIVE_LIBRARY_PATH' && k !== 'INIT_CWD'),
)
childEnv.NAPI_RS_ENFORCE_VERSION_CHECK = '1'

class CommandError extends Error {}

/** Runs a command; throws with its output when it fails. Returns stdout (with `both`, stdout + stderr). */
function run(command, args, { cwd, timeout = 120_000, env = childEnv, both = false } = {}) {
  const useShell = isWindows && !command.endsWith('.exe') && command !== process.execPath
  const r = spawnSync(command, args, { cwd, env, timeout, encoding: 'utf8', shell: useShell, maxBuffer: 64 << 20 })
  if (r.error || r.status !== 0) {
    const why = r.error ? r.error.message : r.signal ? `killed by ${r.signal}` : `exit code ${r.status}`
    const output = `${r.stdout ?? ''}${r.stderr ?? ''}`.trim()
    throw new CommandError(`\`${[command, ...args].join(' ')}\` failed (${why})${output ? `\n${output}` : ''}`)
  }
  return both ? `${r.stdout}\n${r.stderr}` : r.stdout
}
const node = (args, opts) => run(process.execPath, args, opts)
const npm = (args, opts) => run(isWindows ? 'npm.cmd' : 'npm', args, opts)
const napi = (args, opts) => node([NAPI_CLI, ...args], opts)

function assert(condition, message) {
  if (!condition) throw new Error(message)
}
const readJson = (file) => JSON.parse(readFileSync(file, 'utf8'))
const packedFiles = (packJson) => packJson[0].files.map((f) => f.path).sort()
const lastLine = (text) => (text.trim().split('\n').pop() ?? '').trim()
const copyFile = (from, to) => {
  mkdirSync(dirname(to), { recursive: true })
  cpSync(from, to)
}

// ---- the check runner ----------------------------------------------------------------------------------

let passed = 0
let failed = 0
let blocked = null // set when a step the later checks need has failed

function check(name, fn, { needed = false } = {}) {
  if (blocked) {
    failed++
    console.log(`FAIL ${name}: not run, \`${blocked}\` failed`)
    return
  }
  const start = Date.now()
  try {
    const note = fn()
    passed++
    console.log(`ok   ${name} (${((Date.now() - start) / 1000).toFixed(1)} s)${note ? `: ${note}` : ''}`)
  } catch (e) {
    failed++
    console.log(`FAIL ${name}: ${String(e.message).replace(/\n/g, '\n       ')}`)
    if (needed) blocked = name
  }
}

function finish(code) {
  console.log(`${passed} passed, ${failed} failed`)
  process.exit(code ?? (failed > 0 ? 1 : 0))
}

// ---- preconditions -------------------------------------------------------------------------------------

if (!triple || !pkg.napi.targets.includes(triple)) {
  console.log(`FAIL platform: ${platformDir} is not one of the package's napi.targets (${pkg.napi.targets.join(', ')})`)
  failed++
  finish()
}
if (!existsSync(join(ROOT, nodeFile))) {
  console.log(`FAIL addon: ${nodeFile} is missing at the repository root; run \`npm run build\` first`)
  failed++
  finish()
}
if (!existsSync(NAPI_CLI)) {
  console.log('FAIL tooling: @napi-rs/cli is not installed; run `npm ci` first')
  failed++
  finish()
}

const work = realpathSync(mkdtempSync(join(tmpdir(), `${pkg.name}-package-test-`)))
const inRepo = !relative(ROOT, work).startsWith('..') && !relative(ROOT, work).includes(':')
const stage = join(work, 'release') // a copy of what the publish job holds: root files + npm/<platform>
const tarballs = join(work, 'tarballs')
const app = join(work, 'app') // the consumer project
mkdirSync(tarballs)
let rootTarball
let platformTarball
let rootFiles

// ---- packing -------------------------------------------------------------------------------------------

check(
  'root tarball contents (npm pack --dry-run)',
  () => {
    assert(!inRepo, `the temporary directory ${work} is inside the repository`)
    rootFiles = packedFiles(JSON.parse(npm(['pack', '--dry-run', '--json', '--ignore-scripts'], { cwd: ROOT })))
    const stray = rootFiles.filter((f) => ROOT_FILES_FORBIDDEN.some((re) => re.test(f)))
    assert(stray.length === 0, `files that must not be published: ${stray.join(', ')}`)
    const bins = typeof pkg.bin === 'string' ? [pkg.bin] : Object.values(pkg.bin ?? {})
    const required = ['package.json', 'README.md', 'CHANGELOG.md', pkg.main, pkg.types, ...bins].map((f) => f.replace(/^\.\//, ''))
    const missing = required.filter((f) => !rootFiles.includes(f))
    assert(missing.length === 0, `missing from the tarball: ${missing.join(', ')}`)
    return rootFiles.join(', ')
  },
  { needed: true },
)

check(
  'platform packages match the root package',
  () => {
    for (const [t, dir] of Object.entries(PLATFORM_DIRS)) {
      assert(pkg.napi.targets.includes(t), `napi.targets lacks ${t}`)
      const p = readJson(join(ROOT, 'npm', dir, 'package.json'))
      assert(p.name === `${pkg.name}-${dir}`, `npm/${dir}: name ${p.name}`)
      assert(p.version === pkg.version, `npm/${dir}: version ${p.version} is not ${pkg.version}`)
      assert(p.main === `${binaryName}.${dir}.node` && p.files?.length === 1 && p.files[0] === p.main, `npm/${dir}: main/files`)
      assert(p.license === pkg.license && p.engines?.node === pkg.engines.node, `npm/${dir}: license/engines`)
      assert(p.os?.[0] === dir.split('-')[0] && p.cpu?.length === 1, `npm/${dir}: os/cpu`)
      assert(dir.startsWith('linux') === Boolean(p.libc), `npm/${dir}: libc`)
      assert(existsSync(join(ROOT, 'npm', dir, 'README.md')), `npm/${dir}: README.md`)
    }
    const extra = pkg.napi.targets.filter((t) => !PLATFORM_DIRS[t])
    assert(extra.length === 0, `targets without an npm/ package: ${extra.join(', ')}`)
    return `${pkg.napi.targets.length} targets at ${pkg.version}`
  },
)

check(
  'release staging (napi artifacts + napi prepublish -t npm)',
  () => {
    // The publish job's steps, on a copy holding exactly the packed files, with napi.targets cut down to
    // this platform (prepublish fails when a configured target has no artifact).
    for (const f of rootFiles) copyFile(join(ROOT, f), join(stage, f))
    cpSync(join(ROOT, 'npm', platformDir), join(stage, 'npm', platformDir), { recursive: true })
    const staged = readJson(join(stage, 'package.json'))
    staged.napi.targets = [triple]
    writeFileSync(join(stage, 'package.json'), `${JSON.stringify(staged, null, 2)}\n`)
    copyFile(join(ROOT, nodeFile), join(stage, 'artifacts', `bindings-${triple}`, nodeFile))
    napi(['artifacts'], { cwd: stage })
    assert(existsSync(join(stage, 'npm', platformDir, nodeFile)), `napi artifacts did not copy ${nodeFile} into npm/${platformDir}`)
    rmSync(join(stage, 'artifacts'), { recursive: true })
    napi(['prepublish', '-t', 'npm', '--skip-optional-publish', '--no-gh-release'], { cwd: stage })
    const optional = readJson(join(stage, 'package.json')).optionalDependencies
    assert(
      JSON.stringify(optional) === JSON.stringify({ [platformPackage]: pkg.version }),
      `prepublish wrote optionalDependencies ${JSON.stringify(optional)}`,
    )
    return `optionalDependencies ${JSON.stringify(optional)}`
  },
  { needed: true },
)

check(
  'npm pack of both packages',
  () => {
    const root = JSON.parse(npm(['pack', '--json', '--ignore-scripts', '--pack-destination', tarballs], { cwd: stage }))
    const plat = JSON.parse(npm(['pack', '--json', '--ignore-scripts', '--pack-destination', tarballs], { cwd: join(stage, 'npm', platformDir) }))
    assert(packedFiles(root).join() === rootFiles.join(), `the staged root tarball differs: ${packedFiles(root).join(', ')}`)
    const expected = ['README.md', nodeFile, 'package.json'].sort()
    assert(packedFiles(plat).join() === expected.join(), `platform tarball holds ${packedFiles(plat).join(', ')}`)
    rootTarball = join(tarballs, root[0].filename)
    platformTarball = join(tarballs, plat[0].filename)
    return `${root[0].filename} (${(root[0].size / 1024).toFixed(1)} KiB), ${plat[0].filename} (${(plat[0].size / 1024).toFixed(1)} KiB)`
  },
  { needed: true },
)

// ---- the consumer project ------------------------------------------------------------------------------

check(
  'install into a fresh project',
  () => {
    cpSync(CONSUMER, app, { recursive: true })
    const nodeMajor = process.versions.node.split('.')[0]
    const consumer = {
      name: 'package-test-consumer',
      version: '1.0.0',
      private: true,
      // The platform package is reached the way users get it: through the root package's
      // optionalDependencies, redirected to the local tarball.
      dependencies: { [pkg.name]: `file:${rootTarball}` },
      overrides: { [platformPackage]: `file:${platformTarball}` },
      devDependencies: { '@types/node': `^${nodeMajor}`, ava: '^7', jest: '^30', typescript: 'latest' },
      ava: { files: ['ava/**/*.spec.mjs'], timeout: '1m' },
      jest: { testMatch: ['<rootDir>/jest/**/*.test.js'], testEnvironment: 'node' },
    }
    writeFileSync(join(app, 'package.json'), `${JSON.stringify(consumer, null, 2)}\n`)
    npm(['install', '--no-audit', '--no-fund', '--no-update-notifier', '--loglevel=error'], { cwd: app, timeout: 300_000 })
    const installed = join(app, 'node_modules', pkg.name)
    assert(!readdirSync(installed).some((f) => f.endsWith('.node')), 'the root package carries a .node file')
    assert(existsSync(join(app, 'node_modules', platformPackage, nodeFile)), `${platformPackage} was not installed`)
    const tsVersion = readJson(join(app, 'node_modules', 'typescript', 'package.json')).version
    const versions = ['jest', 'ava', '@types/node'].map((p) => `${p} ${readJson(join(app, 'node_modules', p, 'package.json')).version}`)
    return `typescript ${tsVersion}, ${versions.join(', ')}`
  },
  { needed: true },
)

const binDir = join(app, 'node_modules', '.bin')
const tool = (name) => join(binDir, isWindows ? `${name}.cmd` : name)

check('(a) CommonJS require', () => lastLine(node(['cjs.cjs', platformPackage], { cwd: app })))
check('(b) ESM import', () => lastLine(node(['esm.mjs'], { cwd: app })))
check('(c) TypeScript tsc --strict --noEmit', () => {
  run(tool('tsc'), ['--strict', '--noEmit', '-p', 'tsconfig.json'], { cwd: app })
  // the same project with the @ts-expect-error lines removed must fail: the declarations are really checked
  for (const f of ['check.ts', 'check-esm.mts']) {
    const text = readFileSync(join(app, f), 'utf8').replace(/^\s*\/\/ @ts-expect-error.*$/gm, '')
    writeFileSync(join(app, `neg-${f}`), text)
  }
  writeFileSync(join(app, 'tsconfig.neg.json'), JSON.stringify({ extends: './tsconfig.json', files: ['neg-check.ts', 'neg-check-esm.mts'] }))
  let negative
  try {
    run(tool('tsc'), ['--strict', '--noEmit', '-p', 'tsconfig.neg.json'], { cwd: app })
  } catch (e) {
    negative = e.message
  }
  for (const f of ['neg-check.ts', 'neg-check-esm.mts']) {
    assert(negative?.includes(`${f}(`), `a wrong call in ${f} compiled${negative ? `:\n${negative}` : ''}`)
  }
  return 'shipped index.d.ts type-checks; wrong calls are rejected'
})
check('(d) jest', () => {
  const out = run(tool('jest'), ['--ci', '--runInBand', '--colors=false'], { cwd: app, both: true })
  return ['Test Suites:', 'Tests:'].map((k) => out.split('\n').find((l) => l.startsWith(k))?.replace(/\s+/g, ' ')).join('; ')
})
check('(e) ava (worker threads)', () => lastLine(run(tool('ava'), ['--timeout=1m'], { cwd: app })))
check('(f) main thread + 2 worker_threads', () => lastLine(node(['workers.mjs'], { cwd: app, timeout: 60_000 })))
for (const [name, target] of Object.entries(typeof pkg.bin === 'string' ? { [pkg.name]: pkg.bin } : (pkg.bin ?? {}))) {
  check(`(g) CLI \`${name}\` (bin ${target})`, () => {
    const out = run(tool(name), ['inspect', '--json'], { cwd: app })
    const info = JSON.parse(out)
    assert(info.format && info.nTokens >= 0, `unexpected output: ${out.slice(0, 200)}`)
    return `inspect of the bundled sample: ${info.format} v${info.version}, ${info.nTokens} tokens, ${info.nLayer} layers`
  })
}

if (process.env.KEEP_PACKAGE_TEST === '1') console.log(`kept ${work}`)
else {
  rmSync(work, { recursive: true, force: true })
  if (failed > 0) console.log('rerun with KEEP_PACKAGE_TEST=1 to keep the packed tarballs and the consumer project')
}
finish()

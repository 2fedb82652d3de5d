// The shipped declarations (index.d.ts over the generated binding.d.ts) checked by TypeScript
// itself: __test__/fixtures/types/kinds.ts uses the cache's types by kind, the async twins and
// the deprecated names, and marks each call that must not compile with `@ts-expect-error`.

import test from 'ava'
import fs from 'node:fs'
import path from 'node:path'
import { spawnSync } from 'node:child_process'
import { createRequire } from 'node:module'
import { fileURLToPath } from 'node:url'

const require = createRequire(import.meta.url)
const HERE = path.dirname(fileURLToPath(import.meta.url))
const FIXTURE = path.join(HERE, 'fixtures', 'types')
const TSC = require.resolve('typescript/bin/tsc')

const tsc = (project) => spawnSync(process.execPath, [TSC, '-p', project], { encoding: 'utf8' })

test('index.d.ts: seed-only members are type errors on a cache of any kind, narrowing by kind allows them, the async twins return promises', (t) => {
  const r = tsc(path.join(FIXTURE, 'tsconfig.json'))
  t.is(r.status, 0, `${r.stdout}${r.stderr}`)
})

test('the same fixture without its @ts-expect-error lines fails on each of them: the declarations are really checked', (t) => {
  const dir = fs.mkdtempSync(path.join(FIXTURE, 'neg-'))
  t.teardown(() => fs.rmSync(dir, { recursive: true, force: true }))
  const source = fs.readFileSync(path.join(FIXTURE, 'kinds.ts'), 'utf8').split('\n')
  const expected = source.flatMap((line, i) => (/^\s*\/\/ @ts-expect-error/.test(line) ? [i + 2] : []))
  t.true(expected.length >= 8, `${expected.length} expected errors`)
  // blank the directive lines, so that line numbers stay those of the fixture
  const stripped = source.map((line) => (/^\s*\/\/ @ts-expect-error/.test(line) ? '' : line.replace("'../../../", "'../../../../")))
  fs.writeFileSync(path.join(dir, 'kinds.ts'), stripped.join('\n'))
  const config = JSON.parse(fs.readFileSync(path.join(FIXTURE, 'tsconfig.json'), 'utf8'))
  config.compilerOptions.typeRoots = ['../../../../node_modules/@types']
  fs.writeFileSync(path.join(dir, 'tsconfig.json'), JSON.stringify(config))
  const r = tsc(path.join(dir, 'tsconfig.json'))
  t.not(r.status, 0)
  const failing = new Set([...r.stdout.matchAll(/kinds\.ts\((\d+),\d+\): error/g)].map((m) => Number(m[1])))
  t.deepEqual(expected.filter((line) => !failing.has(line)), [], r.stdout)
})

// Driver: runs each peer in its own Node process (two different llama.cpp builds must not share one process),
// then prints a summary. Run from anywhere: node interop/make-fixtures.mjs
import { spawnSync } from 'node:child_process'
import fs from 'node:fs'
import path from 'node:path'
import { HERE, FIXTURES } from './lib.mjs'

let failed = false
for (const script of ['fixtures-llama-node.mjs', 'fixtures-node-llama-cpp.mjs']) {
  console.log(`== ${script}`)
  // @fugood/llama.node 1.7.15 segfaults now and then (every 2nd-4th run here, SIGSEGV inside the native addon):
  // the scripts are idempotent, so retry the whole script.
  let r
  for (let attempt = 1; attempt <= 4; attempt++) {
    r = spawnSync(process.execPath, [path.join(HERE, script)], { cwd: HERE, encoding: 'utf8', maxBuffer: 1 << 28 })
    for (const line of (r.stdout ?? '').split('\n')) if (/^(wrote|FAILED)/.test(line)) console.log('  ' + line)
    if (r.status === 0) break
    console.log(`  attempt ${attempt}: exit ${r.status} signal ${r.signal}` + (attempt < 4 ? ', retrying' : ''))
  }
  if (r.status !== 0) {
    failed = true
    console.log((r.stderr ?? '').split('\n').slice(-30).join('\n'))
  }
}
const files = fs.readdirSync(FIXTURES).filter((f) => /\.gg(sn|sq)$/.test(f)).sort()
let total = 0
for (const f of files) {
  const meta = JSON.parse(fs.readFileSync(path.join(FIXTURES, f + '.json'), 'utf8'))
  total += meta.file.size
  if (!meta.verify?.ok) failed = true
}
console.log(`${files.length} fixtures, ${total} bytes in ${path.relative(process.cwd(), FIXTURES) || '.'}; all verified: ${!failed}`)
process.exit(failed ? 1 : 0)

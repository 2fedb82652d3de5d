// compress: tiers that keep their blocks smaller. Lossless gives the rows back byte for byte,
// q8_0 within half a q8_0 step; every store reads every mode; bad values are refused by name.
import test from 'ava'
import fs from 'node:fs'
import os from 'node:os'
import path from 'node:path'
import { createRequire } from 'node:module'

const require = createRequire(import.meta.url)
const { KvCache, PromptStore } = require('../index.js')

const tmp = (t) => {
  const dir = fs.mkdtempSync(path.join(os.tmpdir(), 'kvcompact-'))
  t.teardown(() => fs.rmSync(dir, { recursive: true, force: true }))
  return dir
}
const N = 128
const tokens = Array.from({ length: N }, (_, i) => 7 + i)
const newCache = () => new KvCache({ size: 256, nLayer: 2, nEmbdKGqa: 64, nSeqMax: 2 })

// f16 rows of activations-like values
function activations() {
  const cache = newCache()
  cache.findSlot({ pos: tokens.map((_, i) => i), seqIds: tokens.map(() => 0) })
  for (let il = 0; il < 2; il++) {
    for (let i = 0; i < N; i++) {
      const row = (sign) => Float32Array.from({ length: 64 }, (_, c) => sign * Math.sin(i * 0.05 + c * 0.7 + il) * (1 + c / 8))
      cache.writeKF32(il, i, row(1))
      cache.writeVF32(il, i, row(-1))
    }
  }
  return cache
}
const rows = (c) => [0, 1].flatMap((il) => [Buffer.from(c.readK(il, 0, N)), Buffer.from(c.readV(il, 0, N))])
const floats = (c) => [0, 1].flatMap((il) => [...c.readKF32(il, 0, N), ...c.readVF32(il, 0, N)])
const dirBytes = (dir) => fs.readdirSync(path.join(dir, 'blocks'), { recursive: true })
  .map((f) => path.join(dir, 'blocks', f))
  .filter((f) => fs.statSync(f).isFile())
  .reduce((sum, f) => sum + fs.statSync(f).size, 0)

test("compress 'lossless' and 'q8_0': smaller on disk, the same rows back (q8_0 within half a step), read by a store of any mode", async (t) => {
  const src = activations()
  const sizes = {}
  for (const mode of ['none', 'lossless', 'q8_0']) {
    const dir = tmp(t)
    const store = new PromptStore({ model: 'm', blockTokens: 16, path: dir, compress: mode })
    t.like(await store.put(src, 0, tokens), { blocksWritten: 8 })
    sizes[mode] = dirBytes(dir)
    await store.close()
    // a reader without the option decodes what the writer kept
    const reader = new PromptStore({ model: 'm', blockTokens: 16, path: dir })
    const dst = newCache()
    t.is(await reader.restore(dst, 0, tokens), N)
    if (mode === 'q8_0') {
      const [want, got] = [floats(src), floats(dst)]
      for (let b = 0; b < want.length; b += 32) {
        const amax = Math.max(...want.slice(b, b + 32).map(Math.abs))
        for (let i = b; i < b + 32; i++) t.true(Math.abs(want[i] - got[i]) <= amax / 254 * 1.0001 + Math.abs(got[i]) / 1024, `value ${i}`)
      }
      t.notDeepEqual(rows(dst), rows(src))
    } else {
      t.deepEqual(rows(dst), rows(src))
    }
    await reader.close()
  }
  t.true(sizes.lossless < sizes.none * 0.9, JSON.stringify(sizes))
  t.true(sizes.q8_0 < sizes.none * 0.6, JSON.stringify(sizes))
})

test('compress per tier: memory as it is in front of a q8_0 dir; options are checked', async (t) => {
  const dir = tmp(t)
  const store = new PromptStore({ model: 'm', blockTokens: 16, tiers: ['memory', 'dir'], path: dir, compress: { dir: 'q8_0' } })
  const src = activations()
  await store.put(src, 0, tokens)
  // the memory tier keeps the exact rows
  const dst = newCache()
  t.is(await store.restore(dst, 0, tokens), N)
  t.deepEqual(rows(dst), rows(src))
  await store.close()
  const bad = [
    [{ compress: 'zstd' }, /compress: unknown mode "zstd" \(expected 'none', 'lossless' or 'q8_0'\)/],
    [{ compress: { redis: 'q8_0' } }, /compress.redis: this store has no redis tier/],
    [{ compress: { disk: 'q8_0' } }, /unknown option 'disk'/],
    [{ compress: { dir: 'q4' } }, /unknown mode "q4"/],
    [{ compress: 5 }, /compress/],
  ]
  for (const [o, message] of bad) {
    t.throws(() => new PromptStore({ model: 'm', path: dir, ...o }), { code: 'ERR_KV_INVALID_ARG', message }, JSON.stringify(o))
  }
})

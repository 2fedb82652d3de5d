// What a cache costs before it is used, and what clear() costs after: creation time and RSS
// right after `new KvCache` at an 8B llama's geometry (32 layers, 1,024-wide f16 K and V) for
// a 2 GiB (16,384 cells) and a 16 GiB (131,072 cells) cache, then clear() of a cache whose
// tensors were all written, against a memset (Buffer.fill) of the same bytes in the same run.
//
//   node bench/create.mjs            # after `npm run build`; BENCH_CLEAR_MIB=512 by default
import fs from 'node:fs'
import { createRequire } from 'node:module'
import { median } from './timing.mjs'

const require = createRequire(import.meta.url)
const { KvCache } = require('../index.js')

const kb = (field) => Number(fs.readFileSync('/proc/self/status', 'utf8').match(new RegExp(`${field}:\\s+(\\d+)`))[1])
const ms = (t0) => Number(process.hrtime.bigint() - t0) / 1e6
const geometry = (size) => ({ size, nLayer: 32, nEmbdKGqa: 1024, typeK: 'f16', typeV: 'f16' })
const ROUNDS = Number(process.env.BENCH_ROUNDS ?? 5)

console.log(`# Creation and clear() (node ${process.version}; median of ${ROUNDS})`)
console.log()
console.log('| cache | tensors | create | RSS right after | first write of one row |')
console.log('|---|---|---|---|---|')
for (const size of [16384, 131072]) {
  const times = []
  const rss = []
  const firstWrite = []
  let bytes = 0
  for (let r = 0; r < ROUNDS; r++) {
    const before = kb('VmRSS')
    const t0 = process.hrtime.bigint()
    const c = new KvCache(geometry(size))
    times.push(ms(t0))
    rss.push((kb('VmRSS') - before) / 1024)
    const t1 = process.hrtime.bigint()
    c.writeK(31, size - 1, Buffer.alloc(2048, 1))
    firstWrite.push(ms(t1))
    bytes = c.totalBytes
    c.dispose()
  }
  console.log(`| ${size.toLocaleString('en')} cells | ${(bytes / 2 ** 30).toFixed(0)} GiB | ${median(times).toFixed(3)} ms | +${median(rss).toFixed(1)} MiB | ${median(firstWrite).toFixed(3)} ms |`)
}

// clear() of a touched cache against a memset of the same bytes
const mib = Number(process.env.BENCH_CLEAR_MIB ?? 512)
const cells = (mib * 2 ** 20) / (32 * 2 * 2048)
const c = new KvCache(geometry(cells))
const rows = Buffer.alloc(cells * 2048, 3)
const touch = () => {
  for (let il = 0; il < 32; il++) {
    c.writeK(il, 0, rows)
    c.writeV(il, 0, rows)
  }
}
const plain = Buffer.alloc(c.totalBytes, 3)
const clear = []
const memset = []
let rssTouched = 0
let rssCleared = 0
for (let r = 0; r < ROUNDS; r++) {
  touch()
  rssTouched = kb('VmRSS')
  let t0 = process.hrtime.bigint()
  c.clear()
  clear.push(ms(t0))
  rssCleared = kb('VmRSS')
  t0 = process.hrtime.bigint()
  plain.fill(0)
  memset.push(ms(t0))
  plain.fill(3)
}
const [cm, mm] = [median(clear), median(memset)]
console.log()
console.log(`| clear() of a touched ${mib} MiB cache | memset of ${mib} MiB | clear / memset speed | RSS released by clear |`)
console.log('|---|---|---|---|')
console.log(`| ${cm.toFixed(2)} ms | ${mm.toFixed(2)} ms | ${(mm / cm).toFixed(2)}x | ${((rssTouched - rssCleared) / 1024).toFixed(0)} MiB |`)
c.dispose()

// One "process" of the several-processes prompt store test: opens the shared directory, puts
// its prompts and restores every prompt of the run, checking each restore byte for byte.
//   node store-worker.mjs <dir | redis://…> <worker> <workers>
// Prints `@@RESULT <json>` and exits 0, or exits 1 with the failure on stderr.
import { createRequire } from 'node:module'
import { promptCache } from './store-prompts.mjs'

const require = createRequire(import.meta.url)
const { KvCache, PromptStore } = require('../../index.js')

const [dir, worker, workers] = process.argv.slice(2)
// a directory, or a Redis URL standing for a store shared by machines
const where = dir.startsWith('redis://') ? { url: dir } : { path: dir }
const store = new PromptStore({ model: 'h16-test', ...where, blockTokens: 16 })
const mine = Number(worker)
let restored = 0
for (let round = 0; round < 3; round++) {
  for (let w = 0; w < Number(workers); w++) {
    // put our own prompt (again: idempotent), then restore whatever the others have stored
    if (w === mine) {
      const { cache, tokens } = promptCache(KvCache, w)
      await store.put(cache, 0, tokens)
    }
    const { cache: want, tokens } = promptCache(KvCache, w)
    const got = new KvCache({ size: 128, nLayer: 2, nEmbdKGqa: 32, nSeqMax: 2 })
    const n = await store.restore(got, 1, tokens)
    if (n === 0) continue // not stored yet by its worker
    for (let il = 0; il < 2; il++) {
      for (const read of ['readK', 'readV']) {
        const a = Buffer.from(want[read](il, 0, n))
        const b = Buffer.from(got[read](il, 0, n))
        if (!a.equals(b)) throw new Error(`worker ${mine}: prompt ${w} layer ${il} ${read} differs after restoring ${n} tokens`)
      }
    }
    restored += n
  }
}
const stats = await store.stats()
console.log('@@RESULT ' + JSON.stringify({ restored, corrupt: stats.corrupt }))

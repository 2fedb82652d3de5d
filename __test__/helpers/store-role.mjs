// One "machine" of the Redis fleet test: opens the store at a URL and plays one role.
//   node store-role.mjs <url> put <w>       puts prompt w (store-prompts.mjs)
//   node store-role.mjs <url> restore <w>   restores prompt w into a fresh cache, byte-checked
//   node store-role.mjs <url> lookup <w>    looks up prompt w followed by 40 more tokens
// Prints `@@RESULT <json>` and exits 0, or exits 1 with the failure on stderr.
import { createRequire } from 'node:module'
import { promptCache, promptTokens } from './store-prompts.mjs'

const require = createRequire(import.meta.url)
const { KvCache, PromptStore } = require('../../index.js')

const [url, role, w] = process.argv.slice(2)
const store = new PromptStore({ model: 'h16-test', url, blockTokens: 16 })
const prompt = Number(w)
let result
if (role === 'put') {
  const { cache, tokens } = promptCache(KvCache, prompt)
  result = await store.put(cache, 0, tokens)
} else if (role === 'restore') {
  const { cache: want, tokens } = promptCache(KvCache, prompt)
  const got = new KvCache({ size: 128, nLayer: 2, nEmbdKGqa: 32, nSeqMax: 2 })
  const restored = await store.restore(got, 1, tokens)
  for (let il = 0; il < 2; il++) {
    for (const read of ['readK', 'readV']) {
      if (!Buffer.from(want[read](il, 0, restored)).equals(Buffer.from(got[read](il, 0, restored)))) {
        throw new Error(`prompt ${prompt} layer ${il} ${read} differs after restoring ${restored} tokens`)
      }
    }
  }
  result = { restored }
} else if (role === 'lookup') {
  const longer = [...promptTokens(prompt), ...Array.from({ length: 40 }, (_, i) => 90_000 + i)]
  result = { found: await store.lookup(longer) }
} else {
  throw new Error(`unknown role ${role}`)
}
console.log('@@RESULT ' + JSON.stringify(result))

'use strict'
// The package's entry point. `binding.js` is napi's generated loader of the native addon (the
// classes and functions, typed by the generated `binding.d.ts`); this file adds the JS half of
// the API: the state streams of KvCache (lib/state-stream.js), plain Node streams around a
// native session. `index.d.ts` types the whole, with the cache's type by kind.

// `module.exports = require(...)` is the form Node's CJS -> ESM detection (cjs-module-lexer)
// follows, so `import { KvCache } from 'llama-kv-cache'` gets every export of the binding
module.exports = require('./binding.js')
require('./lib/state-stream.js').attach(module.exports.KvCache)
require('./lib/store-events.js').attach(module.exports.PromptStore)

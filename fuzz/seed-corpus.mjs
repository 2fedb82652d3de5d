// Seeds fuzz/corpus/state_reader: every fixture file under a few selector bytes (the target's
// first byte picks the cache, the reader and the sequence), and payloads written by the addon
// for the fourth mode (streamed load against state_read); and fuzz/corpus/live_reader (below).
// Run after `npm run build`:
//   node fuzz/seed-corpus.mjs && cargo +nightly fuzz run -s none state_reader -- -fork=1
//   cargo +nightly fuzz run -s none live_reader -- -fork=1
import fs from 'node:fs'
import path from 'node:path'
import { fileURLToPath } from 'node:url'
import { createRequire } from 'node:module'

const root = path.join(path.dirname(fileURLToPath(import.meta.url)), '..')
const { KvCache, inspectState } = createRequire(import.meta.url)(path.join(root, 'index.js'))
const out = path.join(root, 'fuzz/corpus/state_reader')
fs.mkdirSync(out, { recursive: true })
const put = (name, selector, bytes) =>
  fs.writeFileSync(path.join(out, `${name}.${selector.toString(16)}`), Buffer.concat([Buffer.from([selector]), bytes]))

// files: 0xff converts; 0x4_/0x5_ load a sequence file, 0x8_/0x9_/0xa_ a session, with or
// without flash attention, quantized and rotated caches, parts
const walk = (dir) => fs.readdirSync(dir, { withFileTypes: true })
  .flatMap((e) => e.isDirectory() ? walk(path.join(dir, e.name)) : [path.join(dir, e.name)])
let files = 0
for (const f of walk(path.join(root, '__test__/fixtures')).filter((f) => /\.ggs[nq]$/.test(f))) {
  const bytes = fs.readFileSync(f)
  if (bytes.length > 300_000) continue
  const selectors = f.endsWith('.ggsn') ? [0xff, 0x80, 0x81, 0x83, 0x8b, 0x91, 0xa1] : [0xff, 0x40, 0x41, 0x43, 0x4b, 0x51]
  for (const s of selectors) put(path.basename(f), s, bytes)
  files++
}

// payloads from caches shaped like the target's (16 cells, 2 layers, 32 wide, 4 sequences)
let payloads = 0
for (const sel of [0, 1, 2, 3]) {
  const flashAttn = (sel & 1) === 1
  const type = (sel & 2) === 2 ? 'q8_0' : 'f16'
  const c = new KvCache({ size: 16, nLayer: 2, nEmbdKGqa: 32, nSeqMax: 4, flashAttn, typeK: type, typeV: flashAttn ? type : 'f16' })
  c.findSlot({ pos: [0, 1, 2, 3, 4], seqIds: [[0, 1], [1], [2], [0], [1]] })
  for (const layout of ['seed', 'streams']) {
    for (const seq of [-1, 0, 1]) {
      const bytes = c.stateWriteSync(seq, { layout })
      // 0xc_ streams the payload into sequence (hi - 1) in chunks of 1 + hi * 1000 bytes
      for (const hi of [0, 1, 2, 3]) put(`payload-${sel}-${layout}-${seq}`, 0xc0 | (hi << 4) | sel, bytes)
      payloads++
    }
  }
  c.dispose()
}
// fuzz/corpus/live_reader: payloads of today's memories as that target builds them (selector bits
// 0-1 and 6: gemma3 iSWA, Jamba, LFM2, LFM2 with a window, Qwen3.5, Nemotron-H, Falcon-H1; 256 cells, 3 sequences, sequences 0 and 1
// placed with 6 and 3 tokens), in both layouts, whole and of one sequence, and 0.1.161's files'
const liveOut = path.join(root, 'fuzz', 'corpus', 'live_reader')
fs.mkdirSync(liveOut, { recursive: true })
const putLive = (name, selector, bytes) =>
  fs.writeFileSync(path.join(liveOut, `${name}.${selector.toString(16)}`), Buffer.concat([Buffer.from([selector]), bytes]))
const MEMORIES = ['gemma3-swa', 'jamba', 'lfm2', 'lfm2-swa', 'qwen35', 'nemotron-h', 'falcon-h1']
for (const [index, name] of MEMORIES.entries()) {
  const k = (index & 3) | ((index & 4) << 4)
  const c = KvCache.fromModel(path.join(root, 'interop/models', `${name}.gguf`), { nCtx: 256, nSeqMax: 3, nUbatch: 16 })
  for (const [seq, n] of [[0, 6], [1, 3]]) {
    const pos = Array.from({ length: n }, (_, i) => i)
    c.place(name.startsWith('gemma') ? [{ pos, seqIds: Array(n).fill(seq) }] : [{ pos, seqIds: [seq], nSeqTokens: n }])
  }
  for (const [bit, layout] of [[0, 'streams-rot'], [4, 'streams']]) {
    for (const [hi, seq] of [[0, -1], [1, 0]]) {
      putLive(`${name}-${layout}-${seq}`, k | bit | (hi << 3), c.stateWriteSync(seq, { layout }))
      // the checkpoint form (partial, bit 5) with llama_state_seq_get_data's envelope
      putLive(`${name}-${layout}-${seq}-partial`, k | bit | (hi << 3) | 0x20, c.stateWriteSync(seq, { layout, partial: true, envelope: true }))
      payloads += 2
    }
  }
  c.dispose()
  for (const ext of ['ggsn', 'ggsq']) {
    const file = path.join(root, '__test__/fixtures/t161', `t161-${name}.${ext}`)
    const bytes = fs.readFileSync(file)
    const ins = inspectState(file)
    const payload = bytes.subarray(bytes.length - ins.parts.reduce((sum, p) => sum + p.bytes, 0))
    putLive(`t161-${name}.${ext}`, k | ((ext === 'ggsq' ? 1 : 0) << 3), payload)
  }
}
console.log(`seeded ${out}: ${files} fixture files, ${payloads} payloads, each under several selectors`)

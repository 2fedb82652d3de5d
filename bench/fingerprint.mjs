// The weights' fingerprint that keys a prompt store by a GGUF path: BLAKE3 over the whole file,
// computed once per file version and remembered. Prints, for a 1 GiB model file, the first
// (cold) fingerprint in GB/s against reading the same file in the same run (fs.readSync into one
// reused 1 MiB buffer), and the warm open (remembered) against a no-op call, medians of 5
// interleaved rounds.
//
//   node bench/fingerprint.mjs [sizeMiB]
import fs from 'node:fs'
import os from 'node:os'
import path from 'node:path'
import { createRequire } from 'node:module'

const require = createRequire(import.meta.url)
const HERE = import.meta.dirname ?? path.dirname(new URL(import.meta.url).pathname)
const mib = Number(process.argv[2] ?? 1024)
const dir = fs.mkdtempSync(path.join(os.tmpdir(), 'kv-fingerprint-'))
process.env.LLAMA_KV_CACHE_DIR = path.join(dir, 'cache')
const { modelInfoSync } = require('../index.js')

// a real GGUF (header and tensors of the tiny llama) followed by 1 GiB of weights
const file = path.join(dir, 'big.gguf')
fs.copyFileSync(path.join(HERE, '..', 'interop', 'models', 'llama-h16.gguf'), file)
const chunk = Buffer.alloc(1 << 20)
const fd = fs.openSync(file, 'a')
for (let i = 0; i < mib; i++) {
  chunk.fill(i & 0xff)
  fs.writeSync(fd, chunk)
}
fs.closeSync(fd)
const bytes = fs.statSync(file).size

const median = (xs) => [...xs].sort((a, b) => a - b)[xs.length >> 1]
const time = (f) => {
  const t = process.hrtime.bigint()
  f()
  return Number(process.hrtime.bigint() - t) / 1e9
}
const read = () => {
  const buf = Buffer.alloc(1 << 20)
  const fd = fs.openSync(file, 'r')
  while (fs.readSync(fd, buf) > 0);
  fs.closeSync(fd)
}
const rounds = { cold: [], read: [], warm: [], noop: [] }
for (let r = 0; r < 5; r++) {
  fs.rmSync(process.env.LLAMA_KV_CACHE_DIR, { recursive: true, force: true })
  rounds.cold.push(time(() => modelInfoSync(file, { hashFile: true })))
  rounds.read.push(time(read))
  rounds.warm.push(time(() => modelInfoSync(file, { hashFile: true })))
  rounds.noop.push(time(() => modelInfoSync(file)))
}
const gbs = (s) => (bytes / s / 1e9).toFixed(2)
const [cold, raw, warm, header] = ['cold', 'read', 'warm', 'noop'].map((k) => median(rounds[k]))
console.log(`fingerprint of a ${(bytes / 2 ** 30).toFixed(2)} GiB GGUF: first ${(cold * 1e3).toFixed(1)} ms (${gbs(cold)} GB/s); reading it ${(raw * 1e3).toFixed(1)} ms (${gbs(raw)} GB/s); ratio ${(raw / cold).toFixed(2)}`)
console.log(`warm (remembered): ${(warm * 1e3).toFixed(3)} ms; modelInfoSync of the header alone ${(header * 1e3).toFixed(3)} ms; limit 1 ms`)
fs.rmSync(dir, { recursive: true, force: true })

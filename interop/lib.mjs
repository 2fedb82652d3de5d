// Shared helpers for the fixture generators (no native code here).
import fs from 'node:fs'
import path from 'node:path'
import crypto from 'node:crypto'
import { fileURLToPath } from 'node:url'

export const HERE = path.dirname(fileURLToPath(import.meta.url))
export const MODELS = path.join(HERE, 'models')
export const FIXTURES = path.resolve(HERE, '..', '__test__', 'fixtures')
export const PROMPT = 'the cat sat on the mat'
export const N_CTX = 256

export function modelPath(name) {
  const p = path.join(MODELS, name)
  if (!fs.existsSync(p)) throw new Error(`${p} missing: run python interop/make_models.py first`)
  return p
}

export function sha256(file) {
  return crypto.createHash('sha256').update(fs.readFileSync(file)).digest('hex')
}

export function pkgVersion(name) {
  const p = path.join(HERE, 'node_modules', name, 'package.json')
  return JSON.parse(fs.readFileSync(p, 'utf8')).version
}

let vocab = null
/** piece (as the peer prints it, '\u2581' shown as ' ') -> token id */
export function tokenIdOfPiece(piece) {
  if (!vocab) {
    const v = JSON.parse(fs.readFileSync(path.join(MODELS, 'vocab.json'), 'utf8'))
    vocab = new Map(v.tokens.map((t, i) => [t.replaceAll('\u2581', ' '), i]))
  }
  const id = vocab.get(piece)
  if (id === undefined) throw new Error(`piece ${JSON.stringify(piece)} not in vocab`)
  return id
}

export function pieceOf(id) {
  tokenIdOfPiece(' ') // load
  for (const [k, v] of vocab) if (v === id) return k
  return null
}

/** Header of a 'ggsn' / 'ggsq' file: magic, version, n_tokens, tokens. */
export function readStateHeader(file) {
  const b = fs.readFileSync(file)
  const magicNum = b.readUInt32LE(0)
  const magic = { 0x6767736e: 'ggsn', 0x67677371: 'ggsq' }[magicNum] ?? `0x${magicNum.toString(16)}`
  const version = b.readUInt32LE(4)
  const nTokens = b.readUInt32LE(8)
  const tokens = []
  for (let i = 0; i < nTokens; i++) tokens.push(b.readInt32LE(12 + 4 * i))
  return { magic, version, n_tokens: nTokens, tokens, size: b.length }
}

export function writeFixture(name, meta) {
  fs.mkdirSync(FIXTURES, { recursive: true })
  const file = path.join(FIXTURES, name)
  const hdr = readStateHeader(file)
  const out = {
    fixture: name,
    ...meta,
    file: { ...hdr, tokens: undefined, sha256: sha256(file) },
    state_tokens: hdr.tokens,
  }
  fs.writeFileSync(file + '.json', JSON.stringify(out, null, 2) + '\n')
  console.log(`wrote ${name} (${hdr.size} B, ${hdr.magic} v${hdr.version}, n_tokens ${hdr.n_tokens})` +
    ` next=${meta.next_token?.id} then=${meta.then_token?.id} verify=${meta.verify?.ok}`)
  return out
}

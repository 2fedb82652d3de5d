#!/usr/bin/env node
// llama-kv-cache CLI: inspect and convert llama.cpp KV state files, describe GGUF models, manage prompt
// stores.
'use strict'

const path = require('node:path')
const fs = require('node:fs')
const { inspectState, convertStateFileSync, modelInfoSync, checkState, PromptStore, KvCache } = require('..')

const SAMPLE = path.join(__dirname, '..', 'samples', 'llama-node-session.ggsn')
const USAGE = `usage:
  llama-kv-cache inspect [file] [--json] [--model FILE.gguf]
                                               describe a session (ggsn) or sequence (ggsq) file
                                               (no file: a bundled session written by llama.node);
                                               --model adds whether it fits that model and why not
  llama-kv-cache model FILE.gguf [--json] [--n-seq-max N] [--hash-file]
                                               the model's cache geometry, RoPE, sliding window,
                                               recurrent state and KV memory at common contexts
                                               (one sequence and N sequences, default 4)
  llama-kv-cache convert <in> <out> [options]  rewrite a state file
      --layout seed|streams|streams-rot
                              payload layout (default streams; streams-rot: llama.cpp 0.1.161)
      --version N             file version (ggsq 2|3|4, ggsn 9|10|11; default 2 / 9, 4 / 11
                              with streams-rot)
      --part NAME             of an iSWA / hybrid file, only this memory: base|swa|attention|recurrent
      --n-stream N            streams to write (1 = unified context)
      --seq ID                extract one sequence into a sequence file
      --to session|sequence   output kind (default: the input's; sequence with --seq)
      --as-seq ID             rename the written sequence (e.g. a slot of a non-unified context)
      --swa-window N          a sequence's window cache as llama.cpp 0.1.161 saves one: its last
                              N positions only (the model's sliding window)
      --arch NAME             session output from a sequence file: the architecture (default llama)
      --type-k T, --type-v T  re-type K/V (f32, f16, bf16, q8_0, ...)
      --n-rot-k N, --n-rot-v N
                              Hadamard rotation after re-typing (llama.cpp 0.1.161: 64 for
                              quantized K/V of head_dim 64; default: kept, none for float types)
      --recurrent             the input sequence file holds a recurrent (Mamba/RWKV) state
      --transformer           the input sequence file holds a transformer state
  llama-kv-cache store <command> --store DIR | --url URL [options]
                              a prompt store directory, or a Redis server shared by machines
      put <file>...           ingest llama.cpp session/sequence files (one sequence each; any
                              memory: unified, sliding-window, hybrid, recurrent, rotated K/V)
      lookup <tokens>         print the longest restorable prefix in tokens
      write <tokens> <out>    write that prefix as a llama.cpp file; prints its length. Default:
                              the kind, version, layout and flash-attn setting of the files put;
                              --kind, --version, --layout, --flash-attn, --arch as for convert
      --swa-window N          write: keep only the last N positions of a whole sliding-window
                              cache (for a reader without swa_full)
      stats [--json]          blocks, bytes, budget and evictions
      gc                      recount, enforce --max-bytes, remove leftovers of interrupted writes
      --model ID              the model identity the blocks were stored under (put/lookup/write)
      --block-tokens N        tokens per block (default 256)
      --max-bytes N           byte budget (LRU eviction)
      --compress MODE         put: keep blocks as none (default), lossless or q8_0 (every
                              store reads every mode)
      --url redis://[user[:password]@]host[:port][/db]
                              a Redis / Valkey store (with --store too: tiers dir, then redis)
      --prefix P              Redis key namespace (default llama-kv:)
    <tokens>: a JSON file of token ids, or a state file whose tokens are taken`

function fail(message, code = 2) {
  process.stderr.write(`llama-kv-cache: ${message}\n`)
  process.exit(code)
}

function parseFlags(args, spec) {
  const out = { positional: [] }
  for (let i = 0; i < args.length; i++) {
    const a = args[i]
    if (!a.startsWith('--')) {
      out.positional.push(a)
      continue
    }
    const name = a.slice(2)
    if (!(name in spec)) fail(`unknown option ${a}\n${USAGE}`)
    if (spec[name] === 'bool') {
      out[name] = true
    } else {
      if (i + 1 >= args.length) fail(`option ${a} needs a value`)
      out[name] = spec[name] === 'int' ? Number(args[++i]) : args[++i]
      if (spec[name] === 'int' && !Number.isInteger(out[name])) fail(`option ${a} needs an integer, got ${args[i]}`)
    }
  }
  return out
}

function rotation(m) {
  return m.nRotK == null ? '' : `, rotation K ${m.nRotK || 'none'} / V ${m.nRotV || 'none'}`
}

function memoryLines(lines, m, indent) {
  m.streams.forEach((s, i) => {
    const seqs = Object.entries(s.seqs)
      .map(([id, st]) => `seq ${id === '-1' ? '(saved)' : id}: ${st.cells} cells, pos ${st.posMin}..${st.posMax}`)
      .join('; ')
    lines.push(`${indent}stream ${i} ${s.cellCount} cells${seqs ? ` (${seqs})` : ''}`)
  })
  lines.push(`${indent}layers   ${m.nLayer}, V ${m.vTrans == null ? 'n/a' : m.vTrans ? 'transposed' : 'rows'}${rotation(m)}`)
  m.layers.forEach((l, i) => {
    lines.push(`${indent}  ${String(i).padStart(3)}  K ${l.kType} ${l.kRowSize} B/row   V ${l.vType} ${l.vRowSize} B/row`)
  })
}

function human(file, info) {
  const lines = []
  lines.push(`${file}`)
  lines.push(`  format   ${info.format} ('${info.magic}') version ${info.version}, ${info.layout} layout${info.hasOutputs ? ', with outputs block' : ''}`)
  if (info.arch) lines.push(`  arch     ${info.arch}`)
  lines.push(`  tokens   ${info.nTokens}: [${info.tokens.slice(0, 16).join(', ')}${info.nTokens > 16 ? ', ...' : ''}]`)
  if (info.parts) {
    lines.push(`  memory   ${info.memory}: ${info.parts.length} parts`)
    info.parts.forEach((p, i) => {
      lines.push(`  part ${i}   ${p.role} (${p.kind}), ${p.bytes} bytes`)
      memoryLines(lines, p, '    ')
    })
    if (info.compressed) {
      lines.push(`  compressed${info.compressed.partial ? ' (partial: compressors only)' : ''}`)
      for (const s of info.compressed.sections) {
        lines.push(`    ${s.group} ${s.kind.padEnd(10)} ratio ${s.ratio}, ${s.nStream} stream(s) x ${s.nRows} rows of ${s.rowWidth} ${s.rowType}, layers [${s.layers.join(', ')}], ${s.bytes} bytes`)
      }
    }
  } else {
    memoryLines(lines, info, '  ')
  }
  const b = info.byteAccounting
  const compressed = b.compressed ?? 0
  lines.push(`  bytes    ${b.total} = header ${b.header} + session ${b.session} + meta ${b.meta} + K ${b.k} + V ${b.v}${compressed ? ` + compressed ${compressed}` : ''} + framing ${b.total - b.header - b.session - b.meta - b.k - b.v - compressed}`)
  return lines.join('\n')
}

const KIB = 1024
function bytes(n) {
  if (n === null || n === undefined) return 'n/a'
  const units = ['B', 'KiB', 'MiB', 'GiB', 'TiB']
  let i = 0
  while (n >= KIB && i < units.length - 1) {
    n /= KIB
    i++
  }
  return `${i === 0 ? n : n.toFixed(n >= 100 ? 0 : n >= 10 ? 1 : 2)} ${units[i]}`
}

const TABLE_TYPES = ['f16', 'q8_0', 'q4_0']

/**
 * Tensor bytes of the memory `KvCache.fromModel` builds (flash attention, K and V of one type)
 * at common context sizes, for one sequence and for `nSeq` sequences each with that context;
 * null where that context is refused (a type the model's heads do not allow) or the model has
 * no live memory.
 */
function memoryTable(file, info, nSeq) {
  const ctxs = [...new Set([4096, 8192, 32768, 131072, info.nCtxTrain])].sort((a, b) => a - b)
  const bytes = (nCtx, nSeqMax, type) => {
    if (info.unsupported) return null
    try {
      return KvCache.planMemory(file, { nCtx, nSeqMax, typeK: type, typeV: type, flashAttn: true }).bytes
    } catch (e) {
      if (e.code === 'ERR_KV_INVALID_ARG') return null
      throw e
    }
  }
  return ctxs.map((ctx) => {
    const row = { nCtx: ctx, trained: ctx === info.nCtxTrain }
    for (const t of TABLE_TYPES) {
      const one = bytes(ctx, 1, t)
      row[t] = one === null ? null : { one, all: bytes(ctx * nSeq, nSeq, t) }
    }
    return row
  })
}

function humanModel(file, info, nSeq) {
  const lines = [`${file}`]
  lines.push(`  arch     ${info.arch}${info.name ? ` (${info.name})` : ''}, ${info.nLayer} layers, n_embd ${info.nEmbd}, trained context ${info.nCtxTrain}`)
  lines.push(`  memory   ${info.memory}${info.unsupported ? ` (no live cache: ${info.unsupported})` : ''}`)
  lines.push(`  heads    head size K ${info.nEmbdHeadK} / V ${info.nEmbdHeadV}`)
  info.layers.forEach((l, i) => {
    lines.push(`    ${String(i).padStart(3)}  heads ${l.nHead}, KV heads ${l.nHeadKv}, K width ${info.nEmbdKGqa[i]}, V width ${info.nEmbdVGqa[i]}${l.swa ? ', sliding window' : ''}`)
  })
  const r = info.rope
  lines.push(`  rope     ${r.type}, n_rot ${r.nRot}, base ${r.freqBase}, scale ${r.freqScale}, scaling ${r.scalingType}` +
    (r.scalingType === 'yarn' ? `, yarn orig ctx ${r.nCtxOrigYarn}, attn factor ${r.attnFactor}` : '') +
    (r.factorTensors.length ? `, factors ${r.factorTensors.join(', ')}` : ''))
  if (info.swa) lines.push(`  swa      window ${info.swa.window}, pattern ${info.swa.pattern}${info.swa.chunked ? ' (chunked)' : ''}, layers [${info.swa.layers.join(', ')}], base ${r.freqBaseSwa}`)
  if (info.recurrent) {
    const x = info.recurrent
    lines.push(`  state    ${x.wkvHeadSize ? `rwkv wkv head ${x.wkvHeadSize}, token shift ${x.tokenShiftCount}` : `ssm conv ${x.ssmDConv}, inner ${x.ssmDInner}, state ${x.ssmDState}, dt rank ${x.ssmDtRank}`}; widths K+${x.nEmbdKS} V+${x.nEmbdVS}`)
  }
  lines.push(`  file     ${bytes(info.fileSize)} (${info.nTensors} tensors, header ${bytes(info.headerSize)}), fingerprint ${info.fingerprint}`)
  const what = info.memory === 'recurrent' ? 'one f32 state per sequence' : `1 sequence / ${nSeq} sequences of that context`
  lines.push(`  KV memory (KvCache.fromModel's, flash attention, K and V of the same type; ${what})`)
  lines.push(`    ${'n_ctx'.padStart(8)}  ${TABLE_TYPES.map((t) => t.padStart(21)).join('  ')}`)
  for (const row of memoryTable(file, info, nSeq)) {
    const cells = TABLE_TYPES.map((t) => (row[t] ? `${bytes(row[t].one)} / ${bytes(row[t].all)}` : 'n/a').padStart(21))
    lines.push(`    ${String(row.nCtx).padStart(8)}  ${cells.join('  ')}${row.trained ? '  (trained)' : ''}`)
  }
  return lines.join('\n')
}

function humanFit(model, fit) {
  const lines = [`  fits     ${fit.fits ? 'yes' : 'NO'}: ${model}`]
  for (const r of fit.reasons) lines.push(`    - ${r.message}`)
  return lines.join('\n')
}

function main(argv) {
  const [command, ...rest] = argv
  if (!command || command === '--help' || command === '-h') {
    process.stdout.write(`${USAGE}\n`)
    return
  }
  try {
    if (command === 'inspect') {
      const flags = parseFlags(rest, { json: 'bool', model: 'str' })
      const file = flags.positional[0] ?? SAMPLE
      const info = inspectState(file)
      const fit = flags.model === undefined ? null : checkState(file, flags.model)
      const json = {
        format: info.format, magic: info.magic, version: info.version, nTokens: info.nTokens, arch: info.arch ?? null,
        layout: info.layout, recurrent: info.recurrent ?? null, hasOutputs: info.hasOutputs, streams: info.streams, nLayer: info.nLayer,
        vTrans: info.vTrans ?? null, layers: info.layers, bytes: info.bytes, byteAccounting: info.byteAccounting,
        tokens: info.tokens,
        ...(fit ? { model: flags.model, fits: fit.fits, reasons: fit.reasons } : {}),
      }
      if (info.nRotK != null) Object.assign(json, { nRotK: info.nRotK, nRotV: info.nRotV })
      if (info.parts) {
        json.memory = info.memory
        json.parts = info.parts.map((p) => ({
          kind: p.kind, role: p.role, streams: p.streams, nLayer: p.nLayer, vTrans: p.vTrans ?? null, layers: p.layers,
          ...(p.kind === 'kv' ? { nRotK: p.nRotK ?? null, nRotV: p.nRotV ?? null } : {}), bytes: p.bytes,
        }))
      }
      if (info.compressed) json.compressed = info.compressed
      const text = human(file, info) + (fit ? `\n${humanFit(flags.model, fit)}` : '')
      process.stdout.write(flags.json ? `${JSON.stringify(json, null, 2)}\n` : `${text}\n`)
      if (fit && !fit.fits) process.exitCode = 3
    } else if (command === 'model') {
      const flags = parseFlags(rest, { json: 'bool', 'n-seq-max': 'int', 'hash-file': 'bool' })
      const file = flags.positional[0]
      if (!file) fail(`model needs a GGUF file\n${USAGE}`)
      const nSeq = flags['n-seq-max'] ?? 4
      if (nSeq < 1) fail(`--n-seq-max must be at least 1, got ${nSeq}`)
      const info = modelInfoSync(file, { hashFile: flags['hash-file'] === true })
      const json = { ...info, nSeqMax: nSeq, kvMemory: memoryTable(file, info, nSeq) }
      process.stdout.write(flags.json ? `${JSON.stringify(json, null, 2)}\n` : `${humanModel(file, info, nSeq)}\n`)
    } else if (command === 'convert') {
      const flags = parseFlags(rest, {
        layout: 'str', version: 'int', 'n-stream': 'int', seq: 'int', 'type-k': 'str', 'type-v': 'str', 'n-rot-k': 'int', 'n-rot-v': 'int',
        recurrent: 'bool', transformer: 'bool', to: 'str', 'as-seq': 'int', arch: 'str', part: 'str', 'swa-window': 'int',
      })
      if (flags.recurrent && flags.transformer) fail('--recurrent and --transformer exclude each other')
      const [input, output] = flags.positional
      if (!input || !output) fail(`convert needs an input and an output file\n${USAGE}`)
      // streamed layer by layer; the bar (stderr, terminals only) moves after each layer's K and V
      const bar = progressBar(path.basename(output))
      try {
        convertStateFileSync(input, output, {
          layout: flags.layout, version: flags.version, nStream: flags['n-stream'], seqId: flags.seq,
          typeK: flags['type-k'], typeV: flags['type-v'], nRotK: flags['n-rot-k'], nRotV: flags['n-rot-v'], to: flags.to, asSeqId: flags['as-seq'], arch: flags.arch,
          recurrent: flags.recurrent ? true : flags.transformer ? false : undefined, part: flags.part,
          swaWindow: flags['swa-window'],
          onProgress: bar.onProgress,
        })
      } finally {
        bar.done()
      }
      process.stdout.write(`${output}\n`)
    } else if (command === 'store') {
      return storeCommand(rest)
    } else {
      fail(`unknown command ${command}\n${USAGE}`)
    }
  } catch (e) {
    fail(`${e.code ?? 'error'}: ${e.message}`, 1)
  }
}

/** A progress bar on stderr, drawn only when stderr is a terminal. */
function progressBar(label) {
  if (!process.stderr.isTTY) return { onProgress: undefined, done() {} }
  let drawn = false
  return {
    onProgress(done, total) {
      const width = 30
      const filled = total > 0 ? Math.round((done / total) * width) : width
      process.stderr.write(`\r${label} [${'#'.repeat(filled)}${' '.repeat(width - filled)}] ${done}/${total}`)
      drawn = true
    },
    done() {
      if (drawn) process.stderr.write('\n')
    },
  }
}

/** Token ids from a JSON array file, or the tokens of a llama.cpp state file. */
function readTokens(file) {
  const bytes = fs.readFileSync(file)
  const text = bytes.subarray(0, 1).toString() === '[' ? bytes.toString('utf8') : null
  if (text === null) return inspectState(file).tokens
  let tokens
  try {
    tokens = JSON.parse(text)
  } catch (e) {
    fail(`${file}: not a JSON array of token ids (${e.message})`)
  }
  if (!Array.isArray(tokens) || !tokens.every(Number.isInteger)) fail(`${file}: not a JSON array of token ids`)
  return tokens
}

async function storeCommand(args) {
  const [sub, ...rest] = args
  const flags = parseFlags(rest, {
    store: 'str', url: 'str', prefix: 'str', model: 'str', 'block-tokens': 'int', 'max-bytes': 'int', json: 'bool', compress: 'str',
    kind: 'str', version: 'int', layout: 'str', 'flash-attn': 'bool', arch: 'str', 'swa-window': 'int',
  })
  if (!flags.store && !flags.url) fail(`store ${sub ?? ''} needs --store DIR or --url URL\n${USAGE}`)
  // where the blocks are, for messages: a URL without its credentials
  const where = flags.store ?? flags.url.replace(/\/\/[^@/]*@/, '//')
  const needsModel = ['put', 'lookup', 'write'].includes(sub)
  if (needsModel && !flags.model) fail(`store ${sub} needs --model ID (the identity the blocks are stored under)`)
  try {
    const store = new PromptStore({
      // stats and gc concern the directory, not one model
      model: flags.model ?? 'llama-kv-cache-cli',
      path: flags.store,
      url: flags.url,
      prefix: flags.prefix,
      tiers: flags.store && flags.url ? ['dir', 'redis'] : undefined,
      blockTokens: flags['block-tokens'],
      maxBytes: flags['max-bytes'],
      compress: flags.compress,
    })
    if (sub === 'put') {
      if (flags.positional.length === 0) fail('store put needs at least one file')
      for (const file of flags.positional) {
        const bar = progressBar(path.basename(file))
        const r = await store.putFile(file, { onProgress: bar.onProgress })
        bar.done()
        process.stdout.write(`${file}: ${r.tokens} tokens, ${r.blocksWritten} blocks written (${r.bytesWritten} bytes), ${r.blocksSkipped} already stored, ${r.checkpointsWritten} checkpoints written${r.degraded.length ? ` (not reached: ${r.degraded.join(', ')})` : ''}\n`)
      }
    } else if (sub === 'lookup') {
      const [tokensFile] = flags.positional
      if (!tokensFile) fail('store lookup needs a tokens file')
      process.stdout.write(`${await store.lookup(readTokens(tokensFile))}\n`)
    } else if (sub === 'write') {
      const [tokensFile, out] = flags.positional
      if (!tokensFile || !out) fail('store write needs a tokens file and an output file')
      const bar = progressBar(path.basename(out))
      const n = await store.writeFile(readTokens(tokensFile), out, {
        kind: flags.kind, version: flags.version, layout: flags.layout, flashAttn: flags['flash-attn'], arch: flags.arch,
        swaWindow: flags['swa-window'], onProgress: bar.onProgress,
      })
      bar.done()
      if (n === 0) process.stderr.write('llama-kv-cache: nothing stored for these tokens; no file written\n')
      process.stdout.write(`${n}\n`)
      if (n === 0) process.exitCode = 3
    } else if (sub === 'stats' || sub === 'gc') {
      const s = sub === 'gc' ? await store.gc() : await store.stats()
      const { hits: _h, misses: _m, corrupt: _c, rejected: _r, ...dir } = s
      process.stdout.write(flags.json ? `${JSON.stringify(dir, null, 2)}\n`
        : `${where}: ${dir.blocks} blocks, ${dir.bytes} bytes${dir.maxBytes == null ? '' : ` of ${dir.maxBytes}`}, ${dir.evictions} evictions\n`)
    } else {
      fail(`unknown store command ${sub ?? ''}\n${USAGE}`)
    }
  } catch (e) {
    fail(`${e.code ?? 'error'}: ${e.message}`, 1)
  }
}

main(process.argv.slice(2))

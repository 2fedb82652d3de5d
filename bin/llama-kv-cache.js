#!/usr/bin/env node
// llama-kv-cache CLI: inspect and convert llama.cpp KV state files.
'use strict'

const path = require('node:path')
const { inspectState, convertStateFile } = require('..')

const SAMPLE = path.join(__dirname, '..', 'samples', 'llama-node-session.ggsn')
const USAGE = `usage:
  llama-kv-cache inspect [file] [--json]       describe a session (ggsn) or sequence (ggsq) file
                                               (no file: a bundled session written by llama.node)
  llama-kv-cache convert <in> <out> [options]  rewrite a state file
      --layout seed|streams   payload layout (default streams: today's llama.cpp)
      --version N             file version (ggsq 2|3, ggsn 9|10; default 2 / 9)
      --n-stream N            streams to write (1 = unified context)
      --seq ID                extract one sequence into a sequence file
      --to session|sequence   output kind (default: the input's; sequence with --seq)
      --as-seq ID             rename the written sequence (e.g. a slot of a non-unified context)
      --arch NAME             session output from a sequence file: the architecture (default llama)
      --type-k T, --type-v T  re-type K/V (f32, f16, bf16, q8_0, ...)
      --recurrent             the input sequence file holds a recurrent (Mamba/RWKV) state
      --transformer           the input sequence file holds a transformer state`

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

function human(file, info) {
  const lines = []
  lines.push(`${file}`)
  lines.push(`  format   ${info.format} ('${info.magic}') version ${info.version}, ${info.layout} layout${info.hasOutputs ? ', with outputs block' : ''}`)
  if (info.arch) lines.push(`  arch     ${info.arch}`)
  lines.push(`  tokens   ${info.nTokens}: [${info.tokens.slice(0, 16).join(', ')}${info.nTokens > 16 ? ', ...' : ''}]`)
  info.streams.forEach((s, i) => {
    const seqs = Object.entries(s.seqs)
      .map(([id, st]) => `seq ${id === '-1' ? '(saved)' : id}: ${st.cells} cells, pos ${st.posMin}..${st.posMax}`)
      .join('; ')
    lines.push(`  stream ${i} ${s.cellCount} cells${seqs ? ` (${seqs})` : ''}`)
  })
  lines.push(`  layers   ${info.nLayer}, V ${info.vTrans === null ? 'n/a' : info.vTrans ? 'transposed' : 'rows'}`)
  info.layers.forEach((l, i) => {
    lines.push(`    ${String(i).padStart(3)}  K ${l.kType} ${l.kRowSize} B/row   V ${l.vType} ${l.vRowSize} B/row`)
  })
  const b = info.byteAccounting
  lines.push(`  bytes    ${b.total} = header ${b.header} + session ${b.session} + meta ${b.meta} + K ${b.k} + V ${b.v} + framing ${b.total - b.header - b.session - b.meta - b.k - b.v}`)
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
      const flags = parseFlags(rest, { json: 'bool' })
      const file = flags.positional[0] ?? SAMPLE
      const info = inspectState(file)
      const json = {
        format: info.format, magic: info.magic, version: info.version, nTokens: info.nTokens, arch: info.arch ?? null,
        layout: info.layout, recurrent: info.recurrent ?? null, hasOutputs: info.hasOutputs, streams: info.streams, nLayer: info.nLayer,
        vTrans: info.vTrans ?? null, layers: info.layers, bytes: info.bytes, byteAccounting: info.byteAccounting,
        tokens: info.tokens,
      }
      process.stdout.write(flags.json ? `${JSON.stringify(json, null, 2)}\n` : `${human(file, info)}\n`)
    } else if (command === 'convert') {
      const flags = parseFlags(rest, {
        layout: 'str', version: 'int', 'n-stream': 'int', seq: 'int', 'type-k': 'str', 'type-v': 'str',
        recurrent: 'bool', transformer: 'bool', to: 'str', 'as-seq': 'int', arch: 'str',
      })
      if (flags.recurrent && flags.transformer) fail('--recurrent and --transformer exclude each other')
      const [input, output] = flags.positional
      if (!input || !output) fail(`convert needs an input and an output file\n${USAGE}`)
      convertStateFile(input, output, {
        layout: flags.layout, version: flags.version, nStream: flags['n-stream'], seqId: flags.seq,
        typeK: flags['type-k'], typeV: flags['type-v'], to: flags.to, asSeqId: flags['as-seq'], arch: flags.arch,
        recurrent: flags.recurrent ? true : flags.transformer ? false : undefined,
      })
      process.stdout.write(`${output}\n`)
    } else {
      fail(`unknown command ${command}\n${USAGE}`)
    }
  } catch (e) {
    fail(`${e.code ?? 'error'}: ${e.message}`, 1)
  }
}

main(process.argv.slice(2))

// State payloads lent to JS (`stateWrite`, `stateWriteSync`): a payload of a MiB or more may be a
// Buffer over staging memory that goes back for the next payload when the garbage collector
// frees the Buffer. Each case runs in a `node --expose-gc` child (helpers/payloads-child.mjs)
// that collects and scribbles over what it dropped.
import test from 'ava'
import path from 'node:path'
import { runScript } from './helpers/run-script.mjs'

const CHILD = path.join(import.meta.dirname, 'helpers', 'payloads-child.mjs')
const runCase = (name) => runScript(CHILD, [name], ['--expose-gc'])

test('payloads made in memory that earlier payloads held, scribbled over and collected, are the state and not their bytes', async (t) => {
  const r = await runCase('reuse')
  t.true(r.small > 2 ** 20 && r.big > 16 * 2 ** 20, JSON.stringify(r))
  t.is(r.made, 60)
  t.is(r.mismatches, 0)
})

test('a view of a payload, or its transferred ArrayBuffer, keeps its bytes after the Buffer it came in is collected', async (t) => {
  // (Node copies an external ArrayBuffer that a transfer names instead of detaching it; either
  // way the bytes must be intact)
  const r = await runCase('views')
  t.true(r.viewIntact, 'a subarray kept its bytes')
  t.true(r.movedIntact, 'the transferred ArrayBuffer kept its bytes')
})

test('a synchronous loop of stateWriteSync holds bounded memory (Node frees lent Buffers only from its event loop; lending each payload held 3.3 GiB after 300)', async (t) => {
  const r = await runCase('sync-loop')
  t.true(r.made > 2.4 * 2 ** 30, `${r.made} bytes made`)
  t.true(r.grew < 800 * 2 ** 20, `RSS grew ${(r.grew / 2 ** 20).toFixed(0)} MiB`)
})

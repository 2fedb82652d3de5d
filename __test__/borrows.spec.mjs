// Borrows of JS memory: the binding reads typed arrays in place only while no JS can run. An
// options getter runs JS during argument conversion, and an async call runs while JS goes on,
// so a buffer can be detached (transferred with structuredClone) and its memory freed under
// the call. Each case runs in a `node --expose-gc` child (helpers/borrows-child.mjs) that
// detaches, collects and churns memory: a read or write of freed memory fails the test (a
// crash, or wrong bytes), and a call may end only in a coded error or a correct result.

import test from 'ava'
import path from 'node:path'
import { runScript } from './helpers/run-script.mjs'

const CHILD = path.join(import.meta.dirname ?? path.dirname(new URL(import.meta.url).pathname), 'helpers', 'borrows-child.mjs')
const runCase = (name) => runScript(CHILD, [name], ['--expose-gc'])

/** A coded JS error, or a result the case found correct. */
function typedErrorOrCorrect(t, r, pattern) {
  if (r.outcome === 'error') {
    t.true(r.isError, 'a JS Error')
    t.regex(r.code ?? '', /^ERR_KV_[A-Z_]+$/, r.message)
    if (pattern) t.regex(r.message, pattern)
  } else {
    t.true(r.matchesReference, `a result that is not the reference's: ${JSON.stringify(r)}`)
  }
}

test('regression: a getter that detaches pos.buffer during prepareBatchPacked is a typed error, not a read of freed memory', async (t) => {
  const r = await runCase('prepare-batch-packed')
  t.true(r.getterRan)
  t.true(r.detached)
  typedErrorOrCorrect(t, r)
  if (r.outcome === 'error') t.true(r.unchanged, 'a refused ubatch changes nothing')
})

test('regression: a seqIds getter that detaches the Int32Array pos of a findSlot ubatch reads the positions as they were passed', async (t) => {
  const r = await runCase('find-slot-object')
  t.true(r.detached)
  typedErrorOrCorrect(t, r)
})

test('regression: an options getter that detaches the payload of stateReadSync is a typed error, the cache unchanged', async (t) => {
  const r = await runCase('state-read-sync')
  t.true(r.detached)
  typedErrorOrCorrect(t, r)
  if (r.outcome === 'error') t.true(r.unchanged)
})

test('regression: an options getter that detaches the destination of stateWriteIntoSync is a typed error, not a write to freed memory', async (t) => {
  const r = await runCase('state-write-into-sync')
  t.true(r.detached)
  t.is(r.outcome, 'error', 'a detached buffer holds no state')
  typedErrorOrCorrect(t, r, /buffer/)
})

test('regression: a payload transferred away and collected while async stateRead runs still loads the right cells', async (t) => {
  const r = await runCase('state-read-async')
  t.true(r.detached)
  typedErrorOrCorrect(t, r)
  if (r.outcome === 'error') t.true(r.unchanged)
})

test('async stateRead reads a copy: the caller may reuse its buffer as soon as the call returns', async (t) => {
  const r = await runCase('state-read-async-reuse')
  t.is(r.outcome, 'result', r.message)
  t.true(r.matchesReference)
})

test('async stateRead { transfer: true } takes the payload: it is detached at the call, a transfer of it moves no memory, and the load equals the default one', async (t) => {
  const r = await runCase('state-read-transfer')
  t.is(r.outcome, 'result', r.message)
  t.true(r.taken, 'data is detached at the call')
  t.is(r.grabbed, 0, 'the program cannot transfer the bytes away')
  t.true(r.matchesReference)
})

test('async stateRead { transfer: true } of a view of part of its ArrayBuffer copies it: the caller may reuse it at once', async (t) => {
  const r = await runCase('state-read-transfer-partial')
  t.is(r.outcome, 'result', r.message)
  t.true(r.kept, 'a partial view is not detached')
  t.true(r.matchesReference)
})

test('async stateRead { transfer: true } of a payload a getter detached first is a typed error, the cache unchanged', async (t) => {
  const r = await runCase('state-read-transfer-detached')
  t.true(r.detached)
  t.is(r.outcome, 'error', 'a detached buffer holds no state')
  typedErrorOrCorrect(t, r)
  t.true(r.unchanged)
})

test('regression: a destination transferred away and collected while async stateWriteInto runs rejects with ERR_KV_INVALID_ARG naming the buffer, not a write to freed memory', async (t) => {
  const r = await runCase('state-write-into-async')
  t.true(r.detached)
  t.is(r.outcome, 'error', 'a detached buffer holds no state')
  typedErrorOrCorrect(t, r, /buffer.*detached/)
  t.is(r.code, 'ERR_KV_INVALID_ARG')
  t.true(r.cacheUsableAfter, 'the rejected call released the cache')
})

test('async stateWriteInto into a buffer left alone delivers the bytes of stateWriteSync and nothing past them', async (t) => {
  const r = await runCase('state-write-into-async-kept')
  t.is(r.outcome, 'result', r.message)
  t.true(r.matchesReference)
})

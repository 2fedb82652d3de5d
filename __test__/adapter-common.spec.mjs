// What both adapters share (adapters/common.js): where their private folders go, and that a file
// that finds no room in memory is written again on disk. No peer is needed here.
import test from 'ava'
import fs from 'node:fs'
import os from 'node:os'
import path from 'node:path'
import { createRequire } from 'node:module'

const require = createRequire(import.meta.url)
const { ScratchFolder } = require('../adapters/common.js')

/** Runs `fn` with TMPDIR set to `value` (or unset), restoring it afterwards. */
async function withTmpdir(value, fn) {
  const saved = process.env.TMPDIR
  if (value === undefined) delete process.env.TMPDIR
  else process.env.TMPDIR = value
  try {
    return await fn()
  } finally {
    if (saved === undefined) delete process.env.TMPDIR
    else process.env.TMPDIR = saved
  }
}

const shmUsable = (() => {
  if (process.platform !== 'linux') return false
  try {
    fs.accessSync('/dev/shm', fs.constants.W_OK)
    const { bavail, bsize } = fs.statfsSync('/dev/shm')
    return bavail * bsize >= 1 << 30
  } catch {
    return false
  }
})()

test.serial('an explicit TMPDIR holds the private folder, mode 0700, and a file lives only while its work runs', async (t) => {
  const root = fs.mkdtempSync(path.join(os.tmpdir(), 'kv-scratch-spec-'))
  await withTmpdir(root, async () => {
    const scratch = new ScratchFolder('kv-test-')
    const seen = await scratch.withFile('.ggsq', async (file) => {
      fs.writeFileSync(file, 'state')
      return file
    })
    t.is(path.dirname(path.dirname(seen)), root)
    t.is(fs.statSync(path.dirname(seen)).mode & 0o777, 0o700)
    t.false(fs.existsSync(seen), 'removed after the work')
    await t.throwsAsync(scratch.withFile('.ggsq', async (file) => {
      fs.writeFileSync(file, 'half')
      throw Object.assign(new Error('the peer refused it'), { code: 'ERR_KV_BACKEND' })
    }), { code: 'ERR_KV_BACKEND' })
    t.deepEqual(fs.readdirSync(path.dirname(seen)), [], 'removed after a failure too')
    scratch.remove()
    t.deepEqual(fs.readdirSync(root), [])
  })
  fs.rmSync(root, { recursive: true, force: true })
})

test.serial('without TMPDIR on Linux the folder is in memory (/dev/shm), and a file with no room there is written again on disk', async (t) => {
  if (!shmUsable) {
    // off Linux, or a /dev/shm without room: the system's temporary directory is the only root
    await withTmpdir(undefined, async () => {
      const scratch = new ScratchFolder('kv-test-')
      const file = await scratch.withFile('.ggsq', async (f) => f)
      t.is(path.dirname(path.dirname(file)), os.tmpdir())
      scratch.remove()
    })
    return
  }
  await withTmpdir(undefined, async () => {
    const scratch = new ScratchFolder('kv-test-')
    const tries = []
    const result = await scratch.withFile('.ggsq', async (file) => {
      tries.push(file)
      fs.writeFileSync(file, 'part of a state')
      if (tries.length === 1) {
        // what writeFile reports when the file system is full
        throw Object.assign(new Error(`cannot write ${file}: No space left on device (os error 28)`), { code: 'ERR_KV_IO' })
      }
      return 'loaded'
    })
    t.is(result, 'loaded')
    t.is(path.dirname(path.dirname(tries[0])), '/dev/shm')
    t.is(path.dirname(path.dirname(tries[1])), os.tmpdir())
    t.false(fs.existsSync(path.dirname(tries[0])), 'the folder in memory is gone')
    t.false(fs.existsSync(tries[1]))
    // later files go straight to disk
    const next = await scratch.withFile('.ggsq', async (f) => f)
    t.is(path.dirname(next), path.dirname(tries[1]))
    scratch.remove()
    t.false(fs.existsSync(path.dirname(tries[1])))
  })
})

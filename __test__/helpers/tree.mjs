// What the adapters' scratch-folder checks list: every file and folder under a directory.
import fs from 'node:fs'
import path from 'node:path'

/** Every file and folder under `dir` (relative paths, folders ending in '/'), sorted. */
export function listTree(dir) {
  const out = []
  const walk = (d, rel) => {
    for (const e of fs.readdirSync(d, { withFileTypes: true })) {
      const r = rel ? `${rel}/${e.name}` : e.name
      out.push(e.isDirectory() ? `${r}/` : r)
      if (e.isDirectory()) walk(path.join(d, e.name), r)
    }
  }
  if (fs.existsSync(dir)) walk(dir, '')
  return out.sort()
}

/** Files (not folders) under `dir`. */
export const filesUnder = (dir) => listTree(dir).filter((p) => !p.endsWith('/'))

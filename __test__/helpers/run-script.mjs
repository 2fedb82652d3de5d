// Runs a helper script in its own Node process (a stand-in for another process or machine) and
// resolves with the JSON it prints on its `@@RESULT ` line; rejects with its stderr otherwise.
// `nodeArgs` go to node before the script (e.g. ['--expose-gc']).
import { spawn } from 'node:child_process'

export function runScript(script, args, nodeArgs = []) {
  return new Promise((resolve, reject) => {
    const child = spawn(process.execPath, [...nodeArgs, script, ...args.map(String)], { stdio: ['ignore', 'pipe', 'pipe'] })
    let out = ''
    let err = ''
    child.stdout.on('data', (d) => (out += d))
    child.stderr.on('data', (d) => (err += d))
    child.on('close', (code) => {
      const line = out.split('\n').find((l) => l.startsWith('@@RESULT '))
      if (code === 0 && line) resolve(JSON.parse(line.slice(9)))
      else reject(new Error(`${script} ${args.join(' ')} exited ${code}: ${err}`))
    })
  })
}

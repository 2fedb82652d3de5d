// A real redis-server for the ava specs: each test starts its own on a free loopback port, in a
// temporary directory, with no persistence, and stops it afterwards (`t.teardown`). Kill and
// restart helpers serve the fault tests. A missing redis-server fails the test with the command
// that installs it: Redis tests never skip.
import fs from 'node:fs'
import net from 'node:net'
import os from 'node:os'
import path from 'node:path'
import { spawn, spawnSync } from 'node:child_process'

/** The command that provides redis-server on Debian and Ubuntu (what `npm test`'s set-up runs). */
export const INSTALL_HINT = 'apt-get install -y redis-server'
/** The set-up command, which installs it when run as root (`npm test` runs it first, as pretest). */
export const SETUP_HINT = 'node scripts/setup.mjs'

function findBinary(name) {
  if (name === 'redis-server' && process.env.REDIS_SERVER) return process.env.REDIS_SERVER
  for (const dir of (process.env.PATH ?? '').split(path.delimiter)) {
    const candidate = path.join(dir, name)
    if (dir && fs.existsSync(candidate)) return candidate
  }
  return null
}

/** The redis-server binary, or throws naming the install command. */
export function redisServerBinary() {
  const binary = findBinary('redis-server')
  if (!binary) throw new Error(`redis-server is not installed; the Redis tests need it: run \`${SETUP_HINT}\` as root (npm test's pretest), or \`sudo ${INSTALL_HINT}\``)
  return binary
}

function freePort() {
  return new Promise((resolve, reject) => {
    const server = net.createServer()
    server.once('error', reject)
    server.listen(0, '127.0.0.1', () => {
      const { port } = server.address()
      server.close(() => resolve(port))
    })
  })
}

/** Resolves once the port answers PING with +PONG or -NOAUTH; false if not by the deadline. */
async function waitReady(port, child, ms = 10_000) {
  const deadline = Date.now() + ms
  while (Date.now() < deadline) {
    if (child.exitCode !== null || child.signalCode !== null) return false
    const ok = await new Promise((resolve) => {
      const socket = net.connect(port, '127.0.0.1')
      socket.setTimeout(500)
      socket.once('connect', () => socket.write('PING\r\n'))
      socket.once('data', (data) => {
        socket.destroy()
        resolve(/^(\+PONG|-NOAUTH)/.test(data.toString()))
      })
      socket.once('error', () => resolve(false))
      socket.once('timeout', () => {
        socket.destroy()
        resolve(false)
      })
    })
    if (ok) return true
    await new Promise((resolve) => setTimeout(resolve, 20))
  }
  return false
}

/**
 * Starts a redis-server. Options: `requirepass`, `users: [{ name, password }]` (ACL users with full
 * access), `maxmemory` (bytes) with `maxmemoryPolicy` (default `allkeys-lru`).
 * Returns `{ port, url, urlWith(user, password), dir, kill(), restart(), stop(), cli(...args) }`.
 */
export async function startRedis(options = {}) {
  const binary = redisServerBinary()
  const dir = fs.mkdtempSync(path.join(os.tmpdir(), 'kv-redis-test-'))
  let child = null
  let port = 0
  let tlsPort = 0

  const args = () => {
    const list = ['--port', String(port), '--bind', '127.0.0.1', '--dir', dir, '--save', '', '--appendonly', 'no',
      '--daemonize', 'no', '--logfile', 'redis.log']
    if (options.requirepass) list.push('--requirepass', options.requirepass)
    for (const user of options.users ?? []) list.push('--user', user.name, 'on', `>${user.password}`, '~*', '&*', '+@all')
    if (options.maxmemory) {
      // sampling every key makes a tiny test server evict in true LRU order
      list.push('--maxmemory', String(options.maxmemory), '--maxmemory-policy', options.maxmemoryPolicy ?? 'allkeys-lru',
        '--maxmemory-samples', '64')
    }
    if (options.tls) {
      // a TLS port beside the plain one, which only the harness uses to see the server is up
      const { cert, key, ca, authClients } = options.tls
      list.push('--tls-port', String(tlsPort), '--tls-cert-file', cert, '--tls-key-file', key, '--tls-ca-cert-file', ca,
        '--tls-auth-clients', authClients ? 'yes' : 'no')
    }
    if (options.replicaOf) list.push('--replicaof', '127.0.0.1', String(options.replicaOf))
    if (options.cluster) list.push('--cluster-enabled', 'yes', '--cluster-config-file', 'nodes.conf', '--cluster-node-timeout', '2000')
    if (options.sentinelOf) {
      // a Sentinel reads and rewrites its configuration file: written at each start
      const { name, port: primary } = options.sentinelOf
      const conf = path.join(dir, 'sentinel.conf')
      fs.writeFileSync(conf, [`port ${port}`, 'bind 127.0.0.1', `dir ${dir}`, 'logfile sentinel.log',
        `sentinel monitor ${name} 127.0.0.1 ${primary} 1`, `sentinel down-after-milliseconds ${name} 500`,
        `sentinel failover-timeout ${name} 3000`, ''].join('\n'))
      return [conf, '--sentinel']
    }
    return list
  }
  const spawnServer = async () => {
    child = spawn(binary, args(), { cwd: dir, stdio: 'ignore' })
    child.on('error', () => {})
    return waitReady(port, child)
  }
  const kill = async () => {
    if (!child || child.exitCode !== null || child.signalCode !== null) return
    const exited = new Promise((resolve) => child.once('exit', resolve))
    child.kill('SIGKILL')
    await exited
  }

  let started = false
  // a port picked this way can be taken by someone else before redis binds it: retry
  for (let attempt = 0; attempt < 5 && !started; attempt++) {
    port = await freePort()
    tlsPort = await freePort()
    started = await spawnServer()
    if (!started) await kill()
  }
  if (!started) {
    const log = fs.existsSync(path.join(dir, 'redis.log')) ? fs.readFileSync(path.join(dir, 'redis.log'), 'utf8') : ''
    fs.rmSync(dir, { recursive: true, force: true })
    throw new Error(`redis-server did not start; its log:\n${log}`)
  }

  const auth = options.requirepass ? ['--user', 'default', '--pass', options.requirepass, '--no-auth-warning'] : []
  const run = (args, input) => {
    const cli = findBinary('redis-cli')
    if (!cli) throw new Error(`redis-cli is not installed: run \`${SETUP_HINT}\` as root (npm test's pretest), or \`sudo ${INSTALL_HINT}\``)
    const result = spawnSync(cli, ['-h', '127.0.0.1', '-p', String(port), ...auth, ...(input ? ['-x'] : []), ...args], { input })
    if (result.status !== 0) throw new Error(`redis-cli ${args.join(' ')}: ${result.stderr}`)
    return result.stdout
  }
  return {
    port,
    tlsPort,
    dir,
    url: `redis://127.0.0.1:${port}`,
    urlWith: (user, password) => `redis://${user}:${encodeURIComponent(password)}@127.0.0.1:${port}`,
    /** SIGKILL: the server vanishes mid-call, as a crashed machine would. */
    kill,
    /** Starts again on the same port, empty (persistence is off). */
    async restart() {
      await kill()
      if (!(await spawnServer())) throw new Error(`redis-server did not restart on port ${port}`)
    },
    async stop() {
      await kill()
      fs.rmSync(dir, { recursive: true, force: true })
    },
    /** Runs redis-cli against this server and returns its trimmed output as text; `input` (a Buffer) is sent with -x as the last argument. */
    cli(args, input) {
      return run(args, input).toString().trim()
    },
    /** Runs `redis-cli --raw` and returns its output bytes as they are, less the final newline (binary values). */
    cliBuffer(args) {
      const out = run(['--raw', ...args])
      return out.subarray(0, out.length - 1)
    },
  }
}

/** `startRedis` for an ava test: the server is stopped when the test ends. */
export async function redisForTest(t, options) {
  const server = await startRedis(options)
  t.teardown(() => server.stop())
  return server
}

/**
 * `n` cluster-enabled servers joined into one cluster of `n` primaries (`redis-cli --cluster
 * create`), stopped when the test ends. Resolves once every node reports `cluster_state:ok`.
 */
export async function clusterForTest(t, n = 3) {
  const nodes = []
  for (let i = 0; i < n; i++) nodes.push(await redisForTest(t, { cluster: true }))
  const cli = findBinary('redis-cli')
  if (!cli) throw new Error(`redis-cli is not installed: run \`${SETUP_HINT}\` as root (npm test's pretest), or \`sudo ${INSTALL_HINT}\``)
  const created = spawnSync(cli, ['--cluster', 'create', ...nodes.map((node) => `127.0.0.1:${node.port}`),
    '--cluster-replicas', '0', '--cluster-yes'])
  if (created.status !== 0) throw new Error(`redis-cli --cluster create: ${created.stdout}${created.stderr}`)
  const deadline = Date.now() + 20_000
  for (const node of nodes) {
    while (!node.cli(['CLUSTER', 'INFO']).includes('cluster_state:ok')) {
      if (Date.now() > deadline) throw new Error('the cluster did not form')
      await new Promise((resolve) => setTimeout(resolve, 50))
    }
  }
  return nodes
}

/**
 * Certificates made with the `openssl` command for the TLS tests, in a temporary directory removed
 * when the test ends: `ca.pem`, a server certificate for redis.test and 127.0.0.1 signed by it
 * (`server.pem`, `server.key`), a client certificate signed by it (`client.pem`, `client.key`),
 * and an unrelated `other-ca.pem`. Returns `{ dir, path(name), read(name) }`.
 */
export function certsForTest(t) {
  const dir = fs.mkdtempSync(path.join(os.tmpdir(), 'kv-tls-test-'))
  t.teardown(() => fs.rmSync(dir, { recursive: true, force: true }))
  const openssl = (...args) => {
    const result = spawnSync('openssl', args, { cwd: dir })
    if (result.error) throw new Error(`openssl is not installed; the TLS tests need it: run \`${SETUP_HINT}\` as root, or \`sudo apt-get install -y openssl\``)
    if (result.status !== 0) throw new Error(`openssl ${args.join(' ')}: ${result.stderr}`)
  }
  // the extensions make version 3 certificates, the only version webpki accepts
  fs.writeFileSync(path.join(dir, 'server.ext'), 'subjectAltName=DNS:redis.test,IP:127.0.0.1\n')
  fs.writeFileSync(path.join(dir, 'client.ext'), 'extendedKeyUsage=clientAuth\n')
  for (const ca of ['ca', 'other-ca']) {
    openssl('req', '-x509', '-newkey', 'rsa:2048', '-nodes', '-days', '2', '-keyout', `${ca}.key`, '-out', `${ca}.pem`,
      '-subj', `/CN=kv test ${ca}`)
  }
  for (const name of ['server', 'client']) {
    openssl('req', '-newkey', 'rsa:2048', '-nodes', '-keyout', `${name}.key`, '-out', `${name}.csr`, '-subj', `/CN=kv test ${name}`)
    openssl('x509', '-req', '-in', `${name}.csr`, '-CA', 'ca.pem', '-CAkey', 'ca.key', '-CAcreateserial', '-days', '2',
      '-out', `${name}.pem`, '-extfile', `${name}.ext`)
  }
  return {
    dir,
    path: (name) => path.join(dir, name),
    read: (name) => fs.readFileSync(path.join(dir, name)),
  }
}

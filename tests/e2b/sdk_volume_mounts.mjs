// E2B's `volumeMounts` through the real JS SDK (npm `e2b`, pinned in
// tests/e2b/package.json) against a Linux template (E2B_TEST_TEMPLATE:
// `base` in the nested pod): a Volume made and written through E2B's
// volume API is mounted in a sandbox, read and written there, seen back
// through the API, and kept across pause -> connect with a background
// process whose working directory is in it. Run by tests/nested_pod.rs
// with NODE_PATH, E2B_API_URL, E2B_API_KEY and E2B_VOLUME_API_URL set;
// exits non-zero on the first failed check.

import { createRequire } from 'node:module'
import { randomUUID } from 'node:crypto'
import path from 'node:path'
import { checks } from './checks.mjs'

const require = createRequire(path.join(process.env.NODE_PATH, 'noop.js'))
const { Sandbox, Volume } = require('e2b')
const { version } = require('e2b/package.json')

const TEMPLATE = process.env.E2B_TEST_TEMPLATE ?? 'base'
const SLOW = { requestTimeoutMs: 600_000 }
const { check, passed } = checks('e2b-volume-mounts-js')

console.log(`e2b-volume-mounts-js: version ${version}`)
const run = randomUUID().slice(0, 8)
const vol = await Volume.create(`mnt-js-${run}`)
await vol.writeFile('/hello.txt', 'from the JS API')
let sbx = await Sandbox.create(TEMPLATE, {
  ...SLOW,
  timeoutMs: 900_000,
  volumeMounts: { '/mnt/data': vol },
})
try {
  const read = await sbx.commands.run('cat /mnt/data/hello.txt', { timeoutMs: 120_000 })
  check(read.stdout === 'from the JS API', `the sandbox reads the volume: ${JSON.stringify(read.stdout)}`)
  await sbx.commands.run('echo from-js > /mnt/data/guest.txt && mkdir -p /mnt/data/d', { timeoutMs: 120_000 })
  const back = await vol.readFile('/guest.txt')
  check(back === 'from-js\n', `the API reads what the sandbox wrote: ${JSON.stringify(back)}`)
  const bg = await sbx.commands.run('cd /mnt/data/d && exec sleep 3600', { background: true })
  check((await sbx.pause(SLOW)) === true, 'pause')
  await vol.writeFile('/later.txt', 'while paused\n')
  sbx = await Sandbox.connect(sbx.sandboxId, { ...SLOW, timeoutMs: 900_000 })
  const after = await sbx.commands.run('cat /mnt/data/later.txt /mnt/data/guest.txt', { timeoutMs: 120_000 })
  check(after.stdout === 'while paused\nfrom-js\n', `after pause -> connect: ${JSON.stringify(after.stdout)}`)
  const cwd = await sbx.commands.run(`readlink /proc/${bg.pid}/cwd`, { timeoutMs: 120_000 })
  check(cwd.stdout.trim() === '/mnt/data/d', `a process's working directory in the volume: ${cwd.stdout}`)
} finally {
  await sbx.kill()
  await Volume.destroy(vol.volumeId)
}
passed()

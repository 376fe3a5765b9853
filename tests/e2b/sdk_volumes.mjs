// E2B's volumes through the real JS SDK (npm `e2b`, pinned in
// tests/e2b/package.json), against `torpor serve` on loopback. Run by
// tests/e2b_volumes.rs with node, NODE_PATH naming the install's
// node_modules, E2B_API_URL, E2B_API_KEY and E2B_VOLUME_API_URL set (the
// volume content API is the API's own listener), E2B_OTHER_KEY (another
// tenant's key) and TORPOR_VOLUMES_DIR (where a symbolic link is planted);
// exits non-zero on the first failed check.

import { createRequire } from 'node:module'
import { createHash, randomBytes, randomUUID } from 'node:crypto'
import fs from 'node:fs'
import path from 'node:path'
import { checks } from './checks.mjs'

const require = createRequire(path.join(process.env.NODE_PATH, 'noop.js'))
const {
  Volume,
  VolumeError,
  VolumeNotFoundError,
  VolumePathNotFoundError,
  AuthenticationError,
  Sandbox,
} = require('e2b')
const { version } = require('e2b/package.json')

const OTHER = { apiKey: process.env.E2B_OTHER_KEY }
const VOLUMES_DIR = process.env.TORPOR_VOLUMES_DIR
const { check, raises, passed } = checks('e2b-volumes-js')

const sha = (b) => createHash('sha256').update(b).digest('hex')

console.log(`e2b-volumes-js: version ${version}`)
const run = randomUUID().slice(0, 8)

const vol = await Volume.create(`js-${run}`)
check(vol.name === `js-${run}` && vol.volumeId && vol.token, `created ${vol.volumeId}`)
await raises(VolumeError, () => Volume.create(`js-${run}`), 'a second volume of the name', '409')
check((await Volume.list()).some((v) => v.volumeId === vol.volumeId), 'listed')
const info = await Volume.getInfo(vol.volumeId)
check(info.token === vol.token && info.name === vol.name, 'getInfo carries the token')
const same = await Volume.connect(vol.volumeId)
check(same.token === vol.token, 'connect')
await raises(VolumeNotFoundError, () => Volume.getInfo(vol.volumeId, OTHER), "another tenant's getInfo")
check(!(await Volume.list(OTHER)).some((v) => v.volumeId === vol.volumeId), "hidden from another tenant's list")
check((await Volume.destroy(vol.volumeId, OTHER)) === false, "another tenant's destroy")

const d = await vol.makeDir('/docs')
check(d.type === 'directory' && d.path === '/docs' && d.mode === 0o755, `makeDir ${JSON.stringify(d)}`)
await vol.makeDir('/x/y/z', { force: true })
const w = await vol.writeFile('/docs/a.txt', 'hello js', { uid: 1000, gid: 1000, mode: 0o600 })
check(w.size === 8 && w.uid === 1000 && w.mode === 0o600 && w.mtime instanceof Date, `writeFile ${JSON.stringify(w)}`)
check((await vol.readFile('/docs/a.txt')) === 'hello js', 'readFile text')
await raises(VolumeError, () => vol.writeFile('/docs/a.txt', 'again'), 'write without force', '409')
await vol.writeFile('/docs/a.txt', 'replaced', { force: true })
check((await vol.readFile('/docs/a.txt', { format: 'bytes' })).length === 8, 'readFile bytes')

// 8 MiB: bytes up, bytes and a stream down; a stream up.
const big = randomBytes(8 << 20)
await vol.writeFile('/big.bin', big.buffer.slice(big.byteOffset, big.byteOffset + big.length))
check(sha(await vol.readFile('/big.bin', { format: 'bytes' })) === sha(big), '8 MiB round trip')
const blob = await vol.readFile('/big.bin', { format: 'blob' })
check(blob.size === big.length, 'readFile blob')
const up = new ReadableStream({
  start(c) {
    for (let i = 0; i < big.length; i += 1 << 20) c.enqueue(new Uint8Array(big.subarray(i, i + (1 << 20))))
    c.close()
  },
})
await vol.writeFile('/big-stream.bin', up)
const h = createHash('sha256')
for await (const chunk of await vol.readFile('/big-stream.bin', { format: 'stream' })) h.update(chunk)
check(h.digest('hex') === sha(big), '8 MiB streamed round trip')

const top = (await vol.list('/')).map((e) => e.path)
check(top.includes('/docs') && top.includes('/big.bin') && !top.includes('/x/y'), `list ${top}`)
check((await vol.list('/', { depth: 3 })).some((e) => e.path === '/x/y/z'), 'list depth 3')
check((await vol.exists('/docs/a.txt')) && !(await vol.exists('/nope')), 'exists')
const m = await vol.updateMetadata('/docs/a.txt', { mode: 0o644, uid: 1001 })
check(m.mode === 0o644 && m.uid === 1001, 'updateMetadata')
await raises(VolumePathNotFoundError, () => vol.getInfo('/nope'), 'getInfo of nothing')

// Paths stay in the volume; a planted link is never followed.
await raises(VolumeError, () => vol.readFile('../x'), '`../x`', '400')
await raises(VolumePathNotFoundError, () => vol.readFile('/etc/passwd'), '/etc/passwd is the volume\'s own')
fs.symlinkSync('/etc', path.join(VOLUMES_DIR, vol.volumeId, 'content', 'hostetc'))
await raises(VolumeError, () => vol.readFile('/hostetc/passwd'), 'read through a link', 'symbolic link')
await raises(VolumeError, () => vol.writeFile('/hostetc/torpor-escape-js', 'x'), 'write through a link', 'symbolic link')
check(!fs.existsSync('/etc/torpor-escape-js'), 'nothing written on the host')

// Tokens.
const theirs = await Volume.create(`js-${run}`, OTHER)
await raises(AuthenticationError, () => vol.list('/', { token: theirs.token }), "another volume's token")

await raises(Error, () => Sandbox.create('probe', { volumeMounts: { '/mnt/data': vol } }), 'volumeMounts into a probe', 'Linux')

await vol.remove('/x')
check(!(await vol.exists('/x/y')), 'remove a tree')
check((await Volume.destroy(vol.volumeId)) === true, 'destroy')
check(!fs.existsSync(path.join(VOLUMES_DIR, vol.volumeId)), 'its directory is gone')
check((await Volume.destroy(theirs.volumeId, OTHER)) === true, 'the other tenant destroys its own')

passed()

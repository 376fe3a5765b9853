// The E2B control plane through the real JS SDK (npm `e2b`, pinned in
// tests/e2b/package.json, installed by scripts/setup test), against `torpor serve` on
// loopback with the probe template (or E2B_TEST_TEMPLATE: the nested pod's
// `base` in tests/nested_pod.rs). Run by tests/e2b_sdk.rs with node,
// NODE_PATH naming the install's node_modules, E2B_API_URL, E2B_API_KEY and
// E2B_SANDBOX_URL set; exits non-zero on the first failed check.

import { createRequire } from 'node:module'
import { randomUUID } from 'node:crypto'
import path from 'node:path'
import { checks } from './checks.mjs'

// ESM ignores NODE_PATH: resolve the SDK from the install it names.
const require = createRequire(path.join(process.env.NODE_PATH, 'noop.js'))
const { Sandbox, NotFoundError, SandboxError, AuthenticationError } =
  require('e2b')
const { version } = require('e2b/package.json')

const TEMPLATE = process.env.E2B_TEST_TEMPLATE ?? 'probe'
// Per request: the SDK's 60 s default is short for forks and snapshots of
// a Linux guest in the nested host under TCG on a busy machine.
const SLOW = { requestTimeoutMs: 600_000 }
const { check, raises, passed } = checks('e2b-sdk-js')

console.log(`e2b-sdk-js: version ${version}`)
const run = randomUUID().slice(0, 8)
const ids = (xs) => xs.map((s) => s.sandboxId).sort()

const sbx = await Sandbox.create(TEMPLATE, { ...SLOW, timeoutMs: 120_000, metadata: { run, role: 'main' } })
check(sbx.sandboxId.startsWith('sbx_'), `sandbox id ${sbx.sandboxId}`)
let info = await sbx.getInfo()
check(info.sandboxId === sbx.sandboxId, 'getInfo id')
check(info.state === 'running', `state ${info.state}`)
check(info.metadata.run === run && info.metadata.role === 'main', `metadata ${JSON.stringify(info.metadata)}`)
check(info.name === TEMPLATE, `template name ${info.name}`)
const lifetime = (info.endAt - info.startedAt) / 1000
check(lifetime >= 119 && lifetime <= 121, `endAt - startedAt = ${lifetime}`)
check(info.lifecycle?.onTimeout === 'kill', `lifecycle ${JSON.stringify(info.lifecycle)}`)

check((await sbx.isRunning()) === true, 'isRunning while running')

await sbx.setTimeout(30_000)
const left = ((await Sandbox.getInfo(sbx.sandboxId)).endAt - Date.now()) / 1000
check(left >= 20 && left <= 31, `after setTimeout(30 s): ${left} s left`)
await sbx.setTimeout(300_000)

// metrics: its pod's history, oldest first
const metrics = await sbx.getMetrics()
check(metrics.length >= 1 && metrics.at(-1).memUsed > 0, `metrics ${JSON.stringify(metrics)}`)
check(
  metrics.every((m, i) => m.cpuCount >= 1 && m.memTotal > 0 && (i === 0 || metrics[i - 1].timestamp <= m.timestamp)),
  `metrics oldest first ${JSON.stringify(metrics)}`,
)
const now = new Date()
const ranged = await sbx.getMetrics({ start: new Date(info.startedAt.getTime() - 5_000), end: now })
check(ranged.length >= 1, `metrics from its start to now ${JSON.stringify(ranged)}`)
const before = await sbx.getMetrics({
  start: new Date(info.startedAt.getTime() - 3_600_000),
  end: new Date(info.startedAt.getTime() - 1_800_000),
})
check(before.length === 0, `no metrics before the sandbox ${JSON.stringify(before)}`)
await raises(
  SandboxError,
  () => sbx.getMetrics({ start: now, end: new Date(now.getTime() - 3_600_000) }),
  'metrics with start after end',
)

// list with a metadata filter (a space and reserved characters) and paging
const meta = { 'run id': `${run}&x=y` }
const listed = []
for (let i = 0; i < 3; i++) {
  listed.push(await Sandbox.create(TEMPLATE, { ...SLOW, timeoutMs: 300_000, metadata: meta }))
}
const paginator = Sandbox.list({ query: { metadata: meta }, limit: 2 })
const seen = []
let pages = 0
while (paginator.hasNext) {
  const items = await paginator.nextItems()
  check(items.length <= 2, `page of ${items.length}`)
  seen.push(...items)
  pages += 1
}
check(pages === 2, `${pages} pages`)
check(JSON.stringify(ids(seen)) === JSON.stringify(ids(listed)), `listed ${ids(seen)}`)
const order = (xs) => JSON.stringify(xs.map((s) => s.sandboxId))
check(order(seen) === order([...listed].reverse()), `newest first ${order(seen)}`)
// order 'asc': oldest first; its token is bound to its order
const asc = Sandbox.list({ query: { metadata: meta }, limit: 2, order: 'asc' })
const first = await asc.nextItems()
check(order(first) === order(listed.slice(0, 2)), `asc first page ${order(first)}`)
check(asc.hasNext && asc.nextToken, 'asc has a next page')
await raises(
  SandboxError,
  () => Sandbox.list({ query: { metadata: meta }, limit: 2, nextToken: asc.nextToken }).nextItems(),
  'an asc token replayed newest first',
)
const rest = await asc.nextItems()
check(order(rest) === order(listed.slice(2)) && !asc.hasNext, `asc second page ${order(rest)}`)

// the ports' network settings: kept and shown as E2B's API does
const masked = await Sandbox.create(TEMPLATE, {
  ...SLOW,
  timeoutMs: 60_000,
  metadata: { run, role: 'masked' },
  network: { allowPublicTraffic: false, maskRequestHost: 'localhost:${PORT}' },
})
const net = (await masked.getInfo()).network ?? {}
check(
  net.maskRequestHost === 'localhost:${PORT}' && net.allowPublicTraffic === false,
  `masked sandbox's network ${JSON.stringify(net)}`,
)
await masked.kill()
await raises(
  SandboxError,
  () => Sandbox.create(TEMPLATE, { ...SLOW, network: { maskRequestHost: 'not a host' } }),
  'a mask that is not a host (400)',
)

// pause (hibernation) -> already paused -> connect wakes it
check((await sbx.pause(SLOW)) === true, 'pause')
check((await Sandbox.getInfo(sbx.sandboxId)).state === 'paused', 'paused state')
check((await Sandbox.pause(sbx.sandboxId)) === false, 'second pause: already paused (409)')
check((await sbx.isRunning()) === false, 'isRunning while paused')
const paused = await Sandbox.list({ query: { metadata: { run }, state: ['paused'] } }).nextItems()
check(JSON.stringify(ids(paused)) === JSON.stringify([sbx.sandboxId]), `paused list ${ids(paused)}`)
const same = await Sandbox.connect(sbx.sandboxId, { ...SLOW, timeoutMs: 600_000 })
check(same.sandboxId === sbx.sandboxId, 'connect id')
check((await sbx.getInfo()).state === 'running', 'running after connect')

// snapshot -> create from it -> delete
const snap = await sbx.createSnapshot(SLOW)
check(snap.snapshotId.startsWith("tpl_"), `snapshot ${JSON.stringify(snap)}`)
const restored = await Sandbox.create(snap.snapshotId, { ...SLOW, timeoutMs: 60_000 })
check((await restored.getInfo()).state === 'running', 'sandbox from a snapshot')
await restored.kill()
check((await Sandbox.deleteSnapshot(snap.snapshotId)) === true, 'delete snapshot')
check((await Sandbox.deleteSnapshot(snap.snapshotId)) === false, 'snapshot gone')

// fork with a count
const forks = await sbx.fork({ ...SLOW, count: 2, timeoutMs: 60_000 })
check(forks.length === 2, `forks ${forks.length}`)
for (const f of forks) {
  check(f instanceof Sandbox, `fork result ${f}`)
  check((await f.getInfo()).metadata.run === run, 'fork keeps metadata')
  await f.kill()
}

// envs and lifecycle on_timeout=pause
const auto = await Sandbox.create(TEMPLATE, {
  ...SLOW,
  timeoutMs: 60_000,
  envs: { A: 'b' },
  lifecycle: { onTimeout: 'pause' },
})
check((await auto.getInfo()).lifecycle?.onTimeout === 'pause', 'autoPause lifecycle')
await auto.kill()

// kill, then not-found paths
check((await sbx.kill()) === true, 'kill')
check((await Sandbox.kill(sbx.sandboxId)) === false, 'second kill: not found')
check((await sbx.isRunning()) === false, 'isRunning after kill')
await raises(NotFoundError, () => Sandbox.getInfo(sbx.sandboxId), 'getInfo after kill')
await raises(NotFoundError, () => Sandbox.connect(sbx.sandboxId), 'connect after kill')
await raises(SandboxError, () => Sandbox.create('no-such-template'), 'unknown template')
await raises(AuthenticationError, () => Sandbox.list({ apiKey: 'wrong' }).nextItems(), 'wrong key')
// This SDK leaves the count to the server: 400.
try {
  await Sandbox.fork(listed[0].sandboxId, { count: 0 })
  check(false, 'fork count 0 accepted')
} catch (e) {
  check(e instanceof SandboxError && /count 0/.test(e.message), `fork count 0: ${e?.message}`)
}
for (const s of listed) await s.kill()

passed()

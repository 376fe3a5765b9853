// The E2B JS SDK's commands and files (envd) against a Linux sandbox of
// torpor serve: run by tests/nested_pod.rs against the nested pod's `base`
// (E2B_TEST_TEMPLATE) with node, NODE_PATH naming the install's
// node_modules, E2B_API_URL, E2B_SANDBOX_URL and E2B_API_KEY set; argv[2]
// is a scratch directory in the sandbox. Prints "sdk-envd-js: version X",
// one line per check, then "sdk-envd-js: N passed, M failed".

import { createRequire } from 'node:module'
import path from 'node:path'

// ESM ignores NODE_PATH: resolve the SDK from the install it names.
const require = createRequire(path.join(process.env.NODE_PATH, 'noop.js'))
const { Sandbox, CommandExitError, NotFoundError } = require('e2b')
const { version } = require('e2b/package.json')

const TEMPLATE = process.env.E2B_TEST_TEMPLATE ?? 'base'
const SCRATCH = process.argv[2]
console.log(`sdk-envd-js: version ${version}`)

let passed = 0
let failed = 0
async function check(name, f) {
  try {
    await f()
    passed += 1
    console.log(`ok ${name}`)
  } catch (e) {
    failed += 1
    console.log(`FAILED ${name}: ${e?.constructor?.name}: ${e?.message}`)
  }
}
function assert(cond, what) {
  if (!cond) throw new Error(what)
}

// Longer than the SDK's default: the nested pod is slow (TCG).
const sbx = await Sandbox.create(TEMPLATE, {
  timeoutMs: 1_800_000,
  requestTimeoutMs: 300_000,
  envs: { FROM_SANDBOX: 'yes' },
})
await sbx.files.makeDir(SCRATCH)

await check('run_collects_output_env_and_cwd', async () => {
  const out = []
  const err = []
  const r = await sbx.commands.run('echo hi $FROM_SANDBOX $MINE; pwd; echo e >&2', {
    envs: { MINE: 'mine' },
    cwd: SCRATCH,
    onStdout: (d) => out.push(d),
    onStderr: (d) => err.push(d),
  })
  assert(r.exitCode === 0, `exit ${r.exitCode}`)
  assert(r.stdout === `hi yes mine\n${SCRATCH}\n`, JSON.stringify(r.stdout))
  assert(r.stderr === 'e\n', JSON.stringify(r.stderr))
  assert(out.join('') === r.stdout, JSON.stringify(out))
  assert(err.join('') === r.stderr, JSON.stringify(err))
})

await check('default_user_and_tools', async () => {
  const r = await sbx.commands.run('whoami; pwd; sudo -n whoami; git --version >/dev/null; curl --version >/dev/null')
  assert(r.stdout === 'user\n/home/user\nroot\n', JSON.stringify(r.stdout))
})

await check('exit_codes_raise', async () => {
  try {
    await sbx.commands.run('exit 3')
  } catch (e) {
    assert(e instanceof CommandExitError && e.exitCode === 3, `${e}`)
    return
  }
  throw new Error('no CommandExitError')
})

await check('background_list_and_kill', async () => {
  const h = await sbx.commands.run('sleep 30', { background: true })
  assert((await sbx.commands.list()).some((p) => p.pid === h.pid), 'not listed')
  assert((await sbx.commands.kill(h.pid)) === true, 'kill')
  for (let i = 0; i < 50; i++) {
    if (!(await sbx.commands.list()).some((p) => p.pid === h.pid)) return
    await new Promise((r) => setTimeout(r, 100))
  }
  throw new Error('still listed after kill')
})

await check('files_write_read_list_rename_remove', async () => {
  const d = `${SCRATCH}/files`
  assert((await sbx.files.makeDir(d)) === true, 'makeDir')
  await sbx.files.write([
    { path: `${d}/a.txt`, data: 'hello' },
    { path: `${d}/b.bin`, data: new Uint8Array([0, 1, 2, 255]).buffer },
  ])
  assert((await sbx.files.read(`${d}/a.txt`)) === 'hello', 'read text')
  const bytes = await sbx.files.read(`${d}/b.bin`, { format: 'bytes' })
  assert(Array.from(bytes).join(',') === '0,1,2,255', `bytes ${Array.from(bytes)}`)
  const names = (await sbx.files.list(d)).map((e) => e.name).sort()
  assert(JSON.stringify(names) === '["a.txt","b.bin"]', JSON.stringify(names))
  const info = await sbx.files.getInfo(`${d}/a.txt`)
  assert(info.size === 5 && info.type === 'file', JSON.stringify(info))
  const moved = await sbx.files.rename(`${d}/a.txt`, `${d}/c.txt`)
  assert(moved.name === 'c.txt', JSON.stringify(moved))
  await sbx.files.remove(`${d}/c.txt`)
  assert((await sbx.files.exists(`${d}/c.txt`)) === false, 'exists after remove')
  try {
    await sbx.files.read(`${d}/c.txt`)
  } catch (e) {
    assert(e instanceof NotFoundError, `${e?.constructor?.name}: ${e}`)
    return
  }
  throw new Error('no NotFoundError')
})

await check('pause_connect_keeps_processes_and_files', async () => {
  await sbx.files.write(`${SCRATCH}/kept.txt`, 'before pause')
  const h = await sbx.commands.run('sleep 600', { background: true })
  assert((await sbx.pause()) === true, 'pause')
  assert((await Sandbox.getInfo(sbx.sandboxId)).state === 'paused', 'paused')
  const again = await Sandbox.connect(sbx.sandboxId, { timeoutMs: 1_800_000 })
  assert((await again.files.read(`${SCRATCH}/kept.txt`)) === 'before pause', 'file')
  assert((await again.commands.list()).some((p) => p.pid === h.pid), 'process gone')
  assert((await again.commands.kill(h.pid)) === true, 'kill after connect')
})

await sbx.kill()
console.log(`sdk-envd-js: ${passed} passed, ${failed} failed`)
process.exit(failed ? 1 : 0)

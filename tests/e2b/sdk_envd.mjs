// The E2B JS SDK's commands and files (envd) against torpor serve: run by
// api/tests/http_e2b_sdk.rs against the API over a real torpor-agent on the
// host (a probe sandbox, the default template), and by tests/nested_pod.rs
// against the nested pod's `base` (E2B_TEST_TEMPLATE=base, which adds the
// Linux-only checks), with node, NODE_PATH naming the install's
// node_modules, E2B_API_URL, E2B_SANDBOX_URL and E2B_API_KEY set; argv[2]
// is a scratch directory in the sandbox (made if missing). Prints
// "sdk-envd-js: version X", one line per check, then
// "sdk-envd-js: N passed, M failed".

import { createRequire } from 'node:module'
import path from 'node:path'

// ESM ignores NODE_PATH: resolve the SDK from the install it names.
const require = createRequire(path.join(process.env.NODE_PATH, 'noop.js'))
const { Sandbox, CommandExitError, NotFoundError, TimeoutError } = require('e2b')
const { version } = require('e2b/package.json')

const TEMPLATE = process.env.E2B_TEST_TEMPLATE ?? 'probe'
const LINUX = TEMPLATE !== 'probe'
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
  // A probe sandbox of the test service reaches a real agent on the host.
  metadata: LINUX ? {} : { agent: 'real' },
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

if (LINUX) await check('default_user_and_tools', async () => {
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
  // Into a directory not there yet: envd makes it.
  const deeper = await sbx.files.rename(`${d}/c.txt`, `${d}/new/c.txt`)
  assert(deeper.path === `${d}/new/c.txt`, JSON.stringify(deeper))
  assert((await sbx.files.getInfo(`${d}/new`)).type === 'dir', 'made parent')
  await sbx.files.rename(`${d}/new/c.txt`, `${d}/c.txt`)
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

await check('gzip_download_and_upload', async () => {
  const p = `${SCRATCH}/gzipped.txt`
  const text = 'compress me '.repeat(1000)
  await sbx.files.write(p, text, { gzip: true })
  assert((await sbx.files.read(p)) === text, 'read back')
  assert((await sbx.files.read(p, { gzip: true })) === text, 'read back gzipped')
  const url = `${process.env.E2B_SANDBOX_URL}/files?path=${encodeURIComponent(p)}`
  const headers = { 'X-Access-Token': sbx.envdAccessToken, 'E2b-Sandbox-Id': sbx.sandboxId }
  const r = await fetch(url, { headers: { ...headers, 'Accept-Encoding': 'gzip' } })
  assert(r.status === 200, `status ${r.status}`)
  assert(r.headers.get('content-encoding') === 'gzip', `encoding ${r.headers.get('content-encoding')}`)
  assert((await r.text()) === text, 'gzip body')
  const plain = await fetch(url, { headers: { ...headers, 'Accept-Encoding': 'identity' } })
  assert(plain.headers.get('content-encoding') === null, 'identity encoded')
  assert((await plain.text()) === text, 'identity body')
})

await check('remove_of_a_missing_path_is_quiet', async () => {
  await sbx.files.remove(`${SCRATCH}/never-was`)
})

await check('entry_details_as_envd', async () => {
  const d = `${SCRATCH}/details`
  await sbx.files.makeDir(d)
  await sbx.files.write(`${d}/target.txt`, 'hello')
  const script =
    `cd ${d} && chmod 644 target.txt && mkdir -p sub && chmod 755 sub` +
    ' && touch nameless && chown 4242:4243 nameless' +
    ' && ln -sfn target.txt link && realpath . && stat -c "%U %G" target.txt && stat -c %A link'
  // Uploads are root's; a Linux guest's commands run as `user`.
  const r = await sbx.commands.run(LINUX ? `sudo -n sh -c '${script}'` : script)
  const [real, owner, group, linkPerms] = r.stdout.split(/\s+/)
  const f = await sbx.files.getInfo(`${d}/target.txt`)
  assert(f.type === 'file' && f.size === 5 && f.mode === 0o644 && f.permissions === '-rw-r--r--', JSON.stringify(f))
  assert(f.owner === owner && f.group === group && f.symlinkTarget === undefined, JSON.stringify(f))
  const s = await sbx.files.getInfo(`${d}/sub`)
  assert(s.type === 'dir' && s.mode === 0o755 && s.permissions === 'drwxr-xr-x', JSON.stringify(s))
  const n = await sbx.files.getInfo(`${d}/nameless`)
  assert(n.owner === '4242' && n.group === '4243', JSON.stringify(n))
  const l = await sbx.files.getInfo(`${d}/link`)
  assert(l.symlinkTarget === `${real}/target.txt`, JSON.stringify(l))
  // envd's `permissions` is lstat's mode as Go writes it ('L' for a link;
  // `stat -c %A` writes 'l'): 'Lrwxrwxrwx' on most filesystems.
  const want = 'L' + linkPerms.slice(1)
  assert(l.type === 'file' && l.permissions === want && l.size === 'target.txt'.length, JSON.stringify(l))
})

await check('list_dir_walks_depth_first', async () => {
  const d = `${SCRATCH}/walk`
  for (const p of ['a/x.txt', 'a/y/z.txt', 'b.txt']) await sbx.files.write(`${d}/${p}`, p)
  const got = (await sbx.files.list(d, { depth: 3 })).map((e) => e.path.slice(d.length + 1))
  assert(JSON.stringify(got) === '["a","a/x.txt","a/y","a/y/z.txt","b.txt"]', JSON.stringify(got))
})

await check('metadata_is_kept_on_files', async () => {
  const d = `${SCRATCH}/meta`
  const info = await sbx.files.write(`${d}/m.txt`, 'm', { metadata: { Author: 'me' } })
  assert(JSON.stringify(info.metadata) === '{"author":"me"}', JSON.stringify(info))
  const got = await sbx.files.getInfo(`${d}/m.txt`)
  assert(JSON.stringify(got.metadata) === '{"author":"me"}', JSON.stringify(got))
  const octet = await sbx.files.write(`${d}/o.txt`, 'o', { metadata: { k: 'v' }, useOctetStream: true })
  assert(JSON.stringify(octet.metadata) === '{"k":"v"}', JSON.stringify(octet))
})

await check('watch_dir_recursive_with_entries', async () => {
  const d = `${SCRATCH}/watched-deep`
  await sbx.files.makeDir(`${d}/sub`)
  const events = []
  const h = await sbx.files.watchDir(d, (e) => events.push(e), { recursive: true, includeEntry: true })
  await sbx.files.write(`${d}/sub/deep.txt`, '12345')
  await sbx.commands.run(`mkdir ${d}/later && echo hi > ${d}/later/inside.txt`)
  const names = () => events.map((e) => e.name)
  for (let i = 0; i < 50 && !(names().includes('sub/deep.txt') && names().includes('later/inside.txt')); i++) {
    await new Promise((r) => setTimeout(r, 100))
  }
  await h.stop()
  assert(names().includes('sub/deep.txt') && names().includes('later/inside.txt'), JSON.stringify(names()))
  const withEntry = events.filter((e) => e.name === 'sub/deep.txt' && e.entry)
  assert(withEntry.length > 0 && withEntry.at(-1).entry.path === `${d}/sub/deep.txt`, JSON.stringify(events))
})

await check('watch_dir_with_network_mounts_allowed', async () => {
  // envd 0.6.4's opt-in (refused client-side below it); a local directory
  // is watched the same.
  const d = `${SCRATCH}/watched-net`
  await sbx.files.makeDir(d)
  const events = []
  const h = await sbx.files.watchDir(d, (e) => events.push(e), { allowNetworkMounts: true })
  await sbx.files.write(`${d}/new.txt`, 'x')
  for (let i = 0; i < 50 && !events.some((e) => e.name === 'new.txt'); i++) {
    await new Promise((r) => setTimeout(r, 100))
  }
  await h.stop()
  assert(events.some((e) => e.name === 'new.txt'), JSON.stringify(events))
})

// E2B's pty connect test: a PTY made with envs, left, connected to again
// by pid; both connections see the variable.
await check('pty_reconnects_and_keeps_its_env', async () => {
  const decoder = new TextDecoder()
  let first = ''
  let second = ''
  const terminal = await sbx.pty.create({
    cols: 80,
    rows: 24,
    cwd: SCRATCH,
    envs: { FOO: 'bar-pty' },
    onData: (d) => {
      first += decoder.decode(d)
    },
  })
  await sbx.pty.sendInput(terminal.pid, new TextEncoder().encode('echo first-$FOO\n'))
  for (let i = 0; i < 100 && !first.includes('first-bar-pty'); i++) {
    await new Promise((r) => setTimeout(r, 50))
  }
  await terminal.disconnect()
  const again = await sbx.pty.connect(terminal.pid, {
    onData: (d) => {
      second += decoder.decode(d)
    },
  })
  await sbx.pty.sendInput(terminal.pid, new TextEncoder().encode('echo again-$FOO; exit 0\n'))
  const result = await again.wait()
  assert(again.pid === terminal.pid, 'another pid')
  assert(result.exitCode === 0, `exit ${result.exitCode}`)
  assert(first.includes('first-bar-pty'), `first: ${JSON.stringify(first)}`)
  assert(second.includes('again-bar-pty'), `second: ${JSON.stringify(second)}`)
})

// E2B's own test: a command running when its sandbox is killed ends in the
// SDK's TimeoutError "killed or reached its end of life". Linux only: a
// killed VM breaks its agent's connections; the host-run agent of the
// API's test service is shared and outlives a sandbox's kill.
if (LINUX) await check('killing_the_sandbox_during_a_command_says_so', async () => {
  const victim = await Sandbox.create(TEMPLATE, {
    requestTimeoutMs: 300_000,
    metadata: LINUX ? {} : { agent: 'real' },
  })
  const cmd = await victim.commands.run('sleep 60', { background: true })
  await victim.kill()
  const err = await cmd.wait().then(
    () => new Error('the wait returned after its sandbox was killed'),
    (e) => e,
  )
  assert(err instanceof TimeoutError, `${err?.constructor?.name}: ${err?.message}`)
  assert(
    err.message.includes('killed or reached its end of life'),
    `${err?.constructor?.name}: ${err?.message}`,
  )
})

if (LINUX) await check('pause_connect_keeps_processes_and_files', async () => {
  await sbx.files.write(`${SCRATCH}/kept.txt`, 'before pause')
  const h = await sbx.commands.run('sleep 600', { background: true })
  assert((await sbx.pause()) === true, 'pause')
  assert((await Sandbox.getInfo(sbx.sandboxId)).state === 'paused', 'paused')
  const again = await Sandbox.connect(sbx.sandboxId, { timeoutMs: 1_800_000 })
  assert((await again.files.read(`${SCRATCH}/kept.txt`)) === 'before pause', 'file')
  assert((await again.commands.list()).some((p) => p.pid === h.pid), 'process gone')
  assert((await again.commands.kill(h.pid)) === true, 'kill after connect')
})

// pause({ keepMemory: false }) keeps the disk only: the connect boots the
// sandbox again (a new boot id) with the file written before the pause.
if (LINUX) await check('filesystem_pause_reboots_with_files_kept', async () => {
  const bootId = async (s) =>
    (await s.commands.run('cat /proc/sys/kernel/random/boot_id')).stdout.trim()
  const before = await bootId(sbx)
  await sbx.files.write(`${SCRATCH}/fs-kept.txt`, 'before a filesystem pause')
  assert((await sbx.pause({ keepMemory: false })) === true, 'pause')
  assert((await Sandbox.getInfo(sbx.sandboxId)).state === 'paused', 'paused')
  const again = await Sandbox.connect(sbx.sandboxId, { timeoutMs: 1_800_000 })
  assert(
    (await again.files.read(`${SCRATCH}/fs-kept.txt`)) === 'before a filesystem pause',
    'file',
  )
  const after = await bootId(again)
  assert(after && after !== before, `boot id ${before} -> ${after}`)
  assert((await again.commands.run('echo after')).stdout === 'after\n', 'command')
})

await sbx.kill()
console.log(`sdk-envd-js: ${passed} passed, ${failed} failed`)
process.exit(failed ? 1 : 0)

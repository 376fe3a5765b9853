// E2B's template builder through the real JS SDK (npm `e2b`, pinned in
// tests/e2b/package.json), unchanged, against torpor: the routes of
// docs/e2b-template-routes.md. Run like the other scripts here (node,
// NODE_PATH naming the install's node_modules, E2B_API_URL,
// E2B_SANDBOX_URL and E2B_API_KEY set) against a serve whose base template
// is a Linux guest with envd (the nested pod's `base`).
//
// Environment:
//   E2B_TEST_TEMPLATE         the template built from (default `base`)
//   TEMPLATE_BUILD_TIMEOUT    s, bound of the build (default 900)
//   TEMPLATE_REQUEST_TIMEOUT  s, bound of one API request, sandbox creation
//                             included (default 300)
//   TEMPLATE_CMD_TIMEOUT      s, bound of one command in the sandbox (default 120)
//   TEMPLATE_TOTAL_TIMEOUT    s, bound of the whole script (default 1800)
//
// One build: Template().fromTemplate(BASE), a runCmd, a copy (of a file
// this script makes in a temp dir), setStartCmd('python3 -m http.server
// 8000', waitForPort(8000)); a sandbox from it: the runCmd's output, the
// copied file, port 8000 answering on the first try (2 s); the sandbox
// deleted. Prints "sdk-template-js: version X", "ok <check>" lines,
// "sdk-template-js: N passed, 0 failed" and `TEMPLATE-JS-OK`; exits
// non-zero on the first failed check.

import { createRequire } from 'node:module'
import { randomUUID } from 'node:crypto'
import fs from 'node:fs'
import os from 'node:os'
import path from 'node:path'

// ESM ignores NODE_PATH: resolve the SDK from the install it names.
const require = createRequire(path.join(process.env.NODE_PATH, 'noop.js'))
const { Sandbox, Template, waitForPort } = require('e2b')
const { version } = require('e2b/package.json')

const TAG = 'sdk-template-js'
const BASE = process.env.E2B_TEST_TEMPLATE ?? 'base'
const seconds = (name, dflt) => Number(process.env[name] ?? dflt) * 1000
const BUILD_MS = seconds('TEMPLATE_BUILD_TIMEOUT', 900)
const REQUEST_MS = seconds('TEMPLATE_REQUEST_TIMEOUT', 300)
const CMD_MS = seconds('TEMPLATE_CMD_TIMEOUT', 120)
const TOTAL_MS = seconds('TEMPLATE_TOTAL_TIMEOUT', 1800)

let checks = 0
function fail(what) {
  console.log(`${TAG}: FAILED: ${what}`)
  console.error(`${TAG}: FAILED: ${what}`)
  process.exit(1)
}
function check(cond, what) {
  if (!cond) fail(what)
  checks += 1
  console.log(`ok ${what}`)
}
// A promise bounded in time: the script fails past `ms`.
function bounded(what, ms, promise) {
  let timer
  return Promise.race([
    promise,
    new Promise((_, reject) => {
      timer = setTimeout(() => reject(new Error(`${what}: not done in ${ms / 1000} s`)), ms)
    }),
  ]).finally(() => clearTimeout(timer))
}
setTimeout(() => fail(`the script ran over TEMPLATE_TOTAL_TIMEOUT=${TOTAL_MS / 1000} s`), TOTAL_MS).unref()

console.log(`${TAG}: version ${version}`)
const run = randomUUID().slice(0, 8)
// E2B's names: lowercase letters, digits, '-' and '_'.
const name = `sdk-tpl-js-${run}`
const hello = `hello from the JS template context ${run}\n`
const ctx = fs.mkdtempSync(path.join(os.tmpdir(), 'sdk-template-js-'))
fs.writeFileSync(path.join(ctx, 'hello.txt'), hello)

let sbx
try {
  const template = Template({ fileContextPath: ctx })
    .fromTemplate(BASE)
    .runCmd(`echo built-${run} > /home/user/built.txt`)
    .copy('hello.txt', '/home/user/hello.txt')
    .setStartCmd('python3 -m http.server 8000', waitForPort(8000))
  const logs = []
  const started = Date.now()
  const info = await bounded(
    'Template.build',
    BUILD_MS,
    Template.build(template, name, {
      onBuildLogs: (e) => logs.push(e),
      requestTimeoutMs: REQUEST_MS,
      signal: AbortSignal.timeout(BUILD_MS),
    }),
  )
  console.log(`${TAG}: built in ${((Date.now() - started) / 1000).toFixed(1)} s`)
  check(info.templateId && info.buildId && info.name === name, `build ${JSON.stringify(info)}`)
  check(logs.some((e) => e.message === "Uploaded 'hello.txt'"), 'the file was uploaded')
  check(await bounded('exists', REQUEST_MS, Template.exists(name, { requestTimeoutMs: REQUEST_MS })), `Template.exists('${name}')`)

  sbx = await bounded(
    'Sandbox.create',
    REQUEST_MS + 30_000,
    Sandbox.create(name, { timeoutMs: 600_000, requestTimeoutMs: REQUEST_MS }),
  )
  const runCmd = (cmd) => sbx.commands.run(cmd, { timeoutMs: CMD_MS, requestTimeoutMs: REQUEST_MS })
  // The start command runs in the template's snapshot: port 8000 answers
  // on the first try (one request, 2 s), no waiting loop.
  let r = await runCmd(
    `python3 -c "import urllib.request; print(urllib.request.urlopen('http://127.0.0.1:8000/', timeout=2).status)"`,
  )
  check(r.stdout.trim() === '200', `port 8000 answered at once: ${JSON.stringify(r.stdout)} ${JSON.stringify(r.stderr)}`)
  r = await runCmd('cat /home/user/built.txt')
  check(r.stdout === `built-${run}\n`, `the runCmd's file: ${JSON.stringify(r.stdout)}`)
  r = await runCmd('cat /home/user/hello.txt')
  check(r.stdout === hello, `the copied file: ${JSON.stringify(r.stdout)}`)
  check((await sbx.getInfo()).templateId === info.templateId, "the sandbox's templateId is the build's")
} catch (e) {
  fail(`${e?.constructor?.name}: ${e?.message}`)
} finally {
  fs.rmSync(ctx, { recursive: true, force: true })
}
check((await bounded('kill', REQUEST_MS, sbx.kill({ requestTimeoutMs: REQUEST_MS }))) === true, 'the sandbox is deleted')

console.log(`${TAG}: ${checks} passed, 0 failed`)
console.log('TEMPLATE-JS-OK')
process.exit(0)

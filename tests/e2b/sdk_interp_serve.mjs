// The official E2B code interpreter JS SDK (@e2b/code-interpreter) through
// `torpor serve`, as an agent runs it: only E2B_API_URL, E2B_SANDBOX_URL and
// E2B_API_KEY set, Sandbox.create() with the SDK's default template
// (code-interpreter-v1), then runCode and kill (tests/nested_pod.rs, against
// the nested pod; tests/e2b/sdk_interp_serve.py is the long round). A call
// is bounded by argv[2] seconds (default 120: the guests run under TCG).
// Prints "sdk-interp-serve-js: version X" (the e2b version), "timing: NAME
// SECONDS" lines, one line per check, then "sdk-interp-serve-js: N passed, M
// failed".

import { createRequire } from 'node:module'
import path from 'node:path'

// ESM ignores NODE_PATH: resolve the SDKs from the install it names.
const require = createRequire(path.join(process.env.NODE_PATH, 'noop.js'))
const { Sandbox } = require('@e2b/code-interpreter')
const { version } = require('e2b/package.json')
const ci = require('@e2b/code-interpreter/package.json')
console.log(`sdk-interp-serve-js: version ${version}`)
console.log(`sdk-interp-serve-js: @e2b/code-interpreter ${ci.version}`)

const callMs = 1000 * Number(process.argv[2] ?? 120)
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
const timing = (name, since) => console.log(`timing: ${name} ${((performance.now() - since) / 1000).toFixed(3)}`)

const started = performance.now()
const sbx = await Sandbox.create({ timeoutMs: 1_800_000, requestTimeoutMs: 600_000 })
timing('create', started)
console.log(`sdk-interp-serve-js: sandbox ${sbx.sandboxId}`)

await check('runCode', async () => {
  const r = await sbx.runCode('x = 20\nx * 2 + 2', { timeoutMs: callMs })
  timing('create to first runCode', started)
  assert(r.error === undefined, JSON.stringify(r.error))
  assert(r.text === '42', JSON.stringify(r.results))
  const t = performance.now()
  const again = await sbx.runCode('1+1', { timeoutMs: callMs })
  timing('runCode 1+1', t)
  assert(again.text === '2', JSON.stringify(again.results))
})

await check('kill', async () => {
  assert((await sbx.kill()) === true, 'kill did not answer true')
})

console.log(`sdk-interp-serve-js: ${passed} passed, ${failed} failed`)
process.exit(failed ? 1 : 0)

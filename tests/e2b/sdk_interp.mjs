// The official E2B code interpreter JS SDK (@e2b/code-interpreter) against
// torpor's interpreter server (guest-image/interpreter/torpor_interp.py):
// run by tests/interp_sdk.rs against the server on loopback, with node,
// NODE_PATH naming the install's node_modules and E2B_SANDBOX_URL the
// server's URL (the SDK sends every request there, with E2b-Sandbox-Id/Port
// headers the server ignores). The sandbox object is the one
// Sandbox.connect builds from the API's answer; no API is asked here.
// Prints "sdk-interp-js: version X" (the e2b version), one line per check,
// then "sdk-interp-js: N passed, M failed".

import { createRequire } from 'node:module'
import path from 'node:path'

// ESM ignores NODE_PATH: resolve the SDKs from the install it names.
const require = createRequire(path.join(process.env.NODE_PATH, 'noop.js'))
const { Sandbox } = require('@e2b/code-interpreter')
const { version } = require('e2b/package.json')
const ci = require('@e2b/code-interpreter/package.json')
console.log(`sdk-interp-js: version ${version}`)
console.log(`sdk-interp-js: @e2b/code-interpreter ${ci.version}`)

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

// What Sandbox.connect makes of the API's answer (e2b's sandbox/index.ts).
const sbx = new Sandbox({ sandboxId: 'interp-on-loopback', envdVersion: '0.2.0', requestTimeoutMs: 120_000 })

await check('state is kept across calls', async () => {
  await sbx.runCode('x = 41')
  const r = await sbx.runCode('x + 1')
  assert(r.text === '42', JSON.stringify(r.results))
  assert(r.results[0].isMainResult, 'not the main result')
})

await check('stdout reaches the callback', async () => {
  const lines = []
  const r = await sbx.runCode("print('one')\nprint('two')", { onStdout: (m) => lines.push(m.line) })
  assert(lines.join('') === 'one\ntwo\n', JSON.stringify(lines))
  assert(r.logs.stdout.join('') === 'one\ntwo\n', JSON.stringify(r.logs))
})

await check('an exception comes back by name', async () => {
  const r = await sbx.runCode('1 / 0')
  assert(r.error?.name === 'ZeroDivisionError', JSON.stringify(r.error))
  assert(r.error.value === 'division by zero', r.error.value)
})

await check('a matplotlib chart is a PNG', async () => {
  const r = await sbx.runCode('import matplotlib.pyplot as plt\nplt.plot([1, 2, 3])\nplt.show()')
  const png = r.results.find((res) => res.png)
  assert(png, JSON.stringify(r.results.map((res) => res.formats())))
  assert(Buffer.from(png.png, 'base64').subarray(1, 4).toString() === 'PNG', 'not a PNG')
})

await check('a DataFrame is HTML', async () => {
  const r = await sbx.runCode("import pandas as pd\npd.DataFrame({'a': [1, 2]})")
  assert(r.results[0]?.html?.includes('<table'), JSON.stringify(r.results))
})

await check('a fresh context does not see the default one', async () => {
  const ctx = await sbx.createCodeContext()
  const r = await sbx.runCode('x', { context: ctx })
  assert(r.error?.name === 'NameError', JSON.stringify(r.error))
  await sbx.removeCodeContext(ctx.id)
  const ids = (await sbx.listCodeContexts()).map((c) => c.id)
  assert(!ids.includes(ctx.id), 'the removed context is listed')
})

await check('a timeout interrupts and the next call works', async () => {
  let timedOut = false
  try {
    await sbx.runCode('import time\ntime.sleep(60)\nfinished = True', { timeoutMs: 2000 })
  } catch (e) {
    timedOut = true
  }
  assert(timedOut, 'a 60 s cell finished within a 2 s timeout')
  const r = await sbx.runCode("print(x, 'finished' in globals())")
  assert(r.logs.stdout.join('') === '41 False\n', JSON.stringify(r.logs))
})

await check('bash runs in its own kernel', async () => {
  const r = await sbx.runCode('echo $((6 * 7))', { language: 'bash' })
  assert(r.logs.stdout.join('') === '42\n', JSON.stringify(r.logs))
})

// JavaScript and TypeScript (Deno's kernel), as E2B's JS SDK tests use them.
await check('javascript keeps state and returns the last value', async () => {
  await sbx.runCode('let jsCount = 40', { language: 'js' })
  const r = await sbx.runCode('jsCount + 2', { language: 'javascript' })
  assert(r.text === '42', JSON.stringify(r.results))
  assert(r.results[0].isMainResult, 'not the main result')
  const awaited = await sbx.runCode("await Promise.resolve('Hello World!')", { language: 'js' })
  assert(awaited.text === 'Hello World!', JSON.stringify(awaited.results))
})

await check('javascript console.log is stdout', async () => {
  const lines = []
  const r = await sbx.runCode('console.log("Hello World!")', { language: 'js', onStdout: (m) => lines.push(m.line) })
  assert(lines.join('') === 'Hello World!\n', JSON.stringify(lines))
  assert(JSON.stringify(r.logs.stdout) === '["Hello World!\\n"]', JSON.stringify(r.logs))
})

await check('a thrown javascript error comes back by name', async () => {
  const r = await sbx.runCode("console.log('before')\nthrow new RangeError('too far')", { language: 'js' })
  assert(r.error?.name === 'RangeError', JSON.stringify(r.error))
  assert(r.error.value === 'too far', r.error.value)
  assert(r.logs.stdout.join('') === 'before\n', JSON.stringify(r.logs))
})

await check('typescript runs typed code', async () => {
  const r = await sbx.runCode('const message: string = "Hello World!"; console.log(message)', { language: 'ts' })
  assert(r.logs.stdout.join('') === 'Hello World!\n', JSON.stringify(r.logs))
  const typed = await sbx.runCode('type Pair = [number, number]\nconst p: Pair = [6, 7]\np[0] * p[1]', {
    language: 'typescript',
  })
  assert(typed.text === '42', JSON.stringify(typed.results))
})

await check('a new javascript context is separate', async () => {
  const ctx = await sbx.createCodeContext({ language: 'js' })
  assert(ctx.language === 'javascript', JSON.stringify(ctx))
  const r = await sbx.runCode('typeof jsCount', { context: ctx })
  assert(r.text === 'undefined', JSON.stringify(r.results))
  await sbx.removeCodeContext(ctx.id)
  const still = await sbx.runCode('jsCount', { language: 'js' })
  assert(still.text === '40', JSON.stringify(still.results))
})

console.log(`sdk-interp-js: ${passed} passed, ${failed} failed`)
process.exit(failed ? 1 : 0)

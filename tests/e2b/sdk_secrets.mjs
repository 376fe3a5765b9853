// E2B's secrets through the real JS SDK (npm `e2b`, pinned in
// tests/e2b/package.json): `Secret` against `torpor serve` (or a cluster
// replica). Run by tests/e2b_secrets.rs with node, NODE_PATH naming the
// install's node_modules, E2B_API_URL and E2B_API_KEY (tenant A's key) and
// OTHER_E2B_API_KEY (tenant B's); exits non-zero on the first failed
// check. Every answer, the SDK's and the raw JSON (fetch), is checked for
// the values: none may carry one.

import { createRequire } from 'node:module'
import { randomUUID } from 'node:crypto'
import path from 'node:path'
import { checks } from './checks.mjs'

// ESM ignores NODE_PATH: resolve the SDK from the install it names.
const require = createRequire(path.join(process.env.NODE_PATH, 'noop.js'))
const {
  Secret,
  SecretError,
  SecretNotFoundError,
  InvalidArgumentError,
  AuthenticationError,
} = require('e2b')
const { version } = require('e2b/package.json')

const URL_ = process.env.E2B_API_URL.replace(/\/$/, '')
const KEY = process.env.E2B_API_KEY
const OTHER = process.env.OTHER_E2B_API_KEY
const { check, raises, passed } = checks('e2b-secrets-js')

console.log(`e2b-secrets-js: version ${version}`)
const run = randomUUID().slice(0, 8)
const values = []
function value(label) {
  const v = `VALUE-${label}-${randomUUID()}`
  values.push(v)
  return v
}
function noValue(text, what) {
  for (const v of values) check(!text.includes(v), `${what} carries a value: ${text.slice(0, 300)}`)
}
async function raw(method, p, { key = KEY, body } = {}) {
  const r = await fetch(URL_ + p, {
    method,
    headers: { 'X-API-KEY': key, 'content-type': 'application/json' },
    body: body === undefined ? undefined : JSON.stringify(body),
  })
  const text = await r.text()
  noValue(text, `${method} ${p}`)
  for (const [k, h] of r.headers) noValue(h, `${method} ${p} header ${k}`)
  return { status: r.status, text, headers: r.headers, json: () => JSON.parse(text) }
}

// create, getInfo by id and name
const name = `Js-${run}-Key`
const info = await Secret.create(name, value('v1'), { metadata: { env: 'test' } })
check(info.secretId.startsWith('sec_'), `secret id ${info.secretId}`)
check(info.name === name.toLowerCase(), `canonical name ${info.name}`)
check(info.version === 1, `version ${info.version}`)
check(JSON.stringify(info.metadata) === '{"env":"test"}', `metadata ${JSON.stringify(info.metadata)}`)
check(info.createdAt instanceof Date && !isNaN(info.createdAt), 'createdAt is a date')
check(!('value' in info), 'SecretInfo has no value')
noValue(JSON.stringify(info), 'SecretInfo')
for (const key of [info.secretId, info.name, name]) {
  const got = await Secret.getInfo(key)
  check(got.secretId === info.secretId && got.version === 1, `getInfo(${key})`)
}
check((await Secret.exists(info.name)) === true, 'exists')
check(Secret.fill(info.name) === '${e2b.secrets.' + info.name + '}', 'fill')
await raises(InvalidArgumentError, () => Secret.fill('a{b'), 'fill with a brace')

// duplicate and invalid names: 409 and 400, SecretError
let e = await raises(SecretError, () => Secret.create(name, value('dup')), 'duplicate')
check(/409/.test(e.message), `duplicate: ${e.message}`)
noValue(e.message, "duplicate's error")
for (const bad of ['a{b', 'sp ace', 'sec_x', '']) {
  e = await raises(SecretError, () => Secret.create(bad, value('bad')), `create(${JSON.stringify(bad)})`)
  check(/400/.test(e.message), `create(${JSON.stringify(bad)}): ${e.message}`)
}
const r0 = await raw('POST', '/secrets', { body: { name: `big-${run}`, value: value('big') + 'x'.repeat(65536) } })
check(r0.status === 400, `big value ${r0.status}`)

// list: 5 more, 2 a page over 3 pages, oldest first
const made = [info.secretId]
for (let i = 0; i < 5; i++) made.push((await Secret.create(`jpage-${run}-${i}`, value(`p${i}`))).secretId)
const paginator = Secret.list({ limit: 2 })
const sizes = []
const listed = []
while (paginator.hasNext) {
  const items = await paginator.nextItems()
  sizes.push(items.length)
  listed.push(...items.map((s) => s.secretId))
}
check(JSON.stringify(sizes) === '[2,2,2]', `pages ${sizes}`)
check(JSON.stringify(listed) === JSON.stringify(made), `listed ${listed} != ${made}`)
const r1 = await raw('GET', '/secrets?limit=2')
check(r1.status === 200 && r1.headers.get('x-next-token'), 'raw page with a token')

// update: version 2 keeps metadata; 3 replaces it
let up = await Secret.update(info.name, value('v2'))
check(up.version === 2 && up.metadata.env === 'test', `update ${JSON.stringify(up)}`)
up = await Secret.update(info.secretId, value('v3'), { metadata: { rotated: 'yes' } })
check(up.version === 3 && JSON.stringify(up.metadata) === '{"rotated":"yes"}', `update 3 ${JSON.stringify(up)}`)
await raises(SecretNotFoundError, () => Secret.update(`none-${run}`, value('x')), 'update missing')
noValue(JSON.stringify(await Secret.getInfo(info.secretId)), 'getInfo after updates')

// another tenant: nothing of ours
for (const key of [info.secretId, info.name]) {
  await raises(SecretNotFoundError, () => Secret.getInfo(key, { apiKey: OTHER }), `other getInfo ${key}`)
  await raises(SecretNotFoundError, () => Secret.update(key, value('stolen'), { apiKey: OTHER }), `other update ${key}`)
  check((await Secret.destroy(key, { apiKey: OTHER })) === false, `other destroy ${key}`)
}
check((await Secret.list({ apiKey: OTHER }).nextItems()).length === 0, "other's list is empty")
check((await Secret.getInfo(info.name)).version === 3, 'untouched by the other tenant')

// delete
check((await Secret.destroy(info.name)) === true, 'destroy')
await raises(SecretNotFoundError, () => Secret.getInfo(info.secretId), 'getInfo after destroy')
check((await Secret.exists(info.secretId)) === false, 'exists after destroy')
check((await Secret.destroy(info.secretId)) === false, 'second destroy')
for (const id of made.slice(1)) check((await Secret.destroy(id)) === true, `destroy ${id}`)

await raises(AuthenticationError, () => Secret.list({ apiKey: 'wrong' }).nextItems(), 'wrong key')
passed()

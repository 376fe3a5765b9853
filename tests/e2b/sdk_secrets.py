"""E2B's secrets through the real Python SDK (`e2b`, pinned in
scripts/setup test): `Secret` against `torpor serve` (or a cluster
replica). Run by tests/e2b_secrets.rs with E2B_API_URL and E2B_API_KEY
(tenant A's key) and OTHER_E2B_API_KEY (tenant B's); exits non-zero on
the first failed check. Every answer, the SDK's and the raw JSON
(httpx), is checked for the values: none may carry one.
"""

import importlib.metadata
import os
import sys
import uuid

import httpx

from checks import Checks
from e2b import Secret
from e2b.exceptions import (
    AuthenticationException,
    InvalidArgumentException,
    SecretException,
    SecretNotFoundException,
)

URL = os.environ["E2B_API_URL"].rstrip("/")
KEY = os.environ["E2B_API_KEY"]
OTHER = os.environ["OTHER_E2B_API_KEY"]
_checks = Checks("e2b-secrets")
check, raises = _checks.check, _checks.raises


print(f"e2b-secrets: version {importlib.metadata.version('e2b')}")
run = uuid.uuid4().hex[:8]
values = []  # every value written: none may come back


def value(label):
    v = f"VALUE-{label}-{uuid.uuid4().hex}"
    values.append(v)
    return v


def no_value(text, what):
    for v in values:
        check(v not in text, f"{what} carries a value: {text[:300]}")


http = httpx.Client(base_url=URL, headers={"X-API-KEY": KEY}, timeout=30)


def raw(method, path, key=KEY, **kw):
    r = http.request(method, path, headers={"X-API-KEY": key}, **kw)
    no_value(r.text, f"{method} {path}")
    for k, h in r.headers.items():
        no_value(h, f"{method} {path} header {k}")
    return r


# create: the name lower-cased, version 1, metadata kept, no value
name = f"Run-{run}-Key"
first = value("v1")
info = Secret.create(name, first, metadata={"env": "test", "team": "ml"})
check(info.secret_id.startswith("sec_"), f"secret id {info.secret_id}")
check(info.name == name.lower(), f"canonical name {info.name}")
check(info.version == 1, f"version {info.version}")
check(info.metadata == {"env": "test", "team": "ml"}, f"metadata {info.metadata}")
check(info.created_at == info.updated_at, "created_at == updated_at")
check(not hasattr(info, "value"), "SecretInfo has no value")
no_value(repr(info), "SecretInfo")

# get_info by id, by name, by the name as first written
for key in (info.secret_id, info.name, name):
    got = Secret.get_info(key)
    check(got.secret_id == info.secret_id and got.version == 1, f"get_info({key})")
    check(got.metadata == info.metadata, f"get_info({key}) metadata")
check(Secret.exists(info.name) is True, "exists")
check(Secret.fill(info.name) == "${e2b.secrets." + info.name + "}", "fill")

# the raw JSON: E2B's fields, no value anywhere
r = raw("GET", f"/secrets/{info.secret_id}")
check(r.status_code == 200, f"raw get {r.status_code}")
body = r.json()
check(
    set(body) == {"secretID", "name", "currentVersion", "metadata", "createdAt", "updatedAt"},
    f"fields {sorted(body)}",
)
check(body["currentVersion"] == 1 and body["name"] == info.name, f"raw body {body}")

# duplicate name (in any case): 409, the SDK's SecretException
e = raises(SecretException, lambda: Secret.create(name.upper(), value("dup")), "duplicate name")
check("409" in str(e), f"duplicate: {e}")
no_value(str(e), "duplicate's error")
r = raw("POST", "/secrets", json={"name": info.name, "value": value("dup2")})
check(r.status_code == 409, f"raw duplicate {r.status_code} {r.text}")

# invalid names: the SDK's own check (fill), then the server's 400
for bad in ["", "a{b", "b}", "new\nline", "nul\x00"]:
    raises(InvalidArgumentException, lambda: Secret.fill(bad), f"fill({bad!r})")
for bad in ["a{b", "sp ace", "dot.ted", "sec_taken", "x" * 129, ""]:
    e = raises(SecretException, lambda: Secret.create(bad, value("bad")), f"create({bad!r})")
    check("400" in str(e), f"create({bad!r}): {e}")
    no_value(str(e), "invalid name's error")
    r = raw("POST", "/secrets", json={"name": bad, "value": value("badraw")})
    check(r.status_code == 400 and "name" in r.json()["message"], f"raw {bad!r}: {r.text}")
# limits and bodies: 400 naming the field, never quoting a value
big = value("big") + "x" * (64 * 1024)
r = raw("POST", "/secrets", json={"name": f"big-{run}", "value": big})
check(r.status_code == 400 and "value" in r.json()["message"], f"big value: {r.text[:200]}")
r = raw("POST", "/secrets", json={"name": f"m-{run}", "value": value("m"), "metadata": {"k": 1}})
check(r.status_code == 400 and "metadata" in r.json()["message"], f"metadata: {r.text}")
many = {f"k{i}": "v" for i in range(33)}
r = raw("POST", "/secrets", json={"name": f"m-{run}", "value": value("m"), "metadata": many})
check(r.status_code == 400, f"33 metadata entries: {r.text}")
r = raw("POST", "/secrets", json={"name": f"n-{run}"})
check(r.status_code == 400 and "value" in r.json()["message"], f"no value: {r.text}")
r = raw("POST", "/secrets", content=b'{"name": "x", "value": ')
check(r.status_code == 400, f"broken JSON: {r.status_code}")

# list, paged: 7 more (8 of ours in all), 3 a page over 3 pages, oldest first
made = [info.secret_id]
for i in range(7):
    made.append(Secret.create(f"page-{run}-{i}", value(f"p{i}")).secret_id)
paginator = Secret.list(limit=3)
pages = []
while paginator.has_next:
    pages.append(paginator.next_items())
check([len(p) for p in pages] == [3, 3, 2], f"pages {[len(p) for p in pages]}")
listed = [s.secret_id for p in pages for s in p]
check(listed == made, f"listed {listed} != made {made}")
check(paginator.next_token is None, "no token after the last page")
r = raw("GET", "/secrets", params={"limit": 3})
check(r.status_code == 200 and len(r.json()) == 3, f"raw page {r.status_code}")
token = r.headers.get("x-next-token")
check(token, "x-next-token on a first page")
r = raw("GET", "/secrets", params={"limit": 3, "nextToken": token})
check([s["secretID"] for s in r.json()] == made[3:6], "raw second page")
for bad in ["0", "101", "x"]:
    check(raw("GET", "/secrets", params={"limit": bad}).status_code == 400, f"limit {bad}")
check(raw("GET", "/secrets", params={"nextToken": "junk"}).status_code == 400, "bad token")
check(len(Secret.list().next_items()) == 8, "one default page holds them all")

# update: the next version; metadata kept unless given, then replaced
up = Secret.update(info.name, value("v2"))
check(up.secret_id == info.secret_id and up.version == 2, f"update: version {up.version}")
check(up.metadata == {"env": "test", "team": "ml"}, f"update kept metadata {up.metadata}")
check(up.updated_at >= up.created_at == info.created_at, "update's times")
up = Secret.update(info.secret_id, value("v3"), metadata={"rotated": "yes"})
check(up.version == 3 and up.metadata == {"rotated": "yes"}, f"update 3: {up}")
check(Secret.get_info(info.name).version == 3, "get_info after updates")
raises(SecretNotFoundException, lambda: Secret.update(f"none-{run}", value("x")), "update missing")
r = raw("POST", f"/secrets/{info.secret_id}", json={"value": 5})
check(r.status_code == 400 and "5" not in r.json()["message"], f"update value 5: {r.text}")

# another tenant: sees, changes and deletes none of ours; names are per tenant
for key in (info.secret_id, info.name):
    raises(SecretNotFoundException, lambda: Secret.get_info(key, api_key=OTHER), f"other get {key}")
    raises(
        SecretNotFoundException,
        lambda: Secret.update(key, value("stolen"), api_key=OTHER),
        f"other update {key}",
    )
    check(Secret.destroy(key, api_key=OTHER) is False, f"other destroy {key}")
    check(Secret.exists(key, api_key=OTHER) is False, f"other exists {key}")
    r = raw("GET", f"/secrets/{key}", key=OTHER)
    check(r.status_code == 404, f"other raw get {key}: {r.status_code}")
check(Secret.list(api_key=OTHER).next_items() == [], "other's list is empty")
theirs = Secret.create(info.name, value("theirs"), api_key=OTHER)
check(theirs.secret_id != info.secret_id, "the same name, another tenant's secret")
raises(SecretNotFoundException, lambda: Secret.get_info(theirs.secret_id), "theirs from ours")
check(Secret.get_info(info.name).secret_id == info.secret_id, "our name is still ours")
check(Secret.get_info(info.name).version == 3, "untouched by the other tenant")

# delete: gone by id and name, a second delete is False
check(Secret.destroy(info.name) is True, "destroy")
raises(SecretNotFoundException, lambda: Secret.get_info(info.secret_id), "get_info after destroy")
raises(SecretNotFoundException, lambda: Secret.get_info(info.name), "by name after destroy")
check(Secret.exists(info.secret_id) is False, "exists after destroy")
check(Secret.destroy(info.secret_id) is False, "second destroy")
r = raw("DELETE", f"/secrets/{made[1]}")
check(r.status_code == 204 and r.text == "", f"raw delete {r.status_code}")
check(len(Secret.list().next_items()) == 6, "the rest remain")
check(Secret.get_info(theirs.secret_id, api_key=OTHER).name == info.name, "theirs remains")
for sid in made[2:]:
    check(Secret.destroy(sid) is True, f"destroy {sid}")
check(Secret.destroy(theirs.secret_id, api_key=OTHER) is True, "theirs destroyed by them")

raises(AuthenticationException, lambda: Secret.list(api_key="wrong").next_items(), "wrong key")
_checks.passed()

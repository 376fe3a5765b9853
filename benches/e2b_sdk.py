"""The E2B Python SDK's cost over torpor's own API, in one run: driven by
benches/e2b.rs (which starts `torpor serve` and waits for the template) with
E2B_API_URL, E2B_SANDBOX_URL and E2B_API_KEY set; argv: template, rounds.

Each round, through the SDK and then through /v1 with a plain HTTP client
(urllib, the same process): create -> first `echo` -> kill, and pause ->
connect -> first `echo` on a sandbox that ran a command before. Prints one
JSON object per sample, `{"op": ..., "client": "sdk"|"v1", "ms": ...}`; the
Rust side makes the table.
"""

import json
import os
import sys
import time
import urllib.request

from e2b import Sandbox

TEMPLATE = sys.argv[1]
ROUNDS = int(sys.argv[2])
URL = os.environ["E2B_API_URL"]
KEY = os.environ["E2B_API_KEY"]
# The nested pod is slow (TCG): generous limits, never hit in a good run.
LIMIT = 600


def sample(op, client, t0):
    ms = (time.perf_counter() - t0) * 1000
    print(json.dumps({"op": op, "client": client, "ms": round(ms, 3)}), flush=True)


def v1(method, path, body=None):
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(URL + path, data=data, method=method)
    req.add_header("Authorization", f"Bearer {KEY}")
    if data is not None:
        req.add_header("Content-Type", "application/json")
    with urllib.request.urlopen(req, timeout=LIMIT) as r:
        text = r.read()
    return json.loads(text) if text else None


def v1_echo(sid):
    out = v1("POST", f"/v1/sandboxes/{sid}/exec", {"argv": ["echo", "hi"]})
    assert out["exit_code"] == 0 and out["stdout"] == "hi\n", out


def sdk_round():
    t0 = time.perf_counter()
    sbx = Sandbox.create(template=TEMPLATE, timeout=LIMIT, request_timeout=LIMIT)
    sample("create", "sdk", t0)
    t1 = time.perf_counter()
    assert sbx.commands.run("echo hi").stdout == "hi\n"
    sample("first echo", "sdk", t1)
    sbx.kill()
    sample("create -> echo -> kill", "sdk", t0)

    sbx = Sandbox.create(template=TEMPLATE, timeout=LIMIT, request_timeout=LIMIT)
    sbx.commands.run("true")
    t0 = time.perf_counter()
    assert sbx.pause()
    sample("pause", "sdk", t0)
    t1 = time.perf_counter()
    again = Sandbox.connect(sbx.sandbox_id, timeout=LIMIT)
    assert again.commands.run("echo hi").stdout == "hi\n"
    sample("connect -> echo", "sdk", t1)
    again.kill()


def v1_round():
    t0 = time.perf_counter()
    sid = v1("POST", "/v1/sandboxes", {"template": TEMPLATE})["id"]
    sample("create", "v1", t0)
    t1 = time.perf_counter()
    v1_echo(sid)
    sample("first echo", "v1", t1)
    v1("DELETE", f"/v1/sandboxes/{sid}")
    sample("create -> echo -> kill", "v1", t0)

    sid = v1("POST", "/v1/sandboxes", {"template": TEMPLATE})["id"]
    v1("POST", f"/v1/sandboxes/{sid}/exec", {"argv": ["true"]})
    t0 = time.perf_counter()
    v1("POST", f"/v1/sandboxes/{sid}/hibernate")
    sample("pause", "v1", t0)
    t1 = time.perf_counter()
    v1("POST", f"/v1/sandboxes/{sid}/connect")
    v1_echo(sid)
    sample("connect -> echo", "v1", t1)
    v1("DELETE", f"/v1/sandboxes/{sid}")


for _ in range(ROUNDS):
    sdk_round()
    v1_round()
print(json.dumps({"done": ROUNDS}), flush=True)

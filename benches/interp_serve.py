"""The code interpreter through `torpor serve` (issue 27's bench), driven by
benches/e2b.rs --interp (which starts serve and waits for
`code-interpreter-v1` in the nested pod) with only E2B_API_URL,
E2B_SANDBOX_URL and E2B_API_KEY set, as an agent runs the official
e2b-code-interpreter SDK; argv: rounds, calls.

Samples, one JSON object per line (`{"op", "client", "ms"}`; the Rust side
makes the table):
- `create -> first run_code` (sdk), `rounds` times: `Sandbox.create()` with
  the SDK's default template until `run_code("1+1")` answers 2, then kill;
- `run_code("1+1")` (sdk), `calls` round trips on one sandbox;
- the interpreter's `GET /health` through serve's guest-port router by
  E2B's headers (proxy), `calls` times: a guest port's round trip;
- envd's own round trip on the same sandbox (envd): `files.read` of a
  small file (serve's envd, the agent, the guest's file), `calls` times.
"""

import json
import os
import sys
import time

import httpx
from e2b_code_interpreter import Sandbox

ROUNDS = int(sys.argv[1])
CALLS = int(sys.argv[2])
URL = os.environ["E2B_SANDBOX_URL"]
# The nested pod runs its guests under TCG: generous limits, never hit in
# a good run.
CONTROL = 900
CALL = 300


def sample(op, client, t0):
    ms = (time.perf_counter() - t0) * 1000
    print(json.dumps({"op": op, "client": client, "ms": round(ms, 3)}), flush=True)


def two(sbx):
    result = sbx.run_code("1+1", timeout=CALL)
    assert result.error is None, result.error
    assert result.text == "2", result.text


for _ in range(ROUNDS):
    t0 = time.perf_counter()
    sbx = Sandbox.create(timeout=CONTROL, request_timeout=CONTROL)
    two(sbx)
    sample("create -> first run_code", "sdk", t0)
    sbx.kill()

sbx = Sandbox.create(timeout=CONTROL, request_timeout=CONTROL)
two(sbx)
for _ in range(CALLS):
    t0 = time.perf_counter()
    two(sbx)
    sample('run_code("1+1")', "sdk", t0)

headers = {"E2b-Sandbox-Id": sbx.sandbox_id, "E2b-Sandbox-Port": "49999"}
if sbx.traffic_access_token:
    headers["E2B-Traffic-Access-Token"] = sbx.traffic_access_token
with httpx.Client(timeout=CALL) as client:
    for _ in range(CALLS):
        t0 = time.perf_counter()
        answer = client.get(f"{URL}/health", headers=headers)
        assert answer.status_code == 200, (answer.status_code, answer.text)
        sample("guest port: the interpreter's GET /health", "proxy", t0)

sbx.files.write("/tmp/bench.txt", "x")
for _ in range(CALLS):
    t0 = time.perf_counter()
    assert sbx.files.read("/tmp/bench.txt", request_timeout=CALL) == "x"
    sample("envd: files.read of 1 byte", "envd", t0)
sbx.kill()
print(json.dumps({"done": True}), flush=True)

"""The code interpreter server's own costs through the official
e2b-code-interpreter SDK, driven by benches/interp.rs against the server on
loopback (E2B_SANDBOX_URL set to it). argv[1]: rounds. Prints one JSON line
per sample ({"op", "client", "ms"}), then {"done": true}. Clients: "sdk"
(the SDK's run_code and context calls) and "http" (the same request with a
bare httpx client, the floor under the SDK).
"""

import json
import os
import sys
import time

import httpx
from e2b import ConnectionConfig
from e2b_code_interpreter import Sandbox
from packaging.version import Version

ROUNDS = int(sys.argv[1])
URL = os.environ["E2B_SANDBOX_URL"]
sbx = Sandbox(
    sandbox_id="interp-bench",
    sandbox_domain=None,
    envd_version=Version("0.2.0"),
    envd_access_token=None,
    traffic_access_token=None,
    connection_config=ConnectionConfig(request_timeout=120),
)
http = httpx.Client(timeout=120)


def sample(op, client, f):
    start = time.perf_counter()
    f()
    print(json.dumps({"op": op, "client": client, "ms": (time.perf_counter() - start) * 1000}), flush=True)


def sdk_one_plus_one():
    assert sbx.run_code("1+1").text == "2"


def http_one_plus_one():
    lines = http.post(f"{URL}/execute", json={"code": "1+1"}).text.splitlines()
    assert any('"text": "2"' in line for line in lines), lines


def context_round_trip():
    ctx = sbx.create_code_context()
    sbx.remove_code_context(ctx)


def bash_echo():
    assert sbx.run_code("echo 2", language="bash").logs.stdout == ["2\n"]


def plot():
    r = sbx.run_code("import matplotlib.pyplot as plt\nplt.plot([1, 2, 3])\nplt.show()")
    assert any(res.png for res in r.results), r


def frame():
    r = sbx.run_code("import pandas as pd\npd.DataFrame({'a': range(100)})")
    assert r.results and r.results[0].html, r


# Warm-up: the default contexts and the imports exist before timing.
sdk_one_plus_one()
bash_echo()
plot()
frame()
for _ in range(ROUNDS):
    sample("run_code 1+1", "sdk", sdk_one_plus_one)
    sample("run_code 1+1", "http", http_one_plus_one)
    sample("run_code bash echo", "sdk", bash_echo)
    sample("matplotlib figure -> PNG", "sdk", plot)
    sample("DataFrame -> HTML", "sdk", frame)
for _ in range(max(1, ROUNDS // 10)):
    sample("create + remove a context (kernel start)", "sdk", context_round_trip)
print(json.dumps({"done": True}), flush=True)

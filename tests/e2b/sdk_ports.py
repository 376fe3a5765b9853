"""A guest port through the real Python SDK (`e2b`, pinned in scripts/setup
test): `python3 -m http.server` started with `commands.run(background=True)`
in the sandbox, fetched both ways the SDKs address a port: E2B's headers to
E2B_SANDBOX_URL (what the code interpreter SDKs do) and the host name
`sandbox.get_host(port)` (sent as the Host header to the same address, so
that no DNS is needed). Run by api/tests/http_e2b_sdk.rs against a probe
sandbox whose agent is a real one on this host (the "guest" is the host),
and by tests/nested_pod.rs and tests/nested_builds.rs against `base`
(E2B_TEST_TEMPLATE). argv[1]: a scratch directory (on the host agent,
where the server's files go).
Exits non-zero on the first failed check.
"""

import importlib.metadata
import os
import socket
import sys
import time

import httpx
from checks import Checks
from e2b import Sandbox

TEMPLATE = os.environ.get("E2B_TEST_TEMPLATE", "probe")
SCRATCH = sys.argv[1] if len(sys.argv) > 1 else "/tmp"
URL = os.environ["E2B_SANDBOX_URL"]
_checks = Checks("sdk-ports")
check, raises = _checks.check, _checks.raises
print(f"sdk-ports: version {importlib.metadata.version('e2b')}", flush=True)


def free_port():
    # In a guest any port is free; on the host agent, one nobody holds.
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


sbx = Sandbox.create(
    template=TEMPLATE,
    metadata={"agent": "real"} if TEMPLATE == "probe" else {},
    request_timeout=300,
)
token = sbx.traffic_access_token
check(isinstance(token, str) and len(token) == 32, f"trafficAccessToken {token!r}")
port = free_port()
root = f"{SCRATCH}/www-{port}"
sbx.files.write(f"{root}/index.html", "hello from the guest\n")
server = sbx.commands.run(
    f"python3 -m http.server {port} --bind 127.0.0.1 --directory {root}",
    background=True,
)

by_headers = {
    "E2b-Sandbox-Id": sbx.sandbox_id,
    "E2b-Sandbox-Port": str(port),
    "E2B-Traffic-Access-Token": token,
}
answer = None
for _ in range(200):
    answer = httpx.get(f"{URL}/index.html", headers=by_headers, timeout=30)
    if answer.status_code != 502:
        break
    # 502 "port is not open" until the server listens.
    time.sleep(0.1)
check(answer.status_code == 200, f"by headers: {answer.status_code} {answer.text}")
check(answer.text == "hello from the guest\n", f"by headers: {answer.text!r}")

host = sbx.get_host(port)
check(host == f"{port}-{sbx.sandbox_id}.localhost", f"get_host: {host}")
answer = httpx.get(
    f"{URL}/index.html",
    headers={"Host": host, "E2B-Traffic-Access-Token": token},
    timeout=30,
)
check(answer.status_code == 200, f"by host: {answer.status_code} {answer.text}")
check(answer.text == "hello from the guest\n", f"by host: {answer.text!r}")

# Without a token: E2B's 403; another port: not open.
answer = httpx.get(f"{URL}/", headers={"Host": host}, timeout=30)
check(answer.status_code == 403, f"no token: {answer.status_code}")
closed = dict(by_headers, **{"E2b-Sandbox-Port": str(free_port())})
answer = httpx.get(f"{URL}/", headers=closed, timeout=30)
check(answer.status_code == 502, f"closed port: {answer.status_code}")
check("port is not open" in answer.json()["message"], f"closed port: {answer.text}")

server.kill()
sbx.kill()
_checks.passed()

"""E2B's `volumeMounts` through the real Python SDK (`e2b`, pinned in
scripts/setup test) against a Linux template (`E2B_TEST_TEMPLATE`: `base`
in the nested pod): a `Volume` made and written through E2B's volume API
is mounted in a sandbox (`volume_mounts`), read and written there as the
SDK's default user, seen back through the API, and kept across
pause -> connect together with a background process whose working
directory is in it and a file the API wrote while the sandbox was paused.
Run by tests/nested_pod.rs with E2B_API_URL, E2B_API_KEY and
E2B_VOLUME_API_URL set; exits non-zero on the first failed check.
"""

import importlib.metadata
import os
import uuid

from checks import Checks
from e2b import Sandbox, Volume

TEMPLATE = os.environ.get("E2B_TEST_TEMPLATE", "base")
_checks = Checks("e2b-volume-mounts")
check = _checks.check

print(f"e2b-volume-mounts: version {importlib.metadata.version('e2b')}")
run = uuid.uuid4().hex[:8]
vol = Volume.create(f"mnt-{run}")
vol.write_file("/hello.txt", "from the API")
sbx = Sandbox.create(template=TEMPLATE, volume_mounts={"/mnt/data": vol}, timeout=900)
try:
    out = sbx.commands.run("cat /mnt/data/hello.txt", timeout=120).stdout
    check(out == "from the API", f"the sandbox reads the volume: {out!r}")
    sbx.commands.run(
        "echo from-the-sandbox > /mnt/data/guest.txt && mkdir -p /mnt/data/d", timeout=120
    )
    got = vol.read_file("/guest.txt")
    check(got == "from-the-sandbox\n", f"the API reads what the sandbox wrote: {got!r}")
    owner = sbx.commands.run("stat -c %u:%g /mnt/data/guest.txt", timeout=120).stdout.strip()
    check(owner == "1000:1000", f"files are the sandbox user's: {owner}")
    bg = sbx.commands.run("cd /mnt/data/d && exec sleep 3600", background=True)
    sbx.pause()
    vol.write_file("/later.txt", "while paused\n")
    sbx = Sandbox.connect(sbx.sandbox_id, timeout=900)
    out = sbx.commands.run("cat /mnt/data/later.txt /mnt/data/guest.txt", timeout=120).stdout
    check(out == "while paused\nfrom-the-sandbox\n", f"after pause -> connect: {out!r}")
    cwd = sbx.commands.run(f"readlink /proc/{bg.pid}/cwd", timeout=120).stdout.strip()
    check(cwd == "/mnt/data/d", f"a process's working directory in the volume: {cwd!r}")
finally:
    sbx.kill()
    Volume.destroy(vol.volume_id)

_checks.passed()

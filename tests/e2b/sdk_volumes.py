"""E2B's volumes through the real Python SDK (`e2b`, pinned in
scripts/setup test), against `torpor serve` on loopback. Run by
tests/e2b_sdk.rs with E2B_API_URL, E2B_API_KEY and E2B_VOLUME_API_URL set
(the volume content API is the API's own listener), E2B_OTHER_KEY (another
tenant's key) and TORPOR_VOLUMES_DIR (the server's volumes directory, where
this script plants a symbolic link the API itself cannot make); exits
non-zero on the first failed check.
"""

import hashlib
import importlib.metadata
import io
import os
import sys
import time
import uuid

from checks import Checks
from e2b import Sandbox, Volume
from e2b.exceptions import (
    AuthenticationException,
    NotFoundException,
    VolumeException,
    VolumeNotFoundException,
    VolumePathNotFoundException,
)

OTHER_KEY = os.environ["E2B_OTHER_KEY"]
VOLUMES_DIR = os.environ["TORPOR_VOLUMES_DIR"]
_checks = Checks("e2b-volumes")
check, raises = _checks.check, _checks.raises


print(f"e2b-volumes: version {importlib.metadata.version('e2b')}")
run = uuid.uuid4().hex[:8]

# create, list, get_info, connect
vol = Volume.create(f"data-{run}")
check(vol.name == f"data-{run}" and vol.volume_id and vol.token, f"created {vol.volume_id}")
raises(VolumeException, lambda: Volume.create(f"data-{run}"), "a second volume of the name", "409")
raises(VolumeException, lambda: Volume.create("no/slash"), "a bad name", "400")
listed = Volume.list()
check(any(v.volume_id == vol.volume_id and v.name == vol.name for v in listed), f"listed {listed}")
info = Volume.get_info(vol.volume_id)
check((info.volume_id, info.name, info.token) == (vol.volume_id, vol.name, vol.token), f"get_info {info}")
same = Volume.connect(vol.volume_id)
check(same.token == vol.token and same.name == vol.name, "connect carries the token")
raises(VolumeNotFoundException, lambda: Volume.get_info("vol_000000000000000000000000"), "unknown volume")

# Another tenant sees none of it.
check(all(v.volume_id != vol.volume_id for v in Volume.list(api_key=OTHER_KEY)), "hidden from another tenant's list")
raises(VolumeNotFoundException, lambda: Volume.get_info(vol.volume_id, api_key=OTHER_KEY), "another tenant's get_info")
raises(VolumeNotFoundException, lambda: Volume.connect(vol.volume_id, api_key=OTHER_KEY), "another tenant's connect")
check(Volume.destroy(vol.volume_id, api_key=OTHER_KEY) is False, "another tenant's destroy is not found")
theirs = Volume.create(f"data-{run}", api_key=OTHER_KEY)  # names are per tenant
check(theirs.volume_id != vol.volume_id, "another tenant may use the name")
# At most 3 volumes per tenant (serve --volumes-per-tenant 3).
extra = [Volume.create(f"extra-{i}-{run}") for i in range(2)]
raises(VolumeException, lambda: Volume.create(f"one-too-many-{run}"), "past the tenant's volume count", "400")
for e in extra:
    check(Volume.destroy(e.volume_id), "destroy an extra volume")

# Directories, files, metadata.
made = same.make_dir("/docs")
check((made.type.value, made.path, made.name, made.mode) == ("directory", "/docs", "docs", 0o755), f"make_dir {made}")
raises(VolumeException, lambda: same.make_dir("/docs"), "make_dir of an existing directory", "409")
raises(VolumePathNotFoundException, lambda: same.make_dir("/a/b/c"), "make_dir without its parents")
deep = same.make_dir("/a/b/c", force=True)
check(deep.path == "/a/b/c", f"make_dir force {deep}")
w = vol.write_file("/docs/hello.txt", "Hello, volume!")
check((w.type.value, w.size, w.mode, w.path) == ("file", 14, 0o644, "/docs/hello.txt"), f"write_file {w}")
check(vol.read_file("/docs/hello.txt") == "Hello, volume!", "read_file text")
check(vol.read_file("docs/hello.txt", format="bytes") == b"Hello, volume!", "read_file bytes, relative path")
raises(VolumeException, lambda: vol.write_file("/docs/hello.txt", "again"), "write over a file without force", "409")
vol.write_file("/docs/hello.txt", "Replaced", force=True)
check(vol.read_file("/docs/hello.txt") == "Replaced", "write with force replaces")
raises(VolumePathNotFoundException, lambda: vol.write_file("/nope/x.txt", "x"), "write into a missing directory")
owned = vol.write_file("/docs/owned.bin", b"\x00\x01\x02", uid=1000, gid=1000, mode=0o600)
check((owned.uid, owned.gid, owned.mode, owned.size) == (1000, 1000, 0o600, 3), f"write_file metadata {owned}")

# Multi-MiB files: bytes and streamed, both ways.
big = os.urandom(8 << 20) + b"tail"
digest = hashlib.sha256(big).hexdigest()
t0 = time.monotonic()
vol.write_file("/big.bin", big)
t1 = time.monotonic()
back = vol.read_file("/big.bin", format="bytes")
t2 = time.monotonic()
check(hashlib.sha256(back).hexdigest() == digest, "8 MiB bytes round trip")
print(f"e2b-volumes: 8 MiB write {len(big) / (t1 - t0) / 2**20:.0f} MiB/s, read {len(big) / (t2 - t1) / 2**20:.0f} MiB/s")
vol.write_file("/big-stream.bin", io.BytesIO(big))
h = hashlib.sha256()
chunks = 0
for chunk in vol.read_file("/big-stream.bin", format="stream"):
    h.update(chunk)
    chunks += 1
check(h.hexdigest() == digest and chunks > 1, f"8 MiB streamed round trip in {chunks} chunks")
# Past the volume's 64 MiB (serve --volume-max-mib 64): 413 midway, the
# partial file removed, the volume's other files kept.
raises(VolumeException, lambda: vol.write_file("/huge.bin", io.BytesIO(bytes(60 << 20))), "past the volume's size", "413")
check(not vol.exists("/huge.bin") and vol.exists("/big.bin"), "nothing left of the refused write")
vol.write_file("/text-stream.txt", io.StringIO("streamed text"))
check(vol.read_file("/text-stream.txt") == "streamed text", "text IO write")
vol.write_file("/empty.txt", "")
check(vol.read_file("/empty.txt") == "", "empty file")

# Listing, exists, get_info, update_metadata.
top = {e.path: e for e in vol.list("/")}
check(set(top) >= {"/docs", "/a", "/big.bin", "/empty.txt"} and "/a/b" not in top, f"list / {sorted(top)}")
check(top["/big.bin"].size == len(big) and top["/docs"].type.value == "directory", "list sizes and types")
check("/a/b/c" in {e.path for e in vol.list("/", depth=3)}, "list depth 3")
check([e.name for e in vol.list("/docs")] == ["hello.txt", "owned.bin"], "list a directory")
raises(VolumePathNotFoundException, lambda: vol.list("/missing"), "list a missing directory")
check(vol.exists("/docs/hello.txt") and not vol.exists("/docs/nope"), "exists")
gi = vol.get_info("/docs/hello.txt")
check(gi.type.value == "file" and gi.size == 8 and gi.mtime.tzinfo is not None, f"get_info {gi}")
up = vol.update_metadata("/docs/hello.txt", uid=1001, gid=1002, mode=0o640)
check((up.uid, up.gid, up.mode) == (1001, 1002, 0o640), f"update_metadata {up}")
check(vol.get_info("/docs/hello.txt").mode == 0o640, "metadata kept")
raises(VolumeException, lambda: vol.update_metadata("/docs/hello.txt", mode=0o4755), "a set-uid mode", "400")
raises(VolumePathNotFoundException, lambda: vol.update_metadata("/docs/nope", mode=0o600), "update_metadata of nothing")

# Paths never leave the volume.
raises(VolumeException, lambda: vol.read_file("../x"), "`../x`", "400")
raises(VolumeException, lambda: vol.write_file("/docs/../../escape", "x"), "`..` in a write", "400")
raises(VolumeException, lambda: vol.list("/.."), "`/..`", "400")
raises(VolumePathNotFoundException, lambda: vol.read_file("/etc/passwd"), "/etc/passwd is the volume's own (absent)")
# The API makes no symbolic link; one planted in the volume's directory
# (as a sandbox mounting it could) is never followed.
content = os.path.join(VOLUMES_DIR, vol.volume_id, "content")
check(os.path.isdir(content), f"the volume's directory {content}")
os.symlink("/etc", os.path.join(content, "hostetc"))
os.symlink("/etc/passwd", os.path.join(content, "passwd"))
link = vol.get_info("/hostetc")
check(link.type.value == "symlink" and link.target == "/etc", f"a link shows as one {link}")
raises(VolumeException, lambda: vol.read_file("/hostetc/passwd"), "read through a link", "symbolic link")
raises(VolumeException, lambda: vol.read_file("/passwd"), "read a link", "symbolic link")
raises(VolumeException, lambda: vol.list("/hostetc"), "list through a link", "symbolic link")
raises(VolumeException, lambda: vol.write_file("/hostetc/torpor-escape", "x"), "write through a link", "symbolic link")
raises(VolumeException, lambda: vol.make_dir("/hostetc/d", force=True), "make_dir through a link", "symbolic link")
raises(VolumeException, lambda: vol.update_metadata("/passwd", mode=0o777), "chmod a link", "symbolic link")
check(not os.path.exists("/etc/torpor-escape"), "nothing written on the host")
vol.remove("/hostetc")
check(os.path.isdir("/etc") and not vol.exists("/hostetc"), "removing a link removes the link only")

# Tokens: another volume's does not open this one, nor none.
raises(AuthenticationException, lambda: vol.read_file("/docs/hello.txt", token=theirs.token), "another volume's token")
raises(AuthenticationException, lambda: Volume(vol.volume_id, vol.name, token="vtok_nope").list("/"), "a wrong token")
raises(AuthenticationException, lambda: theirs.list("/", token=vol.token), "this volume's token on theirs")

# remove
vol.remove("/a")
check(not vol.exists("/a/b/c") and not vol.exists("/a"), "remove a tree")
raises(VolumePathNotFoundException, lambda: vol.remove("/a"), "remove twice")

# volumeMounts: an unknown volume is 404; a known one mounts only into a
# Linux sandbox (the probe has no agent to mount it: 400 saying so).
raises(Exception, lambda: Sandbox.create(template="probe", volume_mounts={"/mnt/x": "no-such-volume"}), "mount an unknown volume", "404")
raises(Exception, lambda: Sandbox.create(template="probe", volume_mounts={"/mnt/data": vol}), "mount a volume into a probe", "Linux")

# destroy
check(Volume.destroy(vol.volume_id) is True, "destroy")
check(not os.path.exists(os.path.join(VOLUMES_DIR, vol.volume_id)), "its directory is gone")
check(Volume.destroy(vol.volume_id) is False, "destroy twice")
raises(AuthenticationException, lambda: vol.read_file("/big.bin"), "a destroyed volume's token")
check(all(v.volume_id != vol.volume_id for v in Volume.list()), "gone from the list")
check(Volume.destroy(theirs.volume_id, api_key=OTHER_KEY) is True, "the other tenant destroys its own")

_checks.passed()

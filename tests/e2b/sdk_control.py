"""The E2B control plane through the real Python SDK (`e2b`, pinned in
scripts/setup test), against `torpor serve` on loopback with the probe template (no
guest agent: control plane only), or another (E2B_TEST_TEMPLATE: the
nested pod's `base` in tests/nested_pod.rs). Run by tests/e2b_sdk.rs with
E2B_API_URL, E2B_API_KEY and E2B_SANDBOX_URL set; exits non-zero on the
first failed check.
"""

import datetime
import importlib.metadata
import os
import sys
import time
import uuid

import httpx

from checks import Checks
from e2b import Sandbox, SandboxQuery, SandboxState
from e2b.exceptions import (
    AuthenticationException,
    InvalidArgumentException,
    NotFoundException,
    SandboxException,
)

TEMPLATE = os.environ.get("E2B_TEST_TEMPLATE", "probe")
_checks = Checks("e2b-sdk")
check, raises = _checks.check, _checks.raises


print(f"e2b-sdk: version {importlib.metadata.version('e2b')}")
run = uuid.uuid4().hex[:8]

# create, get_info
sbx = Sandbox.create(template=TEMPLATE, timeout=120, metadata={"run": run, "role": "main"})
check(sbx.sandbox_id.startswith("sbx_"), f"sandbox id {sbx.sandbox_id}")
info = sbx.get_info()
check(info.sandbox_id == sbx.sandbox_id, "get_info id")
check(info.state == SandboxState.RUNNING, f"state {info.state}")
check(info.metadata == {"run": run, "role": "main"}, f"metadata {info.metadata}")
check(info.name == TEMPLATE, f"template name {info.name}")
lifetime = (info.end_at - info.started_at).total_seconds()
check(119 <= lifetime <= 121, f"end_at - started_at = {lifetime}")

# envd's /health through E2B_SANDBOX_URL
check(sbx.is_running() is True, "is_running while running")

# set_timeout moves end_at to `timeout` s from now
sbx.set_timeout(30)
left = (Sandbox.get_info(sbx.sandbox_id).end_at.timestamp() - time.time())
check(20 <= left <= 31, f"after set_timeout(30): {left} s left")
sbx.set_timeout(300)

# metrics of a running sandbox: its pod's history, oldest first
created = info.started_at
metrics = sbx.get_metrics()
check(len(metrics) >= 1 and metrics[-1].mem_used > 0, f"metrics {metrics}")
check(
    all(m.cpu_count >= 1 and m.mem_total > 0 and m.cpu_used_pct >= 0 for m in metrics),
    f"metric fields {metrics}",
)
stamps = [m.timestamp for m in metrics]
check(stamps == sorted(stamps), f"metrics oldest first {stamps}")
now = datetime.datetime.now(datetime.timezone.utc)
ranged = sbx.get_metrics(start=created - datetime.timedelta(seconds=5), end=now)
check(len(ranged) >= 1, f"metrics from its start to now {ranged}")
check(
    all(created.timestamp() - 10 <= m.timestamp.timestamp() <= now.timestamp() + 10 for m in ranged),
    f"metrics within the range {ranged}",
)
before = sbx.get_metrics(
    start=created - datetime.timedelta(hours=1), end=created - datetime.timedelta(minutes=30)
)
check(before == [], f"no metrics before the sandbox {before}")
raises(
    SandboxException,
    lambda: sbx.get_metrics(start=now, end=now - datetime.timedelta(hours=1)),
    "metrics with start after end",
)

# list with a metadata filter and paging
others = [
    Sandbox.create(template=TEMPLATE, timeout=300, metadata={"run": run, "role": "worker"})
    for _ in range(2)
]
Sandbox.create(template=TEMPLATE, timeout=60, metadata={"run": "other"}).kill()
paginator = Sandbox.list(query=SandboxQuery(metadata={"run": run}), limit=2)
seen, pages = [], 0
while paginator.has_next:
    items = paginator.next_items()
    check(len(items) <= 2, f"page of {len(items)}")
    seen += [s.sandbox_id for s in items]
    pages += 1
check(pages == 2, f"{pages} pages")
made = [sbx.sandbox_id] + [o.sandbox_id for o in others]
check(seen == made[::-1], f"listed newest first {seen}, made {made}")
# order="asc": oldest first; its token is bound to its order
asc = Sandbox.list(query=SandboxQuery(metadata={"run": run}), limit=2, order="asc")
first = [s.sandbox_id for s in asc.next_items()]
check(first == made[:2], f"asc first page {first}")
check(asc.has_next and asc.next_token, "asc has a next page")
raises(
    SandboxException,
    lambda: Sandbox.list(
        query=SandboxQuery(metadata={"run": run}), limit=2, next_token=asc.next_token
    ).next_items(),
    "an asc token replayed newest first (400)",
)
rest = [s.sandbox_id for s in asc.next_items()]
check(rest == made[2:] and not asc.has_next, f"asc second page {rest}")
workers = Sandbox.list(query=SandboxQuery(metadata={"run": run, "role": "worker"})).next_items()
check(len(workers) == 2, f"workers {workers}")

# the ports' network settings: kept and shown as E2B's API does
masked = Sandbox.create(
    template=TEMPLATE,
    timeout=60,
    metadata={"run": run, "role": "masked"},
    network={"allow_public_traffic": False, "mask_request_host": "localhost:${PORT}"},
)
net = masked.get_info().network or {}
check(
    net.get("mask_request_host") == "localhost:${PORT}" and net.get("allow_public_traffic") is False,
    f"masked sandbox's network {net}",
)
masked.kill()
raises(
    SandboxException,
    lambda: Sandbox.create(template=TEMPLATE, network={"mask_request_host": "not a host"}),
    "a mask that is not a host (400)",
    contains="400: mask request host is not valid: not a host",
)

# pause (hibernation) -> 409 on the second -> connect wakes it
check(sbx.pause() is True, "pause")
check(Sandbox.get_info(sbx.sandbox_id).state == SandboxState.PAUSED, "paused state")
check(Sandbox.pause(sbx.sandbox_id) is False, "second pause answers already paused (409)")
check(sbx.is_running() is False, "is_running while paused")
paused = Sandbox.list(
    query=SandboxQuery(metadata={"run": run}, state=[SandboxState.PAUSED])
).next_items()
check([s.sandbox_id for s in paused] == [sbx.sandbox_id], f"paused list {paused}")
paused_at = datetime.datetime.now(datetime.timezone.utc)
held = sbx.get_metrics()
check(
    all(m.timestamp <= paused_at for m in held),
    f"no new metrics while paused {held}",
)
same = Sandbox.connect(sbx.sandbox_id, timeout=600)
check(same.sandbox_id == sbx.sandbox_id, "connect id")
check(sbx.get_info().state == SandboxState.RUNNING, "running after connect")
check(sbx.beta_pause() is True, "beta_pause")
sbx.connect()
check(sbx.get_info().state == SandboxState.RUNNING, "running after instance connect")

# A filesystem-only snapshot (the disk only): a sandbox made from it boots
# from that disk and answers; the source runs on; the same answer's shape
# as a full one's.
fs_snap = sbx.create_snapshot(mode="filesystem")
check(fs_snap.snapshot_id.startswith("tpl_"), f"filesystem snapshot {fs_snap}")
check(
    len(fs_snap.names) == 1 and fs_snap.names[0].startswith(sbx.sandbox_id),
    f"filesystem snapshot names {fs_snap.names}",
)
check(sbx.get_info().state == SandboxState.RUNNING, "source running after its snapshot")
booted = Sandbox.create(template=fs_snap.snapshot_id, timeout=60)
check(booted.sandbox_id != sbx.sandbox_id, "a new sandbox from the disk")
check(booted.get_info().state == SandboxState.RUNNING, "sandbox from a filesystem snapshot")
check(booted.is_running() is True, "it answers")
listed = [s.snapshot_id for s in Sandbox.list_snapshots(sandbox_id=sbx.sandbox_id).next_items()]
check(listed == [fs_snap.snapshot_id], f"filesystem snapshot listed {listed}")
booted.kill()
check(Sandbox.delete_snapshot(fs_snap.snapshot_id) is True, "delete filesystem snapshot")
check(Sandbox.delete_snapshot(fs_snap.snapshot_id) is False, "filesystem snapshot gone")
# An unknown mode: the SDK refuses it; the API answers a bad `memory` with a
# 400 that names it, and takes nothing.
raises(
    InvalidArgumentException,
    lambda: sbx.create_snapshot(mode="disk"),
    "unknown snapshot mode refused by the SDK",
)
bad = httpx.post(
    f"{os.environ['E2B_API_URL']}/sandboxes/{sbx.sandbox_id}/snapshots",
    headers={"X-API-KEY": os.environ["E2B_API_KEY"]},
    json={"memory": "filesystem"},
)
check(
    bad.status_code == 400 and "memory" in bad.json()["message"],
    f"a bad memory value: {bad.status_code} {bad.text}",
)
check(
    Sandbox.list_snapshots(sandbox_id=sbx.sandbox_id).next_items() == [],
    "no snapshot taken for it",
)
# snapshot -> create from it -> list -> delete
snap = sbx.create_snapshot(mode="full")
check(snap.snapshot_id.startswith("tpl_"), f"snapshot {snap}")
snaps = Sandbox.list_snapshots(sandbox_id=sbx.sandbox_id).next_items()
check([s.snapshot_id for s in snaps] == [snap.snapshot_id], f"snapshots {snaps}")
restored = Sandbox.create(template=snap.snapshot_id, timeout=60)
check(restored.get_info().state == SandboxState.RUNNING, "sandbox from a snapshot")
restored.kill()
check(Sandbox.delete_snapshot(snap.snapshot_id) is True, "delete snapshot")
check(Sandbox.delete_snapshot(snap.snapshot_id) is False, "snapshot gone")

# fork with a count
forks = sbx.fork(count=2, timeout=60)
check(len(forks) == 2, f"forks {forks}")
for f in forks:
    check(isinstance(f, Sandbox), f"fork result {f!r}")
    check(f.get_info().metadata == {"run": run, "role": "main"}, "fork keeps metadata")
    f.kill()

# envs are stored (applied to commands: tests/serve_service.rs); lifecycle
# on_timeout=pause is hibernation on timeout
auto = Sandbox.create(
    template=TEMPLATE, timeout=60, envs={"A": "b"}, lifecycle={"on_timeout": "pause"}
)
check(auto.get_info().lifecycle["on_timeout"] == "pause", f"lifecycle {auto.get_info().lifecycle}")
check(sbx.get_info().lifecycle["on_timeout"] == "kill", "default lifecycle")
auto.kill()

# kill, then the SDK's not-found paths
check(sbx.kill() is True, "kill")
check(Sandbox.kill(sbx.sandbox_id) is False, "second kill: not found")
check(sbx.is_running() is False, "is_running after kill")
raises(NotFoundException, lambda: Sandbox.get_info(sbx.sandbox_id), "get_info after kill")
raises(NotFoundException, lambda: Sandbox.connect(sbx.sandbox_id), "connect after kill")
raises(NotFoundException, lambda: Sandbox.set_timeout(sbx.sandbox_id, 10), "timeout after kill")
raises(NotFoundException, lambda: Sandbox.pause(sbx.sandbox_id), "pause after kill")
raises(SandboxException, lambda: Sandbox.create(template="no-such-template"), "unknown template")
raises(InvalidArgumentException, lambda: sbx.fork(count=0), "fork count 0")
raises(AuthenticationException, lambda: Sandbox.list(api_key="wrong").next_items(), "wrong key")
for o in others:
    o.kill()

_checks.passed()

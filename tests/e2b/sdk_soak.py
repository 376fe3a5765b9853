"""Pause -> connect soak of Linux sandboxes through the real Python SDK
(`e2b`, pinned in scripts/setup test): every cycle must find everything the
sandbox had before it intact. Run by tests/nested_pod.rs (bounded) and by
benches/e2b.rs `--soak` (full length) against `torpor serve` with E2B_API_URL,
E2B_API_KEY and E2B_SANDBOX_URL set.

argv: template, cycles, sandboxes (cycled side by side, a thread each).

Each sandbox starts with:
- a background process that appends a line to a log every 200 ms;
- a process holding a file open (fd 3) that it appends to on each line of
  its stdin, and answers from: an open file description kept across cycles;
- a PTY shell with a shell variable set in it (not in its environment);
- the envd access token, the sandbox's environment variable from create.

A cycle writes `cycle-N` (its own content), then hibernates the sandbox —
E2B's pause on even cycles, /v1's hibernate (what the idle policy does) on
odd ones — and wakes it: `Sandbox.connect` after a pause; after a
hibernate, the first envd call wakes it (as traffic does). It then checks:
every `cycle-K` file so far with its content, the background process alive
and its log still growing, the held file's process alive and writing
through the same open file, the PTY shell's variable, the environment
variable. Prints one JSON object per cycle
`{"sandbox": i, "cycle": n, "hibernate_ms", "wake_ms", "check_ms"}`,
and on the first failure a line starting `soak: FAILED` with what and why,
then exits non-zero.
"""

import importlib.metadata
import json
import os
import sys
import threading
import time
import urllib.request

import e2b
from e2b import Sandbox

TEMPLATE = sys.argv[1]
CYCLES = int(sys.argv[2])
SANDBOXES = int(sys.argv[3])
URL = os.environ["E2B_API_URL"]
KEY = os.environ["E2B_API_KEY"]
# The nested pod runs under TCG: generous, never reached in a good run.
LIMIT = 600
HOME = "/home/user/soak"
out_lock = threading.Lock()
failed = []
samples = []


def emit(obj):
    with out_lock:
        samples.append(obj)
        print(json.dumps(obj), flush=True)


class Failed(Exception):
    pass


def expect(cond, what):
    if not cond:
        raise Failed(what)


def v1(method, path):
    req = urllib.request.Request(URL + path, data=b"" if method == "POST" else None, method=method)
    req.add_header("Authorization", f"Bearer {KEY}")
    with urllib.request.urlopen(req, timeout=LIMIT) as r:
        return json.loads(r.read() or b"null")


def state(sid):
    return v1("GET", f"/v1/sandboxes/{sid}")["state"]


class Pty:
    """A PTY shell whose output is read on a thread of its own; each
    connection (the first, and one after every wake) gets a reader."""

    def __init__(self, sbx):
        self.seen = b""
        self.cond = threading.Condition()
        self.handle = sbx.pty.create(size=e2b.PtySize(rows=24, cols=120), cwd=HOME, timeout=0)
        self.pid = self.handle.pid
        self._read(self.handle)

    def _read(self, handle):
        def pump():
            try:
                for _, _, pty in handle:
                    if pty:
                        with self.cond:
                            self.seen += pty
                            self.cond.notify_all()
            except Exception:  # the stream ends when the sandbox sleeps
                pass

        threading.Thread(target=pump, daemon=True).start()

    def reconnect(self, sbx):
        self.handle = sbx.pty.connect(self.pid, timeout=0)
        self._read(self.handle)

    def ask(self, sbx, line, want, limit=120):
        with self.cond:
            start = len(self.seen)
        sbx.pty.send_stdin(self.pid, line.encode() + b"\n")
        deadline = time.monotonic() + limit
        with self.cond:
            while want.encode() not in self.seen[start:]:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise Failed(f"PTY never showed {want!r}: {self.seen[start:][-300:]!r}")
                self.cond.wait(left)


def soak(i):
    sbx = Sandbox.create(template=TEMPLATE, timeout=3600, envs={"SOAK_ENV": f"env-{i}"})
    sid = sbx.sandbox_id
    try:
        sbx.commands.run(f"mkdir -p {HOME}")
        ticker = sbx.commands.run(
            f"while :; do echo tick >> {HOME}/ticks; sleep 0.2; done",
            background=True,
            timeout=0,
        )
        holder = sbx.commands.run(
            f"exec 3>>{HOME}/held; while read l; do echo \"$l\" >&3; done",
            background=True,
            stdin=True,
            timeout=0,
        )
        pty = Pty(sbx)
        pty.ask(sbx, f"SOAK_VAR=pty-{i}; echo set-$SOAK_VAR", f"set-pty-{i}")
        for n in range(CYCLES):
            sbx.files.write(f"{HOME}/cycle-{n}", f"sandbox {i} cycle {n}")
            ticks_before = int(sbx.commands.run(f"wc -l < {HOME}/ticks").stdout.strip())
            t0 = time.perf_counter()
            if n % 2 == 0:
                expect(sbx.pause() is True, f"cycle {n}: pause answered False")
            else:
                v1("POST", f"/v1/sandboxes/{sid}/hibernate")
            hibernate_ms = (time.perf_counter() - t0) * 1000
            st = state(sid)
            expect(st == "hibernated", f"cycle {n}: state {st} after hibernating")
            t0 = time.perf_counter()
            if n % 2 == 0:
                sbx = Sandbox.connect(sid, timeout=3600)
                sbx.commands.run("true")
            else:
                sbx.commands.run("true")  # envd traffic wakes it
            wake_ms = (time.perf_counter() - t0) * 1000
            t0 = time.perf_counter()
            got = sbx.files.read(f"{HOME}/cycle-{n}")
            expect(got == f"sandbox {i} cycle {n}", f"cycle {n}: cycle-{n} holds {got!r}")
            pids = {p.pid for p in sbx.commands.list()}
            expect(ticker.pid in pids, f"cycle {n}: the background process is gone")
            expect(holder.pid in pids, f"cycle {n}: the file holder is gone")
            sbx.commands.send_stdin(holder.pid, f"held-{n}\n")
            # Every cycle's file, the environment, and (a moment later) the
            # ticker's log and the held file's last line, in one command.
            names = " ".join(f"cycle-{k}" for k in range(n + 1))
            got = sbx.commands.run(
                f"cd {HOME} && for f in {names}; do cat $f; echo; done; echo \"env $SOAK_ENV\"; "
                "sleep 0.5; echo \"ticks $(wc -l < ticks)\"; echo \"held $(tail -n 1 held)\""
            ).stdout
            want = "".join(f"sandbox {i} cycle {k}\n" for k in range(n + 1))
            expect(got.startswith(want), f"cycle {n}: the cycle files hold {got!r}")
            tail = dict(l.split(" ", 1) for l in got[len(want):].splitlines())
            expect(tail.get("env") == f"env-{i}", f"cycle {n}: SOAK_ENV is {tail.get('env')!r}")
            ticks = int(tail.get("ticks", "0"))
            expect(ticks > ticks_before, f"cycle {n}: the log stopped growing ({ticks})")
            deadline = time.monotonic() + 60
            held = tail.get("held")
            while held != f"held-{n}":
                expect(time.monotonic() < deadline, f"cycle {n}: the held file ends {held!r}")
                time.sleep(0.2)
                held = sbx.commands.run(f"tail -n 1 {HOME}/held").stdout.strip()
            pty.reconnect(sbx)
            pty.ask(sbx, "echo got-$SOAK_VAR", f"got-pty-{i}")
            check_ms = (time.perf_counter() - t0) * 1000
            emit(
                {
                    "sandbox": i,
                    "cycle": n,
                    "hibernate_ms": round(hibernate_ms, 1),
                    "wake_ms": round(wake_ms, 1),
                    "check_ms": round(check_ms, 1),
                }
            )
    except Exception as e:
        failed.append(f"sandbox {i} ({sid}): {type(e).__name__}: {e}")
    finally:
        try:
            Sandbox.kill(sid)
        except Exception:
            pass


def pct(values, p):
    values = sorted(values)
    return values[min(len(values) - 1, int(p / 100 * len(values)))] if values else 0


print(f"soak: version {importlib.metadata.version('e2b')}", flush=True)
threads = [threading.Thread(target=soak, args=(i,)) for i in range(SANDBOXES)]
for t in threads:
    t.start()
for t in threads:
    t.join()
for f in failed:
    print(f"soak: FAILED: {f}", file=sys.stderr, flush=True)
for key in ("hibernate_ms", "wake_ms", "check_ms"):
    values = [s[key] for s in samples]
    print(f"soak: {key} p50 {pct(values, 50):.0f} p99 {pct(values, 99):.0f} ({len(values)} cycles)")
print(f"soak: {len(samples)} passed, {len(failed)} failed", flush=True)
sys.exit(1 if failed or len(samples) != CYCLES * SANDBOXES else 0)

"""The official E2B code interpreter SDK (e2b-code-interpreter) through
`torpor serve`, as an agent runs it: only E2B_API_URL, E2B_SANDBOX_URL and
E2B_API_KEY set, `Sandbox.create()` with the SDK's default template
(`code-interpreter-v1`), every call through serve's API and port router to
the server in the sandbox (tests/nested_pod.rs, against the nested pod).

State across run_code calls, on_stdout, ZeroDivisionError by name, a
matplotlib PNG, a DataFrame as HTML, bash, a timeout then a working call,
pause -> Sandbox.connect -> a variable from before the pause, a
filesystem-only snapshot -> a sandbox from it (the file, a new boot id;
the source's unchanged), kill. Each
call is bounded by argv[1] seconds (default 120: the nested pod's guests run
under TCG). Prints "sdk-interp-serve: version X" (the e2b version),
"timing: NAME SECONDS" lines, one line per check, then
"sdk-interp-serve: N passed, M failed".
"""

import base64
import importlib.metadata
import statistics
import sys
import time

from e2b import TimeoutException
from e2b_code_interpreter import Sandbox

CALL = float(sys.argv[1]) if len(sys.argv) > 1 else 120.0
# Control-plane calls (create, pause, connect: a snapshot of 1 GiB under
# TCG) get longer.
CONTROL = 600.0
print(f"sdk-interp-serve: version {importlib.metadata.version('e2b')}")
print(f"sdk-interp-serve: e2b-code-interpreter {importlib.metadata.version('e2b-code-interpreter')}")

passed = 0
failed = 0


def check(name, f):
    global passed, failed
    try:
        f()
        passed += 1
        print(f"ok {name}", flush=True)
    except Exception as e:  # noqa: BLE001 - report every failure
        failed += 1
        print(f"FAILED {name}: {type(e).__name__}: {e}", flush=True)


def timing(name, seconds):
    print(f"timing: {name} {seconds:.3f}", flush=True)


started = time.monotonic()
sbx = Sandbox.create(timeout=1800, request_timeout=CONTROL)
timing("create", time.monotonic() - started)
print(f"sdk-interp-serve: sandbox {sbx.sandbox_id}", flush=True)


def run(code, **kw):
    kw.setdefault("timeout", CALL)
    return sbx.run_code(code, **kw)


def first_call_and_state_across_calls():
    first = run("x = 41")
    timing("create to first run_code", time.monotonic() - started)
    assert first.error is None, first.error
    second = run("x + 1")
    assert second.text == "42", second
    assert second.execution_count == first.execution_count + 1, (first, second)


def round_trips():
    times = []
    for _ in range(10):
        t = time.monotonic()
        r = run("1+1")
        times.append(time.monotonic() - t)
        assert r.text == "2", r
    timing("run_code 1+1 p50", statistics.median(times))
    timing("run_code 1+1 max", max(times))


def stdout_reaches_the_callback():
    out = []
    r = run("print('one')\nprint('two')", on_stdout=out.append)
    assert "".join(m.line for m in out) == "one\ntwo\n", out
    assert "".join(r.logs.stdout) == "one\ntwo\n", r.logs


def an_exception_comes_back_by_name():
    r = run("def f():\n    return 1 / 0\nf()")
    assert r.error is not None and r.error.name == "ZeroDivisionError", r.error
    assert r.error.value == "division by zero", r.error.value


def a_matplotlib_chart_is_a_png():
    t = time.monotonic()
    r = run("import matplotlib.pyplot as plt\nplt.plot([1, 2, 3], [1, 4, 9])\nplt.show()")
    timing("first matplotlib figure", time.monotonic() - t)
    assert r.error is None, r.error
    pngs = [res for res in r.results if res.png]
    assert len(pngs) == 1, r.results
    raw = base64.b64decode(pngs[0].png)
    assert raw.startswith(b"\x89PNG\r\n\x1a\n") and len(raw) > 1000, len(raw)


def a_dataframe_is_html():
    r = run("import pandas as pd\npd.DataFrame({'a': [1, 2], 'b': ['x', 'y']})")
    assert r.error is None, r.error
    main = [res for res in r.results if res.is_main_result]
    assert len(main) == 1 and "<table" in (main[0].html or ""), r.results
    assert "<td>x</td>" in main[0].html, main[0].html


def bash_runs_in_its_own_kernel():
    t = time.monotonic()
    r = run("echo $((6 * 7))", language="bash")
    timing("first bash run_code", time.monotonic() - t)
    assert r.error is None, r.error
    assert "".join(r.logs.stdout) == "42\n", r.logs


def a_timeout_interrupts_and_the_next_call_works():
    try:
        sbx.run_code("import time\nfor i in range(1200):\n    time.sleep(0.1)\nfinished = True", timeout=5)
        raise AssertionError("a 120 s cell finished within a 5 s timeout")
    except TimeoutException:
        pass
    r = run("print(x, 'finished' in globals())")
    assert r.error is None, r.error
    assert "".join(r.logs.stdout) == "41 False\n", r.logs


def state_survives_pause_and_connect():
    global sbx
    run("kept_across_pause = 'still here'")
    t = time.monotonic()
    assert sbx.pause() is True
    timing("pause", time.monotonic() - t)
    t = time.monotonic()
    sbx = Sandbox.connect(sbx.sandbox_id, timeout=1800, request_timeout=CONTROL)
    timing("connect", time.monotonic() - t)
    r = run("kept_across_pause + ' ' + str(x)")
    timing("pause to first run_code after connect", time.monotonic() - t)
    assert r.error is None, r.error
    assert r.text == "still here 41", r


def a_filesystem_snapshot_boots_with_the_files():
    boot_id = "cat /proc/sys/kernel/random/boot_id"
    sbx.commands.run("echo kept > ~/fs-snapshot.txt", timeout=CALL)
    before = sbx.commands.run(boot_id, timeout=CALL).stdout
    t = time.monotonic()
    snap = sbx.create_snapshot(mode="filesystem", request_timeout=CONTROL)
    timing("filesystem snapshot", time.monotonic() - t)
    t = time.monotonic()
    new = Sandbox.create(template=snap.snapshot_id, timeout=600, request_timeout=CONTROL)
    timing("create from a filesystem snapshot", time.monotonic() - t)
    try:
        kept = new.commands.run("cat ~/fs-snapshot.txt", timeout=CALL).stdout
        assert kept == "kept\n", kept
        assert new.commands.run(boot_id, timeout=CALL).stdout != before, "not a new boot"
        assert sbx.commands.run(boot_id, timeout=CALL).stdout == before, "the source rebooted"
    finally:
        new.kill()
        Sandbox.delete_snapshot(snap.snapshot_id)


check("create, then state is kept across calls", first_call_and_state_across_calls)
check("run_code('1+1') round trips", round_trips)
check("stdout reaches the callback", stdout_reaches_the_callback)
check("an exception comes back by name", an_exception_comes_back_by_name)
check("a matplotlib chart is a PNG", a_matplotlib_chart_is_a_png)
check("a DataFrame is HTML", a_dataframe_is_html)
check("bash runs in its own kernel", bash_runs_in_its_own_kernel)
check("a timeout interrupts and the next call works", a_timeout_interrupts_and_the_next_call_works)
check("state survives pause and connect", state_survives_pause_and_connect)
check("a filesystem snapshot boots with the files", a_filesystem_snapshot_boots_with_the_files)
try:
    sbx.kill()
    passed += 1
    print("ok kill", flush=True)
except Exception as e:  # noqa: BLE001
    failed += 1
    print(f"FAILED kill: {type(e).__name__}: {e}", flush=True)
print(f"sdk-interp-serve: {passed} passed, {failed} failed")
sys.exit(1 if failed else 0)

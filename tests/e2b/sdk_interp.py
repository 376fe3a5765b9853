"""The official E2B code interpreter SDK (e2b-code-interpreter) against
torpor's interpreter server (guest-image/interpreter/torpor_interp.py).

Run by tests/interp_sdk.rs against the server on loopback (host kernels),
with E2B_SANDBOX_URL set to the server's URL: the SDK then sends every
request there, with the E2b-Sandbox-Id/Port headers that the server ignores.
The sandbox object is the one `Sandbox.connect` builds from the API's
answer; no API is asked here. argv[1] is the server's output bound in bytes
(--max-output-bytes). Prints "sdk-interp: version X" (the e2b version), one
line per check, then "sdk-interp: N passed, M failed".
"""

import base64
import importlib.metadata
import sys
import time

from e2b import ConnectionConfig, NotFoundException, TimeoutException
from e2b_code_interpreter import Sandbox
from packaging.version import Version

BOUND = int(sys.argv[1])
print(f"sdk-interp: version {importlib.metadata.version('e2b')}")
print(f"sdk-interp: e2b-code-interpreter {importlib.metadata.version('e2b-code-interpreter')}")

passed = 0
failed = 0


def check(name, f):
    global passed, failed
    try:
        f()
        passed += 1
        print(f"ok {name}")
    except Exception as e:  # noqa: BLE001 - report every failure
        failed += 1
        print(f"FAILED {name}: {type(e).__name__}: {e}")


# What Sandbox.connect makes of the API's answer (e2b's sandbox_sync/main.py).
sbx = Sandbox(
    sandbox_id="interp-on-loopback",
    sandbox_domain=None,
    envd_version=Version("0.2.0"),
    envd_access_token=None,
    traffic_access_token=None,
    connection_config=ConnectionConfig(request_timeout=120),
)


def state_is_kept_across_calls():
    first = sbx.run_code("x = 41")
    assert first.error is None, first.error
    second = sbx.run_code("x + 1")
    assert second.text == "42", second
    assert second.results[0].is_main_result
    assert second.execution_count == first.execution_count + 1, (first.execution_count, second.execution_count)


def stdout_and_stderr_reach_the_callbacks():
    out, err = [], []
    r = sbx.run_code(
        "import sys\nprint('one')\nprint('two', file=sys.stderr)\nprint('three')",
        on_stdout=out.append,
        on_stderr=err.append,
    )
    assert "".join(m.line for m in out) == "one\nthree\n", out
    assert "".join(m.line for m in err) == "two\n", err
    assert all(not m.error for m in out) and all(m.error for m in err)
    assert "".join(r.logs.stdout) == "one\nthree\n", r.logs


def an_exception_comes_back_by_name():
    errors = []
    r = sbx.run_code("def f():\n    return 1 / 0\nf()", on_error=errors.append)
    assert r.error is not None, r
    assert r.error.name == "ZeroDivisionError", r.error.name
    assert r.error.value == "division by zero", r.error.value
    assert "1 / 0" in r.error.traceback and "\x1b[" not in r.error.traceback, r.error.traceback
    assert errors and errors[0].name == "ZeroDivisionError"
    # The kernel is fine afterwards.
    assert sbx.run_code("x").text == "41"


def a_matplotlib_chart_is_a_png():
    r = sbx.run_code(
        "import matplotlib.pyplot as plt\n"
        "plt.plot([1, 2, 3], [1, 4, 9])\n"
        "plt.title('squares')\n"
        "plt.show()"
    )
    assert r.error is None, r.error
    pngs = [res for res in r.results if res.png]
    assert len(pngs) == 1, r.results
    raw = base64.b64decode(pngs[0].png)
    assert raw.startswith(b"\x89PNG\r\n\x1a\n") and len(raw) > 1000, len(raw)
    assert not pngs[0].is_main_result


def a_dataframe_is_html():
    r = sbx.run_code("import pandas as pd\npd.DataFrame({'a': [1, 2], 'b': ['x', 'y']})")
    assert r.error is None, r.error
    main = [res for res in r.results if res.is_main_result]
    assert len(main) == 1, r.results
    assert main[0].html and "<table" in main[0].html and "<td>x</td>" in main[0].html, main[0].html
    assert "a" in main[0].text and "x" in main[0].text, main[0].text


def a_string_result_loses_its_quotes():
    assert sbx.run_code("'hello'").text == "hello"


def env_vars_hold_for_one_call():
    r = sbx.run_code("import os\nos.environ['TORPOR_ONE']", envs={"TORPOR_ONE": "only now"})
    assert r.text == "only now", r
    after = sbx.run_code("os.environ.get('TORPOR_ONE', 'gone')")
    assert after.text == "gone", after


def contexts_are_separate_and_managed():
    ctx = sbx.create_code_context()
    assert ctx.language == "python", ctx
    assert ctx.id in [c.id for c in sbx.list_code_contexts()]
    fresh = sbx.run_code("x", context=ctx)
    assert fresh.error is not None and fresh.error.name == "NameError", fresh
    sbx.run_code("z = 7", context=ctx)
    assert sbx.run_code("z", context=ctx).text == "7"
    sbx.restart_code_context(ctx)
    gone = sbx.run_code("z", context=ctx)
    assert gone.error is not None and gone.error.name == "NameError", gone
    sbx.remove_code_context(ctx)
    assert ctx.id not in [c.id for c in sbx.list_code_contexts()]
    try:
        sbx.run_code("1", context=ctx)
        raise AssertionError("a removed context still ran code")
    except NotFoundException:
        pass
    # The default context kept its state throughout.
    assert sbx.run_code("x").text == "41"


def a_timeout_interrupts_and_the_next_call_works():
    start = time.monotonic()
    try:
        sbx.run_code("import time\nfor i in range(600):\n    time.sleep(0.1)\nfinished = True", timeout=2)
        raise AssertionError("a 60 s cell finished within a 2 s timeout")
    except TimeoutException:
        pass
    assert time.monotonic() - start < 30
    # The kernel was interrupted, not restarted: state is there, the loop
    # did not finish, and the next call runs.
    r = sbx.run_code("print(x, 'finished' in globals())")
    assert r.error is None, r.error
    assert "".join(r.logs.stdout) == "41 False\n", r.logs


def bash_runs_in_its_own_kernel():
    r = sbx.run_code("echo $((6 * 7))", language="bash")
    assert r.error is None, r.error
    assert "".join(r.logs.stdout) == "42\n", r.logs
    sbx.run_code("TORPOR_B=kept", language="bash")
    assert "".join(sbx.run_code("echo $TORPOR_B", language="bash").logs.stdout) == "kept\n"
    langs = {c.language for c in sbx.list_code_contexts()}
    assert {"python", "bash"} <= langs, langs


def output_is_cut_at_the_bound():
    r = sbx.run_code(f"for i in range({BOUND // 1000 * 3}):\n    print('y' * 999)\nprint('after the loop')")
    out = "".join(r.logs.stdout)
    err = "".join(r.logs.stderr)
    assert len(out) <= BOUND, len(out)
    assert len(out) > BOUND // 2, len(out)
    assert "after the loop" not in out
    assert f"[torpor: output cut here: this execution's output passed {BOUND} bytes" in err, err
    assert r.error is None, r.error
    # The cut is per execution.
    assert "".join(sbx.run_code("print('small')").logs.stdout) == "small\n"


def an_unknown_language_is_refused():
    try:
        sbx.run_code("1", language="cobol")
        raise AssertionError("cobol ran")
    except Exception as e:  # noqa: BLE001 - the SDK's SandboxException
        assert "400" in str(e) and "cobol" in str(e), e


check("state is kept across calls", state_is_kept_across_calls)
check("stdout and stderr reach the callbacks", stdout_and_stderr_reach_the_callbacks)
check("an exception comes back by name", an_exception_comes_back_by_name)
check("a matplotlib chart is a PNG", a_matplotlib_chart_is_a_png)
check("a DataFrame is HTML", a_dataframe_is_html)
check("a string result loses its quotes", a_string_result_loses_its_quotes)
check("env vars hold for one call", env_vars_hold_for_one_call)
check("contexts are separate and managed", contexts_are_separate_and_managed)
check("a timeout interrupts and the next call works", a_timeout_interrupts_and_the_next_call_works)
check("bash runs in its own kernel", bash_runs_in_its_own_kernel)
check("output is cut at the bound", output_is_cut_at_the_bound)
check("an unknown language is refused", an_unknown_language_is_refused)
print(f"sdk-interp: {passed} passed, {failed} failed")
sys.exit(1 if failed else 0)

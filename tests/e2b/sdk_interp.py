"""The official E2B code interpreter SDK (e2b-code-interpreter) against
torpor's interpreter server (guest-image/interpreter/torpor_interp.py).

Run by tests/interp_sdk.rs against the server on loopback (host kernels),
with E2B_SANDBOX_URL set to the server's URL: the SDK then sends every
request there, with the E2b-Sandbox-Id/Port headers that the server ignores.
The sandbox object is the one `Sandbox.connect` builds from the API's
answer; no API is asked here. JavaScript and TypeScript (Deno's kernel) are
called as E2B's own SDK tests call them. argv[1] is the server's output
bound in bytes (--max-output-bytes). Prints "sdk-interp: version X" (the
e2b version), one line per check, then "sdk-interp: N passed, M failed".
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


# JavaScript and TypeScript (Deno's kernel), as E2B's own SDK tests use them:
# language "js"/"javascript" and "ts"/"typescript".
def javascript_keeps_state_and_returns_the_last_value():
    first = sbx.run_code("let jsCount = 40", language="js")
    assert first.error is None, first.error
    assert first.results == [], first.results
    r = sbx.run_code("jsCount + 2", language="javascript")
    assert r.error is None, r.error
    assert r.text == "42", r
    assert r.results[0].is_main_result
    assert r.execution_count == first.execution_count + 1, (first.execution_count, r.execution_count)
    joined = sbx.run_code("'java' + 'script'", language="js")
    assert joined.text == "javascript", joined.results
    awaited = sbx.run_code("await Promise.resolve('Hello World!')", language="js")
    assert awaited.text == "Hello World!", awaited.results


def javascript_console_log_is_stdout():
    out, err = [], []
    r = sbx.run_code(
        "console.log('Hello, World!')\nconsole.error('to stderr')\nconsole.log('again')",
        language="js",
        on_stdout=out.append,
        on_stderr=err.append,
    )
    assert r.error is None, r.error
    assert "".join(m.line for m in out) == "Hello, World!\nagain\n", out
    assert "".join(m.line for m in err) == "to stderr\n", err
    assert "".join(r.logs.stdout) == "Hello, World!\nagain\n", r.logs
    esm = sbx.run_code("import { readFileSync } from 'fs'\nconsole.log(typeof readFileSync)", language="js")
    assert esm.logs.stdout == ["function\n"], esm.logs
    # CommonJS as in E2B's Node kernel.
    cjs = sbx.run_code("const { join } = require('path')\nconsole.log(join('a', 'b'))", language="js")
    assert cjs.logs.stdout == ["a/b\n"], (cjs.logs, cjs.error)


def javascript_output_and_value_belong_to_their_call():
    # Deno's kernel can say idle before a cell's output is out: each call
    # must still get its own line and value, none of the next one's.
    for i in range(15):
        r = sbx.run_code(f"console.log('line {i}'); {i} * 2", language="js")
        assert r.logs.stdout == [f"line {i}\n"], (i, r.logs)
        assert r.text == str(i * 2), (i, r.results)


def a_thrown_javascript_error_comes_back_by_name():
    errors = []
    r = sbx.run_code("console.log('before')\nthrow new TypeError('boom')", language="js", on_error=errors.append)
    assert r.error is not None, r
    assert r.logs.stdout == ["before\n"], r.logs
    assert r.error.name == "TypeError", r.error.name
    assert r.error.value == "boom", r.error.value
    assert "boom" in r.error.traceback and "\x1b[" not in r.error.traceback, r.error.traceback
    assert errors and errors[0].name == "TypeError"
    missing = sbx.run_code("notDefinedAnywhere.x", language="js")
    assert missing.error is not None and missing.error.name == "ReferenceError", missing
    assert missing.error.value == "notDefinedAnywhere is not defined", missing.error.value
    # The kernel is fine afterwards.
    after = sbx.run_code("jsCount", language="js")
    assert after.text == "40", (after.results, after.error)


def typescript_runs_typed_code():
    r = sbx.run_code("const message: string = 'Hello, World!'; console.log(message)", language="ts")
    assert r.error is None, r.error
    assert r.logs.stdout == ["Hello, World!\n"], r.logs
    typed = sbx.run_code(
        "interface Point { x: number; y: number }\n"
        "function norm1(p: Point): number { return Math.abs(p.x) + Math.abs(p.y) }\n"
        "norm1({ x: -40, y: 2 } as Point)",
        language="typescript",
    )
    assert typed.error is None, typed.error
    assert typed.text == "42", typed.results
    # TypeScript's default context is its own, as on E2B.
    own = sbx.run_code("typeof jsCount", language="ts")
    assert own.text == "undefined", own.results
    langs = {c.language for c in sbx.list_code_contexts()}
    assert {"python", "javascript", "typescript"} <= langs, langs


def javascript_sees_the_cwd_and_env_vars():
    home = sbx.run_code("import os\nos.getcwd()").text
    cwd = sbx.run_code("process.cwd()", language="js")
    assert cwd.text == home, (cwd.results, home)
    r = sbx.run_code("process.env.TORPOR_JS", language="js", envs={"TORPOR_JS": "only now"})
    assert r.text == "only now", r
    after = sbx.run_code("process.env.TORPOR_JS ?? 'gone'", language="js")
    assert after.text == "gone", after


def a_new_javascript_context_is_separate():
    ctx = sbx.create_code_context(language="js")
    assert ctx.language == "javascript", ctx
    fresh = sbx.run_code("typeof jsCount", context=ctx)
    assert fresh.text == "undefined", (fresh.results, fresh.error)
    sbx.run_code("const kept = 'mine'", context=ctx)
    kept = sbx.run_code("kept", context=ctx)
    assert kept.text == "mine", (kept.results, kept.error)
    sbx.restart_code_context(ctx)
    gone = sbx.run_code("kept", context=ctx)
    assert gone.error is not None and gone.error.name == "ReferenceError", gone
    assert sbx.run_code("typeof require", context=ctx).text == "function"
    sbx.remove_code_context(ctx)
    assert ctx.id not in [c.id for c in sbx.list_code_contexts()]
    ts = sbx.create_code_context(language="ts")
    assert ts.language == "typescript", ts
    typed = sbx.run_code("const n: number = 6 * 7; n", context=ts)
    assert typed.text == "42", (typed.results, typed.error)
    sbx.remove_code_context(ts)
    # The default context kept its state throughout.
    still = sbx.run_code("jsCount", language="js")
    assert still.text == "40", (still.results, still.error)


def a_javascript_timeout_interrupts_and_the_next_call_works():
    sbx.run_code("let before = 1", language="js")
    start = time.monotonic()
    try:
        sbx.run_code("while (true) {}\nbefore = 2", language="js", timeout=2)
        raise AssertionError("an endless loop finished within a 2 s timeout")
    except TimeoutException:
        pass
    assert time.monotonic() - start < 30
    # The kernel was interrupted, not restarted: its state is there.
    r = sbx.run_code("before", language="js")
    assert r.error is None, r.error
    assert r.text == "1", r.results

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
check("javascript keeps state and returns the last value", javascript_keeps_state_and_returns_the_last_value)
check("javascript console.log is stdout", javascript_console_log_is_stdout)
check("javascript output and value belong to their call", javascript_output_and_value_belong_to_their_call)
check("a thrown javascript error comes back by name", a_thrown_javascript_error_comes_back_by_name)
check("typescript runs typed code", typescript_runs_typed_code)
check("javascript sees the cwd and env vars", javascript_sees_the_cwd_and_env_vars)
check("a new javascript context is separate", a_new_javascript_context_is_separate)
check("a javascript timeout interrupts and the next call works", a_javascript_timeout_interrupts_and_the_next_call_works)
print(f"sdk-interp: {passed} passed, {failed} failed")
sys.exit(1 if failed else 0)

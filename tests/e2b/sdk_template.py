"""E2B's template builder through the real Python SDK (`e2b`, pinned in
tests/e2b/requirements.txt), unchanged, against torpor: the routes of
docs/e2b-template-routes.md. Run like the other scripts here
(tests/common/e2b.rs run_script: E2B_API_URL, E2B_SANDBOX_URL and
E2B_API_KEY set, E2B_DOMAIN cleared) against a serve whose base template
is a Linux guest with envd (the nested pod's `base`).

Environment:
  E2B_TEST_TEMPLATE         the template built from (default `base`)
  TEMPLATE_BUILD_TIMEOUT    s, bound of each build (default 900)
  TEMPLATE_REQUEST_TIMEOUT  s, bound of one API request, sandbox creation
                            included (default 300)
  TEMPLATE_CMD_TIMEOUT      s, bound of one command in the sandbox
                            (default 120)
  TEMPLATE_TOTAL_TIMEOUT    s, bound of the whole script (default 3600)
  TEMPLATE_CACHE_MAX_RATIO  the unchanged rebuild's time over the first
                            build's, at most (default 0.5)

Flow: build `Template().from_template(BASE)` with set_envs, run_cmd, copy
(of a file this script makes in a temp dir), set_workdir and
set_start_cmd("python3 -m http.server 8000", wait_for_port(8000)), with
on_build_logs; `Template.exists`; a sandbox from it: the env var as the
build and the start command saw it, the copied file, the workdir, the
default user, port 8000 answering on the first try (2 s); the same build
again, timed (line `TEMPLATE-CACHE cold_s=… cached_s=… ratio=…`); a
build whose `run_cmd("exit 7")` fails: BuildException naming the command
and the exit code (line `TEMPLATE-FAIL …`), its traceback at that
run_cmd (reason.step right); build_in_background + get_build_status to
ready; tags (assign, get, exists name:tag, remove). Prints
"sdk-template: version X", "ok <check>" lines, "sdk-template: N passed,
0 failed" and `TEMPLATE-OK`; exits non-zero on the first failed check.
"""

import concurrent.futures
import importlib.metadata
import os
import shutil
import sys
import tempfile
import threading
import time
import traceback
import uuid

from e2b import Sandbox, Template, wait_for_port
from e2b.exceptions import BuildException

BASE = os.environ.get("E2B_TEST_TEMPLATE", "base")
BUILD_TIMEOUT = float(os.environ.get("TEMPLATE_BUILD_TIMEOUT", "900"))
REQUEST_TIMEOUT = float(os.environ.get("TEMPLATE_REQUEST_TIMEOUT", "300"))
CMD_TIMEOUT = float(os.environ.get("TEMPLATE_CMD_TIMEOUT", "120"))
TOTAL_TIMEOUT = float(os.environ.get("TEMPLATE_TOTAL_TIMEOUT", "3600"))
CACHE_MAX_RATIO = float(os.environ.get("TEMPLATE_CACHE_MAX_RATIO", "0.5"))
TAG = "sdk-template"

checks = 0


def out(line):
    print(line, flush=True)


def fail(what):
    out(f"{TAG}: FAILED: {what}")
    print(f"{TAG}: FAILED: {what}", file=sys.stderr, flush=True)
    # Not sys.exit: a build still polling in a worker thread would hold
    # the interpreter's exit.
    os._exit(1)


def check(cond, what):
    global checks
    if not cond:
        fail(what)
    checks += 1
    out(f"ok {what}")


def bounded(what, seconds, fn):
    """fn() in a worker thread, failing the script after `seconds`."""
    pool = concurrent.futures.ThreadPoolExecutor(1)
    fut = pool.submit(fn)
    try:
        return fut.result(timeout=seconds)
    except concurrent.futures.TimeoutError:
        fail(f"{what}: not done in {seconds:.0f} s")
    finally:
        pool.shutdown(wait=False)


def watchdog():
    fail(f"the script ran over TEMPLATE_TOTAL_TIMEOUT={TOTAL_TIMEOUT:.0f} s")


timer = threading.Timer(TOTAL_TIMEOUT, watchdog)
timer.daemon = True
timer.start()

out(f"{TAG}: version {importlib.metadata.version('e2b')}")
run_id = uuid.uuid4().hex[:8]
# E2B's names: lowercase letters, digits, '-' and '_'.
name = f"sdk-tpl-{run_id}"
env_value = f"hello-env-{run_id}"
hello = f"hello from the template context {run_id}\n"
ctx = tempfile.mkdtemp(prefix="sdk-template-")
with open(os.path.join(ctx, "hello.txt"), "w") as f:
    f.write(hello)

# SDK-made on_build_logs lines (the rest come from the server's logEntries).
SDK_LINES = (
    "Build started",
    "Build finished",
    "Requesting build for template:",
    "Template created with ID:",
    "Uploaded '",
    "Skipping upload of '",
    "All file uploads completed",
    "Starting building...",
    "Waiting for logs...",
)


def the_template():
    # The run id is in an env value: the first build is cold whatever an
    # earlier run left in the build cache; the second is the same build.
    return (
        Template(file_context_path=ctx)
        .from_template(BASE)
        .set_envs({"TORPOR_TPL_VAR": env_value})
        .run_cmd('echo "$TORPOR_TPL_VAR" > /home/user/env-at-build.txt')
        .copy("hello.txt", "/home/user/hello.txt")
        .set_workdir("/home/user/app")
        .set_start_cmd("python3 -m http.server 8000", wait_for_port(8000))
    )


def build(template, build_name, logs, **kw):
    return bounded(
        f"Template.build {build_name}",
        BUILD_TIMEOUT,
        lambda: Template.build(
            template,
            build_name,
            on_build_logs=logs.append,
            request_timeout=REQUEST_TIMEOUT,
            **kw,
        ),
    )


def run(sbx, cmd):
    return sbx.commands.run(cmd, timeout=CMD_TIMEOUT, request_timeout=REQUEST_TIMEOUT)


sbx = None
try:
    # --- the first build: cold -------------------------------------------
    logs = []
    t0 = time.monotonic()
    info = build(the_template(), name, logs)
    cold_s = time.monotonic() - t0
    check(info.template_id and info.build_id, f"build {name}: {info}")
    check(info.name == name and info.alias == name, f"BuildInfo name {info.name!r}")
    check(any(m.message == "Uploaded 'hello.txt'" for m in logs), "the file was uploaded")
    server_logs = [m for m in logs if not m.message.startswith(SDK_LINES)]
    check(server_logs, f"the server's build logs reached on_build_logs ({len(server_logs)})")
    check(
        all(m.level in ("debug", "info", "warn", "error") for m in logs),
        "log levels are E2B's",
    )
    out(f"{TAG}: build logs: " + " | ".join(m.message for m in server_logs[:10]))

    # --- exists ------------------------------------------------------------
    check(
        bounded("exists", REQUEST_TIMEOUT, lambda: Template.exists(name)) is True,
        f"Template.exists({name!r})",
    )
    check(
        bounded("exists", REQUEST_TIMEOUT, lambda: Template.exists(f"{name}-missing")) is False,
        "Template.exists of a missing name is False",
    )

    # --- a sandbox from it ---------------------------------------------------
    sbx = bounded(
        "Sandbox.create",
        REQUEST_TIMEOUT + 30,
        lambda: Sandbox.create(template=name, timeout=600, request_timeout=REQUEST_TIMEOUT),
    )
    created = time.monotonic()
    # The start command runs in the template's snapshot: port 8000 answers
    # on the first try (one request, 2 s), no waiting loop.
    r = run(
        sbx,
        "python3 -c \"import urllib.request; "
        "print(urllib.request.urlopen('http://127.0.0.1:8000/', timeout=2).status)\"",
    )
    check(r.stdout.strip() == "200", f"port 8000 answered at once: {r.stdout!r} {r.stderr!r}")
    out(f"{TAG}: port 8000 answered {time.monotonic() - created:.2f} s after the sandbox")
    check(sbx.get_info().template_id == info.template_id, "the sandbox's templateID is the build's")
    r = run(sbx, "cat /home/user/hello.txt")
    check(r.stdout == hello, f"the copied file: {r.stdout!r}")
    r = run(sbx, "cat /home/user/env-at-build.txt")
    check(r.stdout.strip() == env_value, f"set_envs reached the build's run_cmd: {r.stdout!r}")
    # E2B runs the start command with the build's envs (its finalize
    # phase's context), commands of the sandbox without them.
    # (Anchored: the shell running this command has the pattern in its own
    # command line.)
    r = run(
        sbx,
        "pid=$(pgrep -o -f '^python3 -m http.server 8000'); "
        "{ cat /proc/$pid/environ 2>/dev/null || sudo -n cat /proc/$pid/environ; }"
        " | tr '\\0' '\\n' | grep '^TORPOR_TPL_VAR=' || true",
    )
    check(
        r.stdout.strip() == f"TORPOR_TPL_VAR={env_value}",
        f"the start command has the template's env: {r.stdout!r}",
    )
    r = run(sbx, "echo \"runtime=${TORPOR_TPL_VAR:-}\"")
    out(f"TEMPLATE-ENV {r.stdout.strip()} (E2B: commands do not get set_envs values)")
    r = run(sbx, "pwd; whoami")
    check(r.stdout == "/home/user/app\nuser\n", f"workdir and user: {r.stdout!r}")

    # --- the same build again: cached -------------------------------------
    logs2 = []
    t1 = time.monotonic()
    info2 = build(the_template(), name, logs2)
    cached_s = time.monotonic() - t1
    ratio = cached_s / cold_s
    out(f"TEMPLATE-CACHE cold_s={cold_s:.1f} cached_s={cached_s:.1f} ratio={ratio:.2f}")
    check(info2.template_id == info.template_id, "a rebuild keeps the templateID")
    check(info2.build_id != info.build_id, "a rebuild is a new build")
    check(
        any(m.message == "Skipping upload of 'hello.txt', already cached" for m in logs2),
        "the rebuild's file was present (no upload)",
    )
    check(ratio <= CACHE_MAX_RATIO, f"cached rebuild {ratio:.2f} of the first (<= {CACHE_MAX_RATIO})")

    # --- a failing step --------------------------------------------------------
    failing = (
        Template(file_context_path=ctx)
        .from_template(BASE)
        .run_cmd(f"echo before-the-failure-{run_id}")
        .run_cmd("exit 7")  # <- the failing step
    )
    fail_line = next(
        i for i, line in enumerate(open(__file__), 1) if line.rstrip().endswith("# <- the failing step")
    )
    flogs = []
    err = None
    try:
        build(failing, f"{name}-fail", flogs)
    except BuildException as e:
        err = e
    check(err is not None, "a failing run_cmd raises BuildException")
    message = str(err)
    out(f"TEMPLATE-FAIL {message}")
    check("exit 7" in message and "7" in message.replace("exit 7", ""),
          f"the message names the step's command and its exit code: {message!r}")
    frames = traceback.extract_tb(err.__traceback__)
    check(
        os.path.abspath(frames[-1].filename) == os.path.abspath(__file__)
        and frames[-1].lineno == fail_line,
        f"reason.step points at the run_cmd (line {fail_line}): {frames[-1].filename}:{frames[-1].lineno}",
    )

    # --- build_in_background + get_build_status ---------------------------------
    bg_template = (
        Template(file_context_path=ctx)
        .from_template(BASE)
        .run_cmd(f"echo bg-{run_id} > /home/user/bg.txt")
    )
    bg = bounded(
        "build_in_background",
        REQUEST_TIMEOUT * 2,
        lambda: Template.build_in_background(bg_template, f"{name}-bg", request_timeout=REQUEST_TIMEOUT),
    )
    check(bg.template_id and bg.build_id, f"build_in_background: {bg}")
    deadline = time.monotonic() + BUILD_TIMEOUT
    offset, seen = 0, []
    while True:
        s = bounded("get_build_status", REQUEST_TIMEOUT,
                    lambda: Template.get_build_status(bg, logs_offset=offset))
        if s.build_id != bg.build_id or s.template_id != bg.template_id:
            fail(f"get_build_status answered ids {s.template_id}/{s.build_id} for {bg}")
        offset += len(s.log_entries)
        if not seen or seen[-1] != s.status.value:
            seen.append(s.status.value)
        if s.status.value in ("ready", "error"):
            break
        if time.monotonic() > deadline:
            fail(f"background build not done in {BUILD_TIMEOUT:.0f} s: {seen}")
        time.sleep(0.5)
    check(seen[-1] == "ready", f"background build ready: {seen} {s.reason}")
    check(set(seen) <= {"waiting", "building", "ready"}, f"statuses {seen}")
    check(offset > 0, f"the background build logged ({offset} entries)")

    # --- tags ------------------------------------------------------------------
    a = bounded("assign_tags", REQUEST_TIMEOUT, lambda: Template.assign_tags(name, ["stable"]))
    check(a.build_id == info2.build_id and a.tags == ["stable"], f"assign_tags: {a}")
    tags = bounded("get_tags", REQUEST_TIMEOUT, lambda: Template.get_tags(name))
    by_tag = {t.tag: t.build_id for t in tags}
    check(
        by_tag.get("stable") == info2.build_id and by_tag.get("default") == info2.build_id,
        f"get_tags: {tags}",
    )
    check(bounded("exists", REQUEST_TIMEOUT, lambda: Template.exists(f"{name}:stable")) is True,
          "exists(name:tag) of an assigned tag")
    bounded("remove_tags", REQUEST_TIMEOUT, lambda: Template.remove_tags(name, "stable"))
    tags = bounded("get_tags", REQUEST_TIMEOUT, lambda: Template.get_tags(name))
    check("stable" not in {t.tag for t in tags}, f"remove_tags: {tags}")
    check(bounded("exists", REQUEST_TIMEOUT, lambda: Template.exists(f"{name}:stable")) is False,
          "exists(name:tag) of a removed tag")
finally:
    shutil.rmtree(ctx, ignore_errors=True)
    if sbx is not None:
        killed = bounded("kill", REQUEST_TIMEOUT, lambda: sbx.kill(request_timeout=REQUEST_TIMEOUT))
if sbx is not None:
    check(killed is True, "the sandbox is deleted")

out(f"{TAG}: {checks} passed, 0 failed")
out("TEMPLATE-OK")
sys.stdout.flush()
os._exit(0)

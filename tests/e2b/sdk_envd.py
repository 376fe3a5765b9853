"""The E2B Python SDK's commands and files against torpor's envd.

Run by api/tests/http_e2b_sdk.rs against the API over a real torpor-agent
on the host (behind the hybrid vsock stand-in), and by tests/nested_pod.rs
against a Linux sandbox on the nested pod (E2B_TEST_TEMPLATE=base, which
adds the Linux-only checks: default user and tools, pause -> connect, the
default timeout), with
E2B_API_URL, E2B_SANDBOX_URL and E2B_API_KEY set; argv[1] is a scratch
directory in the sandbox (made if missing). Prints "sdk-envd: version X",
one line per check, then "sdk-envd: N passed, M failed".
"""

import asyncio
import importlib.metadata
import os
import sys
import time

import e2b
import httpx
from e2b import AsyncSandbox, Sandbox
from e2b.sandbox_async.commands.command_input_handle import AsyncCommandInputHandle
from e2b.sandbox.commands.command_handle import CommandExitException
from e2b.exceptions import NotFoundException

SCRATCH = sys.argv[1]
print(f"sdk-envd: version {importlib.metadata.version('e2b')}")

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


TEMPLATE = os.environ.get("E2B_TEST_TEMPLATE", "probe")
LINUX = TEMPLATE != "probe"
started = time.time()
# A sandbox left alone with the SDK's defaults (timeout 300 s): checked
# early to be still there, with the life the SDK's default gave it.
if LINUX:
    bystander = Sandbox.create(template=TEMPLATE, request_timeout=300)
sbx = Sandbox.create(
    template=TEMPLATE,
    # A probe sandbox of the test service reaches a real agent on the host.
    metadata={"agent": "real"} if TEMPLATE == "probe" else {},
    envs={"FROM_SANDBOX": "yes"},
    # Longer than the SDK's default 300 s: the nested pod is slow (TCG).
    timeout=1800,
    request_timeout=300,
)
sbx.files.make_dir(SCRATCH)


def run_collects_output_and_env():
    out, err = [], []
    r = sbx.commands.run(
        "echo hi; echo $FROM_SANDBOX $MINE; echo err >&2",
        envs={"MINE": "mine"},
        on_stdout=out.append,
        on_stderr=err.append,
    )
    assert r.exit_code == 0, r
    assert r.stdout == "hi\nyes mine\n", repr(r.stdout)
    assert r.stderr == "err\n", repr(r.stderr)
    assert "".join(out) == r.stdout, out
    assert "".join(err) == r.stderr, err


def run_in_cwd():
    r = sbx.commands.run("pwd", cwd=SCRATCH)
    assert r.stdout.strip() == SCRATCH, repr(r.stdout)


def exit_codes_raise():
    try:
        sbx.commands.run("exit 3")
    except CommandExitException as e:
        assert e.exit_code == 3, e
        return
    raise AssertionError("no CommandExitException")


def background_stdin_and_connect():
    h = sbx.commands.run("read l; echo got $l", background=True, stdin=True)
    again = sbx.commands.connect(h.pid)
    sbx.commands.send_stdin(h.pid, "x\n")
    r = again.wait()
    assert r.stdout.endswith("got x\n"), repr(r.stdout)
    h.disconnect()


def stream_input_in_order():
    # StreamInput (a client stream): chunks reach stdin in order.
    h = sbx.commands.run("cat", background=True, stdin=True)
    sbx.commands.stream_input(h.pid, ["one ", b"two ", "three\n"])
    sbx.commands.close_stdin(h.pid)
    r = h.wait()
    assert r.stdout == "one two three\n", repr(r.stdout)
    try:
        sbx.commands.stream_input(2**31 - 2, ["x"])
    except NotFoundException:
        return
    raise AssertionError("input to a missing pid did not raise NotFoundException")


def pty_stream_input():
    data = []
    h = sbx.pty.create(size=e2b.PtySize(rows=24, cols=80), cwd=SCRATCH)
    sbx.pty.stream_input(h.pid, [b"echo streamed-$((6*7))\n", b"exit 0\n"])
    h.wait(on_pty=data.append)
    text = b"".join(data).decode(errors="replace")
    assert "streamed-42" in text, repr(text)


def async_input_handle_streams_over_time():
    # The async SDK's handle keeps one stream open, sends as it is fed and
    # keepalives while idle (every 0.2 s here instead of the SDK's 50 s).
    async def go():
        a = await AsyncSandbox.connect(sbx.sandbox_id)
        h = await a.commands.run("cat", background=True, stdin=True)
        handle = AsyncCommandInputHandle(
            a.commands._rpc, h.pid, "stdin", 60, a.commands._check_health,
            _keepalive_interval=0.2,
        )
        await handle.send("early ")
        await asyncio.sleep(0.1)
        # The first chunk is in before the stream ends.
        for _ in range(50):
            if h.stdout == "early ":
                break
            await asyncio.sleep(0.1)
        assert h.stdout == "early ", repr(h.stdout)
        await asyncio.sleep(0.7)
        await handle.send("late\n")
        await handle.close()
        await a.commands.close_stdin(h.pid)
        r = await h.wait()
        assert r.stdout == "early late\n", repr(r.stdout)

    asyncio.run(go())


def list_and_kill():
    h = sbx.commands.run("sleep 30", background=True)
    assert any(p.pid == h.pid for p in sbx.commands.list()), "not listed"
    assert sbx.commands.kill(h.pid)
    for _ in range(50):
        if all(p.pid != h.pid for p in sbx.commands.list()):
            return
        time.sleep(0.1)
    raise AssertionError("still listed after kill")


def pty_echoes_input():
    data = []
    h = sbx.pty.create(size=e2b.PtySize(rows=24, cols=80), cwd=SCRATCH)
    sbx.pty.resize(h.pid, e2b.PtySize(rows=40, cols=100))
    sbx.pty.send_stdin(h.pid, b"stty size; exit 7\n")
    try:
        h.wait(on_pty=data.append)
        raise AssertionError("exit 7 did not raise")
    except CommandExitException as e:
        assert e.exit_code == 7, e
    text = b"".join(data).decode(errors="replace")
    assert "40 100" in text, repr(text)


def files_make_list_stat_rename_remove():
    d = f"{SCRATCH}/files"
    assert sbx.files.make_dir(d) is True
    assert sbx.files.make_dir(d) is False
    sbx.files.write(f"{d}/a.txt", "hello")
    assert sbx.files.read(f"{d}/a.txt") == "hello"
    info = sbx.files.get_info(f"{d}/a.txt")
    assert info.size == 5 and info.type.value == "file", info
    assert sbx.files.exists(f"{d}/a.txt")
    names = [e.name for e in sbx.files.list(d)]
    assert names == ["a.txt"], names
    moved = sbx.files.rename(f"{d}/a.txt", f"{d}/b.txt")
    assert moved.name == "b.txt", moved
    # Into directories not there yet: envd makes them, the user's (as a
    # make_dir's).
    deeper = sbx.files.rename(f"{d}/b.txt", f"{d}/new/deeper/b.txt")
    assert deeper.path == f"{d}/new/deeper/b.txt", deeper
    assert sbx.files.read(f"{d}/new/deeper/b.txt") == "hello"
    made = sbx.files.get_info(f"{d}/new")
    assert made.type.value == "dir", made
    assert made.owner == sbx.files.get_info(d).owner, (made, sbx.files.get_info(d))
    sbx.files.rename(f"{d}/new/deeper/b.txt", f"{d}/b.txt")
    sbx.files.remove(f"{d}/b.txt")
    assert not sbx.files.exists(f"{d}/b.txt")
    try:
        sbx.files.get_info(f"{d}/b.txt")
    except NotFoundException:
        return
    raise AssertionError("no NotFoundException")


def watch_sees_a_new_file():
    d = f"{SCRATCH}/watched"
    sbx.files.make_dir(d)
    w = sbx.files.watch_dir(d)
    sbx.files.write(f"{d}/new.txt", "x")
    for _ in range(50):
        events = w.get_new_events()
        if any(e.name == "new.txt" for e in events):
            w.stop()
            return
        time.sleep(0.1)
    raise AssertionError("no event for new.txt")


def watch_with_network_mounts_allowed():
    # envd 0.6.4's opt-in (the SDK refuses it client-side below 0.6.4); on
    # a local directory the watch is the same.
    d = f"{SCRATCH}/watched-net"
    sbx.files.make_dir(d)
    w = sbx.files.watch_dir(d, allow_network_mounts=True)
    sbx.files.write(f"{d}/new.txt", "x")
    for _ in range(50):
        if any(e.name == "new.txt" for e in w.get_new_events()):
            w.stop()
            return
        time.sleep(0.1)
    raise AssertionError("no event for new.txt")


def gzip_download_and_upload():
    # E2B's envd honours `Accept-Encoding: gzip` on downloads and
    # decompresses `Content-Encoding: gzip` uploads (the SDK's `gzip=True`).
    path = f"{SCRATCH}/gzipped.txt"
    text = "compress me " * 1000
    sbx.files.write(path, text, gzip=True)
    assert sbx.files.read(path) == text
    assert sbx.files.read(path, gzip=True) == text
    # A plain httpx client to envd, as the SDK addresses it: it decodes
    # the body but keeps the header that says how it came.
    api = httpx.Client(
        base_url=sbx.envd_api_url,
        headers={"X-Access-Token": sbx._envd_access_token, "E2b-Sandbox-Id": sbx.sandbox_id},
    )
    r = api.get("/files", params={"path": path}, headers={"Accept-Encoding": "gzip"})
    assert r.status_code == 200, r.status_code
    assert r.headers.get("content-encoding") == "gzip", dict(r.headers)
    assert r.content.decode() == text
    assert int(r.headers["content-length"]) < len(text), dict(r.headers)
    r = api.get("/files", params={"path": path}, headers={"Accept-Encoding": "identity"})
    assert r.headers.get("content-encoding") is None, dict(r.headers)
    assert r.content.decode() == text


def uploads_belong_to_the_user():
    # As envd: the file and the directories made for it are the request's
    # user's (`user` by default on a Linux guest). Against the host's agent
    # (probe) a user of this host is named, which only root can give to.
    if LINUX:
        path, user = f"{SCRATCH}/owned/deep/mine.txt", None
        want = "user"
    elif os.geteuid() == 0:
        path, user = f"{SCRATCH}/owned/deep/nobodys.txt", "nobody"
        want = "nobody"
    else:
        print("  (not root: only the default-user write is checked)")
        sbx.files.write(f"{SCRATCH}/plain.txt", "x")
        return
    sbx.files.write(path, "x", user=user) if user else sbx.files.write(path, "x")
    for p in (path, f"{SCRATCH}/owned/deep", f"{SCRATCH}/owned"):
        info = sbx.files.get_info(p)
        assert info.owner == want, (p, info)
    many = [{"path": f"{SCRATCH}/owned/m{i}.txt", "data": "y"} for i in range(2)]
    sbx.files.write_files(many, user=user) if user else sbx.files.write_files(many)
    for w in many:
        assert sbx.files.get_info(w["path"]).owner == want, w


def remove_of_a_missing_path_is_quiet():
    # envd removes with os.RemoveAll: nothing there is no error.
    sbx.files.remove(f"{SCRATCH}/never-was")
    sbx.files.remove(f"{SCRATCH}/never/was/either")


def entry_details_as_envd():
    d = f"{SCRATCH}/details"
    sbx.files.make_dir(d)
    sbx.files.write(f"{d}/target.txt", "hello")
    script = (
        f"cd {d} && chmod 644 target.txt && mkdir -p sub && chmod 755 sub"
        " && touch suid && chmod 4755 suid && mkdir -p sticky && chmod 1777 sticky"
        " && touch nameless && chown 4242:4243 nameless"
        " && ln -sfn target.txt link && ln -sfn missing broken && ln -sfn sub dirlink"
        " && realpath . && stat -c '%U %G' target.txt && stat -c %A link"
    )
    # chown needs root; a Linux guest's commands run as `user`.
    r = sbx.commands.run(f"sudo -n sh -c \"{script}\"" if LINUX else script)
    real, owner, group, link_perms = r.stdout.split()
    f = sbx.files.get_info(f"{d}/target.txt")
    assert (f.type.value, f.size, f.mode, f.permissions) == ("file", 5, 0o644, "-rw-r--r--"), f
    assert (f.owner, f.group) == (owner, group), f
    assert f.symlink_target is None, f
    assert abs(f.modified_time.timestamp() - time.time()) < 120, f
    s = sbx.files.get_info(f"{d}/sub")
    assert (s.type.value, s.mode, s.permissions) == ("dir", 0o755, "drwxr-xr-x"), s
    u = sbx.files.get_info(f"{d}/suid")
    assert (u.mode, u.permissions) == (0o755, "urwxr-xr-x"), u
    t = sbx.files.get_info(f"{d}/sticky")
    assert (t.mode, t.permissions) == (0o777, "dtrwxrwxrwx"), t
    n = sbx.files.get_info(f"{d}/nameless")
    assert (n.owner, n.group) == ("4242", "4243"), n
    # A symlink: its own permissions and size, its target's mode and type,
    # the target resolved to an absolute path.
    link = sbx.files.get_info(f"{d}/link")
    assert link.type.value == "symlink", link
    assert link.symlink_target == f"{real}/target.txt", link
    # envd's `permissions` is lstat's mode as Go writes it ("L" for a link;
    # `stat -c %A` writes "l"): "Lrwxrwxrwx" on most filesystems.
    want = "L" + link_perms[1:]
    assert (link.permissions, link.size, link.mode) == (want, len("target.txt"), 0o644), link
    broken = sbx.files.get_info(f"{d}/broken")
    assert broken.symlink_target == f"{d}/broken", broken
    dl = sbx.files.get_info(f"{d}/dirlink")
    assert (dl.symlink_target, dl.mode) == (f"{real}/sub", 0o755), dl


def list_dir_walks_depth_first():
    d = f"{SCRATCH}/walk"
    for p in ["a/x.txt", "a/y/z.txt", "b.txt"]:
        sbx.files.write(f"{d}/{p}", p)
    got = [e.path[len(d) + 1:] for e in sbx.files.list(d, depth=3)]
    assert got == ["a", "a/x.txt", "a/y", "a/y/z.txt", "b.txt"], got
    got = [e.path[len(d) + 1:] for e in sbx.files.list(d, depth=2)]
    assert got == ["a", "a/x.txt", "a/y", "b.txt"], got


def metadata_is_kept_on_files():
    d = f"{SCRATCH}/meta"
    info = sbx.files.write(f"{d}/m.txt", "m", metadata={"Author": "me", "purpose": "test"})
    want = {"author": "me", "purpose": "test"}
    assert info.metadata == want, info
    assert sbx.files.get_info(f"{d}/m.txt").metadata == want
    listed = sbx.files.list(d)
    assert [e.metadata for e in listed] == [want], listed
    octet = sbx.files.write(f"{d}/o.txt", "o", metadata={"k": "v"}, use_octet_stream=True)
    assert octet.metadata == {"k": "v"}, octet
    # Writing again replaces the set; no metadata clears it.
    sbx.files.write(f"{d}/m.txt", "again")
    assert sbx.files.get_info(f"{d}/m.txt").metadata is None


def watch_recursive_with_entries():
    d = f"{SCRATCH}/watched-deep"
    sbx.files.make_dir(f"{d}/sub")
    w = sbx.files.watch_dir(d, recursive=True, include_entry=True)
    sbx.files.write(f"{d}/sub/deep.txt", "12345")
    # A directory made after the watch began, and a file at once inside it.
    sbx.commands.run(f"mkdir {d}/later && echo hi > {d}/later/inside.txt")
    seen = {}
    for _ in range(50):
        for e in w.get_new_events():
            seen.setdefault(e.name, []).append(e)
        if "sub/deep.txt" in seen and "later/inside.txt" in seen:
            break
        time.sleep(0.1)
    w.stop()
    assert "sub/deep.txt" in seen and "later/inside.txt" in seen, sorted(seen)
    entries = [e.entry for e in seen["sub/deep.txt"] if e.entry is not None]
    assert entries and entries[-1].path == f"{d}/sub/deep.txt", seen["sub/deep.txt"]
    assert entries[-1].type.value == "file", entries[-1]


def pty_reconnects_and_keeps_its_env():
    # E2B's pty connect test: a PTY made with envs, left, connected to
    # again by pid; both connections see the variable.
    h = sbx.pty.create(size=e2b.PtySize(rows=24, cols=80), envs={"FOO": "bar-pty"}, cwd=SCRATCH)
    sbx.pty.send_stdin(h.pid, b"echo first-$FOO\n")
    seen = b""
    for _, _, pty in h:
        seen += pty or b""
        if b"first-bar-pty" in seen:
            break
    h.disconnect()
    again = sbx.pty.connect(h.pid)
    assert again.pid == h.pid
    sbx.pty.send_stdin(h.pid, b"echo again-$FOO; exit 0\n")
    data = []
    result = again.wait(on_pty=data.append)
    assert result.exit_code == 0, result
    text = b"".join(data)
    assert b"again-bar-pty" in text, text


def killing_the_sandbox_during_a_command_says_so():
    # E2B's own test: a command running when its sandbox is killed ends in
    # the SDK's "killed or reached its end of life" (the stream breaks, and
    # the SDK's health probe finds the sandbox gone).
    victim = Sandbox.create(
        template=TEMPLATE,
        metadata={"agent": "real"} if TEMPLATE == "probe" else {},
        request_timeout=300,
    )
    cmd = victim.commands.run("sleep 60", background=True)
    victim.kill()
    try:
        cmd.wait()
        raise AssertionError("the command's wait returned after its sandbox was killed")
    except e2b.TimeoutException as e:
        assert "killed or reached its end of life" in str(e), f"{type(e).__name__}: {e}"


def default_user_and_tools():
    # E2B's base image: commands run as `user` in /home/user, with
    # passwordless sudo, python3, pip, git and curl (pip's own start-up is
    # too slow under the nested host's TCG for a per-command limit: its
    # presence is checked, its use is the network test's `pip download`).
    r = sbx.commands.run(
        "whoami; pwd; sudo -n whoami; python3 --version >/dev/null; test -x /usr/bin/pip3; "
        "git --version >/dev/null; curl --version >/dev/null; echo tools",
        # Four interpreters and sudo start under TCG: minutes on a busy host.
        timeout=600,
        request_timeout=600,
    )
    assert r.stdout == "user\n/home/user\nroot\ntools\n", repr(r.stdout)


def pause_connect_keeps_processes_and_files():
    sbx.files.write(f"{SCRATCH}/kept.txt", "before pause")
    h = sbx.commands.run("sleep 600", background=True)
    assert sbx.pause() is True
    assert Sandbox.get_info(sbx.sandbox_id).state.value == "paused"
    again = Sandbox.connect(sbx.sandbox_id, timeout=1800)
    assert again.get_info().state.value == "running"
    assert again.files.read(f"{SCRATCH}/kept.txt") == "before pause"
    assert any(p.pid == h.pid for p in again.commands.list()), "process gone after pause"
    assert again.commands.kill(h.pid)
    assert again.commands.run("echo after").stdout == "after\n"


def filesystem_pause_reboots_with_files_kept():
    # pause(mode="filesystem") keeps the disk only: the connect boots the
    # sandbox again (a new boot id, no process from before) with the file
    # written before the pause; a memory pause resumed with
    # on_resume="reboot" boots again too.
    def boot_id(s):
        return s.commands.run("cat /proc/sys/kernel/random/boot_id").stdout.strip()

    before = boot_id(sbx)
    sbx.files.write(f"{SCRATCH}/fs-kept.txt", "before a filesystem pause")
    h = sbx.commands.run("sleep 600", background=True)
    assert sbx.pause(mode="filesystem") is True
    assert Sandbox.get_info(sbx.sandbox_id).state.value == "paused"
    again = Sandbox.connect(sbx.sandbox_id, timeout=1800)
    assert again.get_info().state.value == "running"
    assert again.files.read(f"{SCRATCH}/fs-kept.txt") == "before a filesystem pause"
    after = boot_id(again)
    assert after and after != before, (before, after)
    left = [p for p in again.commands.list() if "sleep 600" in " ".join([p.cmd, *p.args])]
    assert not left, f"a process outlived a reboot: {left} (was pid {h.pid})"
    assert again.commands.run("echo after").stdout == "after\n"
    assert again.pause() is True
    third = Sandbox.connect(sbx.sandbox_id, timeout=1800, on_resume="reboot")
    assert boot_id(third) not in (before, after)
    assert third.files.read(f"{SCRATCH}/fs-kept.txt") == "before a filesystem pause"


def default_timeout_is_kept():
    # Checked early (a slow nested host can take longer than 300 s for the
    # whole script), but past E2B's old 15 s default, which deleted
    # SDK-default sandboxes within a minute.
    while time.time() - started < 20:
        time.sleep(1)
    info = Sandbox.get_info(bystander.sandbox_id)
    assert info.state.value == "running", info
    # Both ends are the server's: the life the create gave it.
    life = info.end_at.timestamp() - info.started_at.timestamp()
    assert 295 <= life <= 305, f"a life of {life:.0f} s, expected E2B's default 300"
    bystander.kill()


checks = [
    ("run_collects_output_and_env", run_collects_output_and_env),
    ("run_in_cwd", run_in_cwd),
    ("exit_codes_raise", exit_codes_raise),
    ("background_stdin_and_connect", background_stdin_and_connect),
    ("stream_input_in_order", stream_input_in_order),
    ("pty_stream_input", pty_stream_input),
    ("async_input_handle_streams_over_time", async_input_handle_streams_over_time),
    ("list_and_kill", list_and_kill),
    ("pty_echoes_input", pty_echoes_input),
    ("files_make_list_stat_rename_remove", files_make_list_stat_rename_remove),
    ("watch_sees_a_new_file", watch_sees_a_new_file),
    ("watch_with_network_mounts_allowed", watch_with_network_mounts_allowed),
    ("gzip_download_and_upload", gzip_download_and_upload),
    ("uploads_belong_to_the_user", uploads_belong_to_the_user),
    ("remove_of_a_missing_path_is_quiet", remove_of_a_missing_path_is_quiet),
    ("entry_details_as_envd", entry_details_as_envd),
    ("list_dir_walks_depth_first", list_dir_walks_depth_first),
    ("metadata_is_kept_on_files", metadata_is_kept_on_files),
    ("watch_recursive_with_entries", watch_recursive_with_entries),
    ("pty_reconnects_and_keeps_its_env", pty_reconnects_and_keeps_its_env),
]
if LINUX:
    checks.insert(1, ("default_timeout_is_kept", default_timeout_is_kept))
    checks += [
        ("default_user_and_tools", default_user_and_tools),
        ("pause_connect_keeps_processes_and_files", pause_connect_keeps_processes_and_files),
        ("filesystem_pause_reboots_with_files_kept", filesystem_pause_reboots_with_files_kept),
        # A killed VM breaks its agent's connections; the host-run agent of
        # the API's test service is shared and outlives a sandbox's kill.
        ("killing_the_sandbox_during_a_command_says_so", killing_the_sandbox_during_a_command_says_so),
    ]
for name, f in checks:
    check(name, f)

sbx.kill()
print(f"sdk-envd: {passed} passed, {failed} failed")
sys.exit(1 if failed else 0)

#!/usr/bin/env python3
"""torpor's code interpreter server: the in-guest half of E2B's code interpreter.

Speaks the protocol the `e2b-code-interpreter` SDKs (Python and JS) use on
port 49999 and drives real Jupyter kernels through `jupyter_client` (ipykernel
for Python, bash_kernel for bash, Deno's own kernel for JavaScript and
TypeScript), one kernel per context:

  GET    /health                   200 "OK" once the default Python kernel is up
  POST   /execute                  {code, context_id | language, env_vars}
                                   -> 200, newline-delimited JSON, streamed
  POST   /contexts                 {language?, cwd?} -> {id, language, cwd}
  GET    /contexts                 -> [{id, language, cwd}, ...]
  POST   /contexts/<id>/restart    restart the kernel (its state is lost)
  DELETE /contexts/<id>            shut the kernel down

Streamed messages, one JSON object per line: {"type": "stdout"|"stderr",
"text", "timestamp"}, {"type": "result", "is_main_result", "text", "html",
"png", ...} (a kernel's MIME bundle under the SDKs' field names),
{"type": "error", "name", "value", "traceback"}, {"type":
"number_of_executions", "execution_count"}, and last {"type":
"end_of_execution"}.

An execution whose client goes away (the SDK's timeout closes the connection)
interrupts its kernel; the context's next execution waits until the kernel is
idle again. Output per execution is bounded (--max-output-bytes): past the
bound a stderr message marks the cut and the rest is dropped while the
execution goes on. Python standard library plus jupyter_client; see
docs/interpreter.md.
"""

import argparse
import asyncio
import importlib.util
import inspect
import json
import logging
import os
import re
import select
import shlex
import shutil
import signal
import socket
import sys
import tempfile
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from queue import Empty

import zmq
from jupyter_client import KernelManager
from jupyter_client.kernelspec import KernelSpecManager

log = logging.getLogger("torpor-interp")

KERNEL_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "kernels")
# Language names as the SDKs send them -> our kernel spec names (kernels/).
# JavaScript and TypeScript both run in Deno's kernel, as E2B runs both in
# one JavaScript kernel; each keeps its own default context, as on E2B.
LANGUAGES = {"python": "python3", "bash": "bash", "javascript": "deno", "typescript": "deno"}
ALIASES = {"python3": "python", "sh": "bash", "shell": "bash", "js": "javascript", "ts": "typescript"}
# Each spec runs `python3 -m MODULE`: a language whose module is not
# installed is not offered (400), rather than a kernel that never answers.
KERNEL_MODULES = {"python3": "ipykernel_launcher", "bash": "bash_kernel", "deno": "deno"}
# Kernels whose output can trail their idle status: Deno's publishes a
# cell's stdout and value from a queue drained beside its requests, under
# the parent of whichever request is current when it drains. An execution
# of such a kernel ends only once a fence (a silent empty execution) went
# by with no output arriving meanwhile; output under a fence is the
# execution's.
FENCED = {"deno"}
# Kernels that listen on TCP only (Deno's implements no IPC transport).
TCP_ONLY = {"deno"}
# Run silently in each new kernel of a spec: Deno's has no CommonJS
# `require`, which E2B's Node kernel has and much JavaScript calls.
PRELUDES = {"deno": 'globalThis.require = (await import("node:module")).createRequire(Deno.cwd() + "/");\nundefined;'}
# How long the fences after one execution may take in all: they run
# nothing, but wait for the kernel's queued output, and for whatever the
# cell left running on its event loop (a busy loop in a timer).
FENCE_TIMEOUT = 10.0
MAX_BODY = 16 << 20
ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
# Bundle keys -> the SDKs' Result fields; anything else goes under "extra".
MIME_FIELDS = {
    "text/plain": "text",
    "text/html": "html",
    "text/markdown": "markdown",
    "image/svg+xml": "svg",
    "image/png": "png",
    "image/jpeg": "jpeg",
    "application/pdf": "pdf",
    "text/latex": "latex",
    "application/json": "json",
    "application/javascript": "javascript",
    "e2b/data": "data",
    "e2b/chart": "chart",
}


class InterpError(Exception):
    """A request the server refuses: an HTTP status and a plain-text reason."""

    def __init__(self, status, message):
        super().__init__(message)
        self.status = status
        self.message = message


def offered_languages():
    """The languages whose kernel is installed."""
    return {
        lang
        for lang, spec in LANGUAGES.items()
        if importlib.util.find_spec(KERNEL_MODULES[spec]) is not None
    }


OFFERED = offered_languages()


def normalize_language(language):
    lang = (language or "python").strip().lower()
    lang = ALIASES.get(lang, lang)
    if lang not in OFFERED:
        raise InterpError(
            HTTPStatus.BAD_REQUEST,
            f"language {lang!r} has no kernel in this sandbox (available: {', '.join(sorted(OFFERED))})",
        )
    return lang


_loops = threading.local()


def resolve(value):
    """jupyter_client 7 (Debian 12) returns coroutines where 8 blocks: wait for them."""
    if not inspect.isawaitable(value):
        return value
    loop = getattr(_loops, "loop", None)
    if loop is None:
        loop = _loops.loop = asyncio.new_event_loop()
        loop.set_exception_handler(_quiet_closed_sockets)
    return loop.run_until_complete(value)


def _quiet_closed_sockets(loop, context):
    """jupyter_client 7's channels are zmq.asyncio sockets: one closed by a
    restart or a removal leaves its reader on the loops that polled it,
    which then fails once with ENOTSOCK. Harmless; not worth a traceback on
    the guest's console."""
    exc = context.get("exception")
    if isinstance(exc, zmq.ZMQError) and exc.errno == zmq.ENOTSOCK:
        log.debug("a closed kernel channel's reader: %s", exc)
        return
    loop.default_exception_handler(context)


def get_msg(channel, timeout):
    return resolve(channel.get_msg(timeout=timeout))


def timestamp(msg):
    date = msg.get("header", {}).get("date")
    if hasattr(date, "isoformat"):
        return date.isoformat()
    return date or time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def result_message(content, is_main):
    out = {"type": "result", "is_main_result": is_main}
    extra = {}
    for mime, value in content.get("data", {}).items():
        field = MIME_FIELDS.get(mime)
        if field is None:
            extra[mime] = value
        else:
            out[field] = value
    if extra:
        out["extra"] = extra
    # A string's repr loses its quotes, as E2B's server does ('a' -> a).
    text = out.get("text")
    if isinstance(text, str) and len(text) >= 2 and text[0] == text[-1] and text[0] in "'\"":
        out["text"] = text[1:-1]
    return out


def message_size(msg):
    return sum(len(v) if isinstance(v, str) else len(json.dumps(v)) for v in msg.values())


def env_code(language, env):
    """Code that sets `env` in the kernel, and code that puts it back after."""
    if language == "python":
        keys = json.dumps(sorted(env))
        setup = (
            f"__torpor_env = {{k: __import__('os').environ.get(k) for k in {keys}}}\n"
            f"__import__('os').environ.update({json.dumps(env)})"
        )
        restore = (
            "for __k, __v in __torpor_env.items():\n"
            "    __import__('os').environ.pop(__k, None) if __v is None else __import__('os').environ.__setitem__(__k, __v)\n"
            "del __torpor_env, __k, __v"
        )
        return setup, restore
    if language in ("javascript", "typescript"):
        # Deno.env is process.env; the snippets leave no names and no value.
        keys = json.dumps(sorted(env))
        setup = (
            f"globalThis.__torpor_env = Object.fromEntries({keys}.map((k) => [k, Deno.env.get(k)]));\n"
            f"for (const [k, v] of Object.entries({json.dumps(env)})) Deno.env.set(k, v);\n"
            "undefined;"
        )
        restore = (
            "for (const [k, v] of Object.entries(globalThis.__torpor_env ?? {})) "
            "v === undefined ? Deno.env.delete(k) : Deno.env.set(k, v);\n"
            "delete globalThis.__torpor_env;\n"
            "undefined;"
        )
        return setup, restore
    setup, restore = [], []
    for k, v in sorted(env.items()):
        setup.append(f"__torpor_set_{k}=${{{k}+x}}; __torpor_val_{k}=${{{k}-}}; export {k}={shlex.quote(v)}")
        restore.append(
            f'if [ -n "$__torpor_set_{k}" ]; then export {k}="$__torpor_val_{k}"; else unset {k}; fi; '
            f"unset __torpor_set_{k} __torpor_val_{k}"
        )
    return "\n".join(setup), "\n".join(restore)


class Cancelled(Exception):
    """The client of an execution went away."""


class Context:
    """One kernel: its manager, its client, and one execution at a time."""

    def __init__(self, server, language, cwd):
        self.server = server
        self.id = str(uuid.uuid4())
        self.language = language
        self.cwd = cwd
        self.fenced = LANGUAGES[language] in FENCED
        self.lock = threading.Lock()
        self.restarting = threading.Event()
        self.km = None
        self.kc = None

    def describe(self):
        return {"id": self.id, "language": self.language, "cwd": self.cwd}

    # --- lifecycle (on the server's manager thread) ------------------------
    def start(self):
        # IPC sockets in the server's private directory, not TCP ports
        # other processes in the guest could reach; Deno's kernel speaks
        # TCP only: loopback ports, its messages signed with the
        # connection's random key as every kernel's are.
        spec = LANGUAGES[self.language]
        if spec in TCP_ONLY:
            where = {"transport": "tcp", "ip": "127.0.0.1"}
        else:
            where = {"transport": "ipc", "ip": os.path.join(self.server.runtime, self.id)}
        km = KernelManager(kernel_name=spec, kernel_spec_manager=self.server.specs, **where)
        km.start_kernel(cwd=self.cwd)
        self.km = km
        self._connect()

    def _connect(self):
        kc = self.km.client()
        kc.start_channels()
        try:
            resolve(kc.wait_for_ready(timeout=self.server.kernel_timeout))
        except Exception:
            kc.stop_channels()
            raise
        self.kc = kc

    def prepare(self):
        """Runs the spec's prelude in a new kernel (not on the manager thread)."""
        prelude = PRELUDES.get(LANGUAGES[self.language])
        if prelude and self.kc is not None:
            self.run(prelude, lambda m: None, lambda: False, silent=True)

    def restart_kernel(self):
        """Restarts the kernel and prepares the new one."""
        self.server.manage(self.restart)
        self.prepare()

    def restart(self):
        if self.kc is not None:
            self.kc.stop_channels()
            self.kc = None
        self.km.restart_kernel(now=True)
        self._connect()

    def shutdown(self):
        if self.kc is not None:
            self.kc.stop_channels()
            self.kc = None
        if self.km is not None:
            self.km.shutdown_kernel(now=True)

    # --- executions (on the request's thread, holding self.lock) ----------
    def run(self, code, emit, gone, silent=False):
        """Runs `code`; passes each protocol message to `emit` (unless
        silent). `gone()` says the client left: then the kernel is
        interrupted and Cancelled raised once it is idle again."""
        kc = self.kc
        if kc is None:
            raise InterpError(HTTPStatus.SERVICE_UNAVAILABLE, "the context's kernel is not running")
        msg_id = kc.execute(code, silent=silent, store_history=not silent, allow_stdin=False, stop_on_error=True)
        # The execution's output comes as children of its request, or (a
        # fenced kernel's, trailing) of its fence's.
        parents = {msg_id}
        fence = None
        fence_deadline = None
        quiet = True  # no output since the current fence was sent
        reply = None
        errored = False
        checked = time.monotonic()
        while True:
            if gone():
                if fence is not None:
                    raise Cancelled()  # the execution is over: nothing to interrupt
                self.interrupt_until_idle(msg_id)
                raise Cancelled()
            if self.restarting.is_set():
                emit({"type": "error", "name": "ContextRestarting", "value": "Context was restarted", "traceback": ""})
                return
            if fence is not None and time.monotonic() > fence_deadline:
                log.warning("context %s: output still trailing %.0f s after an execution", self.id, FENCE_TIMEOUT)
                break
            try:
                msg = get_msg(kc.iopub_channel, 0.2)
            except Empty:
                if time.monotonic() - checked > 1:
                    checked = time.monotonic()
                    if not self.server.manage(self.km.is_alive):
                        self.restart_kernel()
                        emit({
                            "type": "error",
                            "name": "KernelDied",
                            "value": "The kernel died during the execution; it was restarted and its state is lost",
                            "traceback": "",
                        })
                        return
                continue
            parent = msg.get("parent_header", {}).get("msg_id")
            if parent not in parents:
                continue
            kind, content = msg["msg_type"], msg["content"]
            if kind in ("stream", "execute_result", "display_data", "error"):
                quiet = False
            if kind == "status":
                if content.get("execution_state") != "idle":
                    continue
                if parent == fence:
                    self.shell_reply(fence, timeout=2.0)
                    if quiet:
                        break
                elif parent == msg_id and reply is None:
                    reply = self.shell_reply(msg_id)
                    if reply is None or silent or not self.fenced:
                        break
                    fence_deadline = time.monotonic() + FENCE_TIMEOUT
                else:
                    continue
                fence = kc.execute("", silent=True, store_history=False, allow_stdin=False, stop_on_error=False)
                parents.add(fence)
                quiet = True
            elif kind == "stream":
                name = "stderr" if content.get("name") == "stderr" else "stdout"
                emit({"type": name, "text": content.get("text", ""), "timestamp": timestamp(msg)})
            elif kind == "execute_input":
                count = content.get("execution_count")
                if count is not None and parent == msg_id:
                    emit({"type": "number_of_executions", "execution_count": count})
            elif kind == "execute_result":
                emit(result_message(content, True))
            elif kind == "display_data":
                emit(result_message(content, False))
            elif kind == "error" and not errored:
                errored = True
                emit(self.error_message(content))
        if reply is None:
            return
        status = reply["content"].get("status")
        if status == "error" and not errored:
            emit(self.error_message(reply["content"]))
        elif status == "aborted":
            emit({"type": "error", "name": "ExecutionAborted", "value": "Execution was aborted", "traceback": ""})

    @staticmethod
    def error_message(content):
        return {
            "type": "error",
            "name": content.get("ename", ""),
            "value": content.get("evalue", ""),
            "traceback": "\n".join(content.get("traceback", [])),
        }

    def shell_reply(self, msg_id, timeout=10.0):
        """The execute_reply to `msg_id`; replies to older requests (an
        interrupted execution's) are dropped on the way."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                reply = get_msg(self.kc.shell_channel, 0.2)
            except Empty:
                continue
            if reply.get("parent_header", {}).get("msg_id") == msg_id:
                return reply
        return None

    def interrupt_until_idle(self, msg_id):
        """Interrupts the kernel and waits until it is idle; a kernel that
        will not be interrupted, or exits on the interrupt, is restarted."""
        log.info("context %s: client gone, interrupting the kernel", self.id)
        self.server.manage(self.km.interrupt_kernel)
        deadline = time.monotonic() + self.server.interrupt_grace
        while time.monotonic() < deadline:
            try:
                msg = get_msg(self.kc.iopub_channel, 0.2)
            except Empty:
                # A kernel that exits on the interrupt is restarted at once.
                if not self.server.manage(self.km.is_alive):
                    log.warning("context %s: the kernel exited on the interrupt; restarting it", self.id)
                    self.restart_kernel()
                    return
                continue
            if (
                msg.get("parent_header", {}).get("msg_id") == msg_id
                and msg["msg_type"] == "status"
                and msg["content"].get("execution_state") == "idle"
            ):
                self.shell_reply(msg_id, timeout=2.0)
                return
        log.warning("context %s: the kernel did not stop after an interrupt; restarting it", self.id)
        self.restart_kernel()


class Interpreter:
    """The contexts, the default context per language, and the kernel manager thread."""

    def __init__(self, home, max_output, kernel_timeout, interrupt_grace):
        self.home = home
        self.max_output = max_output
        self.kernel_timeout = kernel_timeout
        self.interrupt_grace = interrupt_grace
        self.runtime = tempfile.mkdtemp(prefix="torpor-interp-")  # mode 0700
        self.specs = KernelSpecManager()
        self.specs.kernel_dirs = [KERNEL_DIR] + list(self.specs.kernel_dirs)
        # Kernel managers run their (sync-wrapped async) lifecycle calls on
        # one thread: one event loop, never one per request.
        self._manager = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kernels")
        self._lock = threading.Lock()
        self.contexts = {}
        self.defaults = {}
        self._default_locks = {lang: threading.Lock() for lang in LANGUAGES}

    def manage(self, fn, *args):
        return self._manager.submit(fn, *args).result()

    def create(self, language, cwd):
        if not os.path.isdir(cwd):
            raise InterpError(HTTPStatus.BAD_REQUEST, f"cwd {cwd!r} is not a directory")
        ctx = Context(self, language, cwd)
        try:
            self.manage(ctx.start)
            ctx.prepare()
        except Exception as e:  # noqa: BLE001 - the kernel's own error, reported
            log.exception("starting a %s kernel", language)
            self.manage(ctx.shutdown)
            raise InterpError(HTTPStatus.INTERNAL_SERVER_ERROR, f"cannot start a {language} kernel: {e}") from e
        with self._lock:
            self.contexts[ctx.id] = ctx
        log.info("context %s: %s kernel in %s", ctx.id, language, cwd)
        return ctx

    def default(self, language):
        with self._default_locks[language]:
            with self._lock:
                ctx = self.contexts.get(self.defaults.get(language))
            if ctx is None:
                ctx = self.create(language, self.home)
                with self._lock:
                    self.defaults[language] = ctx.id
            return ctx

    def get(self, context_id):
        with self._lock:
            ctx = self.contexts.get(context_id)
        if ctx is None:
            raise InterpError(HTTPStatus.NOT_FOUND, f"Context {context_id} not found")
        return ctx

    def list(self):
        with self._lock:
            return [c.describe() for c in self.contexts.values()]

    def acquire(self, ctx, gone):
        """Waits for the context's turn; gives up if the client leaves."""
        while not ctx.lock.acquire(timeout=0.2):
            if gone():
                raise Cancelled()

    def restart(self, ctx):
        ctx.restarting.set()
        try:
            if not ctx.lock.acquire(timeout=self.interrupt_grace + 10):
                raise InterpError(HTTPStatus.CONFLICT, f"context {ctx.id} is busy and cannot be restarted")
        finally:
            ctx.restarting.clear()
        try:
            ctx.restart_kernel()
        finally:
            ctx.lock.release()

    def remove(self, ctx):
        with self._lock:
            self.contexts.pop(ctx.id, None)
            for lang, cid in list(self.defaults.items()):
                if cid == ctx.id:
                    del self.defaults[lang]
        ctx.restarting.set()
        got = ctx.lock.acquire(timeout=self.interrupt_grace + 10)
        try:
            self.manage(ctx.shutdown)
        finally:
            if got:
                ctx.lock.release()

    def close(self):
        for ctx in list(self.contexts.values()):
            try:
                self.manage(ctx.shutdown)
            except Exception:  # noqa: BLE001 - shutting down anyway
                log.exception("shutting down context %s", ctx.id)
        self._manager.shutdown()
        shutil.rmtree(self.runtime, ignore_errors=True)


class Output:
    """One execution's stream: chunked NDJSON to the client, bounded."""

    def __init__(self, handler, limit):
        self.handler = handler
        self.limit = limit
        self.sent = 0
        self.cut = False
        self.broken = False

    def write_line(self, obj):
        data = (json.dumps(obj) + "\n").encode()
        try:
            self.handler.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
            self.handler.wfile.flush()
        except OSError:
            self.broken = True

    def emit(self, msg):
        if msg["type"] not in ("stdout", "stderr", "result"):
            self.write_line(msg)  # errors and counts always go through
            return
        if self.cut:
            return
        size = message_size(msg)
        if self.sent + size <= self.limit:
            self.sent += size
            self.write_line(msg)
            return
        room = self.limit - self.sent
        if msg["type"] != "result" and room > 0:
            self.write_line(dict(msg, text=msg["text"][:room]))
        self.cut = True
        self.write_line({
            "type": "stderr",
            "text": f"\n[torpor: output cut here: this execution's output passed {self.limit} bytes; "
            "the rest is dropped, the execution goes on]\n",
            "timestamp": msg.get("timestamp") or time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        })

    def gone(self):
        """True once the client closed its connection (or a write failed)."""
        if self.broken:
            return True
        sock = self.handler.connection
        try:
            readable, _, _ = select.select([sock], [], [], 0)
            if readable and sock.recv(1, socket.MSG_PEEK) == b"":
                self.broken = True
        except OSError:
            self.broken = True
        return self.broken

    def finish(self):
        self.write_line({"type": "end_of_execution"})
        if not self.broken:
            try:
                self.handler.wfile.write(b"0\r\n\r\n")
                self.handler.wfile.flush()
            except OSError:
                self.broken = True


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server_version = "torpor-interp"
    interp = None  # set by serve()

    def log_message(self, fmt, *args):
        log.debug("%s %s", self.address_string(), fmt % args)

    def send_json(self, status, body):
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def send_text(self, status, text):
        data = text.encode()
        self.send_response(status)
        self.send_header("Content-Type", "text/plain; charset=utf-8")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def body(self):
        length = int(self.headers.get("Content-Length") or 0)
        if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
            raise InterpError(HTTPStatus.LENGTH_REQUIRED, "send the body with a Content-Length")
        if length > MAX_BODY:
            raise InterpError(HTTPStatus.REQUEST_ENTITY_TOO_LARGE, f"the body is over {MAX_BODY} bytes")
        raw = self.rfile.read(length) if length else b""
        if not raw.strip():
            return {}
        try:
            body = json.loads(raw)
        except ValueError as e:
            raise InterpError(HTTPStatus.BAD_REQUEST, f"the body is not JSON: {e}") from e
        if not isinstance(body, dict):
            raise InterpError(HTTPStatus.BAD_REQUEST, "the body must be a JSON object")
        return body

    def route(self, method):
        path = self.path.split("?", 1)[0].rstrip("/") or "/"
        parts = path.strip("/").split("/")
        try:
            if method == "GET" and path == "/health":
                return self.send_json(200, "OK")
            if method == "POST" and path == "/execute":
                return self.execute(self.body())
            if path == "/contexts":
                if method == "GET":
                    return self.send_json(200, self.interp.list())
                if method == "POST":
                    body = self.body()
                    language = normalize_language(body.get("language"))
                    cwd = body.get("cwd") or self.interp.home
                    return self.send_json(200, self.interp.create(language, cwd).describe())
            if len(parts) == 3 and parts[0] == "contexts" and parts[2] == "restart" and method == "POST":
                self.interp.restart(self.interp.get(parts[1]))
                return self.send_json(200, None)
            if len(parts) == 2 and parts[0] == "contexts" and method == "DELETE":
                self.interp.remove(self.interp.get(parts[1]))
                return self.send_json(200, None)
            self.send_text(HTTPStatus.NOT_FOUND, f"no route {method} {path}")
        except InterpError as e:
            self.send_text(e.status, e.message)

    def execute(self, body):
        code = body.get("code")
        if not isinstance(code, str):
            raise InterpError(HTTPStatus.BAD_REQUEST, "code must be a string")
        context_id, language = body.get("context_id"), body.get("language")
        if context_id and language:
            raise InterpError(HTTPStatus.BAD_REQUEST, "Only one of context_id or language can be provided")
        env = body.get("env_vars") or {}
        if not isinstance(env, dict) or not all(
            isinstance(k, str) and ENV_NAME.match(k) and isinstance(v, str) for k, v in env.items()
        ):
            raise InterpError(HTTPStatus.BAD_REQUEST, "env_vars must map variable names to strings")
        if context_id:
            ctx = self.interp.get(context_id)
        else:
            ctx = self.interp.default(normalize_language(language))

        out = Output(self, self.interp.max_output)
        self.send_response(200)
        self.send_header("Content-Type", "application/x-ndjson")
        self.send_header("Transfer-Encoding", "chunked")
        self.send_header("Cache-Control", "no-cache")
        self.end_headers()
        self.wfile.flush()
        try:
            self.interp.acquire(ctx, out.gone)
        except Cancelled:
            self.close_connection = True
            return
        try:
            if env:
                setup, restore = env_code(ctx.language, env)
                ctx.run(setup, lambda m: None, out.gone, silent=True)
            try:
                ctx.run(code, out.emit, out.gone)
            finally:
                if env and ctx.kc is not None:
                    ctx.run(restore, lambda m: None, lambda: False, silent=True)
        except Cancelled:
            self.close_connection = True
            return
        except InterpError as e:
            out.emit({"type": "error", "name": "InterpreterError", "value": e.message, "traceback": ""})
        finally:
            ctx.lock.release()
        out.finish()
        if out.broken:
            self.close_connection = True

    def do_GET(self):
        self.route("GET")

    def do_POST(self):
        self.route("POST")

    def do_DELETE(self):
        self.route("DELETE")


# What --warm-up runs in the default Python kernel: a silent execution (no
# execution count, no history) whose names are deleted; the modules stay
# loaded, matplotlib's fonts and Agg renderer too.
WARM_UP = """\
import io as _torpor_io
import numpy as _torpor_np, pandas as _torpor_pd, matplotlib.pyplot as _torpor_plt
_torpor_f = _torpor_plt.figure()
_torpor_plt.plot([0, 1], [0, 1])
_torpor_f.savefig(_torpor_io.BytesIO(), format="png")
_torpor_plt.close(_torpor_f)
_torpor_pd.DataFrame({"a": [1]})._repr_html_()
del _torpor_io, _torpor_np, _torpor_pd, _torpor_plt, _torpor_f
"""


def warm_up(interp, python):
    """--warm-up: the data stack loaded in the default Python kernel and the
    default bash kernel started, before the port answers. An image's
    template snapshot (taken once /health answers) then holds them, so a
    sandbox's first plot or bash call does not pay for them."""
    started = time.monotonic()
    with python.lock:
        python.run(WARM_UP, lambda m: None, lambda: False, silent=True)
    interp.default("bash")
    log.info("warmed up in %.1f s: numpy, pandas, matplotlib loaded; bash started", time.monotonic() - started)


def main(argv=None):
    p = argparse.ArgumentParser(description="torpor's code interpreter server (E2B code interpreter protocol)")
    p.add_argument("--listen", default="0.0.0.0:49999", help="address:port to listen on (default 0.0.0.0:49999)")
    p.add_argument("--home", default=None, help="default working directory of contexts (default: $HOME)")
    p.add_argument(
        "--max-output-bytes", type=int, default=4 << 20, help="output bound per execution (default 4 MiB)"
    )
    p.add_argument("--kernel-timeout", type=float, default=120.0, help="seconds a new kernel has to answer")
    p.add_argument(
        "--interrupt-grace", type=float, default=10.0, help="seconds an interrupted kernel has before a restart"
    )
    p.add_argument(
        "--warm-up",
        action="store_true",
        help="before listening, load numpy, pandas and matplotlib in the default Python kernel "
        "(silently, leaving no names) and start the default bash kernel",
    )
    p.add_argument("--verbose", action="store_true")
    args = p.parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="torpor-interp: %(levelname)s %(message)s",
        stream=sys.stderr,
    )
    host, _, port = args.listen.rpartition(":")
    home = args.home or os.environ.get("HOME") or os.getcwd()
    interp = Interpreter(home, args.max_output_bytes, args.kernel_timeout, args.interrupt_grace)
    # The default Python kernel is up before the port answers: /health
    # means ready.
    python = interp.default("python")
    if args.warm_up:
        warm_up(interp, python)
    Handler.interp = interp
    server = ThreadingHTTPServer((host or "0.0.0.0", int(port)), Handler)
    server.daemon_threads = True
    # SIGTERM stops the server and shuts the kernels down.
    signal.signal(signal.SIGTERM, lambda *_: threading.Thread(target=server.shutdown, daemon=True).start())
    print(f"torpor-interp: listening on {server.server_address[0]}:{server.server_address[1]}", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
        interp.close()


if __name__ == "__main__":
    main()

"""Stateful sessions inside a zygote: a Python REPL per episode; its variables persist across calls.

Stdlib-only and part of the zygote program (`zygote.zygote_program` loads it before `zygote.py`);
the trusted side is `jaxrl/sandbox/session_pool.py`. A zygote holds at most one session at a time,
so a session is isolated from every other exactly as a stateless job is (its own slot uid, or its
own namespaces in tier A).

Wire: the pool sends marshal'd specs with a "session" key on the zygote's fd 0:

  {"session": "open", "memory_mb", "cpu_s"}         fork the session process (limits as a job's)
  {"session": "call", "code", "timeout_s", "max_output_bytes"}
  {"session": "close"}                              kill its process tree, wipe what it wrote

and gets one frame back per spec: SESSION_HEADER (status index, flags, t_start, t_end, len out,
len err) + stdout + stderr. The session process runs `repl`: it reads cells from fd 3 and, after
each, writes one status byte to fd 4. Its stdout/stderr are pipes the zygote reads with a cap per
call. A call that passes its wall-clock timeout, writes more than its cap, or whose process exits,
ends the session: its whole process tree is killed, the job dir wiped (flag CLOSED). The session
can forge its own status bytes; that only confuses its own observations, never a verdict (verdicts
are never taken in a session).
"""

import os
import struct
from time import monotonic as _now

SESSION_STATUSES = ("ok", "error", "timeout", "output_limit", "exited", "closed", "no_session")
SESSION_HEADER = struct.Struct("<BBddII")
CLOSED, RETIRED = 1, 2  # flags: the session ended with this op; the zygote exits after replying
MAX_CELL_BYTES = 1 << 20


def repl(sb, cmd_fd: int = 3, ctl_fd: int = 4) -> None:
    """The session process's loop (`sb`: the zygote module): one cell per frame on `cmd_fd`,
    run in one persistent namespace; a final expression's value is printed, as an interactive
    interpreter does."""
    import ast
    import sys
    import traceback

    names = {"__name__": "__main__", "__builtins__": __builtins__}
    while True:
        try:
            (n,) = sb.LEN.unpack(sb.read_exact(cmd_fd, 4))
            src = sb.read_exact(cmd_fd, min(n, MAX_CELL_BYTES)).decode("utf-8", "replace")
        except (EOFError, OSError):
            os._exit(0)
        ok = b"\x00"
        try:
            tree = ast.parse(src, "<cell>", "exec")
            last = tree.body.pop() if tree.body and isinstance(tree.body[-1], ast.Expr) else None
            exec(compile(tree, "<cell>", "exec"), names)
            if last is not None:
                value = eval(compile(ast.Expression(last.value), "<cell>", "eval"), names)
                if value is not None:
                    print(repr(value))
        except SystemExit:
            raise  # ends the session, as exit() ends an interpreter
        except BaseException:  # noqa: BLE001 - the cell's error is its output
            ok = b"\x01"
            kind, value, tb = sys.exc_info()
            try:
                traceback.print_exception(kind, value, tb.tb_next if tb else None)
            except BaseException:  # noqa: BLE001
                sb._try_write(2, b"cell raised an exception\n")
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except BaseException:  # noqa: BLE001
                pass
        sb._try_write(ctl_fd, ok)


class SessionHost:
    """The zygote's side of its (at most one) open session."""

    def __init__(self, zygote, zygote_module):
        self.z, self.sb = zygote, zygote_module
        self.pid = self.pidfd = None
        self.fds: dict[str, int] = {}

    def handle(self, spec: dict) -> bytes:
        op = spec.get("session")
        t0 = _now()
        if op == "open":
            if self.pid is not None:
                self.end()
            self.open(spec)
            return self.reply("ok", 0, t0)
        if op == "close":
            if self.pid is None:
                return self.reply("no_session", 0, t0)
            return self.reply("closed", self.end(), t0)
        if op == "call":
            if self.pid is None:
                return self.reply("no_session", 0, t0)
            return self.call(spec)
        return self.reply("no_session", 0, t0, err=f"unknown session op {op!r}".encode())

    def reply(self, status, flags, t_start, out=b"", err=b"") -> bytes:
        return SESSION_HEADER.pack(SESSION_STATUSES.index(status), flags, t_start, _now(),
                                   len(out), len(err)) + out + err

    def open(self, spec: dict) -> None:
        z, jobdir = self.z, self.z.cfg["jobdir"]
        z.mtimes = [self.sb._mtime(d) for d in z.owned_dirs]
        try:
            os.mkdir(jobdir, 0o700)
        except FileExistsError:
            z.wipe(jobdir)
            os.mkdir(jobdir, 0o700)
        if z.uid >= 0:
            os.chown(jobdir, z.uid, z.gid)
        out_r, out_w = os.pipe2(os.O_CLOEXEC | os.O_NONBLOCK)
        err_r, err_w = os.pipe2(os.O_CLOEXEC | os.O_NONBLOCK)
        cmd_r, cmd_w = os.pipe2(os.O_CLOEXEC)
        ctl_r, ctl_w = os.pipe2(os.O_CLOEXEC | os.O_NONBLOCK)
        job = dict(stdin=b"", files={}, memory_mb=int(spec["memory_mb"]),
                   timeout_s=float(spec["cpu_s"]))  # RLIMIT_CPU of the whole session
        pid = os.fork()
        if pid == 0:
            os.set_blocking(ctl_w, True)
            z.child(job, jobdir, out_w, err_w, extra_fds=(cmd_r, ctl_w),
                    body=lambda: repl(self.sb))
        for fd in (out_w, err_w, cmd_r, ctl_w):
            os.close(fd)
        os.set_blocking(cmd_w, False)
        self.pid, self.fds = pid, dict(out=out_r, err=err_r, cmd=cmd_w, ctl=ctl_r)
        try:
            self.pidfd = os.pidfd_open(pid)
        except OSError:
            self.pidfd = None

    def call(self, spec: dict) -> bytes:
        fds, cap = self.fds, int(spec["max_output_bytes"])
        t_start = _now()
        deadline = t_start + float(spec["timeout_s"])
        try:
            os.read(fds["ctl"], 4096)  # status bytes the session forged between calls
        except (BlockingIOError, OSError):
            pass
        code = spec["code"].encode("utf-8", "replace")[:MAX_CELL_BYTES]
        pending = memoryview(self.sb.LEN.pack(len(code)) + code)
        bufs = {fds["out"]: bytearray(), fds["err"]: bytearray()}
        poller = self.z.select.poll()
        for fd in (fds["out"], fds["err"], fds["ctl"], 0):
            poller.register(fd, self.z.select.POLLIN)
        poller.register(fds["cmd"], self.z.select.POLLOUT)
        if self.pidfd is not None:
            poller.register(self.pidfd, self.z.select.POLLIN)
        status = None
        while status is None:
            left = deadline - _now()
            if left <= 0:
                status = "timeout"
                break
            wait_ms = left * 1000 if self.pidfd is not None else min(left * 1000, 2)
            for fd, _ in poller.poll(max(1, int(wait_ms + 0.999))):
                if fd == 0:
                    self.end()
                    self.z.owner_gone()
                elif fd == fds["cmd"]:
                    try:
                        pending = pending[os.write(fd, pending):]
                    except BlockingIOError:
                        pass
                    except OSError:  # the session closed its command pipe: it cannot go on
                        status = "exited"
                    if not pending:
                        poller.unregister(fd)
                elif fd == fds["ctl"]:
                    try:
                        got = os.read(fd, 1)
                    except BlockingIOError:
                        continue
                    if not got:
                        poller.unregister(fd)  # closed by the session: wait for exit or timeout
                    elif not pending:
                        status = "ok" if got == b"\x00" else "error"
                elif fd == self.pidfd:
                    status = "exited"
                elif not self.z.pump(fd, bufs[fd], cap, poller):
                    status = "output_limit"
            if status is None and self.pidfd is None and os.waitpid(self.pid, os.WNOHANG)[0]:
                status = "exited"
        for fd, buf in bufs.items():
            if len(buf) <= cap and not self.z.pump(fd, buf, cap, None, drain=True):
                status = "output_limit"
        out, err = bytes(bufs[fds["out"]][:cap]), bytes(bufs[fds["err"]][:cap])
        flags = 0 if status in ("ok", "error") else self.end()
        return self.reply(status, flags, t_start, out, err)

    def end(self) -> int:
        """Kills the session's process tree, wipes what it wrote; the flags of the reply."""
        self.sb._kill(-self.pid)
        self.sb._kill(self.pid)
        try:
            os.waitpid(self.pid, 0)
        except ChildProcessError:
            pass
        for fd in (*self.fds.values(), *(() if self.pidfd is None else (self.pidfd,))):
            os.close(fd)
        self.pid = self.pidfd = None
        self.fds = {}
        self.z.sweep()
        self.z.wipe(self.z.cfg["jobdir"])
        return CLOSED | (RETIRED if self.z.leftovers else 0)

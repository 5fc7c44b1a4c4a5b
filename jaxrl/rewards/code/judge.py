"""Programs that run inside the sandbox for `code_tests` (built into jobs by `harness`).

JUDGE_SRC is the job: it never loads a candidate's code. For each item of the job (a completion
and its tests) it gets a candidate process that only computes values (BOOT_SRC), runs the item's
test code in a fresh namespace with proxies for the candidate's functions, and writes verdict
lines to its stdout, which no candidate can reach. Candidates come from SERVER_SRC, a fork server
the judge starts as a fresh interpreter (an exec: it never holds the job, so nothing a candidate
inherits from it is test data), or, when there is no server (one-item jobs, a dead server, a
restart after a timeout), as a fresh interpreter of their own. The items of one job run one after
the other; before the next item the judge kills the previous candidate and, as child subreaper,
every process it left. Design and the threat model: docs/sandbox.md.
"""

from __future__ import annotations

from jaxrl.rewards.code.wire import CODEC_SRC

# The candidate's process: `python -I -S -c BOOT calls`. Its source is on fd 3 (a memfd),
# requests on fd 4, replies on fd 5; fds 0-2 are /dev/null.
BOOT_SRC = r'''
import os, sys
_src = b""
while True:
    _c = os.read(3, 1 << 20)
    if not _c:
        break
    _src += _c
os.close(3)
_src = _src.decode("utf-8", "surrogatepass")
import marshal
__CODEC__
# No json here (importing it doubles this interpreter's start-up): requests come as marshal of
# wire values (from the judge), replies go out as JSON text written by _j.
_ESC = {i: "\\u%04x" % i for i in range(32)}
_ESC[34], _ESC[92] = '\\"', "\\\\"
_FLOATS = {"nan": "NaN", "inf": "Infinity", "-inf": "-Infinity"}


def _j(w):
    t = type(w)
    if w is None:
        return "null"
    if t is bool:
        return "true" if w else "false"
    if t is int:
        return int.__repr__(w)
    if t is float:
        r = float.__repr__(w)
        return _FLOATS.get(r, r)
    if t is str:
        return '"' + w.translate(_ESC) + '"'
    return "[" + ",".join([_j(x) for x in w]) + "]"


def _read(n):
    b = b""
    while len(b) < n:
        c = os.read(4, n - len(b))
        if not c:
            os._exit(0)
        b += c
    return b


def _send(o):
    data = _j(o).encode("utf-8", "surrogatepass")
    data = len(data).to_bytes(4, "big") + data
    while data:
        data = data[os.write(5, data):]


def _why(e):
    try:
        return (type(e).__name__ + ": " + str(e))[:300]
    except BaseException:
        return "exception"


_send(["boot"])  # the interpreter works; from here on, what happens is the candidate's doing
_ns = {"__name__": "__solution__"}
try:
    exec(compile(_src, "<solution>", "exec"), _ns)
except BaseException as e:
    _send(["load", _why(e)])
    os._exit(0)
_send(["ready", [k for k, v in list(_ns.items()) if type(k) is str and callable(v)]])
while True:
    _name, _a, _k = marshal.loads(_read(int.from_bytes(_read(4), "big")))
    try:
        if "." in _name:  # "Class.method": LeetCode style, called on a fresh instance
            _cls, _meth = _name.split(".", 1)
            _f = getattr(_ns[_cls](), _meth)
        else:
            _f = _ns[_name]
        _v = _f(*_dec(_a), **_dec(_k))
        try:
            _r = _j(["v", _enc(_v)])
        except BaseException as e:
            _r = _j(["x", _why(e)])
    except BaseException as e:
        try:
            _r = _j(["e", str.__str__(type(e).__name__)[:100], _why(e)])
        except BaseException:
            _r = '["e", "Exception", "exception"]'
    _r = _r.encode("utf-8", "surrogatepass")
    os.write(5, len(_r).to_bytes(4, "big"))
    while _r:
        _r = _r[os.write(5, _r):]
'''.replace("__CODEC__", CODEC_SRC)


# The fork server: `python -I -S -c SERVER_SRC <items> <base>`. fd 3: requests (an item index
# per line), fd 4: replies (the candidate's pid per line); item i's source memfd, request-pipe
# read end and reply-pipe write end are fds base + 3i, +1, +2.
SERVER_SRC = r'''
import os, sys
import ctypes
ctypes.CDLL(None).prctl(4, 0, 0, 0, 0)  # PR_SET_DUMPABLE 0: candidates cannot reach this process
for _m in ("math", "re", "collections", "itertools", "functools", "heapq", "bisect", "string",
           "random", "fractions", "decimal", "statistics", "typing"):
    __import__(_m)  # once here, so candidates start warm (the zygote's list, minus json and ast)
_BOOT = compile(BOOT_TEXT, "<boot>", "exec")
_n, _base = int(sys.argv[1]), int(sys.argv[2])
_buf = b""
while True:
    while b"\n" not in _buf:
        _c = os.read(3, 64)
        if not _c:
            os._exit(0)
        _buf += _c
    _line, _buf = _buf.split(b"\n", 1)
    _i = int(_line)
    _fds = (_base + 3 * _i, _base + 3 * _i + 1, _base + 3 * _i + 2)
    _pid = os.fork()
    if _pid == 0:
        try:
            os.setsid()
            for _k, _fd in enumerate(_fds):
                os.dup2(_fd, 3 + _k)
            os.closerange(6, max(os.sysconf("SC_OPEN_MAX"), 256))  # other items' pipes, ours
            del _buf, _line, _c
            exec(_BOOT, {"__name__": "__boot__"})
        finally:
            os._exit(0)
    for _fd in _fds:
        os.close(_fd)
    os.write(4, b"%d\n" % _pid)
    while True:  # reap the candidates the judge killed
        try:
            if os.waitpid(-1, os.WNOHANG)[0] == 0:
                break
        except ChildProcessError:
            break
'''.replace("BOOT_TEXT", repr(BOOT_SRC))

# The judge: the job's own program (SPEC_JSON and BOOT/SERVER are set by the job's stub).
JUDGE_SRC = r'''
import builtins, fcntl, json, marshal, os, select, signal, sys, time
SPEC = json.loads(SPEC_JSON)
__CODEC__


class _Abort(BaseException):
    """The candidate broke the protocol, hung or died: the case fails whatever the test does."""


class _Infra(_Abort):
    """The candidate's interpreter did not start: the item is an error, not a failure."""


class CandidateError(Exception):
    """An exception the candidate raised whose type is not a builtin exception."""


_EXC = {n: c for n, c in vars(builtins).items() if isinstance(c, type) and issubclass(c, Exception)}
_now = time.monotonic
_FD_BASE = 10  # where item i's fds sit in the server: 10 + 3i (the judge's own fds are >= 100)


def _high(fd):
    new = fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, 100)
    os.close(fd)
    return new


def _memfd(data):
    fd = _high(os.memfd_create("d", os.MFD_CLOEXEC))
    os.write(fd, data)
    os.lseek(fd, 0, 0)
    return fd


def _read_line(fd, deadline):
    buf = b""
    while not buf.endswith(b"\n"):
        left = deadline - _now()
        if left <= 0 or not select.select([fd], [], [], left)[0]:
            raise _Abort("fork server did not answer")
        c = os.read(fd, 64)
        if not c:
            raise _Abort("fork server died")
        buf += c
    return buf


class Judge:
    def __init__(self):
        self.out = os.dup(1)  # the verdict channel; CLOEXEC, so no child ever gets it
        self.null = _high(os.open(os.devnull, os.O_RDWR))
        os.dup2(self.null, 1)  # what the test (or a value it prints) writes goes nowhere
        os.dup2(self.null, 2)
        self.libc = None
        try:
            import ctypes
            self.libc = ctypes.CDLL(None, use_errno=True)
            self.libc.prctl(4, 0, 0, 0, 0)  # PR_SET_DUMPABLE 0
            self.libc.prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER: orphans come back to us
        except Exception:
            pass
        self.sigs = []
        for s in signal.valid_signals():
            if s not in (signal.SIGKILL, signal.SIGSTOP, signal.SIGCHLD):
                try:
                    signal.signal(s, signal.SIG_IGN)
                    self.sigs.append(s)
                except (OSError, ValueError):
                    pass
        self.exe = sys.executable
        self.timeout = SPEC["timeout"]
        self.cap = SPEC["max_reply"]
        self.server = None  # (pid, request fd, reply fd, {item: (req_w, rep_r)})
        self.pid = self.req = self.rep = None
        self.own = False  # whether self.pid is our child (direct exec) or the server's

    def write(self, line):
        data = (line + "\n").encode("utf-8", "backslashreplace")
        while data:
            data = data[os.write(self.out, data):]

    def emit(self, i, ok, why=""):
        why = " ".join(str(why).split())[:200]
        self.write("%d %d %s %s" % (self.item, i, "pass" if ok else "fail", why))

    # -- candidate processes
    def spawn(self, argv, fds):
        """fds[j] becomes the new process's fd j (-1: /dev/null for 0-2)."""
        acts = [(os.POSIX_SPAWN_DUP2, self.null if f < 0 else f, j) for j, f in enumerate(fds)]
        return os.posix_spawn(self.exe, [self.exe, "-I", "-S", "-B", "-c", *argv], dict(os.environ),
                              file_actions=acts, setsigdef=self.sigs, setsid=True)

    def start_server(self, n):
        ctl_r, ctl_w = map(_high, os.pipe())
        pid_r, pid_w = map(_high, os.pipe())
        mine, theirs = {}, []
        for i, item in enumerate(SPEC["items"]):
            src = _memfd(item["candidate"].encode("utf-8", "surrogatepass"))
            req_r, req_w = map(_high, os.pipe())
            rep_r, rep_w = map(_high, os.pipe())
            mine[i] = (req_w, rep_r)
            theirs += [src, req_r, rep_w]
        fds = [-1, -1, -1, ctl_r, pid_w] + [-1] * (_FD_BASE - 5) + theirs
        try:
            pid = self.spawn([SERVER, str(n), str(_FD_BASE)], fds)
        finally:
            for fd in [ctl_r, pid_w] + theirs:
                os.close(fd)
        self.server = (pid, ctl_w, pid_r, mine)

    def stop_server(self):
        if self.server:
            pid, ctl_w, pid_r, mine = self.server
            self.server = None
            self.kill(pid, own=True)
            for fd in [ctl_w, pid_r] + [fd for pair in mine.values() for fd in pair]:
                os.close(fd)

    def launch(self):
        """A candidate for the current item: forked by the server (once per item), else a fresh
        interpreter of its own."""
        if self.spawns > len(self.cases):
            raise _Abort("candidate restarted too often")
        self.spawns += 1
        self.t_launch = _now()
        if self.server and self.item in self.server[3]:
            pid, ctl_w, pid_r, mine = self.server
            req_w, rep_r = mine.pop(self.item)
            try:
                os.write(ctl_w, b"%d\n" % self.item)
                self.pid = int(_read_line(pid_r, _now() + self.timeout))
                self.req, self.rep, self.own, self.rbuf = req_w, rep_r, False, bytearray()
            except (OSError, ValueError, _Abort):
                for fd in (req_w, rep_r):
                    os.close(fd)
                self.stop_server()
            else:
                os.set_blocking(req_w, False)
                os.set_blocking(rep_r, False)
                return
        req_r, req_w = map(_high, os.pipe())
        rep_r, rep_w = map(_high, os.pipe())
        src = _memfd(self.item_src)
        try:
            self.pid = self.spawn([BOOT], [-1, -1, -1, src, req_r, rep_w])
        finally:
            for fd in (src, req_r, rep_w):
                os.close(fd)
        self.req, self.rep, self.own, self.rbuf = req_w, rep_r, True, bytearray()
        os.set_blocking(req_w, False)
        os.set_blocking(rep_r, False)

    def kill(self, pid, own):
        for target in (-pid, pid):
            try:
                os.kill(target, 9)
            except OSError:
                pass
        if own:
            try:
                os.waitpid(pid, 0)
            except OSError:
                pass
            return
        try:  # the server's child: wait for it to be gone (its orphans then come to us)
            fd = os.pidfd_open(pid)
        except OSError:
            return
        try:
            select.select([fd], [], [], 2.0)
        finally:
            os.close(fd)

    def stop(self):
        if self.pid is not None:
            self.kill(self.pid, self.own)
            for fd in (self.req, self.rep):
                os.close(fd)
            self.pid = self.req = self.rep = None

    def sweep(self):
        """Kills every process left by the item's candidates (they were reparented to us)."""
        keep = self.server[0] if self.server else None
        for _ in range(200):
            kids = [p for p in self.children() if p != keep]
            if not kids:
                return True
            for p in kids:
                self.kill(p, own=True)
        return False

    def children(self):
        me, kids = os.getpid(), []
        try:
            for tid in os.listdir("/proc/self/task"):
                with open("/proc/self/task/%s/children" % tid) as f:
                    kids += [int(x) for x in f.read().split()]
            return kids
        except OSError:
            pass
        for name in os.listdir("/proc"):  # no /proc/<pid>/task/<tid>/children on this kernel
            if name.isdigit():
                try:
                    with open("/proc/%s/stat" % name) as f:
                        if int(f.read().rsplit(")", 1)[1].split()[1]) == me:
                            kids.append(int(name))
                except (OSError, ValueError, IndexError):
                    pass
        return kids

    def ready(self):
        try:
            msg = self.recv(self.t_launch + self.timeout)
        except _Abort as e:  # before any candidate code ran: the sandbox cannot start Python
            raise _Infra("the candidate's interpreter did not start: %s" % e) from None
        if msg[0] != "boot":
            raise _Infra("bad boot message")
        msg = self.recv(self.t_launch + self.timeout)
        if msg[0] == "load" and len(msg) == 2:
            raise _Abort("load_error " + str(msg[1]))
        if msg[0] != "ready" or type(msg[1]) is not list:
            raise _Abort("bad ready message")
        if self.names is None:
            self.names = [n for n in msg[1] if type(n) is str and n.isidentifier()]

    def start(self):
        self.launch()
        self.ready()

    def recv(self, deadline):
        """One frame from the candidate (frames may arrive together: the rest stays buffered)."""
        buf = self.rbuf
        while True:
            if len(buf) >= 4:
                need = 4 + int.from_bytes(buf[:4], "big")
                if need > self.cap:
                    raise _Abort("reply over %d bytes" % self.cap)
                if len(buf) >= need:
                    frame = bytes(buf[4:need])
                    del buf[:need]
                    break
            left = deadline - _now()
            if left <= 0:
                raise _Abort("timeout")
            if not select.select([self.rep], [], [], left)[0]:
                continue
            chunk = os.read(self.rep, 1 << 16)
            if not chunk:
                raise _Abort("candidate died")
            buf += chunk
        try:
            msg = json.loads(frame.decode("utf-8", "surrogatepass"))
        except (ValueError, RecursionError, MemoryError):
            raise _Abort("reply is not valid data") from None
        if type(msg) is not list or not msg or type(msg[0]) is not str:
            raise _Abort("bad reply")
        return msg

    def send(self, data, deadline):
        data = len(data).to_bytes(4, "big") + data
        while data:
            left = deadline - _now()
            if left <= 0:
                raise _Abort("timeout")
            if select.select([], [self.req], [], left)[1]:
                try:
                    data = data[os.write(self.req, data):]
                except BrokenPipeError:
                    raise _Abort("candidate died") from None

    def call(self, name, args, kwargs):
        if self.aborted:
            raise _Abort("earlier failure in this case")
        payload = marshal.dumps((name, _enc(list(args)), _enc(dict(kwargs))))
        try:
            if self.pid is None:
                self.start()
            self.send(payload, self.deadline)
            msg = self.recv(self.deadline)
            if msg[0] == "v" and len(msg) == 2:
                try:
                    return _dec(msg[1])
                except (ValueError, TypeError, RecursionError, MemoryError):
                    raise _Abort("returned value is not plain data") from None
            if msg[0] == "e" and len(msg) == 3 and type(msg[1]) is str:
                exc = _EXC.get(msg[1], CandidateError)
            else:
                raise _Abort("returned value is not plain data: %s" % str(msg[-1])[:100])
        except _Abort:
            self.aborted = True
            self.stop()
            raise
        raise exc(str(msg[2]))

    def proxy(self, name):
        judge, item = self, self.item

        def candidate_function(*args, **kwargs):
            if judge.item != item:
                raise _Abort("a proxy of another item")
            return judge.call(name, args, kwargs)

        candidate_function.__name__ = candidate_function.__qualname__ = name
        return candidate_function

    # -- the tests
    def run(self):
        items = SPEC["items"]
        if len(items) > 1:
            try:
                self.start_server(len(items))
            except OSError:
                self.server = None
        for i, item in enumerate(items):
            self.write("start %d" % i)
            self.run_item(i, item)
            self.stop()
            if not self.sweep():
                return  # something keeps forking: the trusted side reruns the items not done
            self.write("done %d" % i)
        self.stop_server()

    def run_item(self, index, item):
        self.item, self.cases, self.item_src = index, item["cases"], None
        self.item_src = item["candidate"].encode("utf-8", "surrogatepass")
        self.names, self.spawns, self.aborted, self.deadline = None, 0, False, 0.0
        launch_error = None
        try:
            self.launch()  # the candidate starts while the test is set up
        except (OSError, _Abort) as e:
            launch_error = _Infra("cannot start the candidate: %s" % e)
        ns = {"__name__": "__test__", "__builtins__": builtins}
        try:
            for mod in item["auto_imports"]:
                ns[mod] = __import__(mod)
            for src in item["setup"]:
                exec(compile(src, "<test setup>", "exec"), ns)
        except BaseException as e:
            self.emit(-1, False, "setup_error %s: %s" % (type(e).__name__, e))
            return
        try:
            if launch_error:
                raise launch_error
            self.ready()
        except _Infra as e:
            self.emit(-2, False, "infra_error %s" % e)
            return
        except _Abort as e:
            for i in range(len(self.cases)):
                self.emit(i, False, e)
            return
        for name in self.names:
            if not name.startswith("__") and name not in ns and not hasattr(builtins, name):
                ns[name] = self.proxy(name)
        if item.get("entry"):
            ns[item["entry"]] = self.proxy(item["entry"])
        for i, case in enumerate(self.cases):
            self.aborted = False
            self.deadline = _now() + self.timeout
            try:
                ok, why = self.case(case, ns)
            except _Abort as e:
                ok, why = False, e
            except BaseException as e:
                ok, why = False, type(e).__name__
            self.emit(i, ok and not self.aborted, why)

    def case(self, case, ns):
        if case["k"] == "code":
            exec(compile(case["src"], "<test>", "exec"), ns)
            return True, ""
        got = self.call(case["fn"], _dec(case["args"]), _dec(case["kwargs"]))
        want = _dec(case["expected"])
        if case.get("json"):
            got, want = _lists(got), _lists(want)
        tol = case.get("tol")
        same = _close(got, want, tol[0], tol[1]) if tol else (type(got) is type(want)
                                                             and got == want)
        return same, "" if same else "wrong value"


def _lists(v):
    t = type(v)
    if t is list or t is tuple:
        return [_lists(x) for x in v]
    if t is dict:
        return {k: _lists(x) for k, x in v.items()}
    return v


def _close(a, b, rel, abs_):
    import math
    if type(a) in (int, float) and type(b) in (int, float) and float in (type(a), type(b)):
        return math.isclose(a, b, rel_tol=rel, abs_tol=abs_)
    if type(a) is type(b) and type(a) in (list, tuple):
        return len(a) == len(b) and all(_close(x, y, rel, abs_) for x, y in zip(a, b))
    if type(a) is dict and type(b) is dict:
        return a.keys() == b.keys() and all(_close(a[k], b[k], rel, abs_) for k in a)
    return type(a) is type(b) and a == b


Judge().run()
os._exit(0)
'''.replace("__CODEC__", CODEC_SRC)

"""The two-process harness of `code_tests`: the candidate computes, a clean judge decides.

One sandbox job per completion runs the *judge* program built here. The judge never loads the
candidate's code. It starts the candidate as a fresh interpreter (`posix_spawn` of `python -I -S`,
so the candidate's memory holds nothing of the judge's: no test, no expected value), then runs the
test code (asserts, HumanEval's `check(candidate)`, MBPP's `test_list`) in its own namespace,
where the candidate's functions are proxies: a call sends the arguments to the candidate process
as data and gets the return value back as data (the wire format below: None, bool, int, float,
complex, str, bytes, list, tuple, dict, set, frozenset, Counter, OrderedDict, deque; a subclass
of one of these travels as its base type's value; nothing with behaviour crosses). Every predicate,
comparison and helper of the test therefore runs in the judge with clean builtins and modules.
The judge writes one verdict line per case to its stdout, a pipe the candidate has no descriptor
for: the candidate's fds 0-2 are /dev/null, the judge is not dumpable (so `/proc/<judge>/fd` and
`/proc/<judge>/mem` are closed to the same uid) and ptrace is denied by the sandbox's seccomp
filter. The judge ignores every catchable
signal; SIGKILL/SIGSTOP from the candidate only lose verdicts, which count as failures.

The trusted side (`parse_verdicts`) reads only `<index> pass|fail <reason>` lines from a stdout
capped by the pool: bounded work, no evaluation of anything the job printed.
"""

from __future__ import annotations

import json
import marshal
import re
import sys
from typing import Any

# Shared by the trusted side (encoding expected values), the judge and the candidate bootstrap.
CODEC_SRC = r'''
_MAX_DEPTH = 100
_BASES = (bool, int, float, complex, str, bytes, list, tuple, dict, set, frozenset)


def _special():
    # Without `collections` loaded a process has no Counter (the candidate's stays lean).
    c = sys.modules.get("collections")
    return {c.Counter: "C", c.OrderedDict: "O", c.deque: "Q"} if c else {}


def _enc(v, d=0):
    t = type(v)
    if v is None or t is bool or t is int or t is float or t is str:
        return v
    if d > _MAX_DEPTH:
        raise ValueError("value nested deeper than %d" % _MAX_DEPTH)
    special = _special()
    if t in special:
        inner = _enc(list(v) if special[t] == "Q" else dict(v), d + 1)
        return [special[t], inner[1]]
    if t not in _BASES:
        for base in _BASES:  # a subclass travels as its base type's value, without behaviour
            if isinstance(v, base):
                v = base(v)
                if type(v) is not base:
                    raise TypeError("%s(value) did not give a %s" % (base.__name__,
                                                                      base.__name__))
                return _enc(v, d + 1)
    if t is list or t is tuple or t is set or t is frozenset:
        tag = {list: "l", tuple: "t", set: "s", frozenset: "f"}[t]
        return [tag, [_enc(x, d + 1) for x in v]]
    if t is dict:
        flat = []
        for k, x in v.items():
            flat.append(_enc(k, d + 1))
            flat.append(_enc(x, d + 1))
        return ["d", flat]
    if t is bytes:
        return ["b", v.hex()]
    if t is complex:
        return ["c", [v.real, v.imag]]
    raise TypeError("a value of type %s is not plain data" % t.__name__)


def _dec(v, d=0):
    t = type(v)
    if v is None or t is bool or t is int or t is float or t is str:
        return v
    if d > _MAX_DEPTH or t is not list or len(v) != 2 or type(v[0]) is not str:
        raise ValueError("malformed wire value")
    tag, p = v
    if tag == "b" and type(p) is str:
        return bytes.fromhex(p)
    if type(p) is not list:
        raise ValueError("malformed wire value")
    if tag == "c" and len(p) == 2 and all(type(x) in (int, float) for x in p):
        return complex(p[0], p[1])
    items = [_dec(x, d + 1) for x in p]
    if tag == "l":
        return items
    if tag == "t":
        return tuple(items)
    if tag == "s":
        return set(items)
    if tag == "f":
        return frozenset(items)
    if tag in ("C", "O", "Q"):
        import collections
    if tag == "Q":
        return collections.deque(items)
    if tag in ("d", "C", "O") and len(items) % 2 == 0:
        cls = dict if tag == "d" else collections.Counter if tag == "C" else collections.OrderedDict
        return cls(dict(zip(items[0::2], items[1::2])))
    raise ValueError("malformed wire value")
'''

_codec: dict[str, Any] = {"sys": sys}
exec(compile(CODEC_SRC, "<codec>", "exec"), _codec)  # noqa: S102 - our own constant source
encode, decode = _codec["_enc"], _codec["_dec"]

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

# The judge: the sandbox job's own program. SPEC is JSON made by code_formats.
JUDGE_SRC = r'''
import builtins, fcntl, json, marshal, os, select, signal, sys, time
SPEC = json.loads(SPEC_JSON)  # SPEC_JSON and BOOT are set by the job's stub (judge_source)
__CODEC__


class _Abort(BaseException):
    """The candidate broke the protocol, hung or died: the case fails whatever the test does."""


class CandidateError(Exception):
    """An exception the candidate raised whose type is not a builtin exception."""


_EXC = {n: c for n, c in vars(builtins).items() if isinstance(c, type) and issubclass(c, Exception)}
_now = time.monotonic


def _high(fd):
    new = fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, 10)
    os.close(fd)
    return new


def _memfd(data):
    fd = _high(os.memfd_create("d", os.MFD_CLOEXEC))
    os.write(fd, data)
    os.lseek(fd, 0, 0)
    return fd


class Judge:
    def __init__(self):
        self.out = os.dup(1)  # the verdict channel; CLOEXEC, so no child ever gets it
        self.null = _high(os.open(os.devnull, os.O_RDWR))
        os.dup2(self.null, 1)  # what the test (or a value it prints) writes goes nowhere
        os.dup2(self.null, 2)
        try:
            import ctypes
            ctypes.CDLL(None, use_errno=True).prctl(4, 0, 0, 0, 0)  # PR_SET_DUMPABLE 0
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
        self.src = SPEC["candidate"].encode("utf-8", "surrogatepass")
        self.timeout = SPEC["timeout"]
        self.cap = SPEC["max_reply"]
        self.pid = self.req = self.rep = None
        self.names = None
        self.spawns = 0
        self.deadline = 0.0
        self.aborted = False

    def emit(self, i, ok, why=""):
        line = "%d %s %s\n" % (i, "pass" if ok else "fail", " ".join(str(why).split())[:200])
        data = line.encode("utf-8", "backslashreplace")
        while data:
            data = data[os.write(self.out, data):]

    # -- candidate processes
    def spawn(self, mode, fds):
        """fds: what the candidate gets as 0, 1, 2 (and 4, 5); its source is fd 3."""
        src = _memfd(self.src)
        fds = list(fds[:3]) + [src] + list(fds[3:])
        acts = [(os.POSIX_SPAWN_DUP2, f, i) for i, f in enumerate(fds)]
        try:
            pid = os.posix_spawn(self.exe, [self.exe, "-I", "-S", "-c", BOOT, mode],
                                 dict(os.environ), file_actions=acts, setsigdef=self.sigs,
                                 setsid=True)
        finally:
            os.close(src)
        self.spawns += 1
        return pid

    def kill(self, pid):
        for target in (-pid, pid):
            try:
                os.kill(target, 9)
            except OSError:
                pass
        try:
            os.waitpid(pid, 0)
        except OSError:
            pass

    def stop(self):
        if self.pid is not None:
            self.kill(self.pid)
            for fd in (self.req, self.rep):
                os.close(fd)
            self.pid = self.req = self.rep = None

    def start(self):
        self.launch()
        self.ready()

    def launch(self):
        if self.spawns > len(SPEC["cases"]):
            raise _Abort("candidate restarted too often")
        req_r, req_w = map(_high, os.pipe())
        rep_r, rep_w = map(_high, os.pipe())
        try:
            self.pid = self.spawn("calls", [self.null, self.null, self.null, req_r, rep_w])
        finally:
            os.close(req_r)
            os.close(rep_w)
        self.req, self.rep = req_w, rep_r
        os.set_blocking(req_w, False)
        os.set_blocking(rep_r, False)
        self.t_launch = _now()

    def ready(self):
        msg = self.recv(self.t_launch + self.timeout)
        if msg[0] == "load" and len(msg) == 2:
            raise _Abort("load_error " + str(msg[1]))
        if msg[0] != "ready" or type(msg[1]) is not list:
            raise _Abort("bad ready message")
        if self.names is None:
            self.names = [n for n in msg[1] if type(n) is str and n.isidentifier()]

    def recv(self, deadline):
        buf = bytearray()
        need = 4
        while len(buf) < need:
            left = deadline - _now()
            if left <= 0:
                raise _Abort("timeout")
            if not select.select([self.rep], [], [], left)[0]:
                continue
            chunk = os.read(self.rep, 1 << 16)
            if not chunk:
                raise _Abort("candidate died")
            buf += chunk
            if need == 4 and len(buf) >= 4:
                need = 4 + int.from_bytes(buf[:4], "big")
                if need > self.cap:
                    raise _Abort("reply over %d bytes" % self.cap)
        if len(buf) != need:
            raise _Abort("bad frame")
        try:
            msg = json.loads(bytes(buf[4:]).decode("utf-8", "surrogatepass"))
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
        judge = self

        def candidate_function(*args, **kwargs):
            return judge.call(name, args, kwargs)

        candidate_function.__name__ = candidate_function.__qualname__ = name
        return candidate_function

    # -- the test
    def run(self):
        cases = SPEC["cases"]
        launch_error = None
        if cases:
            try:
                self.launch()  # the candidate's interpreter starts while the test is set up
            except (OSError, _Abort) as e:
                launch_error = _Abort("cannot start the candidate: %s" % e)
        ns = {"__name__": "__test__", "__builtins__": builtins}
        try:
            for mod in SPEC["auto_imports"]:
                ns[mod] = __import__(mod)
            for src in SPEC["setup"]:
                exec(compile(src, "<test setup>", "exec"), ns)
        except BaseException as e:
            self.emit(-1, False, "setup_error %s: %s" % (type(e).__name__, e))
            self.stop()
            return
        if cases:
            try:
                if launch_error:
                    raise launch_error
                self.ready()
            except _Abort as e:
                for i in range(len(cases)):
                    self.emit(i, False, e)
                return
            for name in self.names:
                if not name.startswith("__") and name not in ns and not hasattr(builtins, name):
                    ns[name] = self.proxy(name)
            if SPEC.get("entry"):
                ns[SPEC["entry"]] = self.proxy(SPEC["entry"])
        for i, case in enumerate(cases):
            self.aborted = False
            self.deadline = _now() + self.timeout
            try:
                ok, why = self.case(case, ns)
            except _Abort as e:
                ok, why = False, e
            except BaseException as e:
                ok, why = False, type(e).__name__
            self.emit(i, ok and not self.aborted, why)
        self.stop()

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
        return same, "wrong value"


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

_VERDICT_RE = re.compile(r"(-1|\d{1,7}) (pass|fail) ?(.{0,400})")


# The job: a stub that runs the judge from a marshalled code object (compiling the judge's ~300
# lines in every job cost ~3 ms of the job's CPU); any other interpreter compiles the source.
_STUB = """import marshal as _m, sys as _s
SPEC_JSON = {spec!r}
BOOT = {boot!r}
_c = None
if _s.implementation.cache_tag == {tag!r}:
    try:
        _c = _m.loads({code!r})
    except Exception:
        _c = None
exec(_c if _c is not None else compile({src!r}, "<judge>", "exec"))
"""
_judge_code: bytes | None = None


def judge_source(spec: dict) -> str:
    """The sandbox program for one completion's tests (spec made by `code_formats`)."""
    global _judge_code
    if _judge_code is None:
        _judge_code = marshal.dumps(compile(JUDGE_SRC, "<judge>", "exec", dont_inherit=True))
    return _STUB.format(spec=json.dumps(spec), boot=BOOT_SRC, tag=sys.implementation.cache_tag,
                        code=_judge_code, src=JUDGE_SRC)


def parse_verdicts(stdout: str, n: int) -> tuple[list[bool], str | None]:
    """(per case: passed, setup error or None) from the judge's stdout. A case passes only with
    exactly one line for it and that line says pass. Work is linear in the (capped) output."""
    lines: list[list[str]] = [[] for _ in range(n)]
    setup_error = None
    for line in stdout.splitlines():
        m = _VERDICT_RE.fullmatch(line)
        if not m:
            continue
        i = int(m.group(1))
        if i == -1:
            setup_error = m.group(3)
        elif i < n:
            lines[i].append(m.group(2))
    return [v == ["pass"] for v in lines], setup_error

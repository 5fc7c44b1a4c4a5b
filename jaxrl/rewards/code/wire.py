"""The wire format of values between a `code_tests` candidate and its judge (plain data only).

JSON of None, bool, int, float and str as themselves, and tagged lists for the rest:
["l"|"t"|"s"|"f", [...]] list/tuple/set/frozenset, ["d"|"C"|"O", [k, v, ...]] dict/Counter/
OrderedDict, ["Q", [...]] deque, ["b", hex] bytes, ["c", [re, im]] complex. A subclass of one of
these is sent as its base type's value; ["r", [start, stop, step]] is a range and ["i", [...]] an
iterator (a generator, `map`, ... is consumed, at most 10**6 items, and arrives as an iterator
over them). Anything else is not data. Nesting is at most 100 deep.
The same source runs in the judge and in the candidate's process (as text; `sys` must be bound),
and here on the trusted side, which encodes the expected values of function-call cases.
"""

from __future__ import annotations

import sys
from typing import Any

CODEC_SRC = r'''
_MAX_DEPTH = 100
_MAX_ITEMS = 1000000
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
    if t is range:
        return ["r", [v.start, v.stop, v.step]]
    if hasattr(t, "__next__") and hasattr(t, "__iter__"):  # a generator, map, zip, ...: its items
        items = []
        for x in v:
            if len(items) >= _MAX_ITEMS:
                raise ValueError("an iterator of more than %d items" % _MAX_ITEMS)
            items.append(x)
        return ["i", [_enc(x, d + 1) for x in items]]
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
    if tag == "r" and len(p) == 3 and all(type(x) is int for x in p) and p[2]:
        return range(p[0], p[1], p[2])
    items = [_dec(x, d + 1) for x in p]
    if tag == "l":
        return items
    if tag == "t":
        return tuple(items)
    if tag == "s":
        return set(items)
    if tag == "f":
        return frozenset(items)
    if tag == "i":  # an iterator over the items: `list(it)` works, `it == [...]` is False
        return iter(items)
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

"""Batches in flight at a checkpoint: made by the generator, not yet trained on, saved with it.

With a lead (`periodic`, `async`, `inflight`), batch `b` is generated from weights older than
version `b` while the trainer still trains earlier batches. A checkpoint after `n` steps holds
version `n`; a batch `b >= n` begun with an older version could not be made again from it, so a
resume that regenerated it would train on other rollouts than the uninterrupted run did. The loop
hands those batches to the checkpoint (`Loop` → `Checkpoints.save` → `DataStates.share`), and a
resume trains on them as they were made (`Loop.run`).

    record = encode(produced, started)        # JSON-able, for the checkpoint's extra state
    produced, started = decode(record)        # the same batch back, arrays bit for bit

`started` is the newest published version when the batch began (a lower bound on its weights).
Token ids, versions and masks (as int32), behaviour log-probs and MoE routing (as they are) travel
as base64 of their arrays (exact, and a few times smaller than JSON numbers); the rest (rewards,
metrics, samples) as JSON: about 5 bytes per prompt token and 16 per completion token (64
prompts x 8 samples x (512 + 1,024) tokens: ~10 MB), against the train state's 12+ bytes per
parameter; MoE routing adds its [layers, tokens, k] int32 per rollout.
"""

from __future__ import annotations

import base64
import dataclasses
import json
from typing import Any

import numpy as np

from jaxrl.rl.buffer import Group, Rollout
from jaxrl.rl.rollout import Produced

_ARRAYS = ("prompt", "completion", "logprobs", "versions")
_INTS, _INT = ("prompt", "completion", "versions"), np.int32  # token ids, versions: < 2**31


def _array(x) -> dict:
    a = np.ascontiguousarray(np.asarray(x))
    return {"dtype": a.dtype.str, "shape": list(a.shape),
            "b64": base64.b64encode(a.tobytes()).decode("ascii")}


def _unarray(d: dict) -> np.ndarray:
    raw = base64.b64decode(d["b64"])
    return np.frombuffer(raw, dtype=np.dtype(d["dtype"])).reshape(d["shape"]).copy()


def _json(value: Any) -> Any:
    """`value` as JSON would give it back (numpy scalars and arrays as numbers and lists)."""
    def default(x):
        if isinstance(x, (np.generic, np.ndarray)):
            return x.tolist()
        return str(x)

    return json.loads(json.dumps(value, default=default))


def _encode_rollout(r: Rollout) -> dict:
    out = {name: _array(np.asarray(getattr(r, name), _INT) if name in _INTS
                        else getattr(r, name)) for name in _ARRAYS}
    out.update(finish_reason=r.finish_reason, reward=float(r.reward),
               mask=None if r.mask is None else _array(np.asarray(r.mask, _INT)),
               routing=None if r.routing is None else _array(r.routing))
    return out


def _decode_rollout(d: dict) -> Rollout:
    return Rollout(**{name: _unarray(d[name]).tolist() for name in _ARRAYS},
                   finish_reason=d["finish_reason"], reward=d["reward"],
                   mask=None if d["mask"] is None else _unarray(d["mask"]).tolist(),
                   routing=None if d["routing"] is None else _unarray(d["routing"]))


def encode(produced: Produced, started: int) -> dict:
    groups = [{"example": _json(g.example), "weight": float(g.weight),
               "rollouts": [_encode_rollout(r) for r in g.rollouts]} for g in produced.groups]
    scalars = {f.name: getattr(produced, f.name) for f in dataclasses.fields(Produced)
               if f.name not in ("groups", "metrics", "samples")}
    return {"started": int(started), "groups": groups, **_json(scalars),
            "metrics": _json(produced.metrics), "samples": _json(produced.samples)}


def decode(record: dict) -> tuple[Produced, int]:
    groups = [Group(example=g["example"], weight=g["weight"],
                    rollouts=[_decode_rollout(r) for r in g["rollouts"]])
              for g in record["groups"]]
    fields = {f.name: record[f.name] for f in dataclasses.fields(Produced) if f.name != "groups"}
    return Produced(groups=groups, **fields), int(record["started"])

"""One-step golden test on the tiny model: loss, grad norm and updated parameters.

Regenerate with  JAXRL_UPDATE_GOLDEN=1 python -m pytest tests/train/test_golden.py
"""

import json
import os
from pathlib import Path

import jax
import numpy as np

from jaxrl.train.trainer import Trainer

GOLDEN = Path(__file__).parent / "golden" / "one_step.json"
# f32 on CPU; XLA fusion changes between releases move results by a few ulps, far below this.
RTOL = 1e-4

WHEN_TO_UPDATE = (
    "The one-step golden values changed. Updating them is legitimate ONLY when the change is "
    "intended and explained in the same commit: a deliberate change to the default algorithm "
    "maths, the optimiser or its defaults, the model's initialisation, or the tiny model config "
    "(or a jax/XLA upgrade that moves results beyond the tolerance, checked by hand). Otherwise "
    "this is a regression. To update: JAXRL_UPDATE_GOLDEN=1 python -m pytest "
    "tests/train/test_golden.py, and say why in the commit message."
)


def _fingerprint(model_cfg, mesh, train_cfg, make_toy):
    tr = Trainer(model_cfg, train_cfg, mesh)
    m = tr.step(make_toy(seed=20))
    leaves = [np.asarray(x, np.float64) for x in jax.tree.leaves(jax.device_get(tr.state.params))]
    flat = np.concatenate([x.ravel() for x in leaves])
    return {
        "loss/total": m["loss/total"],
        "train/grad_norm": m["train/grad_norm"],
        "policy/entropy": m["policy/entropy"],
        "params_sum": float(flat.sum()),
        "params_abs_sum": float(np.abs(flat).sum()),
        "params_sample": [float(v) for v in flat[:: max(1, flat.size // 16)][:16]],
    }


def test_one_step_golden(model_cfg, mesh, train_cfg, make_toy):
    got = _fingerprint(model_cfg, mesh, train_cfg, make_toy)
    if os.environ.get("JAXRL_UPDATE_GOLDEN"):
        GOLDEN.parent.mkdir(exist_ok=True)
        GOLDEN.write_text(json.dumps(got, indent=1) + "\n")
    want = json.loads(GOLDEN.read_text())
    for k, v in want.items():
        np.testing.assert_allclose(
            got[k], v, rtol=RTOL, atol=1e-7, err_msg=f"{k}: {WHEN_TO_UPDATE}"
        )

"""The jitted-step cache is keyed by everything the step computes with: a different optimizer or
objective never reuses another's compiled step; corrections declare what they need."""

import dataclasses

import jax
import numpy as np

from jaxrl.train import algorithms as A
from jaxrl.train import objective
from jaxrl.train.state import (
    init_train_state,
    make_optimizer,
    model_graphdef,
    train_state_shardings,
)
from jaxrl.train.step import batch_shardings, make_train_step


def test_a_different_optimizer_gets_its_own_step(model_cfg, mesh, train_cfg, make_toy):
    graphdef, _ = model_graphdef(model_cfg, train_cfg)
    _, shardings = train_state_shardings(model_cfg, train_cfg, mesh)
    batch = make_toy(seed=3)
    batch = jax.device_put(batch, batch_shardings(batch, mesh))

    def updated(tx):
        state = init_train_state(model_cfg, train_cfg, mesh)
        before = jax.device_get(state.params)
        step = make_train_step(graphdef, train_cfg, mesh, shardings, tx)
        new, _ = step(state, batch)
        return before, jax.device_get(new.params)

    updated(make_optimizer(train_cfg))  # AdamW at lr 1e-2: compiled and cached
    # the same optimizer state structure at learning rate 0: the params must not move
    before, after = updated(make_optimizer(dataclasses.replace(train_cfg, lr=0.0)))
    for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(after), strict=True):
        np.testing.assert_array_equal(a, b)  # an old cache keyed by cfg alone ran AdamW here


def test_corrections_declare_needs_and_scope():
    allowed = {"behaviour", "proximal"}
    for name in A.CORRECTIONS.names():
        meta = A.CORRECTIONS.meta(name)
        assert set(meta["needs"]) <= allowed and meta["scope"] in ("none", "batch", "micro_batch")
    assert A.CORRECTIONS.meta("m2po")["scope"] == "batch"
    # the objective dispatches on the registry, not on names
    source = open(objective.__file__).read()
    for name in A.CORRECTIONS.names():
        if name != "none":
            assert f'"{name}"' not in source, name

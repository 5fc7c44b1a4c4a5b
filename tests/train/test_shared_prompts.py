"""Shared prompts in the train step (`train.share_prompts`): each group's prompt runs once.

The reference is the plain forward over whole rows (itself checked against `transformers` in
tests/models): log-probs at every loss position, gradients and the updated parameters must equal
it to f32 rounding, with prompts of different lengths per group, ragged completions, padding
rows, micro-batches and remat."""

import dataclasses

import jax
import numpy as np
import pytest
from flax import nnx

from jaxrl.sharding import make_mesh
from jaxrl.train.batch import make_batch, pad_batch
from jaxrl.train.config import TrainConfig
from jaxrl.train.logprobs import full_logprobs_reference, shared_logprobs
from jaxrl.train.objective import prepare_targets
from jaxrl.train.prefix import micro_layouts, plan_prefix_layout
from jaxrl.train.state import init_train_state, model_graphdef
from jaxrl.train.step import _grads_and_stats, batch_shardings, layout_shardings
from jaxrl.train.trainer import Trainer

CFG = TrainConfig(lr=1e-2, logprob_chunk=8, weight_decay=0.0, correction="tis_token",
                  aggregation="seq_mean_token_mean")


def grpo_batch(seed=0, prompts=(5, 9, 3, 7), n=4, t=24, vocab=128, shuffle=True):
    """len(prompts) groups of n samples: one random prompt per group (its own length), random
    ragged completions after it, right padded to t; rows shuffled so groups interleave."""
    rng = np.random.default_rng(seed)
    rows, masks, segs, gids = [], [], [], []
    for g, p in enumerate(prompts):
        prompt = rng.integers(0, vocab, p)
        for _ in range(n):
            length = int(rng.integers(p + 1, t + 1))
            row = np.concatenate([prompt, rng.integers(0, vocab, t - p)])
            pos = np.arange(t)
            rows.append(row)
            segs.append((pos < length).astype(np.int32))
            masks.append(((pos >= p) & (pos < length)).astype(np.float32))
            gids.append(g)
    order = rng.permutation(len(rows)) if shuffle else np.arange(len(rows))
    pick = lambda xs: np.stack(xs)[order]
    mask = pick(masks)
    behaviour = (-np.abs(rng.normal(size=mask.shape)) - 3.0) * mask
    return make_batch(pick(rows), mask, rng.random(len(rows)).round(1), np.asarray(gids)[order],
                      segment_ids=pick(segs), behaviour_logprobs=behaviour)


def test_plan_keeps_groups_whole_and_cuts_before_the_first_completion_token():
    batch = pad_batch(grpo_batch(), 20, 32)  # 4 padding rows
    planned = plan_prefix_layout(batch, 2, min_len=8)
    assert planned is not None
    lay, out = planned.layout, planned.batch
    gid, valid = np.asarray(out.group_ids), np.asarray(out.segment_ids).any(axis=1)
    for m in range(2):  # micro-batch m = rows m, m + 2, ...: whole groups, one slot per group
        rows = np.arange(m, 20, 2)
        for g in np.unique(gid[rows][valid[rows]]):
            assert set(np.flatnonzero((gid == g) & valid) % 2) == {m}
            assert len(set(lay.group_B[rows][(gid[rows] == g) & valid[rows]])) == 1
    # prompts (5, 9, 3, 7): the shared prefix stops one token short of the first completion token
    assert sorted(lay.lengths_MG[lay.lengths_MG > 0].tolist()) == [2, 4, 6, 8]
    # every real token is computed exactly once per row, or once per group in the prefix
    assert planned.computed_tokens == planned.batch_tokens - 3 * (2 + 4 + 6 + 8)
    # the batch itself is only reordered
    key = lambda b: sorted(map(tuple, np.asarray(b.tokens).tolist()))
    assert key(out) == key(batch)


def test_plan_falls_back_where_nothing_is_shared():
    solo = grpo_batch(n=1, prompts=(5, 9, 3, 7, 6, 8, 4, 5))  # one sample per prompt
    assert plan_prefix_layout(solo, 1) is None
    packed = grpo_batch()
    packed = dataclasses.replace(packed, segment_ids=packed.segment_ids * 2)  # segment 2
    assert plan_prefix_layout(packed, 1) is None
    assert plan_prefix_layout(grpo_batch(n=4), 4) is not None  # 4 groups into 4-row parts
    # a group larger than a micro-batch is split, each part computing its prompt once
    split = plan_prefix_layout(grpo_batch(n=8, prompts=(5, 9)), 4, min_len=8)
    assert sorted(split.layout.lengths_MG.ravel().tolist()) == [4, 4, 8, 8]
    assert split.computed_tokens == split.batch_tokens - 3 * (4 + 4 + 8 + 8)
    # ... and where the parts are single rows nothing is shared
    assert plan_prefix_layout(grpo_batch(n=2, prompts=(5, 9, 3, 7)), 8) is None


@pytest.mark.parametrize("micro,olmo2", [(1, False), (2, False), (2, True)])
def test_shared_logprobs_equal_the_full_forward(model_cfg, mesh, micro, olmo2):
    if olmo2:  # post-norm layers with q/k norms over all heads
        model_cfg = dataclasses.replace(model_cfg, architecture="olmo2", post_norm=True,
                                        qk_norm=True, qk_norm_full=True)
    batch = pad_batch(grpo_batch(seed=1), 16, 32)
    planned = plan_prefix_layout(batch, micro, min_len=8)
    graphdef, _ = model_graphdef(model_cfg, CFG)
    model = nnx.merge(graphdef, init_train_state(model_cfg, CFG, mesh).params)
    want = np.asarray(full_logprobs_reference(model, planned.batch))
    lay = jax.tree.map(np.asarray, planned.layout)
    got, _ = jax.jit(lambda m, b, l: shared_logprobs(m, b, l.whole(), chunk=8))(
        model, planned.batch, lay)
    mask = np.asarray(planned.batch.loss_mask) > 0
    np.testing.assert_allclose(np.asarray(got)[mask], want[mask], rtol=1e-5, atol=1e-5)
    assert np.all(np.asarray(got)[~mask & (np.asarray(lay.inverse_BT) < 0)] == 0)
    # each micro-batch's slice on its own rows gives the same
    split = micro_layouts(lay, micro)
    one_micro = jax.jit(lambda m, b, l: shared_logprobs(m, b, l, chunk=8))
    for m in range(micro):
        one = jax.tree.map(lambda x, m=m: x[m], split)
        rows = jax.tree.map(lambda x, m=m: None if x is None else x[m::micro], planned.batch)
        part, _ = one_micro(model, rows, one)
        sel = mask[m::micro]
        np.testing.assert_allclose(np.asarray(part)[sel], want[m::micro][sel], rtol=1e-5,
                                   atol=1e-5)


@pytest.mark.parametrize("extra", [dict(micro_batches=1), dict(micro_batches=2, remat="full"),
                                   dict(micro_batches=2, remat="dots", kl_coef=0.1),
                                   dict(mini_batches=2, epochs=2, micro_batches=2, lr=1e-5)])
def test_training_step_equals_the_plain_step(model_cfg, mesh, extra):
    """Every update's loss and gradient norm, and the parameters after two batches. (With 4
    updates a batch at lr 1e-2, Adam's lr-sized steps on near-zero gradient entries amplify f32
    rounding into losses that part at 1e-4 by the eighth update; at lr 1e-5 they do not.)"""
    cfg = dataclasses.replace(CFG, **extra)
    ref = None
    if cfg.kl_coef:  # a reference policy: a perturbed copy of the start
        start = init_train_state(model_cfg, cfg, mesh).params
        ref = jax.tree.map(lambda x: x * 1.01, start)
    out = {}
    for share in (False, True):
        c = dataclasses.replace(cfg, share_prompts=share)
        trainer = Trainer(model_cfg, c, mesh, ref_params=ref)
        metrics = []
        for seed in (2, 3):  # two batches: the second runs on the shared-updated params
            flushed = trainer.step(grpo_batch(seed=seed))
            assert flushed["train/shared_prompt_frac"] == trainer.last_shared_fraction
            metrics += [flushed, *trainer.last_updates]  # the batch's, then each update's
        out[share] = (jax.device_get(trainer.state.params), metrics, trainer.last_shared_fraction)
    (p0, m0, f0), (p1, m1, f1) = out[False], out[True]
    # 4 groups of 4 rows; with 2 mini-batches x 2 micro-batches on 2 devices a cell holds 2 rows,
    # so each group is split in two and saves less
    assert f0 == 0 and f1 > (0.1 if cfg.mini_batches > 1 else 0.2)
    for a, b in zip(m0, m1, strict=True):
        for k in ("loss/total", "train/grad_norm", "policy/approx_kl"):
            assert b[k] == pytest.approx(a[k], rel=1e-4, abs=1e-6), k
        if cfg.kl_coef:
            assert b["loss/kl"] == pytest.approx(a["loss/kl"], rel=1e-4, abs=1e-6)
    # Adam moves a weight by ~lr whatever its gradient's size, so a gradient entry near 0 can
    # round to a visibly different update: compare to a tenth of lr (a wrong or missing prefix
    # gradient moves its weights by ~lr); the gradients themselves are compared tightly below
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=cfg.lr / 10),
                 p0, p1)


@pytest.mark.parametrize("micro", [1, 2])
def test_gradients_equal_the_plain_step(model_cfg, mesh, micro):
    cfg = dataclasses.replace(CFG, micro_batches=micro)
    planned = plan_prefix_layout(pad_batch(grpo_batch(seed=4), 16, 32), micro, min_len=8)
    graphdef, _ = model_graphdef(model_cfg, cfg)
    params = init_train_state(model_cfg, cfg, mesh).params

    def grads(params, batch, layout):
        tg, _ = prepare_targets(cfg, batch)
        return _grads_and_stats(params, batch, tg, layout, graphdef=graphdef, cfg=cfg)

    run = jax.jit(grads)
    g0, s0 = run(params, planned.batch, None)
    g1, s1 = run(params, planned.batch, jax.tree.map(np.asarray, planned.layout))
    scale = max(float(np.max(np.abs(x))) for x in jax.tree.leaves(g0))
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5 * scale),
                 g0, g1)
    np.testing.assert_allclose(s0["loss/total"], s1["loss/total"], rtol=1e-5)


def _flops_per_device(fn, *args):
    cost = jax.jit(fn).lower(*args).compile().cost_analysis()
    return float((cost[0] if isinstance(cost, list) else cost)["flops"])


def test_data_parallel_devices_split_the_prompts_work(model_cfg):
    """On 8 data-parallel devices, 16 groups of 4 rows with 24-token prompts: the compiled
    step's FLOPs per device (XLA's cost analysis of the partitioned program) fall with shared
    prompts, so the replicated prefixes' work is split among the devices, not repeated on each
    (every prompt on every device would be ~1.9x the plain step's FLOPs here)."""
    mesh8 = make_mesh((8, 1), "trainer", jax.devices()[:8])
    batch = pad_batch(grpo_batch(seed=6, prompts=(24,) * 16, n=4, t=32), 64, 32)
    planned = plan_prefix_layout(batch, 1, min_len=8)
    graphdef, _ = model_graphdef(model_cfg, CFG)
    params = init_train_state(model_cfg, CFG, mesh8).params
    on = jax.device_put(planned.batch, batch_shardings(planned.batch, mesh8))
    layout = jax.device_put(planned.layout, layout_shardings(planned.layout, mesh8))

    def grads(params, batch, layout):
        tg, _ = prepare_targets(CFG, batch)
        return _grads_and_stats(params, batch, tg, layout, graphdef=graphdef, cfg=CFG)

    with jax.set_mesh(mesh8):
        plain = _flops_per_device(grads, params, on, None)
        shared = _flops_per_device(grads, params, on, layout)
    # per device: 8 rows x 32 positions plain; 2 prefixes x 24 + 8 x 12 suffix positions shared
    # (the buckets), ~0.56 of the plain (measured 0.55)
    assert shared < 0.7 * plain, (shared, plain)

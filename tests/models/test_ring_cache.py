"""Sliding layers' KV kept as a ring of their window (`KVCache` / `PagedKVCache` with
`ring=True`, what the generation engine makes): the model's decode through it equals the full
cache (which tests/models/test_gemma.py checks against `transformers`) over a padded chunked
prefill, a second chunk and one-token steps to ~4x the window; the memory it keeps, from the
real arrays, against the memory plan's and the planner's figures."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl.config import GenerateConfig, RunConfig
from jaxrl.models import KVCache, create_model
from jaxrl.models.kv_cache import ring_positions
from jaxrl.models.paged import PagedKVCache
from jaxrl.presets import tiny_model_config

WINDOW = 5
LAYERS = ("sliding_attention", "full_attention")


def _model(impl="xla", window=WINDOW):
    cfg = tiny_model_config(sliding_window=window, layer_types=LAYERS, attention_impl=impl)
    return cfg, create_model(cfg, seed=2)


def test_ring_positions_by_hand():
    # a 4-slot ring after 0, 3 and 10 tokens: position p in slot p % 4, -1 where none yet
    got = np.asarray(ring_positions(jnp.array([0, 3, 10]), 4))
    np.testing.assert_array_equal(got, [[-1, -1, -1, -1], [0, 1, 2, -1], [8, 9, 6, 7]])


def _decode_both(model, cfg, ring_cache, max_len, steps):
    """Run `steps` (tokens, num_valid) through the ring cache and a full `KVCache`; assert equal
    logits at every valid position and equal lengths. Returns the ring cache."""
    full = KVCache.init(cfg, 2, max_len)
    step = jax.jit(lambda c, t, n: model.decode(t, c, n))
    for i, (chunk, num_valid) in enumerate(steps):
        want, full = step(full, chunk, num_valid)
        got, ring_cache = step(ring_cache, chunk, num_valid)
        for b in range(2):  # padding positions (past num_valid) differ by design
            n = chunk.shape[1] if num_valid is None else int(num_valid[b])
            np.testing.assert_allclose(got[b, :n], want[b, :n], atol=2e-5, rtol=0,
                                       err_msg=f"step {i}, row {b}")
        np.testing.assert_array_equal(ring_cache.lengths_B, full.lengths_B)
    return ring_cache


def _steps(cfg, n_single):
    """A padded prefill (row 1: 9 of 13 tokens), a 7-token chunk, then one-token steps."""
    tokens = jnp.asarray(np.random.default_rng(1).integers(0, cfg.vocab_size, (2, 60)), jnp.int32)
    steps = [(tokens[:, :13], jnp.asarray([13, 9])), (tokens[:, 13:20], None)]
    return steps + [(tokens[:, i:i + 1], None) for i in range(20, 20 + n_single)]


@pytest.mark.parametrize("layout", ["heads_major", "sequence_major", "paged_4", "paged_5"])
def test_ring_decode_equals_the_full_cache_to_4x_the_window(layout):
    """XLA attention. The ring holds `WINDOW` slots (paged: whole pages, 8 positions of 4-page
    pages, masked by the positions they hold; 5 of 5-position pages); the padded row's padding
    never evicts a kept position; the decode runs to 33 positions (> 6x the window)."""
    cfg, model = _model()
    max_len = 40
    if layout.startswith("paged"):
        page = int(layout.split("_")[1])
        cache = PagedKVCache.init(cfg, 2, max_len, page, ring=True)
        ring = -(-WINDOW // page) * page
        assert cache.rings == (ring, 0) and cache.k_pages[0].shape[0] == 2 * ring // page
        assert cache.k_pages[1].shape[0] == 2 * -(-max_len // page)
    else:
        cache = KVCache.init(cfg, 2, max_len, heads_major=layout == "heads_major", ring=True)
        seq = -1 if layout == "heads_major" else 1
        assert [k.shape[seq] for k in cache.k] == [WINDOW, max_len] and cache.max_len == max_len
    cache = _decode_both(model, cfg, cache, max_len, _steps(cfg, 13))
    assert int(cache.lengths_B[1]) == 9 + 7 + 13  # past the window many times over


@pytest.mark.slow
@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
def test_ring_under_pallas_runs_the_decode_kernels_on_the_window(paged, monkeypatch):
    """impl="pallas" (interpreted on CPU): a ring exactly the window (16, pages of 16) is read by
    the decode kernels as a prefix of `min(length, 16)` valid slots with no window; the full
    layer keeps the window. The tokens equal the full cache's (XLA attention)."""
    import jaxrl_kernels

    calls = []
    for name in ("decode_attention", "paged_decode_attention"):
        kernel = getattr(jaxrl_kernels, name)

        def spy(*args, _name=name, _kernel=kernel, **kw):
            calls.append((_name, kw.get("window"), args[1].shape[1 if _name[0] == "d" else 0]))
            return _kernel(*args, **kw)

        monkeypatch.setattr(jaxrl_kernels, name, spy)
    window, max_len = 16, 64
    cfg, model = _model("pallas", window)
    cache = (PagedKVCache.init(cfg, 2, max_len, 16, ring=True) if paged
             else KVCache.init(cfg, 2, max_len, ring=True))
    ref_cfg = dataclasses.replace(cfg, attention_impl="xla")
    ref_model = create_model(ref_cfg, seed=2)
    full = KVCache.init(ref_cfg, 2, max_len)
    step = lambda m: jax.jit(lambda c, t, n: m.decode(t, c, n))
    ref_step, ring_step = step(ref_model), step(model)
    for chunk, num_valid in _steps(cfg, 20):
        want, full = ref_step(full, chunk, num_valid)
        got, cache = ring_step(cache, chunk, num_valid)
        n = 9 if num_valid is not None else chunk.shape[1]
        np.testing.assert_allclose(got[:, :n], want[:, :n], atol=2e-5, rtol=0)
    assert int(cache.lengths_B[0]) == 40  # the ring wrapped twice
    kernel = "paged_decode_attention" if paged else "decode_attention"
    # traced once: the ring layer (no window, 16 slots / 2 x 1 pages), the full layer (window
    # None as well: it has none; 64 positions / 2 x 4 pages)
    ring_read, full_read = (2, 8) if paged else (16, 64)
    assert calls == [(kernel, None, ring_read), (kernel, None, full_read)]


def test_local_layers_keep_an_eighth_of_a_full_cache():
    """A 64-token window and 1,024-token generations (after 64-token prompts): each sliding
    layer's arrays hold <= 1/8 of a full layer's bytes (the real arrays' nbytes, both layouts),
    and the memory plan's KV item is those arrays' bytes."""
    from jaxrl.train.memory.plan import plan_memory

    cfg = tiny_model_config(sliding_window=64, layer_types=LAYERS)
    slots, max_len = 4, 64 + 1024
    nbytes = lambda xs: sum(x.nbytes for x in xs)
    full = KVCache.init(cfg, slots, max_len)
    ring = KVCache.init(cfg, slots, max_len, ring=True)
    assert ring.k[0].nbytes * 8 <= full.k[0].nbytes and ring.v[0].nbytes * 8 <= full.v[0].nbytes
    assert ring.k[1].nbytes == full.k[1].nbytes  # the full layer keeps every position
    paged = PagedKVCache.init(cfg, slots, max_len, 16, ring=True)
    assert paged.k_pages[0].nbytes * 8 <= paged.k_pages[1].nbytes  # 4 of 68 pages a slot

    arrays = {"contiguous": ring.k + ring.v, "paged": paged.k_pages + paged.v_pages}
    for layout, cache in arrays.items():
        run = RunConfig(model=cfg, generate=GenerateConfig(num_slots=slots, max_len=max_len,
                                                           kv_layout=layout, page_size=16))
        plan = plan_memory(run, cfg, trainer_mesh_shape=(1, 1), generator_mesh_shape=(1, 1),
                           max_seq_len=max_len, platform="cpu", budget_bytes=2**30)
        item = plan.item("KV cache")
        assert item.bytes == nbytes(cache), layout
        assert "1 sliding: their 64-position window" in item.note


def test_planner_counts_the_window_of_sliding_layers():
    """Gemma 3 1B in the planner's table: 22 of 26 layers keep a 512-token window; per sequence
    of 4,096 tokens the KV is (4 x 4096 + 22 x 512) x 2 x 1 kv head x 256, by hand."""
    from jaxrl.planner.specs import get_model

    spec = get_model("gemma3-1b")
    assert spec.kv_elems_per_sequence(4096) == (4 * 4096 + 22 * 512) * 2 * 256
    assert spec.kv_elems_per_sequence(300) == 26 * 300 * 2 * 256  # within the window: all
    assert get_model("qwen3-8b").kv_elems_per_sequence(100) == 36 * 100 * 2 * 8 * 128

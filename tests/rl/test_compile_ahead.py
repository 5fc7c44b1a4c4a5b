"""Compile before moving (jaxrl/rl/compile_ahead.py, LiveRebalance): the next split's trainer
step and generator are compiled on a background thread, so the move itself compiles nothing,
and a move back to a split met before compiles nothing either (XLA's compile events counted).
Components only: a real Trainer and a real generator, no run."""

from pathlib import Path
from types import SimpleNamespace

import jax
import numpy as np
import pytest
from run_helpers import tiny_run_config

from jaxrl.config import PipelineConfig
from jaxrl.rl.compile_ahead import CompileCounter
from jaxrl.rl.hooks import StepRecord
from jaxrl.rl.loop import Parts
from jaxrl.rl.rebalance import LiveRebalance, split_meshes
from jaxrl.rl.sync import build_generator
from jaxrl.train.batch import make_batch
from jaxrl.train.trainer import Trainer


def _batch(seed=0, b=16, t=16, prompt=6, vocab=64):
    rng = np.random.default_rng(seed)
    lengths = rng.integers(prompt + 2, t + 1, b)
    pos = np.arange(t)[None, :]
    seg = (pos < lengths[:, None]).astype(np.int32)
    mask = ((pos >= prompt) & (pos < lengths[:, None])).astype(np.float32)
    return make_batch(rng.integers(0, vocab, (b, t)), mask, rng.random(b).round(1),
                      np.repeat(np.arange(4), b // 4), segment_ids=seg,
                      behaviour_logprobs=-rng.random((b, t)).astype(np.float32) * mask)


def _generate(generator, prompts):
    """Prefill `prompts`, insert them, decode a chunk and release a slot on the generator's
    engine (every executable a batch uses)."""
    engine = generator.engine
    sp = engine.slot_params(key_data=np.asarray([0, 1], np.uint32), sample_index=0,
                            temperature=1.0, top_k=0, top_p=1.0, max_tokens=4, stop_token_ids=())
    state = engine.init_decode_state()
    prefixes = engine.prefill_many(engine.params, prompts)
    for slot, prefix in enumerate(prefixes):
        state = engine.insert(prefix, state, slot, sp)
    state, _ = engine.generate_chunk(engine.params, state)
    state = engine.release(state, 0)
    jax.block_until_ready(state)


def test_a_move_compiled_ahead_compiles_nothing_and_a_move_back_neither(tmp_path):
    """6:2 -> 2:6 compiled ahead (trainer step for fsdp 2, the generator on 6 devices), then
    the move and a step and a generation at 2:6 compile nothing; the move back to 6:2 (met
    before) compiles nothing; with nothing compiled ahead the same move compiles (the check
    that the counter sees compilations). The correction (`decoupled`) recomputes pi_old before
    each update: that log-prob pass is compiled ahead too."""
    cfg = tiny_run_config(tmp_path, mesh=dict(trainer=(6, 1), generator=(2, 1)),
                          train=dict(correction="decoupled"))
    devices = jax.devices()[:8]
    meshes = split_meshes(devices, 6)
    trainer = Trainer(cfg.model, cfg.train, meshes.trainer)

    def rebuild(mesh, params, base, version):
        return build_generator(cfg, cfg.model, mesh, params, seq_len=32, version=version,
                               eos_id=1, multi=False, base=base)

    generator = rebuild(meshes.generator, trainer.state.params, None, 0)
    prompts = [[3, 4, 5], [6, 7, 8, 9], [5, 5, 5, 5, 5, 5, 5, 5, 5]]
    parts = Parts(trainer, generator, 6, 2)
    trainer.step(_batch(0))
    _generate(generator, prompts)
    pipeline = PipelineConfig(mode="sync", steps=20, rebalance="auto")
    live = LiveRebalance(pipeline, devices, 6, trainer_tp=1, generator_tp=1,
                         rebuild_generator=rebuild, batch=16)

    live._start_ahead((2, False), parts).result()
    live._ahead_counting = False
    assert live.ahead.compiles > 0
    live._compiled()
    live._pending = (SimpleNamespace(new=(2, 6), old=(6, 2)), False)
    with CompileCounter() as moving:
        parts = live.build(2)(parts, 1)
        parts.trainer.step(_batch(1))
        _generate(parts.generator, prompts)
    assert moving.count == 0, moving.count
    assert parts.trainer.mesh.size == 2 and parts.generator.engine.mesh.size == 6
    live.policy.split = (2, 6)

    with CompileCounter() as back:  # 6:2 met before: its generator kept, its step compiled
        parts = live.build(6)(parts, 2)
        parts.trainer.step(_batch(2))
        _generate(parts.generator, prompts)
    assert back.count == 0, back.count
    assert parts.trainer.mesh.size == 6

    live.policy.split = (6, 2)
    with CompileCounter() as cold:  # 4:4 never compiled: the move and what follows compile
        parts = live.build(4)(parts, 3)
        parts.trainer.step(_batch(3))
    assert cold.count > 0


def test_the_processes_must_agree_on_a_move_or_it_is_refused(caplog):
    """Two processes (the exchange faked): a move is made only at a step where both propose
    it; when the other is not ready, the move is refused that step, logged with the proposals,
    and proposed again at once the next step."""
    cfg = PipelineConfig(mode="sync", steps=20, rebalance="auto", rebalance_min_interval=1,
                         rebalance_confirm=2, rebalance_cost_s=0.0)
    seen = []

    def agree(mine):  # the other process proposes as this one, except at step 3: not ready
        seen.append(mine)
        return [mine, None if len(seen) == 3 else mine]

    live = LiveRebalance(cfg, list(range(8)), 6, trainer_tp=1, generator_tp=1, batch=16,
                         agree=agree)
    live.build = lambda trainer_chips, mirrored=False: ("build", trainer_chips)
    slow_gen = {"pipeline/rollouts_per_s_consumed": 300.0,
                "pipeline/rollouts_per_s_produced": 10.0, "pipeline/step_s": 1.7}
    builds = []
    for n in range(1, 5):
        _, build = live.plan(StepRecord(n - 1, n, False, dict(slow_gen), None))
        builds.append(build)
    # step 1 compiles (not observed); 2 observed, named once; 3 confirmed, other not ready:
    # refused; 4 both propose 2:6
    assert builds[:3] == [None, None, None] and builds[3] == ("build", 2)
    assert seen == [None, None, (2, False), (2, False)]
    assert "refused at step 3" in caplog.text and "[(2, False), None]" in caplog.text


def test_the_compile_aheads_cost_is_the_slowdown_of_the_steps_beside_it():
    """Rows fed by hand, the compile-ahead a thread held until told: step 1 compiles, step 2
    (1.0 s) is observed and names 2:6 (sync: 16/300 + 16/10 s a step at 6:2, 16/100 + 16/30 at
    2:6), compiled beside the next two steps (1.6 and 1.3 s: 0.6 + 0.3 s slower than 1.0), which
    are not observed but count toward min_interval (3); once it is ready its cost and wall time
    go to the policy and the row, and the move follows at once (compiled: only the pause)."""
    import threading

    from jaxrl.rl.compile_ahead import Ahead

    cfg = PipelineConfig(mode="sync", steps=40, rebalance="auto", rebalance_min_interval=3,
                         rebalance_confirm=1, rebalance_cost_s=0.5)
    live = LiveRebalance(cfg, list(range(8)), 6, trainer_tp=1, generator_tp=1, batch=16)
    release, started = threading.Event(), []

    def start(key, parts):
        started.append(key)
        live.ahead = Ahead(key, lambda: (None, None, 3) if release.wait(10) else None)
        live._ahead_cost_s, live._ahead_counting = 0.0, True
        return live.ahead

    live._start_ahead = start
    live.build = lambda trainer_chips, mirrored=False: ("build", trainer_chips)
    rates = {"pipeline/rollouts_per_s_consumed": 300.0, "pipeline/rollouts_per_s_produced": 10.0}
    out = []
    for n, step_s in enumerate((9.0, 1.0, 1.6, 1.3), start=1):
        if n == 4:
            release.set()
            live.ahead.result(10)
        added, build = live.plan(StepRecord(n - 1, n, False, dict(rates, **{
            "pipeline/step_s": step_s}), None), parts="parts")
        out.append((added, build))
    assert started == [(2, False)]  # named after the first observed step, compiled once
    assert all(b is None for _, b in out[:3]) and out[3][1] == ("build", 2)
    added = out[3][0]
    assert added["rebalance/compile_ahead_cost_s"] == pytest.approx(0.6 + 0.3)
    assert added["rebalance/compile_ahead_s"] > 0
    assert live.policy.compile_cost_s == pytest.approx(0.9)
    assert live.policy.since_move == 3  # 1 observed step + 2 beside the compile
    # the next compile-ahead is assumed to cost what this one did only beside 6:2's steps:
    # at another split its whole wall time (as if it took 19.5 s and cost 0.4 s)
    live._cold = (19.5, 0.4)
    assert live.policy.compile_estimate((3, 5)) == (19.5, 0.4)
    live.policy.split = (2, 6)
    assert live.policy.compile_estimate((3, 5)) == (19.5, 19.5)


@pytest.mark.parametrize("compiled_s, saved_s, known, starts", [
    (30.0, 0.0, False, False), (0.5, 0.0, False, True),  # nothing cached: compiling costs
    (0.5, 29.5, True, True), (0.5, 29.5, False, False),  # cached: only the splits it holds
    (0.5, 0.0, "slow before", False)])  # an earlier run's compile-ahead took 30 s
def test_a_compile_ahead_starts_only_when_its_estimated_time_can_pay(
        compiled_s, saved_s, known, starts, tmp_path, caplog):
    """No compile time assumed (`rebalance_compile_s=None`): the run's first step's compile
    seconds (the counter's, set here) stand for a compile-ahead's, plus the compile time its
    persistent-cache hits spared, unless the cache holds the candidate split (CompiledSplits,
    the file beside the cache): then the first step's load time. A 10-step sync run at 6:2,
    steps of 1.7 s (16/300 + 16/10 s), 2:6 would take 16/100 + 16/30 = 0.693 s: after the
    first observed step (8 left) a 30 s compile would take ceil(30 / 1.7) = 18 steps, more than
    are left, so nothing is compiled and the log says why; a 0.5 s one (1 step, 7 x 1.01 s
    saved against 0.5 + 0.5 s) starts one."""
    import logging

    from jaxrl.rl.compile_ahead import CompiledSplits

    cfg = PipelineConfig(mode="sync", steps=10, rebalance="auto", rebalance_min_interval=1,
                         rebalance_confirm=1, rebalance_cost_s=0.5)
    splits = CompiledSplits(str(tmp_path), "programs")
    if known == "slow before":  # an earlier run's compile-ahead compiled for 30 s
        CompiledSplits(str(tmp_path), "programs").compiled(30.0, 30.0)
    elif known:
        CompiledSplits(str(tmp_path), "programs").add((2, False))  # an earlier run's
    CompiledSplits(str(tmp_path), "other programs").add((3, False))
    live = LiveRebalance(cfg, list(range(8)), 6, trainer_tp=1, generator_tp=1, batch=16,
                         compiled_splits=splits)
    counter = live._first_compile  # as if the first step compiled (or loaded) this long
    counter.seconds, counter.saved_s, counter.cache_hits = compiled_s, saved_s, int(saved_s > 0)
    started = []
    live._start_ahead = lambda key, parts: started.append(key)
    rates = {"pipeline/rollouts_per_s_consumed": 300.0, "pipeline/rollouts_per_s_produced": 10.0,
             "pipeline/step_s": 1.7}
    with caplog.at_level(logging.INFO, logger="jaxrl"):
        first, _ = live.plan(StepRecord(0, 1, False, dict(rates), None), parts="parts")
        live.plan(StepRecord(1, 2, False, dict(rates), None), parts="parts")
    assert first["rebalance/first_compile_s"] == compiled_s
    assert first["rebalance/first_compile_saved_s"] == saved_s
    cold = 30.0 if known == "slow before" else compiled_s + saved_s
    assert live.policy.compile_estimate((2, 6)) == (
        (0.5, 0.5) if known is True else (cold, cold))
    assert started == ([(2, False)] if starts else [])
    if not starts:
        assert "6:2 -> 2:6 does not pay" in caplog.text and "compile 30s" in caplog.text
    assert splits.known((6, False)) and not splits.known((3, False))  # the first step's split


def test_a_run_turns_on_the_persistent_cache_unless_one_is_set(tmp_path):
    """`compile_cache`: the directory when jax has none, `~` expanded; never over one already set
    (JAX_COMPILATION_CACHE_DIR: the test session's) and never for ""."""
    from jaxrl.rl.compile_ahead import use_compile_cache

    before = jax.config.jax_compilation_cache_dir
    try:
        use_compile_cache(str(tmp_path / "other"))
        assert jax.config.jax_compilation_cache_dir == before  # set already: kept
        jax.config.update("jax_compilation_cache_dir", None)
        use_compile_cache("")
        assert jax.config.jax_compilation_cache_dir is None
        use_compile_cache("~/jaxrl-xla")
        assert jax.config.jax_compilation_cache_dir == str(Path.home() / "jaxrl-xla")
    finally:
        jax.config.update("jax_compilation_cache_dir", before)


def test_compiled_splits_keep_splits_and_the_longest_compile_per_program(tmp_path):
    """The file beside the cache: splits added by any instance (a compile-ahead thread, a later
    run) are known to every instance of the same programs, not to other programs; a compile
    time recorded is kept only when longer; no cache directory or a broken file knows
    nothing."""
    from jaxrl.rl.compile_ahead import CompiledSplits

    a, b = CompiledSplits(str(tmp_path), "p"), CompiledSplits(str(tmp_path), "p")
    other = CompiledSplits(str(tmp_path), "q")
    assert not a.known((2, False)) and a.compile_s() is None
    a.add((2, False))
    b.add((4, True))
    b.compiled(18.1, 0.5)
    a.compiled(6.0, 2.0)  # shorter wall, larger cost: each kept at its maximum
    assert b.known((2, False)) and a.known((4, True)) and not a.known((4, False))
    assert a.compile_s() == (18.1, 2.0)
    assert not other.known((2, False)) and other.compile_s() is None
    assert not CompiledSplits(None, "p").known((2, False))
    (tmp_path / CompiledSplits.FILE).write_text("{not json")
    assert not a.known((2, False)) and a.compile_s() is None
    a.add((3, False))  # rewrites the broken file
    assert b.known((3, False))


def test_closing_a_run_that_never_planned_stops_its_compile_counter():
    """The first step's compile counter is a process-wide listener: a run that ends before its
    first step is planned removes it when it closes (`LiveRebalance.close`, a run's closer)."""
    cfg = PipelineConfig(mode="sync", steps=4, rebalance="auto")
    live = LiveRebalance(cfg, list(range(8)), 6, trainer_tp=1, generator_tp=1, batch=16)
    counter = live._first_compile
    jax.jit(lambda x: x * 3 + 1)(np.arange(5.0))  # a new program: counted
    seen = counter.count
    assert seen >= 1
    live.close()
    live.close()  # twice is harmless
    jax.jit(lambda x: x * 5 - 2)(np.arange(7.0))
    assert counter.count == seen

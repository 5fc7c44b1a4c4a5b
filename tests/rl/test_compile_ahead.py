"""Compile before moving (jaxrl/rl/compile_ahead.py, LiveRebalance): the next split's trainer
step and generator are compiled on a background thread, so the move itself compiles nothing,
and a move back to a split met before compiles nothing either (XLA's compile events counted).
Components only: a real Trainer and a real generator, no run."""

from types import SimpleNamespace

import jax
import numpy as np
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
                      np.repeat(np.arange(4), b // 4), segment_ids=seg)


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
    that the counter sees compilations)."""
    cfg = tiny_run_config(tmp_path, mesh=dict(trainer=(6, 1), generator=(2, 1)))
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

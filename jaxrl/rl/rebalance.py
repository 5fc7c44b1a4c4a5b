"""Live device moves: a different split of the same devices between the trainer and the generator.

At a step boundary the controller may rebuild both meshes with another split (`split_meshes`)
and move the trainer onto its new mesh (`move_trainer`): the train state (params and optimizer
state) is resharded with `jax.device_put` onto the new mesh's shardings, so it is bit-identical
after the move, and the jitted step is rebuilt for that mesh. The policy that decides when and
where to move is jaxrl/planner/rebalance.py (the same code the simulator runs).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import time
from collections.abc import Sequence

import jax
import numpy as np

from jaxrl.config.sections import MeshConfig, lead_for
from jaxrl.planner.rebalance import Decision, RebalanceConfig, Rebalancer
from jaxrl.rl.compile_ahead import Ahead, CompileCounter, CompiledSplits
from jaxrl.rl.sync import build_generator
from jaxrl.sharding import Meshes, make_meshes
from jaxrl.train.memory.plan import plan_memory
from jaxrl.train.state import train_state_shardings
from jaxrl.train.trainer import Trainer, precompile_step, tree_bytes

log = logging.getLogger("jaxrl")


def split_meshes(devices: Sequence[jax.Device], trainer_chips: int, *, trainer_tp: int = 1,
                 generator_tp: int = 1) -> Meshes:
    """Meshes over `devices`: the first `trainer_chips` for the trainer (fsdp x trainer_tp), the
    rest for the generator (dp x generator_tp). Raises ValueError for a split the tp sizes do not
    divide (an infeasible split for the policy)."""
    devices = list(devices)
    gen_chips = len(devices) - trainer_chips
    if not (0 < trainer_chips < len(devices)) or trainer_chips % trainer_tp or \
            gen_chips % generator_tp:
        raise ValueError(f"split {trainer_chips}:{gen_chips} of {len(devices)} devices does not "
                         f"fit trainer tp {trainer_tp} / generator tp {generator_tp}")
    cfg = MeshConfig(trainer=(trainer_chips // trainer_tp, trainer_tp),
                     generator=(gen_chips // generator_tp, generator_tp))
    return make_meshes(cfg, devices)


def move_trainer(trainer, mesh):
    """A Trainer on `mesh` holding `trainer`'s state, bit for bit (with LoRA, its frozen base
    too; the reference policy is resharded). Returns (new trainer, seconds the move took, the
    state's bytes moved)."""
    t0 = time.perf_counter()
    _, shardings = train_state_shardings(trainer.model_cfg, trainer.cfg, mesh)
    state = jax.device_put(trainer.state, shardings)
    lora = trainer.frozen is not None
    new = Trainer(trainer.model_cfg, trainer.cfg, mesh, state=state,
                  params=trainer.frozen if lora else None,
                  ref_params=None if lora else trainer.ref_params, max_len=trainer.max_len)
    new.last_updates = trainer.last_updates
    jax.block_until_ready(new.state)
    moved = tree_bytes(trainer.state) + (tree_bytes(trainer.frozen) if lora else 0)
    return new, time.perf_counter() - t0, moved


class LiveRebalance:
    """`pipeline.rebalance=auto` (or forced moves, `pipeline.rebalance_every`): asked by the loop
    at each step boundary, after the step's update, weight sync and hooks (`plan(record)`).

    Each step it feeds the step's measured rates (`pipeline/rollouts_per_s_consumed` and
    `_produced`, per busy second of each role) to the policy (`jaxrl.planner.rebalance.
    Rebalancer`), except on the steps that compile (the first of the run, the `settle` steps
    after a move) or that ran beside a compile-ahead, whose rates say little about the split.

    Compile before moving: when the policy names a candidate split, `Ahead`
    (jaxrl/rl/compile_ahead.py) compiles the trainer's step for its trainer mesh
    (`precompile_step`) and builds its generator with the engine's executables compiled
    (`rebuild_generator(mesh, params, base, version)` from a copy of the trainer's params, then
    `JaxEngine.precompile`, then its weights released) on a background thread, while the
    current split keeps running. The policy moves only once that is ready; the `build(parts,
    version) -> Parts` it returns to the loop (`Loop.swap_parts`, between batches) then moves the
    trainer's state (`move_trainer`) and publishes the current weights to the built generator:
    the pause is the weight move and the engine's new weights, no compilation. Generators built
    are kept per split (weights and KV cache released), so moving back compiles nothing.

    Costs, each measured and counted by the policy: the compile-ahead's slowdown of the steps
    it ran beside (their `pipeline/step_s` over the median of the 3 observed before it,
    `rebalance/compile_ahead_cost_s`, with its wall time `rebalance/compile_ahead_s` and
    compilations `rebalance/compile_ahead_compiles`), the pause (`rebalance/move_s`), and the
    compilation it did not hide: how much longer the `settle` steps after the move took than the
    first step after them (`rebalance/recompile_s`). Every decision is logged when made (its
    predicted rate and payback, `rebalance/predicted_payback_steps`) and at its first settled
    step with the measured rate, cost and payback (`rebalance/measured_*`). A step whose best
    split does not pay logs why (once per reason). With several processes, `agree(key)` returns
    every process's proposed move; a move is made only when all propose the same one at the
    same step, else it is refused for that step and the reason logged.
    """

    def __init__(self, pipeline_cfg, devices: Sequence[jax.Device], trainer_chips: int, *,
                 trainer_tp: int, generator_tp: int, rebuild_generator=None, fits=None,
                 batch: int = 1, agree=None, compiled_splits: CompiledSplits | None = None):
        self.cfg, self.devices = pipeline_cfg, list(devices)
        self.tp = (trainer_tp, generator_tp)
        self.rebuild_generator = rebuild_generator
        self.fits = fits or (lambda trainer_shape, generator_shape: True)
        self.agree = agree  # None: one process
        self.configured, self.batch = trainer_chips, batch
        self.mirrored = False  # the state is on the devices in reverse order (forced moves)
        self.moves = 0
        policy_cfg = RebalanceConfig(min_interval=pipeline_cfg.rebalance_min_interval,
                                     confirm=pipeline_cfg.rebalance_confirm,
                                     cost_s=pipeline_cfg.rebalance_cost_s,
                                     compile_cost_s=pipeline_cfg.rebalance_compile_s)
        self.policy = Rebalancer(len(self.devices), trainer_chips, policy_cfg,
                                 mode=pipeline_cfg.mode, batch=batch,
                                 staleness=max(pipeline_cfg.max_staleness, 1),
                                 feasible=self.feasible)
        self._unmeasured = None  # the last decision, until its measured effect is logged
        self._pending = None  # (decision, mirrored) of the move the loop is making
        # after a move, the steps until the first batch of the rebuilt engine is trained on:
        # the first would recompile the train step; the generator finishes the batch it was
        # making and those it may run ahead (lead_for) on the old engine
        self.settle = 2 + lead_for(pipeline_cfg.mode, pipeline_cfg.max_staleness)
        self._settling = 1  # steps left that compile; the run's first compiles both roles
        self._settle_s: list[float] = []  # those steps' seconds, after a move
        self._recent: list[float] = []  # the last observed steps' seconds
        self._before_s = float("nan")  # the step time before the last move
        self.ahead: Ahead | None = None  # the running (or finished, unclaimed) compile-ahead
        self._ahead_counting = False  # it is running: the steps beside it count its cost
        self._ahead_cost_s = 0.0  # the slowdown of the steps it ran beside
        self._generators: dict = {}  # (trainer_chips, mirrored) -> built Generator
        self._failed: set[int] = set()  # trainer chips whose compile-ahead failed
        self._said = ""
        # no assumed compile time: the first step's (until a compile-ahead is measured)
        self._first_compile = None
        if pipeline_cfg.rebalance_compile_s is None:
            self._first_compile = CompileCounter().__enter__()
        # splits the persistent cache holds: their compile-ahead is a load (`_estimate`)
        self.compiled_splits = compiled_splits or CompiledSplits(None, "")
        self._cold = self._warm = None  # (wall, cost) of a compile-ahead that compiles / loads
        self._cost_split = None  # the split whose steps ran beside the last measured one

    def close(self) -> None:
        """Stop counting the first step's compilations (a run that ended before its first
        step was planned)."""
        if self._first_compile is not None:
            self._first_compile.__exit__(None, None, None)
            self._first_compile = None

    def feasible(self, trainer_chips: int, generator_chips: int) -> bool:
        """The tp sizes divide both roles, the memory plan says both fit, and compiling it
        ahead did not fail."""
        t_tp, g_tp = self.tp
        if trainer_chips % t_tp or generator_chips % g_tp or trainer_chips in self._failed:
            return False
        return self.fits((trainer_chips // t_tp, t_tp), (generator_chips // g_tp, g_tp))

    def plan(self, record, parts=None) -> tuple[dict, object]:
        """The columns this step adds (a measured move's effect, a finished compile-ahead) and,
        when the policy (or `rebalance_every`) decides to move, the `build` the loop runs (else
        None). `parts`: the loop's parts in use (a compile-ahead starts from them)."""
        row, added = record.row, {}
        pol, step_s = self.policy, row.get("pipeline/step_s", float("nan"))
        beside = self.ahead is not None and self._ahead_counting
        if beside:  # this step ran beside a compile-ahead: its extra time is the compiler's
            base = float(np.median(self._recent)) if self._recent else step_s
            self._ahead_cost_s += max(0.0, step_s - base)
            self._ahead_counting = not self.ahead.ready()
            if not self._ahead_counting:
                added.update(self._compiled())
        if self._first_compile is not None:  # the run's first step: its compilation
            added.update(self._first_step_compiled())
        if self._settling:  # its rates are the compiler's; after a move, its time is the cost's
            self._settling -= 1
            self._settle_s.append(step_s)
        elif beside:
            pol.skip()
        else:
            self._recent = [*self._recent[-2:], step_s]
            pol.observe(row.get("pipeline/rollouts_per_s_consumed", float("nan")),
                        row.get("pipeline/rollouts_per_s_produced", float("nan")))
            added.update(self._measure(step_s))
        steps_done = record.steps_done
        if steps_done >= self.cfg.steps:
            if self.ahead is not None and self._ahead_counting:
                took = time.perf_counter() - self.ahead.started
                log.info("rebalance: the run ended with %d:%d still compiling ahead (for "
                         "%.1fs): it did not pay", self.ahead.key[0],
                         len(self.devices) - self.ahead.key[0], took)
                self.compiled_splits.compiled(took, self._ahead_cost_s)  # at least that
            return added, None
        decision, mirrored = None, self.mirrored
        every = self.cfg.rebalance_every
        if every and steps_done % every == 0:  # forced: alternate configured <-> rebalance_to
            target = self.configured
            if not self.mirrored:
                target = self.cfg.rebalance_to or self.configured
            new = (target, len(self.devices) - target)
            rate = (lambda s: pol.throughput(*s)) if pol.t_rate else (lambda s: float("nan"))
            decision = Decision(steps_done, pol.split, new, rate(pol.split), rate(new), pol.cost_s)
            mirrored = not self.mirrored
            if parts is not None:  # a forced move does not wait: the pause waits for this
                self._start_ahead((new[0], mirrored), parts)
        elif self.cfg.rebalance == "auto":
            ready = lambda split: self._ready((split[0], mirrored), parts)
            decision = pol.decide(steps_done, steps_left=self.cfg.steps - steps_done,
                                  ready=ready)
            if decision is None:
                self._say(pol.last_reason)
                key = None if pol.candidate is None else (pol.candidate[0], mirrored)
                if key is not None and parts is not None and not self._ready(key, parts) and (
                        self.ahead is None or not self._ahead_counting):
                    self._start_ahead(key, parts)
        if self.agree is not None:  # a collective: every process asks at every step
            decision = self._agreed(decision, mirrored)
        if decision is None:
            return added, None
        self._pending = (decision, mirrored)
        return added, self.build(decision.new[0], mirrored=mirrored)

    # ------------------------------------------------------------------ compile ahead

    def _ready(self, key, parts) -> bool:
        """Whether the split `key` is compiled (its generator built and its step compiled)."""
        if parts is None:  # no parts to compile from (a policy test): nothing to wait for
            return True
        ahead = self.ahead
        return key in self._generators or (ahead is not None and ahead.key == key and
                                           ahead.ready() and not self._ahead_counting)

    def _start_ahead(self, key, parts) -> Ahead:
        """Compile the split `key` = (trainer_chips, mirrored) on a background thread."""
        trainer, engine = parts.trainer, parts.generator.engine
        meshes = self._meshes(*key)
        built = self._generators.get(key)
        params, base, version = None, trainer.frozen, 0
        # with several processes the generator is built in the move, on the step all agreed on
        # (its weights cross processes); only the trainer's step is compiled ahead
        build_ahead = self.rebuild_generator is not None and self.agree is None
        if built is None and build_ahead:
            # a copy: the train step donates the state's buffers; no compilation (device_put)
            params = jax.device_put(trainer.state.params, may_alias=False)
            version = int(jax.device_get(trainer.state.step))
        shapes = tuple(getattr(engine, "prefill_shapes", set()).copy())

        def work():
            compiled = precompile_step(trainer, meshes.trainer)
            generator = built
            if generator is None and build_ahead:
                generator = self.rebuild_generator(meshes.generator, params, base, version)
                if hasattr(generator.engine, "precompile"):
                    compiled += generator.engine.precompile(shapes)
                generator.scheduler.release()  # its weights come with the move
            self.compiled_splits.add(key)  # in the cache now, even if the run has ended
            return meshes, generator, compiled

        self.ahead, self._ahead_cost_s, self._ahead_counting = Ahead(key, work), 0.0, True
        log.info("rebalance: compiling %d:%d ahead on a background thread", key[0],
                 len(self.devices) - key[0])
        return self.ahead

    def _first_step_compiled(self) -> dict:
        """The compile seconds of everything before the end of the run's first step (its
        executables compiled, or loaded from the persistent cache): what compiling another
        split ahead is assumed to take, and to cost the steps beside it, until one is
        measured, or what an earlier run's compile-ahead that compiled took (recorded beside
        the persistent cache) if longer: the first step compiles fewer executables than a
        compile-ahead, and not beside running steps. Cold on a small host that is many steps'
        time, and no move pays for it in a short run; for a split the cache holds it is the
        first step's load time."""
        counter, self._first_compile = self._first_compile, None
        counter.__exit__(None, None, None)
        cold = counter.seconds + counter.saved_s  # as if nothing were cached
        self._cold = (cold, cold)
        seen = self.compiled_splits.compile_s()  # an earlier run's compile-ahead that compiled
        if seen is not None and seen[0] > cold:
            self._cold = seen
        if counter.cache_hits:
            self._warm = (counter.seconds, counter.seconds)
        self.policy.compiled(*self._cold)
        self.policy.compile_estimate = self._estimate
        self.compiled_splits.add((self.policy.split[0], self.mirrored))
        log.info("rebalance: the first step compiled %d executables in %.2fs (%d loaded from the "
                 "persistent cache, sparing %.2fs): a compile-ahead is assumed to take %.2fs "
                 "(costing the steps beside it %.2fs), or the load time for a split the cache "
                 "holds, until one is measured", counter.count, counter.seconds,
                 counter.cache_hits, counter.saved_s, *self._cold)
        return {"rebalance/first_compile_s": counter.seconds,
                "rebalance/first_compile_saved_s": counter.saved_s}

    def _estimate(self, split) -> tuple[float, float]:
        """(wall, cost) of compiling `split` ahead: a load when the persistent cache holds it
        and a load was measured, else a compilation. A cost measured beside another split's
        steps is not assumed at this one: there the compile's whole wall time is (how much it
        slows a step depends on how busy that step keeps the host: on 2 cores one 19.5 s
        compile cost a 6:2 split whose generator mostly slept 0.4 s, the next 6.3 s at 3:5)."""
        known = self._warm is not None and self.compiled_splits.known((split[0], self.mirrored))
        wall, cost = self._warm if known else self._cold
        if self._cost_split not in (None, self.policy.split):
            cost = max(cost, wall)
        return wall, cost

    def _compiled(self) -> dict:
        """The compile-ahead finished: its measured cost goes to the policy, its generator to
        the built ones. One that failed (e.g. out of memory beside the running split) makes its
        split infeasible for the rest of the run (logged)."""
        ahead = self.ahead
        try:
            meshes, generator, n = ahead.result()
        except Exception as e:  # any failure: that split is not moved to
            log.warning("rebalance: compiling %d:%d ahead failed (%s: %s); not moving there",
                        ahead.key[0], len(self.devices) - ahead.key[0], type(e).__name__, e)
            self._failed.add(ahead.key[0])
            self.ahead = None
            return {}
        if generator is not None:
            self._generators[ahead.key] = generator
        self.policy.compiled(ahead.seconds, self._ahead_cost_s)
        self._cost_split = self.policy.split  # the steps it was measured beside
        loaded = ahead.compiles and ahead.cache_hits >= ahead.compiles
        if not loaded:
            self.compiled_splits.compiled(ahead.seconds, self._ahead_cost_s)
        if self._cold is not None:  # the next estimates: a compilation's or a load's
            setattr(self, "_warm" if loaded else "_cold", (ahead.seconds, self._ahead_cost_s))
        log.info("rebalance: %d:%d compiled ahead: %d executables (%d compilations, %d from "
                 "the persistent cache), %.2fs on its thread, %.2fs slower running steps beside "
                 "it", ahead.key[0], len(self.devices) - ahead.key[0], n, ahead.compiles,
                 ahead.cache_hits, ahead.seconds, self._ahead_cost_s)
        return {"rebalance/compile_ahead_s": ahead.seconds,
                "rebalance/compile_ahead_cost_s": self._ahead_cost_s,
                "rebalance/compile_ahead_compiles": float(ahead.compiles),
                "rebalance/compile_ahead_cache_hits": float(ahead.cache_hits)}

    def _agreed(self, decision, mirrored):
        """Every process's proposal for this step (`agree`, called by every process at every
        step); the decision if all are the same, else None (the move refused for this step,
        the reason logged)."""
        mine = None if decision is None else (decision.new[0], mirrored)
        everyone = [tuple(p) if p is not None else None for p in self.agree(mine)]
        if all(p == mine for p in everyone):
            return decision
        if decision is None:
            return None
        self.policy.hold(decision)
        log.warning("rebalance: move to %d:%d refused at step %d: the processes did not agree "
                    "(proposals %s; None = not ready or not paying there)", decision.new[0],
                    decision.new[1], decision.step, everyone)
        return None

    def _say(self, reason: str) -> None:
        if reason and reason != self._said:
            log.info("rebalance: no move: %s", reason)
        self._said = reason

    def _measure(self, step_s: float) -> dict:
        """The first observed step after a move: the move's measured effect."""
        done = self._unmeasured
        if done is None or done.measured_rate is None:
            return {}
        done.measured_rate = self.batch / step_s  # samples per second of wall time
        extra = max(0.0, sum(self._settle_s) - len(self._settle_s) * step_s)
        self.policy.add_cost(done, extra)
        done.measured_gain_s = self._before_s - step_s
        log.info("%s (the %d steps after it took %.2fs more than this one: compilation not "
                 "hidden)", done.log_line(), len(self._settle_s), extra)
        self._unmeasured = None
        return {"rebalance/measured_samples_per_s": done.measured_rate,
                "rebalance/recompile_s": extra,
                "rebalance/measured_cost_s": done.measured_cost_s,
                "rebalance/measured_payback_steps": done.measured_payback_steps}

    # ------------------------------------------------------------------ the move

    def _meshes(self, trainer_chips: int, mirrored: bool) -> Meshes:
        devices = self.devices[::-1] if mirrored else self.devices
        return split_meshes(devices, trainer_chips, trainer_tp=self.tp[0],
                            generator_tp=self.tp[1])

    def build(self, trainer_chips: int, *, mirrored: bool = False):
        """`build(parts, version) -> Parts` moving to `trainer_chips` of the devices
        (`mirrored`: counted from the last device), with the generator compiled ahead for it
        (else one built now)."""
        key, old_key = (trainer_chips, mirrored), (self.policy.split[0], self.mirrored)
        meshes = self._meshes(*key)

        def build(parts, version: int):
            if self.ahead is not None and self.ahead.key == key:
                if self._ahead_counting:  # a forced move's, finished in the pause
                    self.ahead.result()
                    self._ahead_counting = False
                    self._compiled()
                self.ahead = None
            trainer, _, _ = move_trainer(parts.trainer, meshes.trainer)
            generator = self._generators.pop(key, None)
            if generator is None:
                generator = self.rebuild_generator(meshes.generator, trainer.state.params,
                                                   trainer.frozen, version)
            else:
                params, _ = generator.publisher.publish(trainer.state.params, version)
                generator.scheduler.set_params(params, version)
            if getattr(parts.generator, "scheduler", None) is not None:
                parts.generator.scheduler.release()  # kept for a move back, without weights
                self._generators[old_key] = parts.generator
            return dataclasses.replace(parts, trainer=trainer, generator=generator,
                                       trainer_chips=meshes.trainer.size,
                                       generator_chips=meshes.generator.size)

        return build

    def moved(self, seconds: float) -> dict:
        """The loop made the move `plan` asked for in `seconds` (both roles paused)."""
        decision, self.mirrored = self._pending
        self._pending, self.moves = None, self.moves + 1
        self.policy.moved(decision, seconds)
        self._unmeasured, self._settling, self._settle_s = decision, self.settle, []
        self._before_s = float(np.median(self._recent)) if self._recent else float("nan")
        self._recent = []
        log.info("%s (assumed); the move took %.2fs", decision.log_line(), seconds)
        return {"rebalance/move_s": seconds,
                "rebalance/from_trainer_chips": float(decision.old[0]),
                "rebalance/to_trainer_chips": float(decision.new[0]),
                "rebalance/current_samples_per_s": decision.current_rate,
                "rebalance/predicted_samples_per_s": decision.predicted_rate,
                "rebalance/predicted_payback_steps": decision.payback_steps,
                "rebalance/steps_left": float(decision.steps_left or 0)}


def build_rebalance(cfg, model_cfg, meshes, seq_len: int, tokenizer, closers=None
                    ) -> LiveRebalance | None:
    """The run's `LiveRebalance` over the devices of both meshes, with `pipeline.rebalance=auto`
    or `rebalance_every` (else None); its `close` goes to `closers` (an ExitStack). A move
    rebuilds the generator (publisher, engine, scheduler) on its new mesh from the moved
    trainer's params. A split is feasible when the tp sizes divide it and the memory plan says
    it fits."""
    if cfg.pipeline.rebalance == "off" and not cfg.pipeline.rebalance_every:
        return None

    def rebuild_generator(mesh, params, base, version: int):
        return build_generator(cfg, model_cfg, mesh, params, seq_len=seq_len,
                               version=version, eos_id=tokenizer.eos_ids, multi=False,
                               base=base)

    def fits(trainer_shape, generator_shape) -> bool:
        if cfg.mesh.memory_check == "off":
            return True
        budget = int(cfg.mesh.memory_budget_gib * 2**30) or None
        return plan_memory(cfg, model_cfg, trainer_mesh_shape=trainer_shape,
                           generator_mesh_shape=generator_shape, colocated=False,
                           max_seq_len=seq_len, budget_bytes=budget).fits()

    devices = [*meshes.trainer.devices.flat, *meshes.generator.devices.flat]
    programs = json.dumps([dataclasses.asdict(c) for c in (cfg.model, cfg.train, cfg.generate)] + [
        cfg.pipeline.mode, seq_len, cfg.data.prompts_per_step, cfg.data.group_size,
        [d.device_kind for d in devices], jax.__version__], sort_keys=True, default=str)
    compiled_splits = CompiledSplits(jax.config.jax_compilation_cache_dir,
                                     hashlib.sha256(programs.encode()).hexdigest()[:16])
    agree = None
    if jax.process_count() > 1:  # every process proposes; a move needs them all to agree
        from jaxrl.distributed import allgather_objects as agree
    live = LiveRebalance(cfg.pipeline, devices, meshes.trainer.size,
                         trainer_tp=meshes.trainer.shape["tp"],
                         generator_tp=meshes.generator.shape["tp"],
                         rebuild_generator=rebuild_generator, fits=fits, agree=agree,
                         batch=cfg.data.prompts_per_step * cfg.data.group_size,
                         compiled_splits=compiled_splits)
    if closers is not None:
        closers.callback(live.close)
    return live

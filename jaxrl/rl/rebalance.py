"""Live device moves: a different split of the same devices between the trainer and the generator.

At a step boundary the controller may rebuild both meshes with another split (`split_meshes`)
and move the trainer onto its new mesh (`move_trainer`): the train state (params and optimizer
state) is resharded with `jax.device_put` onto the new mesh's shardings, so it is bit-identical
after the move, and the jitted step is rebuilt for that mesh. The policy that decides when and
where to move is jaxrl/planner/rebalance.py (the same code the simulator runs).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Sequence

import jax

from jaxrl.config.sections import MeshConfig, lead_for
from jaxrl.planner.rebalance import Decision, RebalanceConfig, Rebalancer
from jaxrl.rl.sync import build_generator
from jaxrl.sharding import Meshes, make_meshes
from jaxrl.train.memory.plan import plan_memory
from jaxrl.train.state import train_state_shardings
from jaxrl.train.trainer import Trainer, tree_bytes

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
    after a move), whose rates say little about the split. A decision returns a `build(parts,
    version) -> Parts` to the loop, which runs it between batches (`Loop.swap_parts`): the
    trainer moved (`move_trainer`) and the generator rebuilt on its new mesh
    (`rebuild_generator(mesh, trainer, version) -> jaxrl.rl.sync.Generator`).

    A move's measured cost is the time both roles were paused plus the recompilation it causes:
    how much longer the `settle` steps after it took (`pipeline/step_s`) than the first step
    after them, the first measured at the new split. Every decision is logged with its predicted
    rate when made, and again at that step with the rate measured there (samples per second of
    the step's wall time) and its measured cost; the row of the step that moved carries
    `rebalance/move_s` and the predictions, the measuring row `rebalance/measured_*` and
    `rebalance/recompile_s`; `pipeline/trainer_chips` / `generator_chips` follow from the next
    step's row on.
    """

    def __init__(self, pipeline_cfg, devices: Sequence[jax.Device], trainer_chips: int, *,
                 trainer_tp: int, generator_tp: int, rebuild_generator=None, fits=None,
                 batch: int = 1):
        self.cfg, self.devices = pipeline_cfg, list(devices)
        self.tp = (trainer_tp, generator_tp)
        self.rebuild_generator = rebuild_generator
        self.fits = fits or (lambda trainer_shape, generator_shape: True)
        self.configured, self.batch = trainer_chips, batch
        self.mirrored = False  # the state is on the devices in reverse order (forced moves)
        self.moves = 0
        policy_cfg = RebalanceConfig(min_interval=pipeline_cfg.rebalance_min_interval,
                                     confirm=pipeline_cfg.rebalance_confirm,
                                     cost_s=pipeline_cfg.rebalance_cost_s)
        self.policy = Rebalancer(len(self.devices), trainer_chips, policy_cfg,
                                 mode=pipeline_cfg.mode, batch=batch,
                                 staleness=max(pipeline_cfg.max_staleness, 1),
                                 feasible=self.feasible)
        self._unmeasured = None  # the last decision, until its measured effect is logged
        self._pending = None  # (decision, mirrored) of the move the loop is making
        # after a move, the steps until the first batch of the rebuilt engine is trained on:
        # the first recompiles the train step; the generator finishes the batch it was making
        # and those it may run ahead (lead_for) on the old engine, then compiles the new one
        self.settle = 2 + lead_for(pipeline_cfg.mode, pipeline_cfg.max_staleness)
        self._settling = 1  # steps left that compile; the run's first compiles both roles
        self._settle_s: list[float] = []  # those steps' seconds, after a move

    def feasible(self, trainer_chips: int, generator_chips: int) -> bool:
        """The tp sizes divide both roles, and the memory plan says both fit."""
        t_tp, g_tp = self.tp
        if trainer_chips % t_tp or generator_chips % g_tp:
            return False
        return self.fits((trainer_chips // t_tp, t_tp), (generator_chips // g_tp, g_tp))

    def plan(self, record) -> tuple[dict, object]:
        """The columns this step adds (a measured move's effect) and, when the policy (or
        `rebalance_every`) decides to move, the `build` the loop runs (else None)."""
        row, added = record.row, {}
        pol, step_s = self.policy, row.get("pipeline/step_s", float("nan"))
        done = self._unmeasured
        if self._settling:  # its rates are the compiler's; after a move, its time is the cost's
            self._settling -= 1
            self._settle_s.append(step_s)
        else:
            pol.observe(row.get("pipeline/rollouts_per_s_consumed", float("nan")),
                        row.get("pipeline/rollouts_per_s_produced", float("nan")))
            if done is not None and done.measured_rate is not None:
                done.measured_rate = self.batch / step_s  # samples per second of wall time
                extra = max(0.0, sum(self._settle_s) - len(self._settle_s) * step_s)
                pol.add_cost(done, extra)
                log.info("%s (the %d steps after it took %.2fs more than this one: "
                         "recompilation)", done.log_line(), len(self._settle_s), extra)
                added.update({"rebalance/measured_samples_per_s": done.measured_rate,
                              "rebalance/recompile_s": extra,
                              "rebalance/measured_cost_s": done.measured_cost_s})
                self._unmeasured = None
        steps_done = record.steps_done
        if steps_done >= self.cfg.steps:
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
        elif self.cfg.rebalance == "auto":
            decision = pol.decide(steps_done,
                                  remaining_samples=(self.cfg.steps - steps_done) * self.batch)
        if decision is None:
            return added, None
        self._pending = (decision, mirrored)
        return added, self.build(decision.new[0], mirrored=mirrored)

    def build(self, trainer_chips: int, *, mirrored: bool = False):
        """`build(parts, version) -> Parts` moving to `trainer_chips` of the devices
        (`mirrored`: counted from the last device)."""
        devices = self.devices[::-1] if mirrored else self.devices
        meshes = split_meshes(devices, trainer_chips, trainer_tp=self.tp[0],
                              generator_tp=self.tp[1])

        def build(parts, version: int):
            trainer, _, _ = move_trainer(parts.trainer, meshes.trainer)
            generator = self.rebuild_generator(meshes.generator, trainer, version)
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
        log.info("%s (assumed); the move took %.2fs", decision.log_line(), seconds)
        return {"rebalance/move_s": seconds,
                "rebalance/from_trainer_chips": float(decision.old[0]),
                "rebalance/to_trainer_chips": float(decision.new[0]),
                "rebalance/current_samples_per_s": decision.current_rate,
                "rebalance/predicted_samples_per_s": decision.predicted_rate}


def build_rebalance(cfg, model_cfg, meshes, seq_len: int, tokenizer) -> LiveRebalance | None:
    """The run's `LiveRebalance` over the devices of both meshes, with `pipeline.rebalance=auto`
    or `rebalance_every` (else None). A move rebuilds the generator (publisher, engine,
    scheduler) on its new mesh from the moved trainer's params. A split is feasible when the tp
    sizes divide it and the memory plan says it fits."""
    if cfg.pipeline.rebalance == "off" and not cfg.pipeline.rebalance_every:
        return None

    def rebuild_generator(mesh, trainer, version: int):
        return build_generator(cfg, model_cfg, mesh, trainer.state.params, seq_len=seq_len,
                               version=version, eos_id=tokenizer.eos_id, multi=False,
                               base=trainer.frozen)

    def fits(trainer_shape, generator_shape) -> bool:
        if cfg.mesh.memory_check == "off":
            return True
        budget = int(cfg.mesh.memory_budget_gib * 2**30) or None
        return plan_memory(cfg, model_cfg, trainer_mesh_shape=trainer_shape,
                           generator_mesh_shape=generator_shape, colocated=False,
                           max_seq_len=seq_len, budget_bytes=budget).fits()

    devices = [*meshes.trainer.devices.flat, *meshes.generator.devices.flat]
    return LiveRebalance(cfg.pipeline, devices, meshes.trainer.size,
                         trainer_tp=meshes.trainer.shape["tp"],
                         generator_tp=meshes.generator.shape["tp"],
                         rebuild_generator=rebuild_generator, fits=fits,
                         batch=cfg.data.prompts_per_step * cfg.data.group_size)

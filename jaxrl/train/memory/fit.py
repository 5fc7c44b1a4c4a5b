"""Does a run fit, and what would make it fit: each setting re-planned, with the figure it reaches.

`check_run(cfg, model_cfg, meshes, seq_len, leader=...)` prints a run's plan before any work and
stops it (`mesh.memory_check="fail"`) or warns; `check(plan)` raises with the settings that fit.
`suggest(plan)` tries, one at a time, the settings a user can change (more micro-batches, a remat
policy, bf16 reference / parameters / generator weights, fewer slots or a shorter KV cache, more
devices) and reports those that fit; when none fits alone, each one's figure and all of them
together. Re-planning uses cached abstract shapes: nothing is compiled or allocated.
"""

from __future__ import annotations

import dataclasses
import logging

from jaxrl.config import ConfigError, RunConfig
from jaxrl.generate.disaggregated import decode_mesh_shape
from jaxrl.train.memory.plan import MemoryPlan, plan_memory
from jaxrl.train.memory.step import fmt_bytes as _fmt

log = logging.getLogger("jaxrl")


def check_run(cfg: RunConfig, model_cfg, meshes, seq_len: int, *, leader: bool) -> None:
    """Print the bytes per device the run will need before any work, and stop it
    (`mesh.memory_check="fail"`) or warn ("warn") when they exceed the device's memory."""
    if cfg.mesh.memory_check == "off":
        return
    budget = int(cfg.mesh.memory_budget_gib * 2**30) or None
    # prefill/decode split: the decode group holds the KV cache on fewer devices
    gen_shape = decode_mesh_shape(meshes.generator.devices.shape, cfg.generate.prefill_devices)
    plan = plan_memory(cfg, model_cfg, trainer_mesh_shape=meshes.trainer.devices.shape,
                       generator_mesh_shape=gen_shape,
                       colocated=meshes.colocated, max_seq_len=seq_len, budget_bytes=budget)
    if leader:
        log.info("memory plan:\n%s", plan.format())
    if cfg.mesh.memory_check == "fail":
        check(plan)
    elif not plan.fits():
        log.warning("the memory plan says the run does not fit (mesh.memory_check='warn': "
                    "going on); the figures above")


def check(plan: MemoryPlan) -> None:
    """Raise ConfigError with the figures and what would fit when over the budget."""
    if plan.fits():
        return
    raise ConfigError("the run does not fit in device memory:\n" + plan.format()
                      + "\nsettings that would make it fit:\n"
                      + "\n".join(f"  - {h}" for h in suggest(plan)))


def _with(cfg, section: str, **kw):
    return dataclasses.replace(cfg, **{section: dataclasses.replace(getattr(cfg, section), **kw)})


def _line(setting: str, before: MemoryPlan, after: MemoryPlan, what: str = "") -> str:
    ok = "fits" if after.fits() else "not enough alone"
    what = f"; {what}" if what else ""
    return (f"{setting}: need {_fmt(before.need())} -> {_fmt(after.need())} of "
            f"{_fmt(after.budget_bytes)} ({ok}{what})")


def _first_fit(plan: MemoryPlan, candidates) -> tuple[str, MemoryPlan] | None:
    """The first (setting, plan) that fits, else the last one tried (the furthest it goes)."""
    last = None
    for setting, cfg, tshape, gshape in candidates:
        p = plan.replan(cfg, tshape, gshape)
        last = (setting, p)
        if p.fits():
            return last
    return last


def _trainer(plan: MemoryPlan) -> list[tuple[str, MemoryPlan, str]]:
    cfg, (fsdp, tp) = plan.cfg, plan.trainer_shape
    t, out = cfg.train, []
    rows_dev = cfg.data.prompts_per_step * cfg.data.group_size // max(t.mini_batches, 1) // fsdp
    micro = [(f"--train.micro_batches={m}", _with(cfg, "train", micro_batches=m),
              plan.trainer_shape, plan.generator_shape)
             for m in (t.micro_batches * 2**i for i in range(1, 12)) if m <= max(rows_dev, 1)]
    act = plan.item("activations").bytes
    if micro:
        s, p = _first_fit(plan, micro)
        out.append((s, p, f"activations {_fmt(act)} -> {_fmt(p.item('activations').bytes)}"))
    chunks = [(f"--train.logprob_chunk={c}", _with(cfg, "train", logprob_chunk=c),
               *_shapes(plan)) for c in _halvings(t.logprob_chunk, 8)]
    if chunks:
        s, p = _first_fit(plan, chunks)
        out.append((s, p, f"activations -> {_fmt(p.item('activations').bytes)} (lm-head chunk)"))
    for remat in ("full", "dots_no_batch"):
        if t.remat not in ("full", remat):
            p = plan.replan(_with(cfg, "train", remat=remat), *_shapes(plan))
            out.append((f"--train.remat={remat}", p,
                        f"activations -> {_fmt(p.item('activations').bytes)}"))
    if t.needs_reference and (t.ref_dtype or "float32") == "float32":
        p = plan.replan(_with(cfg, "train", ref_dtype="bfloat16"), *_shapes(plan))
        out.append(("--train.ref_dtype=bfloat16", p, "the frozen reference in bf16"))
    if "float32" in plan.item("parameters").name:
        p = plan.replan(_with(cfg, "train", param_dtype="bfloat16"), *_shapes(plan))
        out.append(("--train.param_dtype=bfloat16", p, "bf16 master weights and Adam state"))
    opt = plan.item("optimizer").bytes + plan.item("gradients").bytes
    out.append(("LoRA (--model.lora.rank=16)", plan, f"would drop most of the optimizer state and "
                f"gradients ({_fmt(opt)} per trainer device)"))
    if not plan.shared_host:  # CPU devices share one RAM: more of them add nothing
        cands = [(f"--mesh.trainer={fsdp * 2**i}x{tp} (more trainer devices)", cfg,
                  (fsdp * 2**i, tp), plan.generator_shape) for i in range(1, 11)]
        s, p = _first_fit(plan, cands)
        out.append((s, p, ""))
    return out


def _generator(plan: MemoryPlan, max_seq_len: int) -> list[tuple[str, MemoryPlan, str]]:
    cfg, (dp, tp) = plan.cfg, plan.generator_shape
    g, out = cfg.generate, []
    slots = [(f"--generate.num_slots={n}", _with(cfg, "generate", num_slots=n),
              *_shapes(plan)) for n in _halvings(g.num_slots, dp)]
    if slots:
        s, p = _first_fit(plan, slots)
        out.append((s, p, f"KV cache -> {_fmt(p.item('KV cache').bytes)}"))
    kv_len = g.max_len or 0
    if kv_len != max_seq_len:
        p = plan.replan(_with(cfg, "generate", max_len=max_seq_len), *_shapes(plan))
        out.append((f"--generate.max_len={max_seq_len}", p,
                    "exactly the longest prompt + completion"))
    if (g.dtype or cfg.model.param_dtype) == "float32":
        p = plan.replan(_with(cfg, "generate", dtype="bfloat16"), *_shapes(plan))
        out.append(("--generate.dtype=bfloat16", p, "generator weights and KV cache in bf16"))
    if not plan.shared_host:
        cands = [(f"--mesh.generator={dp * 2**i}x{tp} (more generator devices)", cfg,
                  plan.trainer_shape, (dp * 2**i, tp)) for i in range(1, 11)]
        s, p = _first_fit(plan, cands)
        out.append((s, p, ""))
    return out


def _shapes(plan: MemoryPlan):
    return plan.trainer_shape, plan.generator_shape


def _halvings(n: int, multiple: int) -> list[int]:
    out = []
    while n > multiple:
        n = max(multiple, (n // 2) // multiple * multiple)
        out.append(n)
    return out


def suggest(plan: MemoryPlan) -> list[str]:
    """Lines `setting: need before -> after of budget (fits | not enough alone; detail)`."""
    max_seq_len = plan.max_seq_len
    tried = _trainer(plan) + _generator(plan, max_seq_len)
    over = plan.need() - plan.budget_bytes
    fixed = [i for i in plan.items if i.name.startswith(("parameters", "optimizer state",
                                                         "reference", "weights"))]
    per = {r: sum(i.bytes for i in fixed if i.role == r) for r in ("trainer", "generator")}
    static = dataclasses.replace(plan, items=tuple(fixed))
    if not static.fits():
        head = [f"the weights and optimizer state alone need {_fmt(static.need())} (trainer "
                f"{_fmt(per['trainer'])}, generator {_fmt(per['generator'])} per device): only "
                "a smaller model, bf16 parameters, LoRA, or more memory / devices can fit"]
    else:
        head = []
    lines = [_line(s, plan, p, w) for s, p, w in tried if p is not plan and p.fits()]
    # a setting that does not fit alone is listed when it closes >= 10% of the gap
    rest = [_line(s, plan, p, w) for s, p, w in tried
            if p is not plan and not p.fits() and plan.need() - p.need() >= over / 10]
    rest += [f"{s}: {w}" for s, p, w in tried if p is plan]
    if not lines:  # every setting at its furthest, together
        cfg, (fsdp, _), (dp, _) = plan.cfg, plan.trainer_shape, plan.generator_shape
        rows_dev = cfg.data.prompts_per_step * cfg.data.group_size // cfg.train.mini_batches
        m = max(cfg.train.micro_batches, rows_dev // fsdp)
        best = plan.replan(_with(_with(cfg, "train", remat="full", ref_dtype="bfloat16",
                                       micro_batches=m, logprob_chunk=8),
                                 "generate", dtype="bfloat16", max_len=max_seq_len, num_slots=dp),
                           *_shapes(plan))
        rest.append(_line(f"all together (micro_batches={m}, remat full, logprob_chunk=8, bf16 "
                          f"reference and generator, num_slots={dp}, max_len={max_seq_len})",
                          plan, best))
    return head + lines + rest

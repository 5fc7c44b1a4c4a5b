"""`python launch/plan.py`: how to split C chips between trainer and generator, and which mode.

    python launch/plan.py --model qwen3-235b-a22b --hardware h200 --chips 256 --split 64:192
    python launch/plan.py --model qwen3-8b --hardware tpu-v5p --chips 64 \\
        --workload.response_mean=4096 --eff.trainer_mfu=0.35 --simulate --trace /tmp/plan.json
    python launch/plan.py --from-run runs/<name>      # measured rates -> recommended split
    python launch/plan.py --published                 # the published case, reproduced
    python launch/plan.py --list                      # presets
    python launch/plan.py --cost                      # the published case in $ (price sheet)
    python launch/plan.py --hardware mi300x --cost --objective cost --prices my_prices.json

Overrides `--SECTION.FIELD=VALUE` change one field of the model, hardware, workload, eff
(efficiency assumptions) or sim (simulator) settings; an unknown field is an error listing the
valid ones.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from collections.abc import Sequence
from typing import Any

from jaxrl.planner import cost as costs
from jaxrl.planner import published
from jaxrl.planner.analytic import MODES, Infeasible, predict, sandbox_cores
from jaxrl.planner.hardware import CPU_NAME, HARDWARE, get_hardware
from jaxrl.planner.measured import from_measured, read_run
from jaxrl.planner.recommend import Recommendation, SplitResult, recommend_analytic
from jaxrl.planner.simulate import SimConfig, simulate_split
from jaxrl.planner.specs import MODELS, Efficiency, Workload, get_model

SECTIONS = ("model", "hardware", "workload", "eff", "sim")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="plan.py", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="\n\n".join(__doc__.split("\n\n")[1:]))
    p.add_argument("--model", default="qwen3-235b-a22b", help=f"one of {sorted(MODELS)}")
    p.add_argument("--hardware", default="h200",
                   help=f"one of {sorted([*HARDWARE, CPU_NAME])} (cpu: measured once)")
    p.add_argument("--chips", type=int, default=None, help="chips to split (default 256)")
    p.add_argument("--split", default=None,
                   help="baseline split TRAINER:GENERATOR to compare with (default: half each)")
    p.add_argument("--mode", default="periodic", help=f"baseline mode, one of {list(MODES)}")
    p.add_argument("--modes", default=",".join(MODES), help="modes the recommendation may use")
    p.add_argument("--staleness", type=int, default=1, help="async bound k / inflight run-ahead")
    p.add_argument("--granularity", type=int, default=None,
                   help="split step in chips (default: chips per node)")
    p.add_argument("--simulate", action="store_true", help="also run the simulator")
    p.add_argument("--steps", type=int, default=20, help="simulated trainer steps")
    p.add_argument("--trace", default=None, help="write the simulated trace (Perfetto) here")
    p.add_argument("--from-run", default=None, help="run directory with metrics.jsonl")
    p.add_argument("--published", action="store_true", help="reproduce the published case")
    p.add_argument("--list", action="store_true", help="list presets and exit")
    p.add_argument("--cost", action="store_true",
                   help="add $ per 1M rollouts, $ per step and the cost split (alone: the "
                        "published case)")
    p.add_argument("--prices", default=None, help="JSON price sheet overriding the built-in one")
    p.add_argument("--objective", default="throughput", choices=("throughput", "cost"),
                   help="what the recommended split maximises: rollouts/s or 1/($ per rollout)")
    p.add_argument("--hosted", default="tinker-inkling",
                   help="hosted-API price entry for the comparison line")
    return p


def _coerce(text: str, current: Any, where: str) -> Any:
    if isinstance(current, bool):
        if text.lower() not in ("true", "false", "1", "0"):
            raise ValueError(f"{where} expects true/false, got {text!r}")
        return text.lower() in ("true", "1")
    for kind in (int, float):
        if isinstance(current, kind):
            try:
                return kind(float(text)) if kind is int and float(text).is_integer() else kind(
                    text)
            except ValueError:
                raise ValueError(f"{where} expects {kind.__name__}, got {text!r}") from None
    if current is None:
        try:
            return int(text)
        except ValueError:
            return text
    return text


def parse_overrides(extra: Sequence[str]) -> dict[str, dict[str, str]]:
    out: dict[str, dict[str, str]] = {s: {} for s in SECTIONS}
    for arg in extra:
        key, eq, value = arg.removeprefix("--").partition("=")
        section, dot, field = key.partition(".")
        if not arg.startswith("--") or not eq or not dot or section not in SECTIONS:
            raise ValueError(f"unrecognised argument {arg!r}; overrides look like "
                             f"--SECTION.FIELD=VALUE with SECTION in {list(SECTIONS)}")
        out[section][field] = value
    return out


def apply(obj: Any, overrides: dict[str, str], section: str) -> Any:
    fields = {f.name for f in dataclasses.fields(obj)}
    changes = {}
    for field, text in overrides.items():
        if field not in fields:
            raise ValueError(f"unknown field {section}.{field}; valid: {sorted(fields)}")
        changes[field] = _coerce(text, getattr(obj, field), f"{section}.{field}")
    return dataclasses.replace(obj, **changes) if changes else obj


def _split(text: str) -> tuple[int, int]:
    try:
        t, g = (int(x) for x in text.split(":"))
    except ValueError:
        raise ValueError(f"--split must look like TRAINER:GENERATOR (e.g. 64:192), got "
                         f"{text!r}") from None
    return t, g


def _row(label: str, r: SplitResult) -> str:
    m = r.rates
    mfu = f"{r.mfu:6.1%}" if r.mfu is not None else "     -"
    stale = "token" if m.staleness_bound is None else f"<= {m.staleness_bound}"
    return (f"{label:<14} {r.split:>9} {m.mode:<9} {m.step_s:>9.3g} {m.consumed_per_s:>11.4g} "
            f"{m.trainer_idle:>8.1%} {m.generator_idle:>8.1%} {mfu} {stale:>9}")


def format_recommendation(rec: Recommendation) -> str:
    head = (f"{'':<14} {'split':>9} {'mode':<9} {'step_s':>9} {'samples/s':>11} "
            f"{'tr_idle':>8} {'gen_idle':>8} {'MFU':>6} {'staleness':>9}")
    lines = [head, "-" * len(head)]
    for mode, r in rec.best_per_mode().items():
        lines.append(_row(f"best {mode}", r))
    if rec.baseline is not None:
        lines.append(_row("baseline", rec.baseline))
    lines.append("")
    b = rec.best
    lines.append(f"recommended: {b.split} (trainer:generator) in mode {b.rates.mode} -> "
                 f"{b.rates.consumed_per_s:.4g} samples/s")
    if rec.baseline is not None:
        lines.append(f"predicted gain over baseline {rec.baseline.split} "
                     f"{rec.baseline.rates.mode}: {rec.gain:+.1%}")
        base = rec.baseline.rates.consumed_per_s
        per_mode = ", ".join(f"{m} {r.rates.consumed_per_s / base:.2f}x"
                             for m, r in rec.best_per_mode().items())
        lines.append(f"speedup per mode (best split of each): {per_mode}")
    lines += rec.notes
    return "\n".join(lines)


def _plan(args: argparse.Namespace, ov: dict[str, dict[str, str]]) -> str:
    model = apply(get_model(args.model), ov["model"], "model")
    hw = apply(get_hardware(args.hardware), ov["hardware"], "hardware")
    workload = apply(Workload(), ov["workload"], "workload")
    eff = apply(Efficiency(), ov["eff"], "eff")
    chips = args.chips or 256
    t, g = _split(args.split) if args.split else (chips // 2, chips - chips // 2)
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    rec = recommend_analytic(model, hw, workload, eff, chips, modes=modes,
                             baseline=(t, g, args.mode), staleness=args.staleness,
                             granularity=args.granularity)
    best = rec.best
    p = predict(model, hw, workload, eff, best.trainer_chips, best.generator_chips,
                staleness=args.staleness)
    gen, tr = p.generator, p.trainer
    s = workload.response_stats()
    out = [
        f"model {model.name}: {model.total_params / 1e9:.4g}B total, "
        f"{model.active_params / 1e9:.4g}B active ({model.source})",
        f"hardware {hw.name}: {hw.peak_flops / 1e12:.4g} TFLOP/s, {hw.hbm_bytes / 1e9:.4g} GB at "
        f"{hw.hbm_bw / 1e12:.3g} TB/s ({hw.source})",
        f"workload: prompt {workload.prompt_len}, response mean {s.mean:.0f} (sigma "
        f"{workload.response_sigma}, max {workload.response_max}), group {workload.group_size}, "
        f"batch {workload.batch_size}; {chips} chips",
        f"per chip: trainer {tr.samples_per_s / tr.chips:.4g} samples/s "
        f"({tr.flops_per_sample:.3g} FLOP/sample at MFU {eff.trainer_mfu:.0%}); generator "
        f"replica of {gen.replica_chips} chips x {gen.slots} slots: "
        f"{gen.samples_per_s / gen.replicas:.4g} samples/s at full occupancy "
        f"({gen.tokens_per_s / gen.replicas / gen.replica_chips:.4g} tokens/s/chip)",
        f"at {best.split}: weight sync {p.weight_sync_s:.3g} s/step; sandbox cores "
        f"{sandbox_cores(workload, best.rates.consumed_per_s, eff):.1f} "
        f"(at {workload.sandbox_s_per_sample:.4g} s/sample: "
        f"{workload.tool_calls_per_sample:g} tool calls x {workload.tool_latency_s} s + reward "
        f"{workload.sandbox_exec_s} s)",
        "", format_recommendation(rec)]
    if args.cost or args.objective == "cost":
        out += ["", *_plan_cost(args, rec, model, hw, workload, eff, modes)]
    if args.simulate or args.trace:
        out += ["", f"simulator (steps: {args.steps}):"]
        runs = [("recommended", best)] + ([("baseline", rec.baseline)] if rec.baseline else [])
        for label, r in runs:
            cfg = apply(SimConfig(mode=r.rates.mode, steps=args.steps, staleness=args.staleness,
                                  trace=bool(args.trace) and label == "recommended"),
                        ov["sim"], "sim")
            try:
                res = simulate_split(model, hw, workload, eff, r.trainer_chips,
                                     r.generator_chips, cfg)
            except Infeasible as e:
                out.append(f"  {label}: infeasible ({e})")
                continue
            sm = res.summary()
            out.append(
                f"  {label:<11} {r.split:>9} {cfg.mode:<9} median step {sm['step_s_median']:.4g}"
                f" s (analytic {r.rates.step_s:.4g}), {sm['steady_consumed_per_s']:.4g} samples/s "
                f"(analytic {r.rates.consumed_per_s:.4g}), "
                f"trainer idle {sm['trainer_idle']:.1%} (analytic {r.rates.trainer_idle:.1%}),"
                f" staleness {res.staleness_hist}, dropped {res.dropped}")
            if res.trace is not None:
                out.append(f"  trace: {res.trace.save(args.trace)}")
    return "\n".join(out)


def _cost_lines(args: argparse.Namespace, rows: list[tuple[str, SplitResult]],
                hw_name: str, workload: Workload, eff: Efficiency, batch: int | None = None
                ) -> tuple[list[str], Any]:
    sheet = costs.load_prices(args.prices)
    chip = costs.chip_price(sheet, hw_name)
    core = sheet["cpu_core"]["usd_per_hour"]

    def cost_of(r: SplitResult) -> costs.Cost:
        c = costs.split_cost(r, chip, core, workload.sandbox_s_per_sample,
                             eff.sandbox_utilization)
        if batch is not None:  # measured rates: a step is one batch at the consumed rate
            c = dataclasses.replace(c, step_s=batch / r.rates.consumed_per_s)
        return c

    lines = [f"cost ({hw_name} ${chip:g}/chip-hour: {sheet['chips'][hw_name]['source']}, "
             f"{sheet['chips'][hw_name]['date']}; sandbox ${core:g}/core-hour, "
             f"{sheet['cpu_core']['date']}):"]
    lines += ["  " + costs.format_cost(label, r.split, cost_of(r)) for label, r in rows]
    return lines, cost_of


def _hosted_line(args: argparse.Namespace, prompt: float, response: float, epochs: int) -> str:
    sheet = costs.load_prices(args.prices)
    if args.hosted not in sheet["hosted"]:
        return (f"hosted API {args.hosted}: no price in the sheet (priced: "
                f"{sorted(sheet['hosted'])})")
    return costs.format_hosted(args.hosted, sheet["hosted"][args.hosted], prompt, response,
                               epochs)


def _plan_cost(args: argparse.Namespace, rec: Recommendation, model: Any, hw: Any,
               workload: Workload, eff: Efficiency, modes: list[str]) -> list[str]:
    rows = ([("baseline", rec.baseline)] if rec.baseline else []) + [("recommended", rec.best)]
    lines, cost_of = _cost_lines(args, rows, hw.name, workload, eff)
    if args.objective == "cost":
        # $ per rollout may fall with fewer chips (tail, replica granularity): try every total.
        g = args.granularity or hw.chips_per_node
        pool = list(rec.candidates)
        for total in range(2 * g, rec.total_chips, g):
            try:
                pool += recommend_analytic(model, hw, workload, eff, total, modes=modes,
                                           staleness=args.staleness, granularity=g).candidates
            except ValueError:
                continue
        best = costs.cheapest(pool, cost_of)
        lines.append("  " + costs.format_cost("cheapest", best.split, cost_of(best))
                     + f" (mode {best.rates.mode}; objective cost, any total up to "
                       f"{rec.total_chips} chips)")
    s = workload.response_stats()
    lines.append("  " + _hosted_line(args, workload.prompt_len, s.mean, workload.epochs))
    return lines


def _published_cost(args: argparse.Namespace, ov: dict[str, dict[str, str]]) -> str:
    """The published case (GLM-5 description, 128 + 128 H200) priced."""
    hw = apply(get_hardware("h200"), ov["hardware"], "hardware")
    workload = apply(Workload(), ov["workload"], "workload")
    eff = apply(Efficiency(), ov["eff"], "eff")
    case = published.CASES[0]
    r = published.reproduce(case, hw)
    rec = r.matched
    rows = [("published", rec.baseline), ("recommended", rec.best)]
    lines, cost_of = _cost_lines(args, rows, hw.name, workload, eff,
                                 batch=workload.batch_size)
    if args.objective == "cost":
        best = costs.cheapest(rec.candidates, cost_of)
        lines.append("  " + costs.format_cost("cheapest", best.split, cost_of(best)))
    base, best = cost_of(rec.baseline), cost_of(rec.best)
    prompt = min(workload.prompt_len, r.sample_tokens - 1)
    lines += [f"  recommended saves {1 - best.usd_per_million / base.usd_per_million:.1%} per "
              f"rollout; an RL step is {workload.batch_size} rollouts "
              f"(--workload.batch_size)",
              "  " + _hosted_line(args, prompt, r.sample_tokens - prompt, workload.epochs)]
    head = (f"Published case {case.label} H200 ({published.SOURCE}): trainer "
            f"{published.TRAINER_CAPACITY} vs generator {published.GENERATOR_RATE} "
            f"samples/s; {r.sample_tokens:,} tokens per sample (implied, planner)")
    return "\n".join([head, *lines])


def _from_run(args: argparse.Namespace) -> str:
    metrics = read_run(args.from_run)
    kw = {}
    if args.split:
        kw["trainer_chips"], kw["generator_chips"] = _split(args.split)
    granularity = args.granularity or 1
    rec = from_measured(metrics, total_chips=args.chips, granularity=granularity, **kw)
    return f"measured run {args.from_run}:\n" + format_recommendation(rec)


def _only_cost(argv: Sequence[str] | None) -> bool:
    """`plan.py --cost` with no plan of its own (no --model/--hardware/--chips/--split):
    the published case."""
    given = sys.argv[1:] if argv is None else list(argv)
    plan_flags = ("--model", "--hardware", "--chips", "--split", "--from-run")
    return not any(a.split("=")[0] in plan_flags for a in given)


def main(argv: Sequence[str] | None = None) -> int:
    args, extra = _parser().parse_known_args(argv)
    try:
        ov = parse_overrides(extra)
        if args.list:
            print("models:", ", ".join(sorted(MODELS)))
            print("hardware:", ", ".join(sorted([*HARDWARE, CPU_NAME])))
            print("modes:", ", ".join(MODES))
            return 0
        if args.published and not args.cost:
            print(published.report(apply(get_hardware("h200"), ov["hardware"], "hardware")))
        elif args.cost and (args.published or _only_cost(argv)):
            print(_published_cost(args, ov))
        elif args.from_run:
            print(_from_run(args))
        else:
            print(_plan(args, ov))
    except (ValueError, FileNotFoundError) as e:
        print(f"plan.py: error: {e}", file=sys.stderr)
        return 2
    return 0

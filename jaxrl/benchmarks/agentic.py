"""Multi-turn episodes with slow tools: `python launch/bench.py agentic [options]`.

Generated tokens/s of `EpisodeRunner` (a turn is a generation request; the slot is free while
the episode's tool runs) against the same engine when an episode holds its slot through its tool
calls (`EpisodeRunner(blocking=True)`, the peer), in the same process, rounds interleaved
(free, blocking, free, blocking, ...; one warm-up round each first, untimed).

Each episode is `--turns` turns of exactly `--turn-tokens` sampled tokens (EOS ignored), and
after every turn but the last a tool call whose latency is drawn uniformly from `--latency`
(seconds, seeded by episode and call, so both sides wait the same): `sleep` sleeps on the tool
thread; `python` runs code in the episode's stateful Python session in the sandbox pool (a
counter kept across calls, plus the same sleep inside the session). Both sides run the same
episodes on the same `JaxEngine` (`--slots` decode slots); the free side may have all
`--episodes` live at once, the blocking side at most `--slots`.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import random
import statistics
import time

from jaxrl.envs.base import Environment, Step
from jaxrl.presets import tiny_task_model_config
from jaxrl.sandbox.session_pool import SessionPool
from jaxrl.tokenizers import CharTokenizer

print = functools.partial(print, flush=True)


def _parse(argv):
    p = argparse.ArgumentParser(prog="bench.py agentic", description=__doc__.split("\n")[0])
    p.add_argument("--tools", default="sleep,python", help="comma-separated: sleep, python")
    p.add_argument("--latency", default="0.05,0.5", help="tool latency range in seconds: lo,hi")
    p.add_argument("--episodes", type=int, default=32, help="episodes per round")
    p.add_argument("--slots", type=int, default=8, help="the engine's decode slots")
    p.add_argument("--turns", type=int, default=4, help="model turns per episode")
    p.add_argument("--turn-tokens", type=int, default=16, help="tokens per model turn")
    p.add_argument("--chunk-steps", type=int, default=4)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--repeats", type=int, default=2, help="timed rounds per side and tool")
    p.add_argument("--tier", default="auto", help="sandbox tier of the python tool's sessions")
    p.add_argument("--json", action="store_true", help="print one JSON line of results")
    return p.parse_args(argv)


class _ToolEnv(Environment):
    """`turns` model turns; after each but the last, one tool call of seeded latency."""

    turns, lo, hi, python = 4, 0.05, 0.5, False

    def __init__(self, record, tools):
        super().__init__(record, tools)
        self.calls = 0

    def step(self, action: str) -> Step:
        self.calls += 1
        if self.calls >= self.turns:
            return Step(done=True, reward=1.0)
        latency = random.Random(f"{self.record['uid']}/{self.calls}").uniform(self.lo, self.hi)
        if self.python:
            r = self.tools.python(f"import time\ntime.sleep({latency:.4f})\n"
                                  "n = globals().get('n', 0) + 1\nprint(n, end='')")
            return Step(observation=f"={r.stdout};")
        with self.tools.timed():
            time.sleep(latency)
        return Step(observation=f"={self.calls};")


def env_class(tool: str, turns: int, latency: tuple[float, float], turn_tokens: int):
    attrs = dict(turns=turns, lo=latency[0], hi=latency[1], python=tool == "python",
                 max_turns=turns, turn_max_tokens=turn_tokens, max_wall_s=600.0)
    return type(f"Bench_{tool}", (_ToolEnv,), attrs)


def run_round(engine, tokenizer, env_cls, *, episodes: int, blocking: bool, sessions,
              max_tokens: int, turn_tokens: int, seed: int) -> dict:
    """One round of `episodes` episodes; returns generated tokens, seconds, tokens/s."""
    from jaxrl.generate import SamplingParams, Scheduler
    from jaxrl.rl.multiturn import EpisodeRunner

    runner = EpisodeRunner(Scheduler(engine), tokenizer, env_cls, sessions=sessions,
                           max_tokens=max_tokens, tool_threads=episodes, blocking=blocking)
    records = [{"uid": f"{seed}/{i}", "prompt": f"q{i}="} for i in range(episodes)]
    prompts = [tokenizer.encode(r["prompt"], add_bos=True) for r in records]
    sampling = [SamplingParams(max_tokens=turn_tokens, temperature=1.0, seed=seed * 1000 + i,
                               ignore_eos=True) for i in range(episodes)]
    try:
        t0 = time.perf_counter()
        groups = runner.run(records, prompts, sampling)
        seconds = time.perf_counter() - t0
    finally:
        runner.close()
    eps = [ep for g in groups for ep in g]
    tokens = sum(sum(ep.mask) for ep in eps)
    m = runner.stats.metrics()
    return {"tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds,
            "turns_mean": m["env/turns_mean"], "tool_p50": m["env/tool_latency_p50"],
            "slots_waiting_on_tools": m["generator/slots_waiting_on_tools"],
            "ended": sorted({ep.ended_by for ep in eps})}


def main(argv: list[str]) -> int:
    args = _parse(argv)
    lo, hi = (float(x) for x in args.latency.split(","))
    tools = [t.strip() for t in args.tools.split(",") if t.strip()]
    bad = [t for t in tools if t not in ("sleep", "python")]
    if bad:
        print(f"error: --tools takes sleep and/or python, got {bad}")
        return 2
    from jaxrl.generate import JaxEngine
    from jaxrl.models import create_model

    tok = CharTokenizer()
    cfg = tiny_task_model_config(hidden_size=args.hidden, intermediate_size=3 * args.hidden,
                                 num_layers=args.layers)
    max_tokens = args.turns * (args.turn_tokens + 8)
    engine = JaxEngine(create_model(cfg, seed=0), num_slots=args.slots,
                       max_len=max_tokens + 16, chunk_steps=args.chunk_steps)
    print(f"agentic: {args.episodes} episodes x {args.turns} turns x {args.turn_tokens} tokens, "
          f"tools {lo * 1e3:.0f}-{hi * 1e3:.0f} ms, {args.slots} slots, model "
          f"{cfg.num_params() / 1e6:.2f}M params, load {os.getloadavg()[0]:.1f}")
    results = {}
    for tool in tools:
        env_cls = env_class(tool, args.turns, (lo, hi), args.turn_tokens)
        sessions = None
        if tool == "python":
            sessions = SessionPool(args.episodes, tier=args.tier)
        try:
            runs = {"free": [], "blocking": []}
            for r in range(args.repeats + 1):  # round 0: warm-up (compilation), not kept
                for side in ("free", "blocking"):
                    out = run_round(engine, tok, env_cls, episodes=args.episodes,
                                    blocking=side == "blocking", sessions=sessions,
                                    max_tokens=max_tokens, turn_tokens=args.turn_tokens,
                                    seed=r)
                    if r:
                        runs[side].append(out)
                        print(f"  {tool:<6} {side:<8} round {r}: {out['tokens_per_s']:8.1f} "
                              f"tokens/s ({out['tokens']} tokens, {out['seconds']:.2f} s, tool "
                              f"p50 {out['tool_p50'] * 1e3:.0f} ms, slots waiting on tools "
                              f"{out['slots_waiting_on_tools']:.2f})")
        finally:
            if sessions is not None:
                sessions.close()
        free = statistics.median(o["tokens_per_s"] for o in runs["free"])
        held = statistics.median(o["tokens_per_s"] for o in runs["blocking"])
        results[tool] = {"free_tokens_per_s": free, "blocking_tokens_per_s": held,
                         "ratio": free / held, "runs": runs}
        print(f"{tool:<6} free {free:8.1f} tokens/s  blocking {held:8.1f} tokens/s  "
              f"ratio {free / held:.2f}x (median of {args.repeats} interleaved rounds)")
    print(f"load average after: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    if args.json:
        print(json.dumps({t: {k: v for k, v in r.items() if k != "runs"}
                          for t, r in results.items()}))
    return 0

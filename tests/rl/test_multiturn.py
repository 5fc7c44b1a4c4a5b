"""Multi-turn episodes: exact tokens across turns, the loss mask, tools off the generator's path,
and a session closed by a limit ending its episode with the penalty."""

from __future__ import annotations

import time

import numpy as np
import pytest

from jaxrl.envs.base import Environment, Step, Tools, get_env
from jaxrl.generate import JaxEngine, SamplingParams, Scheduler
from jaxrl.models import create_model
from jaxrl.rl.buffer import Group, Rollout, groups_to_batch
from jaxrl.rl.multiturn import EpisodeRunner
from jaxrl.testing import tiny_model_config
from jaxrl.tokenizers import CharTokenizer
from jaxrl.train.logprobs import model_logprobs

TOK = CharTokenizer()
OBS = " obs;"


class Ping(Environment):
    """A test environment in a few lines: every turn is answered with OBS, three turns."""

    stop = ("!",)
    max_turns = 3
    turn_max_tokens = 5
    tool_sleep_s = 0.0

    def step(self, action: str) -> Step:
        time.sleep(self.tool_sleep_s)
        return Step(observation=OBS, reward=0.25)


class SlowPing(Ping):
    tool_sleep_s = 0.05


@pytest.fixture(scope="module")
def model():
    cfg = tiny_model_config()
    assert cfg.vocab_size >= TOK.vocab_size
    return create_model(cfg, seed=3)


@pytest.fixture(scope="module")
def engine(model):
    return JaxEngine(model, num_slots=4, max_len=64, chunk_steps=4, max_stop_ids=4)


def _records(n):
    return [{"uid": i, "prompt": f"q{i}="} for i in range(n)]


def _run(engine, env_cls=Ping, n_records=3, n=2, blocking=False, max_tokens=40):
    runner = EpisodeRunner(Scheduler(engine), TOK, env_cls, max_tokens=max_tokens,
                           blocking=blocking)
    records = _records(n_records)
    prompts = [[TOK.bos_id, *TOK.encode(r["prompt"])] for r in records]
    sampling = [SamplingParams(max_tokens=8, temperature=1.0, n=n, seed=11 + i)
                for i in range(n_records)]
    try:
        return runner.run(records, prompts, sampling), runner.stats
    finally:
        runner.close()


def test_episode_sequence_is_model_tokens_and_observation_tokens(engine):
    groups, stats = _run(engine)
    obs = TOK.encode(OBS)
    for g in groups:
        for ep in g:
            assert ep.turns == 3 and ep.ended_by == "turns"
            assert ep.reward == pytest.approx(0.75)
            # the sequence splits into model runs and exact observation ids, in turn order
            runs, i, m = [], 0, np.asarray(ep.mask)
            while i < len(m):
                j = i
                while j < len(m) and m[j] == m[i]:
                    j += 1
                runs.append((int(m[i]), ep.tokens[i:j]))
                i = j
            assert [k for k, _ in runs] == [1, 0, 1, 0, 1]
            assert all(ids == obs for k, ids in runs if k == 0)
            assert all(lp == 0.0 for lp, k in zip(ep.logprobs, ep.mask, strict=True) if not k)
            assert all(lp < 0.0 for lp, k in zip(ep.logprobs, ep.mask, strict=True) if k)
    assert stats.metrics()["env/turns_mean"] == 3.0


def test_trainer_logprobs_equal_behaviour_logprobs_across_turns(engine, model):
    groups, _ = _run(engine)
    batch = groups_to_batch([Group(example={}, rollouts=[Rollout(
        prompt=ep.prompt, completion=ep.tokens, logprobs=ep.logprobs, versions=ep.versions,
        mask=ep.mask) for ep in g]) for g in groups])
    logp, _ = model_logprobs(model, batch, chunk=16)
    mask = np.asarray(batch.loss_mask)
    behaviour = np.asarray(batch.behaviour_logprobs)
    assert mask.sum() == sum(sum(ep.mask) for g in groups for ep in g)
    np.testing.assert_allclose(np.asarray(logp)[mask == 1], behaviour[mask == 1], atol=2e-4)
    assert np.all(behaviour[mask == 0] == 0.0)
    # the second and third turns are scored too (after an observation)
    assert all(ep.mask.count(1) > ep.mask.index(0) for g in groups for ep in g)


def test_loss_mask_covers_only_model_tokens_hand_built():
    #            prompt     turn 1    observation   turn 2
    prompt, completion = [2, 10, 11], [20, 21, 30, 31, 32, 22]
    mask = [1, 1, 0, 0, 0, 1]
    lp = [-0.5, -0.25, 0.0, 0.0, 0.0, -1.0]
    batch = groups_to_batch([Group(example={}, rollouts=[Rollout(
        prompt, completion, lp, [0] * 6, mask=mask)])])
    np.testing.assert_array_equal(batch.loss_mask[0], [0, 0, 0, 1, 1, 0, 0, 0, 1])
    np.testing.assert_array_equal(batch.tokens[0], prompt + completion)
    np.testing.assert_allclose(batch.behaviour_logprobs[0], [0, 0, 0, *lp])


def test_generator_never_holds_a_slot_for_a_tool(engine):
    _, free = _run(engine, SlowPing, n_records=4, n=2)
    _, blocked = _run(engine, SlowPing, n_records=4, n=2, blocking=True)
    assert free.metrics()["generator/slots_waiting_on_tools"] == 0.0
    assert blocked.metrics()["generator/slots_waiting_on_tools"] > 0.0
    assert free.turns == blocked.turns == 4 * 2 * 3


def test_token_budget_ends_an_episode(engine):
    groups, _ = _run(engine, n_records=1, n=1, max_tokens=8)
    (ep,) = groups[0]
    assert len(ep.tokens) <= 8 and ep.ended_by in ("tokens", "turns")


@pytest.fixture(scope="module")
def sessions():
    from jaxrl.sandbox.session_pool import SessionPool

    with SessionPool(2) as pool:
        yield pool


class Hang(Ping):
    session_penalty = -2.0

    def step(self, action: str) -> Step:
        self.tools.python("import time\ntime.sleep(60)", timeout_s=0.3)
        return Step(observation=OBS)


def test_a_session_closed_by_its_timeout_ends_the_episode_with_the_penalty(engine, sessions):
    runner = EpisodeRunner(Scheduler(engine), TOK, Hang, sessions=sessions, max_tokens=40)
    try:
        groups = runner.run(_records(1), [[TOK.bos_id, 60]], [SamplingParams(seed=1, n=2)])
    finally:
        runner.close()
    for ep in groups[0]:
        assert (ep.turns, ep.reward, ep.ended_by) == (1, -2.0, "session:timeout")
    assert runner.stats.metrics()["env/session_penalties"] == 2.0
    assert sessions.stats()["session_count"] == 0
    with sessions.open() as s:  # the next episode's session is clean
        assert s.run("print(sorted(globals()))").stdout == "['__builtins__', '__name__']\n"


class TwoTools(Ping):
    """Two tool calls per turn: a Python call in the session and a timed sleep."""

    max_turns = 2

    def step(self, action: str) -> Step:
        self.tools.python("import time\ntime.sleep(0.03)")
        with self.tools.timed():
            time.sleep(0.01)
        return Step(observation=OBS)


def test_each_tool_call_is_a_span_on_the_sandbox_track(engine, sessions):
    from jaxrl.trace import TraceWriter

    trace = TraceWriter()
    runner = EpisodeRunner(Scheduler(engine), TOK, TwoTools, sessions=sessions, max_tokens=40,
                           trace=trace)
    try:
        groups = runner.run(_records(1), [[TOK.bos_id, 60]], [SamplingParams(seed=2, n=2)])
    finally:
        runner.close()
    sandbox = next(e["tid"] for e in trace.events() if e.get("args", {}).get("name") == "sandbox")
    spans = [e for e in trace.events() if e["ph"] == "X" and e["name"] == "tool_call"]
    assert all(e["tid"] == sandbox for e in spans)
    assert len(spans) == runner.stats.tool_calls == 2 * 2 * 2  # episodes x turns x calls
    durations = sorted(e["dur"] / 1e6 for e in spans)
    latencies = sorted(t for ep in groups[0] for t in ep.tool_s)
    np.testing.assert_allclose(durations, latencies, atol=1e-5)
    assert all(0.01 <= d < 0.5 for d in durations[:4]) and all(d >= 0.03 for d in durations[4:])
    by_episode = {}
    for e in spans:
        by_episode.setdefault(e["args"]["episode"], []).append(e)
    for calls in by_episode.values():  # an episode's calls one after the other, not overlapping
        calls.sort(key=lambda e: e["ts"])
        assert all(a["ts"] + a["dur"] <= b["ts"] for a, b in zip(calls, calls[1:], strict=False))
        assert [e["args"]["turn"] for e in calls] == [1, 1, 2, 2]


def test_builtin_environments_answer_with_their_tools(sessions):
    lookup = get_env("lookup")({"answer": "7", "prompt": "k="}, Tools(sessions))
    assert lookup.step("?") == Step(observation="7;")
    assert lookup.step("7") == Step(done=True, reward=1.0)
    lookup.tools.close()
    tool = get_env("python_tool")({"answer": "42", "prompt": "6*7="},
                                  Tools(sessions, score=lambda text: float("42" in text)))
    assert tool.step("[x = 6 * 7\nx]").observation == "=42;"
    assert tool.step("42").reward == 1.0
    tool.tools.close()
    code = get_env("code_feedback")({"prompt": "f(1)=3 f(2)=5\nf(x)="},
                                    Tools(sessions, score=lambda text: 1.0))
    wrong = code.step("x+2")
    assert not wrong.done and "f(2)=5 not 4" in wrong.observation
    assert code.step("2*x+1") == Step(done=True, reward=1.0)
    code.tools.close()
    assert sessions.stats()["session_count"] == 0


def test_code_feedback_reward_is_the_judged_pass_rate_of_the_final_candidate(sessions):
    from jaxrl.config import DataConfig
    from jaxrl.data.pysynth import pysynth_tests_batch
    from jaxrl.data.tasks import build_task
    from jaxrl.rewards import LocalSandboxPool
    from jaxrl.rewards.rewards import RewardScorer

    task = build_task(DataConfig(task="code_feedback"))
    assert dict(task.rewards) == {"pysynth_tests": 1.0}
    inputs = [-3, 0, 2, 4, 7, 9, 12, 15]
    record = {"prompt": "f(1)=3 f(2)=5\nf(x)=", "inputs": inputs,
              "expected": [2 * x + 1 for x in inputs]}
    partial = "def f(x):\n    return 2*x+1 if x < 8 else 0"  # right on 5 of the 8 hidden inputs
    forger = ("def f(x):\n    import os\n    os.write(1, b'0 %d pass\\n' % x)\n"
              "    print('pass')\n    return 0")
    with LocalSandboxPool(num_workers=1) as pool, \
            RewardScorer(task.reward_spec(), pool=pool) as scorer:
        def score(text):
            return float(scorer.score_batch(task.reward_items([record], [text])).total[0])

        assert pysynth_tests_batch([{**record, "completion": c} for c in
                                    ("2*x+1", "x+x", partial, forger, "2*x+")], pool=pool) == [
            1.0, 0.0, 5 / 8, 0.0, 0.0]
        env = get_env("code_feedback")(record, Tools(sessions, score=score))
        assert env.step("x+2") == Step(observation="\nwrong: f(2)=5 not 4\nf(x)=")
        assert env.step(partial) == Step(done=True, reward=5 / 8)  # shown pass, hidden 5 of 8
        env.tools.close()
        env = get_env("code_feedback")(record, Tools(sessions, score=score))
        env.step("x")
        env.step("x")
        # the last turn ends the episode though f(1) is wrong: right at x=2 and the 3 inputs >= 8
        assert env.step("x+3 if x < 8 else 2*x+1") == Step(done=True, reward=4 / 8)
        env.tools.close()


class PieceTokenizer:
    """A vocabulary where the closing tag `</tool_call>` spans several tokens, spelled two
    ways, and one token runs past it (`>\n`)."""

    pieces = ["a", "b", "</", "tool", "_call", ">", ">\n", "<", "/", "tool_call>"]

    def decode(self, ids, errors="replace"):
        return "".join(self.pieces[i] for i in ids)

    def encode(self, text):
        return [self.pieces.index(p) for p in ("</", "tool", "_call", ">")] if text == \
            "</tool_call>" else [self.pieces.index(c) for c in text]


def test_a_stop_string_of_several_tokens_ends_at_the_token_that_completes_it():
    from jaxrl.envs.base import split_stops
    from jaxrl.generate.stops import StopText

    tok = PieceTokenizer()
    stop = StopText(("</tool_call>",), tok.decode)
    assert stop.find([0, 2, 3, 4, 5, 0, 1]) == 5  # "a</tool_call>ab": ids kept up to ">"
    assert stop.find([1, 7, 8, 9, 0]) == 4  # spelled "<" "/" "tool_call>"
    assert stop.find([0, 2, 3, 4, 6, 0]) == 5  # ">\n" completes it: kept whole
    assert stop.find([0, 2, 3, 4, 0, 5]) is None  # "</tool_call" then "a>": no stop
    assert stop.find([2, 3, 4, 5, 0], start=5) is None  # checked before
    assert split_stops(tok, ("a", "</tool_call>")) == ((0,), ("</tool_call>",))
    assert split_stops(TOK, ("!",)) == ((TOK.encode("!")[0],), ())


def test_multi_token_stop_keeps_exactly_the_generated_ids_and_frees_the_slot(engine):
    from jaxrl.generate.stops import StopText

    prompt, greedy = [TOK.bos_id, *TOK.encode("q0=")], SamplingParams(max_tokens=12,
                                                                       temperature=0.0)
    sched = Scheduler(engine)
    sched.submit(prompt, greedy)
    (free,) = sched.run()
    text = [TOK.decode([t]) for t in free.tokens]
    cut = next(j for j in range(2, 12) if "".join(text[j - 2:j]) not in "".join(text[:j - 1]))
    stop = StopText(("".join(text[cut - 2:cut]),), lambda ids: TOK.decode(ids, errors="replace"))
    sched.submit(prompt, greedy, stop_text=stop)
    (stopped,) = sched.run()
    assert stopped.finish_reason == "stop" and stopped.tokens == free.tokens[:cut]
    assert stopped.logprobs == free.logprobs[:cut]
    assert sched.num_running == 0 and not np.asarray(sched.state.active_B).any()
    sched.submit(prompt, greedy)  # the released slot serves the next request as before
    assert sched.run()[0].tokens == free.tokens

    tag = stop.strings

    class Tag(Ping):
        stop = tag
        turn_max_tokens = 12

    runner = EpisodeRunner(sched, TOK, Tag, max_tokens=40)
    try:
        (ep,), = runner.run([{"prompt": "q0="}], [prompt], [greedy])
    finally:
        runner.close()
    assert ep.tokens[:cut] == free.tokens[:cut] and ep.mask[:cut + 1] == [1] * cut + [0]


def test_lookup_demonstrations_copy_the_tool_in_the_share_set_by_difficulty():
    from jaxrl.data.tasks import LOOKUP_COPY_SHARE, make_lookup

    for share in LOOKUP_COPY_SHARE:
        records = [make_lookup("train", i, seed=0, copy_share=share) for i in range(2000)]
        assert all(r["demo"][:3] == f"?{r['answer']};" for r in records)  # always asks first
        copied = np.mean([r["demo"][3] == r["answer"] for r in records])
        assert abs(copied - share) < 0.035, (share, copied)

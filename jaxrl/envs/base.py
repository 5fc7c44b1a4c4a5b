"""The environment protocol: an episode is a dataset item, the model's turns and the environment's
observations, all in ONE token sequence.

    @register_env("echo_tool")
    class EchoTool(Environment):
        stop = ("]",)            # strings that end a turn besides EOS
        max_turns = 3

        def step(self, action: str) -> Step:
            if action.endswith("]"):                          # a tool call "[code]"
                r = self.tools.python(action[action.rfind("[") + 1:-1])
                return Step(observation=f"={r.stdout.strip()};")
            return Step(done=True, reward=float(action.strip() == self.record["answer"]))

An episode starts from the task's prompt (rendered as the task renders prompts; a task names its
environment in `Task.env`). The model acts until EOS or a stop string; `step(action_text)`
answers with an observation whose tokens are appended to the same sequence (masked out of the
loss, no behaviour logprobs), until `done` or a budget (`max_turns`, the episode's token
budget, `max_wall_s`) ends it. The episode's reward is the sum of its steps' rewards. A tool
session that a call closes by a limit (timeout, output cap, exit) ends the episode with
`session_penalty`. `step` runs on a tool thread, never on the generator's: it may block on it.

Nothing here imports jax: environments are host-side Python.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from jaxrl.sandbox.session_pool import ENDINGS, SessionPool, ToolResult


@dataclasses.dataclass(frozen=True)
class Step:
    """What the environment answers to one turn."""

    observation: str = ""  # text appended to the sequence (tokens masked out of the loss)
    done: bool = False
    reward: float = 0.0  # summed over the episode's steps


@dataclasses.dataclass(frozen=True)
class ToolCall:
    """One call of an episode's tool: its start on the `Tools` clock, its duration, its status."""

    start_s: float
    dur_s: float
    status: str


class Tools:
    """An episode's tools: a stateful Python session (opened on first use, closed with the
    episode) and each call's start and duration on `clock` (the run's trace clock when it has
    one: `EpisodeRunner(trace=...)`). `broken` names the limit that closed the session."""

    def __init__(self, sessions: SessionPool | None, *, timeout_s: float = 5.0,
                 max_output_bytes: int = 4096, score: Callable[[str], float] | None = None,
                 clock: Callable[[], float] = time.perf_counter):
        self._sessions, self._session, self._score = sessions, None, score
        self.timeout_s, self.max_output_bytes, self._clock = timeout_s, max_output_bytes, clock
        self.calls: list[ToolCall] = []
        self.broken: str | None = None

    @property
    def latencies(self) -> list[float]:
        return [c.dur_s for c in self.calls]

    @contextlib.contextmanager
    def timed(self, status: str = "ok") -> Iterator[None]:
        """Records the body as one tool call (a tool that is not the Python session)."""
        t0 = self._clock()
        try:
            yield
        finally:
            self.calls.append(ToolCall(t0, max(self._clock() - t0, 0.0), status))

    def python(self, code: str, *, timeout_s: float | None = None) -> ToolResult:
        """Runs `code` in the episode's session; a final expression's value is printed."""
        if self._sessions is None:
            raise RuntimeError("this run has no tool sessions (the environment needs a "
                               "SessionPool: EpisodeRunner(sessions=...))")
        t0 = self._clock()
        if self._session is None:
            self._session = self._sessions.open()
        r = self._session.run(code, timeout_s=timeout_s or self.timeout_s,
                              max_output_bytes=self.max_output_bytes)
        self.calls.append(ToolCall(t0, max(self._clock() - t0, 0.0), r.status))
        if r.closed and r.status in ENDINGS:
            self.broken = r.status
        return r

    def score(self, text: str) -> float:
        """The task's own reward of `text` for this episode's record (trusted side; code runs
        as stateless sandbox jobs): the verdict is never taken in the episode's session."""
        if self._score is None:
            raise RuntimeError("this run gives environments no scorer")
        return self._score(text)

    def close(self) -> None:
        if self._session is not None:
            self._session.close()
            self._session = None


class Environment:
    """One episode of a registered environment. Subclasses set the class attributes and define
    `step`; `self.record` is the dataset item, `self.tools` its tools."""

    stop: tuple[str, ...] = ()  # strings that end a turn besides EOS (one token or several)
    max_turns: int = 4
    turn_max_tokens: int = 0  # tokens one turn may generate (0: the episode's budget)
    max_wall_s: float = 60.0  # the episode ends at its next turn boundary after this
    session_penalty: float = -1.0  # the reward of an episode whose session a limit closed

    def __init__(self, record: Mapping[str, Any], tools: Tools):
        self.record, self.tools = record, tools

    @classmethod
    def stops(cls, tokenizer) -> tuple[str, ...]:
        """The stop strings for `tokenizer` (default: `stop`). A stop of one token ends the turn
        on device; one of several tokens is checked on the decoded tail after each chunk (the
        turn may then run a few tokens past it in the chunk before the check drops them)."""
        return cls.stop

    def step(self, action: str) -> Step:
        raise NotImplementedError

    def on_budget(self) -> float:
        """Extra reward when a budget (turns, tokens, wall-clock) ends the episode undone."""
        return 0.0


# --- registry ------------------------------------------------------------------------------------
# `jaxrl/envs/__init__.py` imports `builtin`, which registers the built-ins; Python runs it first.

_ENVS: dict[str, type[Environment]] = {}
_LOCK = threading.Lock()


def register_env(name: str, *, overwrite: bool = False) -> Callable[[type], type]:
    """Class decorator registering an `Environment` subclass under `name`."""

    def deco(cls):
        if not (isinstance(cls, type) and issubclass(cls, Environment)):
            raise TypeError(f"register_env({name!r}) takes an Environment subclass, got {cls!r}")
        with _LOCK:
            if name in _ENVS and not overwrite:
                raise ValueError(f"environment {name!r} is already registered "
                                 "(pass overwrite=True)")
            _ENVS[name] = cls
        return cls

    return deco


def env_names() -> list[str]:
    return sorted(_ENVS)


def get_env(name: str) -> type[Environment]:
    if name not in _ENVS:
        raise ValueError(f"unknown environment {name!r}; registered: {sorted(_ENVS)}")
    return _ENVS[name]


def split_stops(tokenizer, stops: tuple[str, ...]) -> tuple[tuple[int, ...], tuple[str, ...]]:
    """(stop ids, stop strings): a stop that is one token with `tokenizer` ends the turn on
    device as a stop id (a closing tool-call tag is one special token in Qwen's vocabulary);
    one spelled with several tokens is checked on the decoded tail of the generated ids after
    each chunk (`jaxrl.generate.stops.StopText`)."""
    ids, strings = [], []
    for s in stops:
        enc = list(tokenizer.encode(s))
        if not enc:
            raise ValueError(f"stop string {s!r} encodes to no tokens with this tokenizer")
        if len(enc) == 1:
            ids.append(int(enc[0]))
        else:
            strings.append(s)
    return tuple(ids), tuple(strings)

"""Built-in environments: `lookup` (learnable by the tiny model on CPU), `python_tool`,
`code_feedback`. Their tasks (records, prompts, SFT demonstrations) are in
`jaxrl/data/env_tasks.py`."""

from __future__ import annotations

import re

from jaxrl.envs.base import Environment, Step, register_env


@register_env("lookup")
class Lookup(Environment):
    """The answer is a digit only a tool knows: the model asks ("?"), the tool answers "d;",
    the model answers the digit. Reward 1 for the right digit; guessing without the tool earns
    1/10 on average. The tool runs in the episode's Python session."""

    stop = ("?",)
    max_turns = 3
    turn_max_tokens = 4

    def step(self, action: str) -> Step:
        if action.endswith("?"):
            r = self.tools.python(f"print({int(self.record['answer'])}, end=';')")
            return Step(observation=r.stdout)
        return Step(done=True, reward=float(action.strip()[:1] == self.record["answer"]))


@register_env("python_tool")
class PythonTool(Environment):
    """Arithmetic with a Python tool: `<tool_call>code</tool_call>` (or `[code]` where that tag
    is not one token) runs code in the episode's session, whose output comes back; any other
    turn is the final answer, scored by the task's reward (math_answer)."""

    stop = ("</tool_call>",)
    max_turns = 4

    @classmethod
    def stops(cls, tokenizer) -> tuple[str, ...]:
        one = len(list(tokenizer.encode("</tool_call>"))) == 1
        return ("</tool_call>",) if one else ("]",)

    def step(self, action: str) -> Step:
        m = re.search(r"(?:<tool_call>|\[)(.*?)(?:</tool_call>|\])\s*$", action, re.DOTALL)
        if m and (action.rstrip().endswith("</tool_call>") or action.rstrip().endswith("]")):
            r = self.tools.python(m.group(1))
            out = (r.stdout + r.stderr)[-300:]
            return Step(observation=f"\n<tool_response>{out}</tool_response>\n"
                        if "</tool_call>" in action else f"={out.strip()};")
        return Step(done=True, reward=self.tools.score(action))


@register_env("code_feedback")
class CodeFeedback(Environment):
    """Write a function, see which shown examples it gets wrong, retry (up to `max_turns`).
    The candidate's values on the shown inputs come from the episode's session (data for the
    feedback, never a verdict). The episode ends when the shown examples pass or at the last
    turn; its reward is then the final candidate's pass rate over the hidden tests, the task's
    own reward taken on the trusted side (`pysynth_tests`: judged outside the candidate's
    process). Feedback names the shown examples it gets wrong (never the hidden tests). An
    episode a token or wall-clock budget cuts has no final answer: reward 0."""

    max_turns = 3

    def __init__(self, record, tools):
        super().__init__(record, tools)
        self.turn = 0

    def step(self, action: str) -> Step:
        self.turn += 1
        candidate = action.strip()
        shown = [(int(x), int(y)) for x, y in
                 re.findall(r"f\((-?\d+)\)=(-?\d+)", str(self.record["prompt"]))]
        body = candidate if candidate.startswith("def ") else f"def f(x):\n return {candidate}"
        r = self.tools.python(f"{body}\nprint([f(x) for x, _ in {shown!r}])")
        got = _ints(r.stdout)
        wrong = [f"f({x})={y} not {g}" for (x, y), g in zip(shown, got, strict=False) if y != g]
        passed = r.status == "ok" and not wrong and len(got) == len(shown)
        if passed or self.turn >= self.max_turns:
            return Step(done=True, reward=self.tools.score(action))
        feedback = " ".join(wrong) if r.status == "ok" else (r.stderr.strip().splitlines()
                                                              or ["error"])[-1][:80]
        return Step(observation=f"\nwrong: {feedback}\nf(x)=")


def _ints(text: str) -> list[int]:
    return [int(v) for v in re.findall(r"-?\d+", text)]

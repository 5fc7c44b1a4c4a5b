"""Stop strings that are several tokens: a host-side check on the decoded tail of the ids.

A one-token stop (a closing tool-call tag that is one special token) is a stop id and ends the
sample on device (`SamplingParams.stop_token_ids`). A stop string the vocabulary spells with
several tokens (`</tool_call>` as `</` `tool` `_call` `>`) cannot be one id, and matching one
token sequence would miss the other ways the model may spell it. So the scheduler checks, after
each chunk, the text of each new token's tail window (the last `window` ids, `window` = the
longest stop's UTF-8 length + 1: every token adds at least one byte) and ends the sample at the
first token whose window contains a stop that the window without that token did not contain.
The sample keeps exactly the ids generated up to that token (the token that completes the
string included, as a stop id is); nothing is re-encoded, and the ids decoded are the ones
trained on. What the model drew after it in the same chunk is dropped and its slot released.

    stop = StopText(("</tool_call>",), tokenizer.decode)
    scheduler.submit(prompt, sampling, stop_text=stop)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence


@dataclasses.dataclass(frozen=True)
class StopText:
    """Stop strings checked on the decoded tail of a sample's ids. `decode(ids) -> str`."""

    strings: tuple[str, ...]
    decode: Callable[[list[int]], str]

    def __post_init__(self):
        strings = tuple(str(s) for s in self.strings)
        if not strings or not all(strings):
            raise ValueError(f"StopText needs non-empty stop strings, got {self.strings!r}")
        object.__setattr__(self, "strings", strings)

    @property
    def window(self) -> int:
        return max(len(s.encode("utf-8")) for s in self.strings) + 1

    def _has(self, ids: list[int]) -> bool:
        text = self.decode(ids)
        return any(s in text for s in self.strings)

    def find(self, tokens: Sequence[int], start: int = 0) -> int | None:
        """The length of `tokens` to keep when a stop string ends in one of `tokens[start:]`
        (the first such token is kept, the rest dropped), else None. Tokens before `start`
        were checked before."""
        w = self.window
        for j in range(max(start, 0), len(tokens)):
            lo = max(0, j + 1 - w)
            tail = [int(t) for t in tokens[lo:j + 1]]
            if self._has(tail) and not self._has(tail[:-1]):
                return j + 1
        return None

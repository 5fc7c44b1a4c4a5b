"""jaxrl.rewards.math: the `math_answer` checks: `answer` (comparison), `latex`, `parse`."""

"""The memory plan printed before any work (docs/memory.md), import-free: `plan.plan_memory`
(bytes per device from abstract shapes), `fit` (a run checked; the settings that would fit),
`step` (the train step's activations, its compiled form), `cli` (`python launch/memory.py`)."""

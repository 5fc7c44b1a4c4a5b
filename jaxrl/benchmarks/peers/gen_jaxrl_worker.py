"""jaxrl's side of `bench.py generate --vs ...`: `JaxEngine` + `Scheduler` (this environment).

    python gen_jaxrl_worker.py WORK_DIR none|int8|w8a8|fp8 [greedy]

Loads the saved HF model in the workload's `dtype` (then, unless `none`, the generator copy
quantized to that `generate.quantize` format), one engine with one slot per prompt and one prefill
bucket (the prompt length). With `greedy`, first prints the greedy continuations of the first
`greedy_prompts` prompts; then a warm-up of `chunk_steps` tokens (compiles prefill and the
decode chunk), then `repeats` timed generations of the whole batch, exactly `new_tokens` each (no
EOS ids), each printed as a `run` line.
"""

from __future__ import annotations

import sys

import common
import jax

from jaxrl.generate import JaxEngine, SamplingParams, Scheduler
from jaxrl.models import load_pretrained
from jaxrl.models.quant import quantized_copy


def main(argv: list[str]) -> int:
    work, quantize, *flags = argv
    w = common.load_workload(work)
    _, model = load_pretrained(w["model"], w.get("dtype", "float32"))
    if quantize != "none":
        model = quantized_copy(model, quantize)
    engine = JaxEngine(model, num_slots=w["batch"], max_len=w["prompt_tokens"] + w["new_tokens"],
                       chunk_steps=w["chunk_steps"], prefill_buckets=[w["prompt_tokens"]])
    prompts = w["prompts"]

    def generate(batch, sampling):
        sched = Scheduler(engine)
        for p in batch:
            sched.submit(p, sampling)
        done = sorted(sched.run(), key=lambda c: c.request_id)
        jax.block_until_ready(sched.state)
        return [list(c.tokens) for c in done]

    if "greedy" in flags:
        greedy = SamplingParams(max_tokens=w["greedy_new"], temperature=0.0)
        common.emit("greedy", tokens=generate(prompts[:w["greedy_prompts"]], greedy))
    sample = dict(temperature=w["temperature"], top_k=w["top_k"], top_p=w["top_p"])
    generate(prompts, SamplingParams(max_tokens=min(w["chunk_steps"], w["new_tokens"]), **sample))
    common.emit_timed_runs(w["repeats"], lambda i: generate(
        prompts, SamplingParams(max_tokens=w["new_tokens"], seed=i, **sample)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

"""CTranslate2's side of `bench.py generate --vs ct2` (its own venv).

    python gen_ct2_worker.py WORK_DIR convert          (once per saved model)
    python gen_ct2_worker.py WORK_DIR f32|int8 [greedy]

`convert`: CTranslate2's `TransformersConverter` turns the saved HF model into `ct2_dir` (f32).
Otherwise: loads it as a `Generator` (CPU, compute type float32 or int8 -- int8 quantizes the
weights at load; inter_threads 1, intra_threads `threads`), maps the prompt ids to the model's
vocabulary strings, warms up with a 2-token generation, then times `repeats` generations of the
whole batch (min_length = max_length = `new_tokens`, so no EOS before the cap; prompt not in the
result), each printed as a `run` line. With `greedy`, first prints the greedy continuations
(top-k 1) of the first `greedy_prompts` prompts.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import common
import ctranslate2

COMPUTE = {"f32": "float32", "int8": "int8"}


def main(argv: list[str]) -> int:
    work, mode, *flags = argv
    w = common.load_workload(work)
    if mode == "convert":
        from ctranslate2.converters import TransformersConverter

        TransformersConverter(w["model"]).convert(w["ct2_dir"], quantization="float32",
                                                  force=True)
        return 0
    gen = ctranslate2.Generator(w["ct2_dir"], device="cpu", compute_type=COMPUTE[mode],
                                inter_threads=1, intra_threads=w["threads"])
    vocab = json.loads((Path(w["ct2_dir"]) / "vocabulary.json").read_text())
    index = {tok: i for i, tok in enumerate(vocab)}
    prompts = [[vocab[t] for t in p] for p in w["prompts"]]

    def generate(batch, n, **sampling):
        res = gen.generate_batch(batch, max_length=n, min_length=n,
                                 include_prompt_in_result=False, **sampling)
        return [[index[t] for t in r.sequences[0]] for r in res]

    if "greedy" in flags:
        common.emit("greedy", tokens=generate(prompts[:w["greedy_prompts"]], w["greedy_new"],
                                              sampling_topk=1))
    sample = dict(sampling_topk=w["top_k"], sampling_topp=w["top_p"],
                  sampling_temperature=w["temperature"])
    generate(prompts, 2, **sample)  # warm-up
    common.emit_timed_runs(w["repeats"], lambda i: generate(prompts, w["new_tokens"], **sample))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

"""`transformers.generate`'s side of `bench.py generate --vs hf` (torch CPU, own venv).

    python gen_hf_worker.py WORK_DIR [greedy | reference]

Loads the saved model in the workload's `dtype`, sets `threads` torch threads, warms up with a
2-token generate, then times `repeats` generations of the whole batch (exactly `new_tokens` each:
min = max new tokens, no EOS id), each printed as a `run` line. With `greedy`, first prints the
greedy continuations of the first `greedy_prompts` prompts (`greedy` line), always in f32: the
reference every engine's greedy tokens are compared with; `reference` prints only those.
"""

from __future__ import annotations

import sys
import time

import common
import torch
from transformers import AutoModelForCausalLM


def main(argv: list[str]) -> int:
    work, *flags = argv
    w = common.load_workload(work)
    torch.set_num_threads(w["threads"])
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[w.get("dtype", "float32")]
    model = AutoModelForCausalLM.from_pretrained(w["model"], dtype=dtype).eval()
    ids = torch.tensor(w["prompts"])
    plen = ids.shape[1]
    kw = dict(eos_token_id=None, pad_token_id=0)

    def generate(batch, n, net=model, **sampling):
        out = net.generate(batch, attention_mask=torch.ones_like(batch), max_new_tokens=n,
                             min_new_tokens=n, **kw, **sampling)
        return out[:, plen:]

    sample = dict(do_sample=True, temperature=w["temperature"], top_k=w["top_k"],
                  top_p=w["top_p"])
    with torch.no_grad():
        if "greedy" in flags or "reference" in flags:
            f32 = model if dtype == torch.float32 else AutoModelForCausalLM.from_pretrained(
                w["model"], dtype=torch.float32).eval()
            new = generate(ids[:w["greedy_prompts"]], w["greedy_new"], net=f32, do_sample=False)
            common.emit("greedy", tokens=new.tolist())
            if "reference" in flags:
                return 0
        generate(ids, 2, **sample)  # warm-up
        for i in range(w["repeats"]):
            torch.manual_seed(i)
            start = time.perf_counter()
            new = generate(ids, w["new_tokens"], **sample)
            total = time.perf_counter() - start
            common.emit("run", total_s=total, samples=new.shape[0], new_min=new.shape[1],
                        new_max=new.shape[1])
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

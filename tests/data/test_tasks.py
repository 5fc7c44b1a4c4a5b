"""Tasks: registry, splits, rendering, and rewards through the real sandbox pool / math workers."""

from __future__ import annotations

import json

import pytest

from jaxrl.data import pysynth
from jaxrl.data.config import DataConfig, DataConfigError, SFTConfig
from jaxrl.data.tasks import build_task, parse_gsm8k, task_names
from jaxrl.rewards import RewardScorer
from jaxrl.tokenizers import CharTokenizer


@pytest.fixture(scope="module")
def pool():
    from jaxrl.sandbox.pool import LocalSandboxPool

    with LocalSandboxPool(num_workers=2) as p:
        print(f"sandbox tier: {p.tier}")
        yield p


@pytest.fixture(scope="module")
def pysynth_task():
    return build_task(DataConfig(task="pysynth", difficulty=1, eval_size=16))


def _score(task, pool, records, completions):
    with RewardScorer(task.reward_spec(), pool=pool, num_workers=1) as scorer:
        out = scorer.score_batch(task.reward_items(records, completions))
    assert not any(out.errors.values()), out.errors
    return out.total


def test_registry_and_config_validation():
    assert {"pysynth", "arith", "gsm8k_jsonl"} <= set(task_names())
    with pytest.raises(DataConfigError, match=r"data.task='nope' is not valid; valid choices: "
                                              r"\[.*'pysynth'"):
        DataConfig(task="nope")
    with pytest.raises(DataConfigError, match=r"data.difficulty=7 .* in 0..3"):
        DataConfig(difficulty=7)
    with pytest.raises(DataConfigError, match=r"data.prompt_format='html'"):
        DataConfig(prompt_format="html")
    with pytest.raises(DataConfigError, match=r"data.sft.lr=0 .* > 0"):
        SFTConfig(lr=0)
    with pytest.raises(DataConfigError, match=r"data.prompts_per_step=0"):
        DataConfig(prompts_per_step=0)


def test_pysynth_is_deterministic_and_splits_are_disjoint(pysynth_task):
    a = [pysynth_task.source("train")[i] for i in range(300)]
    b = [build_task(DataConfig(difficulty=1)).source("train")[i] for i in range(300)]
    assert a == b
    assert all(len(r["prompt"]) <= 60 for r in a)
    assert all(len(r["reference"]) <= pysynth.MAX_REF_CHARS for r in a)
    # level 1 (depth 1) splits by problem: no held-out prompt appears in training
    ev = pysynth_task.eval_records()
    assert not {r["prompt"] for r in ev} & {r["prompt"] for r in a}
    # depth >= 2 splits by function: held-out functions are never trained on
    deep = build_task(DataConfig(difficulty=2, eval_size=64))
    train_fns = {pysynth.fingerprint(eval(f"lambda x: {deep.source('train')[i]['reference']}"))
                 for i in range(500)}
    eval_fns = {pysynth.fingerprint(eval(f"lambda x: {r['reference']}"))
                for r in deep.eval_records()}
    assert len(train_fns) > 50 and len(eval_fns) > 10 and not train_fns & eval_fns


def test_pysynth_references_pass_their_hidden_tests(pysynth_task, pool):
    recs = [pysynth_task.source("train")[i] for i in range(40)] + pysynth_task.eval_records()
    assert _score(pysynth_task, pool, recs, [r["reference"] for r in recs]) == [1.0] * len(recs)


def test_pysynth_alternative_correct_programs_pass_wrong_ones_fail(pool):
    task = build_task(DataConfig(task="pysynth"))
    rec = {"uid": "hand", "prompt": "f(0)=1 f(1)=3 f(2)=5\nf(x)=", "reference": "2*x+1",
           "inputs": [-3, 0, 4, 11], "expected": [-5, 1, 9, 23]}
    cands = {
        "2*x+1": 1.0,
        "1+x+x": 1.0,  # another expression of the same function
        "x*2+1\n": 1.0,
        "f(x)=(x+1)*2-1": 1.0,
        "def f(x):\n    return x + x + 1\n": 1.0,  # a function, in its own sandbox job
        "```python\ndef f(x):\n    y = 2 * x\n    return y + 1\n```": 1.0,
        "(2*x+1) if x < 100 else 0": 1.0,  # not whitelisted: runs as a program
        "2*x+2": 0.0,  # wrong
        "x*x+1": 0.0,  # agrees on 0 and 2, wrong on the hidden inputs
        "2*x+1+(x==11)": 0.0,
        "1//0": 0.0,
        "2*x+": 0.0,  # does not parse
        "__import__('os')._exit(0)": 0.0,
        "": 0.0,
    }
    scores = _score(task, pool, [rec] * len(cands), list(cands))
    assert dict(zip(cands, scores, strict=True)) == cands


def test_pysynth_one_job_for_many_expressions(pool):
    class CountingPool:
        def __init__(self):
            self.calls, self.jobs = 0, 0

        def run(self, jobs):
            self.calls += 1
            self.jobs += len(jobs)
            return pool.run(jobs)

    counting = CountingPool()
    items = [{"completion": f"x+{i}", "inputs": [1, 2], "expected": [1 + i, 2 + i]}
             for i in range(100)]
    assert pysynth.pysynth_batch(items, pool=counting, exprs_per_job=64) == [1.0] * 100
    assert (counting.calls, counting.jobs) == (1, 2)


def test_pysynth_failed_shared_job_is_retried_per_candidate(pool):
    from jaxrl.sandbox.types import SandboxResult

    class FlakyPool:
        def __init__(self):
            self.batches = []

        def run(self, jobs):
            self.batches.append(len(jobs))
            results = pool.run(jobs)
            if len(self.batches) == 1:  # the shared expression job (last) dies
                results[-1] = SandboxResult("timeout", None, "", "", 5.0, 0.0)
            return results

    flaky = FlakyPool()
    items = [{"completion": c, "inputs": [1, 2], "expected": [2, 4]}
             for c in ("2*x", "x+x", "x*x", "def f(x):\n    return 2*x")]
    assert pysynth.pysynth_batch(items, pool=flaky) == [1.0, 1.0, 0.0, 1.0]
    assert flaky.batches == [2, 3]  # program + shared job, then one job per expression


def test_pysynth_candidate_parsing():
    assert pysynth.parse_candidate("2*x+1") == ("expr", "2*x+1")
    assert pysynth.parse_candidate("f(x) = x*x\n") == ("expr", "x*x")
    assert pysynth.parse_candidate("x**2")[0] == "expr"
    assert pysynth.parse_candidate("(x**4)**4")[0] == "program"  # no power towers in a shared job
    assert pysynth.parse_candidate("abs(x)")[0] == "program"
    assert pysynth.parse_candidate("x +* 2")[0] == "invalid"


def test_pysynth_difficulty_knobs():
    easy = build_task(DataConfig(difficulty=0)).source("train")
    hard = build_task(DataConfig(difficulty=3, pysynth_examples=2)).source("train")
    assert all(r["prompt"].count("f(") == 4 + 1 for r in (easy[i] for i in range(20)))
    assert all(r["prompt"].count("f(") == 2 + 1 for r in (hard[i] for i in range(20)))
    assert pysynth.canonical({2: 1, 1: -1, 0: 3}) == "x*x-x+3"
    assert pysynth.canonical(pysynth.polynomial(("*", ("+", ("x",), ("c", 1)), ("x",)))) == "x*x+x"


def test_arith_answers_with_math_reward(pool):
    task = build_task(DataConfig(task="arith", difficulty=2))
    recs = [task.source("train")[i] for i in range(6)]
    for r in recs:
        assert str(eval(r["expression"])) == r["answer"]
    hand = {"uid": "h", "prompt": "12+7*3=", "answer": "33"}
    comps = ["33", "The answer is 33.", "\\boxed{33}", "34", "34? no: 33", "33 or 34", ""]
    # the last number (or the last \\boxed{}) is the answer
    assert _score(task, pool, [hand] * len(comps), comps) == [1, 1, 1, 0, 1, 0, 0]
    assert _score(task, pool, recs, [r["answer"] for r in recs]) == [1.0] * len(recs)


def test_gsm8k_jsonl_reads_answers_and_scores(tmp_path, pool):
    rows = [
        {"question": "Nat sold 48 clips in April and half as many in May. How many in total?",
         "answer": "In May she sold 48/2 = <<48/2=24>>24 clips.\nIn total 48+24 = "
                   "<<48+24=72>>72.\n#### 72"},
        {"question": "A shirt costs $1,200 and is 50% off. What is the price?",
         "answer": "Half of 1,200 is 600.\n#### 600"},
        {"question": "How many?", "answer": "Big number.\n#### 1,000,000"},
    ]
    path = tmp_path / "gsm8k.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    task = build_task(DataConfig(task="gsm8k_jsonl", paths=(str(path),), eval_size=1))
    train, ev = task.source("train"), task.source("eval")
    assert [r["answer"] for r in train] == ["72", "600"] and ev[0]["answer"] == "1000000"
    assert "<<" not in train[0]["solution"]
    assert task.demonstration(train[0], False).endswith("#### 72")
    comps = ["She sold 72 clips.", "#### 71", "so \\boxed{72}"]
    assert _score(task, pool, [train[0]] * 3, comps) == [1.0, 0.0, 1.0]
    with pytest.raises(ValueError, match="set data.paths"):
        build_task(DataConfig(task="gsm8k_jsonl")).source("train")


def test_gsm8k_answer_without_final_line_names_record():
    with pytest.raises(ValueError, match=r"f.jsonl:3: field 'answer' has no final '#### N'"):
        parse_gsm8k({"question": "q", "answer": "42"}, "f.jsonl:3")


class _ChatTok(CharTokenizer):
    chat_template = "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}<assistant>"

    def apply_chat_template(self, messages, add_generation_prompt=True, tokenize=False):
        text = "".join(f"<{m['role']}>{m['content']}" for m in messages) + "<assistant>"
        return self.encode(text) if tokenize else text


def test_render_plain_and_chat(pysynth_task):
    tok = CharTokenizer()
    rec = pysynth_task.source("train")[0]
    ids = pysynth_task.render(rec, tok, "plain")
    assert ids[0] == tok.bos_id and tok.decode(ids[1:]) == rec["prompt"]
    demo = pysynth_task.render_demonstration(rec, tok, "plain")
    assert demo[-1] == tok.eos_id and tok.decode(demo[:-1]) == rec["reference"]
    with pytest.raises(ValueError, match="needs a tokenizer with a chat template"):
        pysynth_task.render(rec, tok, "chat")
    chat_tok = _ChatTok()
    text = chat_tok.decode(pysynth_task.render(rec, chat_tok, "auto"))
    assert text.startswith("<user>Find the integer function f with f(") and text.endswith(
        "<assistant>")
    sys_task = build_task(DataConfig(system_prompt="Be brief."))
    assert chat_tok.decode(sys_task.render(rec, chat_tok, "chat")).startswith(
        "<system>Be brief.<user>")
    assert chat_tok.decode(pysynth_task.render_demonstration(rec, chat_tok, "chat")).startswith(
        "f(x)=")


def test_builtin_task_names_match_the_registry():
    from jaxrl.data import config as data_config

    # tasks that tests register in this process (e.g. the multi-turn tests' test_two_turns)
    # are not built in
    registered = [name for name in task_names() if not name.startswith("test_")]
    assert sorted(data_config.BUILTIN_TASKS) == registered


def test_gsm8k_through_a_real_hf_chat_template(tmp_path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from jaxrl.tokenizers import HFTokenizer
    from jaxrl.train.sft import sft_rows

    chatml = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
              "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<unk>", "<|im_start|>", "<|im_end|>", "<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(["Nat sold 48 clips. How many? #### 72 \\boxed{}"] * 20, trainer)
    tok.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "chat_template": chatml}))
    hf = HFTokenizer(tmp_path)
    data = tmp_path / "train.jsonl"
    data.write_text(json.dumps({"question": "Nat sold 48 clips. How many?",
                                "answer": "48 clips.\n#### 48"}) + "\n")
    task = build_task(DataConfig(task="gsm8k_jsonl", paths=(str(data),),
                                 eval_paths=(str(data),), system_prompt="Be exact."))
    rec = task.source("train")[0]
    prompt = hf.decode(task.render(rec, hf, "auto"), skip_special_tokens=False)
    assert prompt == ("<|im_start|>system\nBe exact.<|im_end|>\n<|im_start|>user\nNat sold 48 "
                      "clips. How many?\nSolve it step by step and put the final answer in "
                      "\\boxed{}.<|im_end|>\n<|im_start|>assistant\n")
    batch = sft_rows(task, [rec], hf, "chat", 256)
    target = batch.tokens[0][batch.loss_mask[0] > 0].tolist()
    assert hf.decode(target, skip_special_tokens=False) == (
        "48 clips.\nThe answer is \\boxed{48}.<|im_end|>")

"""The `records` task: any JSONL / Parquet records mapped to prompts by field names."""

import dataclasses
import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from jaxrl.config import ConfigError, DataConfig, RunConfig
from jaxrl.data.sources import RecordError
from jaxrl.data.tasks import build_task


def _jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_fields_and_template_map_records(tmp_path):
    rows = [{"question": f"What is {i}+1?", "final": i + 1, "id": i} for i in range(6)]
    cfg = DataConfig(task="records", paths=(_jsonl(tmp_path / "t.jsonl", rows),), eval_size=2,
                     prompt_template="Q: {question}\nA:", answer_field="final")
    task = build_task(cfg)
    train, held = task.source("train"), task.eval_records()
    assert len(train) == 4 and [r["id"] for r in held] == [4, 5]
    assert train[0]["prompt"] == "Q: What is 0+1?\nA:" and train[0]["answer"] == "1"
    assert task.demonstration(train[0], False) == "1" and dict(task.rewards) == {
        "math_answer": 1.0}


def test_parquet_and_prompt_field(tmp_path):
    pq.write_table(pa.table({"text": ["a", "b", "c"], "answer": ["1", "2", "3"]}),
                   tmp_path / "t.parquet")
    cfg = DataConfig(task="records", paths=(str(tmp_path / "t.parquet"),), eval_size=1,
                     prompt_field="text", reward="math_answer,format")
    task = build_task(cfg)
    assert [r["prompt"] for r in task.source("train")] == ["a", "b"]
    assert dict(task.rewards) == {"math_answer": 1.0, "format": 1.0}


def test_bad_records_and_settings_name_the_fix(tmp_path):
    path = _jsonl(tmp_path / "t.jsonl", [{"q": "x"}, {"q": "y"}])
    with pytest.raises(RecordError, match=r"no field data.prompt_field='prompt' .*'q'"):
        build_task(DataConfig(task="records", paths=(path,), eval_size=1)).source("train")
    with pytest.raises(RecordError, match=r"prompt_template='\{question\}' needs a field"):
        build_task(DataConfig(task="records", paths=(path,), eval_size=1,
                              prompt_template="{question}")).source("train")
    with pytest.raises(ConfigError, match="reads data.paths .* or data.hf_dataset"):
        RunConfig(data=DataConfig(task="records"))


def test_a_misspelled_answer_field_fails_when_the_data_loads(tmp_path):
    # --data.answer_field=finall --data.reward=math_answer: every item used to score 0 (128
    # errors a step) and the run exited 0
    path = _jsonl(tmp_path / "t.jsonl", [{"question": f"{i}+1?", "final": i + 1} for i in range(3)])
    cfg = DataConfig(task="records", paths=(path,), eval_size=1, prompt_field="question",
                     answer_field="finall", reward="math_answer")
    with pytest.raises(RecordError) as info:
        build_task(cfg).source("train")
    assert str(info.value) == (
        f"{path}:1: no field data.answer_field='finall' (the record has ['final', 'question', "
        "'uid']), and reward 'math_answer' reads it; set --data.answer_field to one of those")
    # a reward that reads no answer needs no answer field; the right name maps it
    assert len(build_task(dataclasses.replace(cfg, reward="format")).source("train")) == 2
    fixed = build_task(dataclasses.replace(cfg, answer_field="final")).source("train")
    assert [r["answer"] for r in fixed] == ["1", "2"]


def test_a_saved_hugging_face_dataset(tmp_path):
    datasets = pytest.importorskip("datasets", reason="the `datasets` extra is not installed")
    ds = datasets.DatasetDict({
        "train": datasets.Dataset.from_list([{"q": f"q{i}", "a": str(i)} for i in range(5)]),
        "test": datasets.Dataset.from_list([{"q": "t", "a": "9"}])})
    ds.save_to_disk(str(tmp_path / "saved"))
    cfg = DataConfig(task="records", hf_dataset=str(tmp_path / "saved"), prompt_field="q",
                     answer_field="a", eval_size=2)
    task = build_task(cfg)
    assert [r["prompt"] for r in task.source("train")] == ["q0", "q1", "q2"]
    assert [r["answer"] for r in task.eval_records()] == ["3", "4"]
    with pytest.raises(RecordError, match=r"has splits \['test', 'train'\], not 'dev'"):
        build_task(DataConfig(task="records", hf_dataset=str(tmp_path / "saved"),
                              hf_split="dev")).source("train")

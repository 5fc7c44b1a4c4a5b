"""JSONL / Parquet sources: globs, malformed lines (file + line), missing fields, skip + count."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from jaxrl.data.config import DataConfig
from jaxrl.data.pipeline import PromptIterator
from jaxrl.data.sources import RecordError, expand_paths, load_records
from jaxrl.data.tasks import build_task


def _write_jsonl(path, records, extra_lines=()):
    lines = [json.dumps(r) for r in records]
    for pos, text in extra_lines:
        lines.insert(pos, text)
    path.write_text("\n".join(lines) + "\n")
    return path


def test_jsonl_records_get_uids_and_keep_fields(tmp_path):
    f = _write_jsonl(tmp_path / "a.jsonl", [{"q": i} for i in range(3)])
    src = load_records([f], required_fields=("q",))
    assert len(src) == 3
    assert [src[i]["q"] for i in range(3)] == [0, 1, 2]
    assert src[1]["uid"] == f"{f}:2"


def test_malformed_json_names_file_and_line(tmp_path):
    f = _write_jsonl(tmp_path / "bad.jsonl", [{"q": 1}, {"q": 2}], extra_lines=[(1, '{"q": 3,')])
    with pytest.raises(RecordError, match=r"bad\.jsonl:2: malformed JSON"):
        load_records([f])


def test_skip_bad_records_counts_them(tmp_path):
    f = _write_jsonl(tmp_path / "bad.jsonl", [{"q": 1}, {"x": 2}, {"q": 3}],
                     extra_lines=[(0, "not json"), (2, "[1, 2")])
    src = load_records([f], required_fields=("q",), skip_bad_records=True)
    assert [r["q"] for r in src] == [1, 3]
    assert src.bad_records == 3  # two malformed lines + one record without "q"
    assert src.metrics()["data/bad_records"] == 3.0
    it = PromptIterator(src, prompts_per_step=1)  # the run's data metrics carry the count
    assert it.metrics()["data/bad_records"] == 3.0


def test_missing_field_names_field_and_record(tmp_path):
    f = _write_jsonl(tmp_path / "m.jsonl", [{"question": "a", "answer": "#### 1"},
                                           {"question": "b"}])
    with pytest.raises(RecordError, match=r"m\.jsonl:2: record is missing required field "
                                          r"'answer' \(has \['question'\]\)"):
        load_records([f], required_fields=("question", "answer"))


def test_non_object_line_is_malformed(tmp_path):
    f = _write_jsonl(tmp_path / "n.jsonl", [{"q": 1}], extra_lines=[(1, "[1, 2]")])
    with pytest.raises(RecordError, match=r"n\.jsonl:2: record must be a JSON object"):
        load_records([f])


def test_all_records_bad_is_an_error(tmp_path):
    f = _write_jsonl(tmp_path / "x.jsonl", [], extra_lines=[(0, "{"), (1, "}")])
    with pytest.raises(RecordError, match="no usable records .2 bad"):
        load_records([f], skip_bad_records=True)


def test_globs_sorted_and_missing_paths(tmp_path):
    for name in ("b.jsonl", "a.jsonl"):
        _write_jsonl(tmp_path / name, [{"q": name}])
    files = expand_paths([str(tmp_path / "*.jsonl")])
    assert [p.name for p in files] == ["a.jsonl", "b.jsonl"]
    assert [r["q"] for r in load_records([str(tmp_path / "*.jsonl")])] == ["a.jsonl", "b.jsonl"]
    with pytest.raises(FileNotFoundError, match="matches no files"):
        expand_paths([str(tmp_path / "*.parquet")])
    with pytest.raises(FileNotFoundError, match="does not exist"):
        expand_paths([str(tmp_path / "nope.jsonl")])


def test_parquet_source(tmp_path):
    table = pa.table({"question": ["one?", "two?"], "answer": ["x\n#### 1", "y\n#### 2,000"]})
    pq.write_table(table, tmp_path / "train.parquet")
    src = load_records([tmp_path / "train.parquet"], required_fields=("question",))
    assert [r["question"] for r in src] == ["one?", "two?"]
    assert src[1]["uid"].endswith("train.parquet:row1")
    task = build_task(DataConfig(task="gsm8k_jsonl", paths=(str(tmp_path / "train.parquet"),),
                                 eval_size=1))
    assert [r["answer"] for r in task.source("train")] == ["1"]
    assert [r["answer"] for r in task.source("eval")] == ["2000"]


def test_parquet_missing_field_names_row(tmp_path):
    pq.write_table(pa.table({"question": ["q"]}), tmp_path / "t.parquet")
    with pytest.raises(RecordError, match=r"t\.parquet:row0: record is missing required field "
                                          r"'answer'"):
        load_records([tmp_path / "t.parquet"], required_fields=("question", "answer"))

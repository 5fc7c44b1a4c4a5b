"""Records for the `records` task (`jaxrl.data.tasks.records_task`): any records (JSONL /
Parquet files, a Hugging Face `datasets` dataset, or an in-memory list from `jaxrl.api.train`)
mapped to prompts by field names.

    --data.task=records --data.paths=train.jsonl --data.prompt_field=question \\
        --data.answer_field=final --data.reward=math_answer
    --data.task=records --data.hf_dataset=/data/gsm8k_saved --data.prompt_template='Q: {question}'

A record becomes `prompt` (the template formatted with the record's fields, else its
`prompt_field`), `answer` (from `answer_field`, for math / answer rewards) and `tests` (from
`tests_field`, for code rewards); every other field is kept for the rewards. The SFT
demonstration is the record's `completion` field, else its answer.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from jaxrl.config.data import DataConfig
from jaxrl.data.sources import RecordError, RecordSource
from jaxrl.rewards import get_reward, reward_names

# the mapped fields and the DataConfig key that names each one's source field
_FIELD_KEYS = {"answer": "answer_field", "tests": "tests_field"}


def reward_fields(rewards: Iterable[str]) -> dict[str, str]:
    """{item field: the first reward that cannot score without it} (`register_reward`'s
    `fields`); a name not registered (yet) is left to the reward spec to report."""
    needs: dict[str, str] = {}
    known = set(reward_names())
    for name in rewards:
        for field in get_reward(name).fields if name in known else ():
            needs.setdefault(field, name)
    return needs


def field_mapper(cfg: DataConfig, needs: Mapping[str, str] | None = None):
    """`fn(record, location) -> record` with `prompt`, `answer`, `tests` set from the fields.
    `needs` ({field: reward}, `reward_fields`): a mapped record without one of those fields is a
    `RecordError` naming the setting, the fields the record has and the reward."""
    needs = dict(needs or {})

    def mapped(record: dict, location: str) -> dict:
        out = dict(record)
        if cfg.prompt_template:
            try:
                out["prompt"] = cfg.prompt_template.format(**record)
            except (KeyError, IndexError, ValueError) as e:
                raise RecordError(f"{location}: data.prompt_template={cfg.prompt_template!r} "
                                  f"needs a field the record lacks ({e}); it has "
                                  f"{sorted(record)}") from None
        elif cfg.prompt_field in record:
            out["prompt"] = str(record[cfg.prompt_field])
        else:
            raise RecordError(f"{location}: no field data.prompt_field={cfg.prompt_field!r} "
                              f"(the record has {sorted(record)}); set data.prompt_field or "
                              "data.prompt_template")
        if cfg.answer_field in record:
            out["answer"] = str(record[cfg.answer_field])
        if cfg.tests_field in record:
            out["tests"] = record[cfg.tests_field]
        for field, reward in needs.items():
            if field not in out:
                key = _FIELD_KEYS.get(field)
                what = f"data.{key}={getattr(cfg, key)!r}" if key else repr(field)
                raise RecordError(f"{location}: no field {what} (the record has "
                                  f"{sorted(record)}), and reward {reward!r} reads it"
                                  + (f"; set --data.{key} to one of those" if key else ""))
        return out

    return mapped


def _hf_records(cfg: DataConfig, split: str):
    """(location, record) pairs of a `datasets` dataset (optional extra `datasets`)."""
    try:
        import datasets
    except ImportError as e:
        raise RecordError("data.hf_dataset needs the `datasets` package: "
                          "pip install 'jaxrl[datasets]'") from e
    if os.path.isdir(cfg.hf_dataset):
        ds = datasets.load_from_disk(cfg.hf_dataset)
        if isinstance(ds, datasets.DatasetDict):
            if split not in ds:
                raise RecordError(f"data.hf_dataset={cfg.hf_dataset!r} has splits "
                                  f"{sorted(ds)}, not {split!r}; set data.hf_split")
            ds = ds[split]
    else:  # a Hub id: the local cache first, a download when online
        ds = datasets.load_dataset(cfg.hf_dataset, split=split)
    for i, rec in enumerate(ds):
        yield f"{cfg.hf_dataset}[{split}][{i}]", dict(rec)


def in_memory(records: Sequence[Mapping[str, Any]], name: str, mapper) -> RecordSource:
    return RecordSource(((f"{name}:{i}", dict(r)) for i, r in enumerate(records)),
                        transform=mapper, name=name)

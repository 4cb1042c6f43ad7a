"""Load an extractive-QA task (SQuAD v1.1 schema) by example: read, subset, check.

Rows come out as ``id``, ``title``, ``context``, ``question``, ``answers`` (``{"text": [...],
"answer_start": [...]}``) plus ``title-bucket``: the article title hashed (crc32) into
``TITLE_BUCKETS`` buckets, the pseudo-label a Dirichlet partition of QA data skews over
(a client then sees a few topics more than others; a question and its article's other
questions stay in one bucket). Rows without a title are bucketed by their context.

Sources: the Hub (``rajpurkar/squad``), a fetched asset, or local files (jsonl/json/csv/parquet
in the HF schema, or the official nested SQuAD v1.1 ``{"data": [{"title", "paragraphs":
[{"context", "qas": [...]}]}]}`` json).
"""

from __future__ import annotations

import json
import zlib
from pathlib import Path
from typing import Any

import datasets

from flower_app.data.loading import (
    TEST_SEED,
    _load_raw,
    _source,
    _subset,
    held_out_splits,
    require_splits,
    require_test_split,
)
from flower_app.data.tasks import TaskSpec

TITLE_BUCKET = "title-bucket"
TITLE_BUCKETS = 10


def title_bucket(title: str, context: str) -> int:
    """A process-independent bucket of the article (its title; the context when untitled)."""
    return zlib.crc32((title or context).encode("utf-8")) % TITLE_BUCKETS


def flatten_official_squad(document: dict[str, Any]) -> list[dict[str, Any]]:
    """Rows in the HF schema from the official nested SQuAD json document."""
    rows = []
    for article in document["data"]:
        for paragraph in article["paragraphs"]:
            for qa in paragraph["qas"]:
                rows.append(
                    {
                        "id": str(qa["id"]),
                        "title": article.get("title", ""),
                        "context": paragraph["context"],
                        "question": qa["question"],
                        "answers": {
                            "text": [a["text"] for a in qa.get("answers", [])],
                            "answer_start": [int(a["answer_start"]) for a in qa.get("answers", [])],
                        },
                    }
                )
    return rows


def _read_json_document(path: Path) -> datasets.Dataset | None:
    """A .json file holding one document (official SQuAD or a list of rows); None for JSON
    lines, which ``datasets`` reads."""
    try:
        document = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError:
        return None
    if isinstance(document, dict) and isinstance(document.get("data"), list):
        return datasets.Dataset.from_list(flatten_official_squad(document))
    if isinstance(document, list):
        return datasets.Dataset.from_list(document)
    raise ValueError(f"{path}: expected SQuAD json ({{'data': [...]}}), a list of rows, or jsonl")


def _load_splits(spec: TaskSpec) -> dict[str, datasets.Dataset]:
    if spec.hub_path is not None:
        return dict(_load_raw(spec))
    file_format, _, files = _source(spec)
    assert files is not None
    out: dict[str, datasets.Dataset] = {}
    for split, file in files.items():
        path = Path(file)
        document = _read_json_document(path) if path.suffix == ".json" else None
        if document is None:
            document = datasets.load_dataset(file_format, data_files={split: file})[split]
        out[split] = document
    return out


def _check_row(row: dict[str, Any], where: str, fields: tuple[str, str], answers: str) -> None:
    question, context = (row[f] for f in fields)
    if not isinstance(question, str) or not isinstance(context, str):
        raise ValueError(f"{where}: question and context must be strings")
    gold = row[answers]
    if not isinstance(gold, dict) or {"text", "answer_start"} - set(gold):
        raise ValueError(f"{where}: answers must be {{'text': [...], 'answer_start': [...]}}")
    if len(gold["text"]) != len(gold["answer_start"]):
        raise ValueError(f"{where}: answers 'text' and 'answer_start' differ in length")
    if not gold["text"]:
        raise ValueError(
            f"{where}: no answer; extractive QA here is SQuAD v1.1-style (every question "
            "is answerable), SQuAD v2's unanswerable questions are not supported"
        )
    for text, start in zip(gold["text"], gold["answer_start"], strict=True):
        if context[int(start) : int(start) + len(text)] != text:
            raise ValueError(f"{where}: answer {text!r} is not at character {start} of the context")


def _clean(ds: datasets.Dataset, spec: TaskSpec, split: str) -> datasets.Dataset:
    """Check every row; add ``id`` / ``title`` when missing and the ``title-bucket``."""
    question, context = spec.text_fields
    answers = spec.label_field
    missing = [c for c in (question, context, answers) if c not in ds.column_names]
    if missing:
        raise ValueError(
            f"{spec.name}/{split}: missing column(s) {missing}; available: {ds.column_names}"
        )
    has_id, has_title = "id" in ds.column_names, "title" in ds.column_names
    keep = [c for c in ("id", "title", question, context, answers) if c in ds.column_names]
    ds = ds.select_columns(keep)

    def convert(batch: dict[str, list[Any]], indices: list[int]) -> dict[str, list[Any]]:
        n = len(indices)
        ids = [str(i) for i in batch["id"]] if has_id else [f"{split}-{i}" for i in indices]
        titles = [str(t or "") for t in batch["title"]] if has_title else [""] * n
        rows = []
        for k in range(n):
            row = {f: batch[f][k] for f in (question, context, answers)}
            _check_row(row, f"{spec.name}/{split} row {ids[k]}", (question, context), answers)
            rows.append(row)
        return {
            "id": ids,
            "title": titles,
            "context": [r[context] for r in rows],
            "question": [r[question] for r in rows],
            "answers": [
                {"text": list(r[answers]["text"]), "answer_start": list(r[answers]["answer_start"])}
                for r in rows
            ],
            TITLE_BUCKET: [title_bucket(t, r[context]) for t, r in zip(titles, rows, strict=True)],
        }

    features = datasets.Features(
        {
            "id": datasets.Value("string"),
            "title": datasets.Value("string"),
            "context": datasets.Value("string"),
            "question": datasets.Value("string"),
            "answers": {
                "text": datasets.Sequence(datasets.Value("string")),
                "answer_start": datasets.Sequence(datasets.Value("int32")),
            },
            TITLE_BUCKET: datasets.Value("int64"),
        }
    )
    cleaned = ds.map(
        convert,
        batched=True,
        with_indices=True,
        features=features,
        remove_columns=ds.column_names,
        desc=f"{spec.name}/{split} check",
    )
    ids = cleaned["id"]
    if len(set(ids)) != len(ids):
        raise ValueError(f"{spec.name}/{split}: question ids are not unique")
    return cleaned


def _held_out(
    spec: TaskSpec, raw: dict[str, datasets.Dataset]
) -> tuple[datasets.Dataset, datasets.Dataset, datasets.Dataset | None]:
    """(train, eval, test) raw rows, the test rows set aside as for labelled tasks."""
    require_splits(spec, raw, spec.train_split, spec.eval_split, spec.test_split)
    evaluation = raw[spec.eval_split] if spec.eval_split is not None else None
    test = raw[spec.test_split] if spec.test_split is not None else None
    return held_out_splits(spec, raw[spec.train_split], evaluation, test)


def load_qa_splits(
    spec: TaskSpec, max_train: int | None = None, max_eval: int | None = None, seed: int = 0
) -> tuple[datasets.Dataset, datasets.Dataset]:
    """(train, eval) examples of an extractive-QA task; subsets are seeded shuffles of
    whole examples (taken before the checks, so only the rows used are read row by row).
    Rows of the task's test split (``load_qa_test``) are in neither."""
    train, evaluation, _ = _held_out(spec, _load_splits(spec))
    train = _clean(_subset(train, max_train, seed), spec, spec.train_split)
    evaluation = _clean(_subset(evaluation, max_eval, seed), spec, spec.eval_split or "holdout")
    if len(train) == 0 or len(evaluation) == 0:
        raise ValueError(f"{spec.name}: empty train or eval split")
    return train, evaluation


def load_qa_test(spec: TaskSpec, max_test: int | None = None) -> datasets.Dataset:
    """The held-out test examples (a subset of ``max_test`` drawn with the fixed TEST_SEED,
    so every run seed and every method is scored on the same questions)."""
    require_test_split(spec)
    _, _, test = _held_out(spec, _load_splits(spec))
    assert test is not None
    test = _clean(_subset(test, max_test, TEST_SEED), spec, spec.test_split or "test")
    if len(test) == 0:
        raise ValueError(f"{spec.name}: empty test split")
    return test

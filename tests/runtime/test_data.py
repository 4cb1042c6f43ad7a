"""Offline asset fetcher and data layer, on the real fetched data."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import datasets
import pytest
import torch

from florg_tools import assets
from flower_app.cache import assets as asset_registry
from flower_app.data import (
    TASKS,
    load_task_splits,
    make_loader,
    partition_dataset,
    resolve_task,
    tokenize_dataset,
)
from flower_app.data.partition import partition_indices

DEFAULT_ASSETS = ("all-MiniLM-L6-v2", "snli", "squad", "squad-qnli", "movie-sentiment")


@pytest.fixture(scope="session")
def registry() -> dict[str, Any]:
    """The default cache's registry; runs the fetcher when something is missing."""
    try:
        reg = asset_registry.load_registry()
        present = set(reg["models"]) | set(reg["tasks"])
        if present.issuperset(DEFAULT_ASSETS):
            return reg
    except FileNotFoundError:
        pass
    return assets.fetch()


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    with open(path, encoding="utf-8") as fh:
        return [json.loads(line) for line in fh]


def task_rows(registry: dict[str, Any], task: str, split: str) -> list[dict[str, Any]]:
    return read_jsonl(Path(registry["tasks"][task]["path"]) / f"{split}.jsonl")


@pytest.fixture(scope="session")
def tokenizer(registry: dict[str, Any]) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(registry["models"]["all-MiniLM-L6-v2"])


@pytest.fixture(scope="session")
def movie(registry: dict[str, Any]) -> tuple[datasets.Dataset, datasets.Dataset]:
    return load_task_splits(resolve_task("movie-sentiment"), seed=0)


# --------------------------------------------------------------------------- fetcher


def test_sha256_mismatch_names_file_and_both_hashes(tmp_path: Path) -> None:
    path = tmp_path / "pkg-1.0-py3-none-any.whl"
    path.write_bytes(b"not the pinned file")
    actual = hashlib.sha256(b"not the pinned file").hexdigest()
    assets.verify_sha256(path, actual)  # the right hash passes
    wrong = "0" * 64
    with pytest.raises(assets.ChecksumError) as err:
        assets.verify_sha256(path, wrong)
    message = str(err.value)
    assert path.name in message and wrong in message and actual in message


def test_pinned_sources_are_sha256_hex() -> None:
    for asset in assets.ASSETS.values():
        assert len(asset.source.sha256) == 64
        int(asset.source.sha256, 16)
    assert {a.name for a in assets.ASSETS.values() if a.default} == set(DEFAULT_ASSETS)


def test_registry_lists_every_default_asset(registry: dict[str, Any]) -> None:
    assert (assert_dir(registry["models"]["all-MiniLM-L6-v2"]) / "config.json").is_file()
    for name in DEFAULT_ASSETS[1:]:
        entry = registry["tasks"][name]
        directory = assert_dir(entry["path"])
        assert entry["format"] == "jsonl"
        for split, rows in entry["splits"].items():
            with open(directory / f"{split}.jsonl", encoding="utf-8") as fh:
                assert sum(1 for _ in fh) == rows > 0
    minilm = Path(registry["models"]["all-MiniLM-L6-v2"])
    assert asset_registry.model_path("all-MiniLM-L6-v2") == minilm


def assert_dir(path: str) -> Path:
    assert Path(path).is_absolute() and Path(path).is_dir(), path
    return Path(path)


def test_second_fetch_is_up_to_date(registry: dict[str, Any], capsys) -> None:
    capsys.readouterr()
    assets.fetch(["movie-sentiment", "snli"])
    out = capsys.readouterr().out
    assert "[movie-sentiment] up to date" in out and "[snli] up to date" in out
    assert "download" not in out and "building" not in out


def test_tampered_output_is_detected(registry: dict[str, Any], tmp_path: Path) -> None:
    asset = assets.ASSETS["movie-sentiment"]
    src = assets.asset_dir(asset, asset_registry.default_cache_dir())
    shutil.copytree(src, assets.asset_dir(asset, tmp_path))
    assert assets.read_stamp(asset, tmp_path) is not None
    target = assets.asset_dir(asset, tmp_path) / "validation.jsonl"
    text = target.read_text(encoding="utf-8")
    target.write_text(text.replace('"label": 1', '"label": 0', 1), encoding="utf-8")
    assert assets.read_stamp(asset, tmp_path) is None  # same size, different hash
    target.unlink()
    assert assets.write_registry(tmp_path)["tasks"] == {}


def test_unknown_asset_is_rejected() -> None:
    with pytest.raises(assets.AssetError, match="known: all-MiniLM-L6-v2"):
        assets.select_assets(["no-such-asset"])


def test_sentence_splitter_keeps_abbreviations() -> None:
    text = 'Dr. Smith moved to the U.S. Army in 1990. He said "Yes!" Then 5 men left. ok'
    sentences = [text[a:b] for a, b in assets.split_sentences(text)]
    assert sentences == [
        "Dr. Smith moved to the U.S. Army in 1990.",
        'He said "Yes!"',
        "Then 5 men left. ok",
    ]


# --------------------------------------------------------------------------- datasets


def test_snli_splits_labels_and_sizes(registry: dict[str, Any]) -> None:
    sizes = {}
    for split in ("train", "validation", "test"):
        rows = task_rows(registry, "snli", split)
        sizes[split] = len(rows)
        assert set(rows[0]) == {"premise", "hypothesis", "label"}
        assert {r["label"] for r in rows} == {0, 1, 2}
        assert all(r["premise"] and r["hypothesis"] for r in rows)
    assert sizes == {"train": 89890, "validation": 10000, "test": 9824}
    raw_labels = {"-"} & {str(r["label"]) for r in task_rows(registry, "snli", "test")}
    assert not raw_labels


def test_squad_schema_and_answer_offsets(registry: dict[str, Any]) -> None:
    rows = task_rows(registry, "squad", "validation")
    assert len(rows) == 10570 and registry["tasks"]["squad"]["splits"]["train"] == 87599
    assert set(rows[0]) == {"id", "title", "context", "question", "answers"}
    for row in rows[::50]:
        for text, start in zip(row["answers"]["text"], row["answers"]["answer_start"], strict=True):
            assert row["context"][start : start + len(text)] == text


def test_squad_qnli_labels_follow_the_answer(registry: dict[str, Any]) -> None:
    squad = {r["id"]: r for r in task_rows(registry, "squad", "validation")}
    rows = task_rows(registry, "squad-qnli", "validation")
    counts = Counter(r["label"] for r in rows)
    assert set(counts) == {0, 1} and 0.45 < counts[0] / len(rows) < 0.55
    for row in rows:
        source = squad[row["id"]]
        assert row["sentence"] in source["context"] and row["question"] == source["question"]
        found = [a.casefold() in row["sentence"].casefold() for a in source["answers"]["text"]]
        assert any(found) if row["label"] == 0 else not any(found)


def test_movie_sentiment_is_binary_and_split(registry: dict[str, Any]) -> None:
    train = task_rows(registry, "movie-sentiment", "train")
    val = task_rows(registry, "movie-sentiment", "validation")
    assert (len(train), len(val)) == (9511, 1057)
    for rows in (train, val):
        assert set(rows[0]) == {"sentence", "label"}
        counts = Counter(r["label"] for r in rows)
        assert set(counts) == {0, 1} and min(counts.values()) > 0.4 * len(rows)
    assert len({r["sentence"] for r in val} & {r["sentence"] for r in train}) < 10


def test_minilm_loads_offline(registry: dict[str, Any], monkeypatch) -> None:
    from safetensors.torch import load_file
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    path = registry["models"]["all-MiniLM-L6-v2"]
    model = AutoModelForSequenceClassification.from_pretrained(path, num_labels=3)
    tok = AutoTokenizer.from_pretrained(path)
    saved = load_file(str(Path(path) / "model.safetensors"))
    key = next(k for k in saved if k.endswith("embeddings.word_embeddings.weight"))
    assert torch.equal(model.bert.embeddings.word_embeddings.weight, saved[key])
    batch = tok(["a man plays"], ["someone plays"], return_tensors="pt")
    with torch.no_grad():
        assert model(**batch).logits.shape == (1, 3)


# --------------------------------------------------------------------------- tasks, loading


def test_glue_specs() -> None:
    assert {"mrpc", "qqp", "mnli", "qnli", "wnli", "rte"} <= set(TASKS)
    mnli = TASKS["mnli"]
    assert (mnli.hub_path, mnli.hub_config, mnli.num_labels) == ("nyu-mll/glue", "mnli", 3)
    assert mnli.eval_split == "validation_matched"
    assert TASKS["qqp"].text_fields == ("question1", "question2")


def test_unknown_task_lists_known_tasks() -> None:
    with pytest.raises(ValueError, match="unknown task 'nope'.*mrpc.*snli"):
        resolve_task("nope")


def test_missing_fetch_is_explained(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="florg_tools.assets fetch"):
        resolve_task("snli", cache_dir=tmp_path)
    spec = resolve_task(str(tmp_path), text_fields="text")
    with pytest.raises(FileNotFoundError, match=r"train\.jsonl.*florg_tools.assets fetch"):
        load_task_splits(spec)


def test_fetched_task_subsets_are_seeded(registry: dict[str, Any]) -> None:
    spec = resolve_task("snli")
    train, evaluation = load_task_splits(spec, max_train=500, max_eval=100, seed=1)
    again, _ = load_task_splits(spec, max_train=500, max_eval=100, seed=1)
    other, _ = load_task_splits(spec, max_train=500, max_eval=100, seed=2)
    assert (len(train), len(evaluation)) == (500, 100)
    assert train["premise"] == again["premise"] and train["premise"] != other["premise"]
    assert train.features["label"].num_classes == 3
    assert set(train["label"]) == {0, 1, 2}


def local_rows() -> dict[str, list[Any]]:
    texts = [f"example number {i}" for i in range(40)]
    labels: list[Any] = ["pos" if i % 3 else "neg" for i in range(40)]
    labels[5] = None
    return {"text": texts, "other": [f"second {i}" for i in range(40)], "target": labels}


@pytest.mark.parametrize("ext", ["csv", "jsonl", "parquet"])
def test_local_file_task(tmp_path: Path, ext: str) -> None:
    ds = datasets.Dataset.from_dict(local_rows())
    path = tmp_path / f"reviews.{ext}"
    {"csv": ds.to_csv, "jsonl": ds.to_json, "parquet": ds.to_parquet}[ext](str(path))
    spec = resolve_task(str(path), text_fields=["text", "other"], label_field="target")
    assert spec.data_file == str(path) and spec.eval_split is None
    train, evaluation = load_task_splits(spec, seed=0)
    assert len(train) + len(evaluation) == 39  # the row without a label is dropped
    assert train.column_names == ["text", "other", "target"]
    assert train.features["target"].names == ["neg", "pos"]
    assert not set(train["text"]) & set(evaluation["text"])


def test_local_folder_task_with_int_labels(tmp_path: Path) -> None:
    rows = {"sentence": [f"s{i}" for i in range(30)], "label": [i % 3 for i in range(30)]}
    rows["label"][0] = -1
    datasets.Dataset.from_dict(rows).to_csv(str(tmp_path / "train.csv"))
    datasets.Dataset.from_dict(rows).to_csv(str(tmp_path / "validation.csv"))
    spec = resolve_task("my-task", data_path=tmp_path, text_fields="sentence")
    train, evaluation = load_task_splits(spec, max_train=10, seed=0)
    assert (len(train), len(evaluation)) == (10, 29)
    assert train.features["label"].num_classes == 3
    bad = resolve_task("my-task", data_path=tmp_path, text_fields="sentence", num_labels=2)
    with pytest.raises(ValueError, match="outside"):
        load_task_splits(bad)


# --------------------------------------------------------------------------- partitioning


def test_dirichlet_partitions_are_seeded_disjoint_and_cover(movie) -> None:
    train, _ = movie
    parts = partition_indices(train, 20, "dirichlet", alpha=0.3, seed=3)
    assert parts == partition_indices(train, 20, "dirichlet", alpha=0.3, seed=3)
    assert parts != partition_indices(train, 20, "dirichlet", alpha=0.3, seed=4)
    flat = [i for p in parts for i in p]
    assert sorted(flat) == list(range(len(train)))  # disjoint and covering
    assert min(len(p) for p in parts) >= 1
    shard = partition_dataset(train, 20, 7, "dirichlet", alpha=0.3, seed=3)
    assert shard["sentence"] == train.select(parts[7])["sentence"]
    labels = list(train["label"])
    skew = [Counter(labels[i] for i in p) for p in parts]
    assert max(max(c.values()) / sum(c.values()) for c in skew) > 0.9  # label skew


def test_tiny_alpha_still_gives_nonempty_partitions(movie) -> None:
    train, _ = movie
    small = train.select(range(2000))
    parts = partition_indices(small, 20, "dirichlet", alpha=0.05, seed=0)
    assert min(len(p) for p in parts) >= 1
    assert sorted(i for p in parts for i in p) == list(range(2000))


def test_iid_partitions(movie) -> None:
    train, _ = movie
    parts = partition_indices(train, 7, "iid", seed=0)
    assert {len(p) for p in parts} <= {len(train) // 7, len(train) // 7 + 1}
    assert sorted(i for p in parts for i in p) == list(range(len(train)))
    assert parts[0] != partition_indices(train, 7, "iid", seed=1)[0]


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"alpha": 0.0}, "alpha"),
        ({"alpha": -1.0}, "alpha"),
        ({"partition_id": 20}, "partition_id"),
        ({"partition_id": -1}, "partition_id"),
        ({"num_partitions": 0}, "partition"),
    ],
)
def test_partition_argument_errors(movie, kwargs: dict[str, Any], match: str) -> None:
    args = {"num_partitions": 20, "partition_id": 0, "alpha": 0.5} | kwargs
    with pytest.raises(ValueError, match=match):
        partition_dataset(movie[0], **args)


# --------------------------------------------------------------------------- tokenisation


def test_tokenize_shapes_and_loader(registry: dict[str, Any], tokenizer: Any) -> None:
    spec = resolve_task("snli")
    train, _ = load_task_splits(spec, max_train=64, max_eval=8, seed=0)
    tokenized = tokenize_dataset(train, tokenizer, spec, max_length=32)
    assert tokenized.column_names == ["input_ids", "attention_mask", "token_type_ids", "labels"]
    tensors = tokenized[:]
    assert tensors["input_ids"].shape == (64, 32) and tensors["input_ids"].dtype == torch.int64
    assert tensors["labels"].tolist() == list(train["label"])
    assert int(tensors["attention_mask"].sum(1).min()) > 4
    assert int(tensors["token_type_ids"].max()) == 1  # sentence pairs
    batches = list(make_loader(tokenized, batch_size=16, shuffle=True, seed=5))
    assert len(batches) == 4 and batches[0]["input_ids"].shape == (16, 32)
    again = next(iter(make_loader(tokenized, batch_size=16, shuffle=True, seed=5)))
    assert torch.equal(batches[0]["labels"], again["labels"])


def test_tokenize_single_sentence(movie, tokenizer: Any) -> None:
    spec = resolve_task("movie-sentiment")
    tensors = tokenize_dataset(movie[1].select(range(10)), tokenizer, spec, max_length=16)[:]
    assert tensors["input_ids"].shape == (10, 16)
    assert int(tensors["token_type_ids"].max()) == 0
    assert int(tensors["attention_mask"].sum(1).max()) == 16  # long reviews are truncated


def test_tokenized_fingerprint_follows_what_the_encoding_reads(movie, tokenizer: Any) -> None:
    """The fingerprint names datasets' cache files of the tokenised rows: equal inputs give
    equal fingerprints; other rows, length, fields or pad token give another."""
    from dataclasses import replace

    spec = resolve_task("movie-sentiment")
    rows = movie[1].select(range(10))
    base = tokenize_dataset(rows, tokenizer, spec, max_length=16)._fingerprint
    assert tokenize_dataset(rows, tokenizer, spec, max_length=16)._fingerprint == base
    others = [
        tokenize_dataset(movie[1].select(range(1, 11)), tokenizer, spec, max_length=16),
        tokenize_dataset(rows, tokenizer, spec, max_length=17),
        tokenize_dataset(
            rows.add_column("copy", rows[spec.text_fields[0]]),
            tokenizer,
            replace(spec, text_fields=("copy",)),
            16,
        ),
    ]
    assert len({base, *(d._fingerprint for d in others)}) == 4
    pad = tokenizer.pad_token
    try:
        tokenizer.pad_token = tokenizer.sep_token
        assert tokenize_dataset(rows, tokenizer, spec, max_length=16)._fingerprint != base
    finally:
        tokenizer.pad_token = pad


def test_smollm2_when_fetched(registry: dict[str, Any]) -> None:
    """Optional asset (``fetch --all``): float32 safetensors and a working tokenizer."""
    if "SmolLM2-135M" not in asset_registry.load_registry()["models"]:
        reason = "SmolLM2-135M not fetched (python -m florg_tools.assets fetch --all)"
        if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
            pytest.fail(reason)  # scripts/test.sh fetches it: in CI, missing is an error
        pytest.skip(reason)
    from safetensors import safe_open
    from transformers import AutoConfig, AutoTokenizer

    path = asset_registry.model_path("SmolLM2-135M")
    config = AutoConfig.from_pretrained(path)
    assert config.model_type == "llama" and config.hidden_size == 576
    assert getattr(config, "quantization_config", None) is None
    with safe_open(str(path / "model.safetensors"), framework="pt") as fh:
        weight = fh.get_tensor("model.embed_tokens.weight")
    assert weight.dtype == torch.float32 and weight.shape == (config.vocab_size, 576)
    tok = AutoTokenizer.from_pretrained(path)
    assert tok.decode(tok("The capital of France")["input_ids"]).endswith("The capital of France")


def test_client_app_import_leaves_flwr_datasets_unloaded():
    """A deployed ClientApp process whose partition comes from the disk cache never needs
    flwr_datasets' partitioners, whose import pulls seaborn and scipy.stats."""
    probe = (
        "import sys, client_app.client_app, flower_app.data.partition; "
        "print(sorted(m for m in ('flwr_datasets', 'seaborn', 'scipy.stats') if m in sys.modules))"
    )
    out = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, check=True,
        cwd=Path(__file__).resolve().parents[2],
    )  # fmt: skip
    assert out.stdout.strip() == "[]", out.stdout + out.stderr

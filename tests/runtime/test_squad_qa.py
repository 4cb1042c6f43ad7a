"""Extractive QA (SQuAD v1.1): loading, features, post-processing, and FLoRG end to end."""

from __future__ import annotations

import json
import math
import random
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from florg_tools import assets
from florg_tools.synthetic import NEGATIVE, NEUTRAL, POSITIVE, make_tiny_bert
from flower_app.cache import assets as asset_registry
from flower_app.data.qa_features import (
    CONTEXT_OFFSETS,
    EXAMPLE_INDEX,
    check_window,
    max_question_tokens,
    qa_features,
)
from flower_app.data.qa_loading import TITLE_BUCKET, TITLE_BUCKETS, load_qa_splits
from flower_app.data.tasks import resolve_task
from flower_app.methods.registry import method_names
from flower_app.settings.config import ConfigError, resolve_config
from flower_app.task_kinds.qa_eval import best_span, postprocess_predictions

# The span head through the simulation: the methods whose round touches the task kind beyond
# the shared arrays -- FLoRG (its Gram step carries the trained head, the PEFT export),
# FedIT (the mean), FedSA-LoRA (the clients' personalised QA scores), FedEx-LoRA (the
# residual fold beside the head). The other server rules do not depend on the task kind
# (flower_app/task_kinds/) and run end to end on classification (test_app_e2e.py), as
# test_causal_lm.py chooses for the decoder; every method's QA round runs in-process in the
# unit set.
E2E_METHODS = ["florg", "fedit", "fedsa-lora", "fedex-lora"]
METHODS = method_names()

ROOT = Path(__file__).resolve().parents[2]
WORDS = POSITIVE + NEGATIVE + NEUTRAL


# --------------------------------------------------------------------------- assets


def qa_row(rng: random.Random, i: int, title: str, n_words: tuple[int, int]) -> dict[str, Any]:
    """A SQuAD-schema row over the tiny vocabulary; the answer is 1-3 whole words."""
    words = [rng.choice(WORDS) for _ in range(rng.randint(*n_words))]
    words[rng.randrange(len(words))] += "."  # punctuation: its own token, offsets still exact
    first = rng.randrange(len(words) - 3)
    span = words[first : first + rng.randint(1, 3)]
    start = len(" ".join(words[:first])) + (1 if first else 0)
    text = " ".join(span)
    return {
        "id": f"q{i}",
        "title": title,
        "context": " ".join(words),
        "question": f"what {rng.choice(NEUTRAL)} {rng.choice(WORDS)} ?",
        "answers": {"text": [text, text], "answer_start": [start, start]},
    }


def official_squad(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The nested SQuAD v1.1 json document of ``rows`` (one paragraph per row)."""
    data: dict[str, list] = {}
    for r in rows:
        qas = [
            {
                "id": r["id"],
                "question": r["question"],
                "answers": [
                    {"text": t, "answer_start": s}
                    for t, s in zip(r["answers"]["text"], r["answers"]["answer_start"], strict=True)
                ],
            }
        ]
        data.setdefault(r["title"], []).append({"context": r["context"], "qas": qas})
    return {
        "version": "1.1",
        "data": [{"title": t, "paragraphs": p} for t, p in data.items()],
    }


def make_qa_task(directory: Path, n_train: int = 60, n_eval: int = 24, seed: int = 0) -> Path:
    """train.json (official nested SQuAD) and validation.jsonl (HF schema)."""
    rng = random.Random(seed)
    directory.mkdir(parents=True, exist_ok=True)
    train = [qa_row(rng, i, f"article-{i % 6}", (20, 70)) for i in range(n_train)]
    valid = [qa_row(rng, n_train + i, f"article-{i % 3}", (20, 70)) for i in range(n_eval)]
    (directory / "train.json").write_text(json.dumps(official_squad(train)))
    with (directory / "validation.jsonl").open("w") as f:
        for r in valid:
            f.write(json.dumps(r) + "\n")
    return directory


def make_tiny_qa_bert(directory: Path) -> Path:
    """fixtures' tiny BERT with a tokenizer that knows its vocabulary (transformers 5's
    ``BertTokenizerFast(vocab_file=...)`` ignores the file: every word would be [UNK])."""
    from transformers import BertTokenizerFast

    make_tiny_bert(directory)
    tokenizer = BertTokenizerFast(vocab=str(directory / "vocab.txt"), do_lower_case=True)
    assert tokenizer.convert_tokens_to_ids("movie") != tokenizer.unk_token_id
    tokenizer.save_pretrained(directory)
    return directory


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> tuple[Path, Path]:
    base = tmp_path_factory.mktemp("qa")
    return make_tiny_qa_bert(base / "model"), make_qa_task(base / "task")


@pytest.fixture(scope="module")
def tiny_tokenizer(tiny) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny[0])


@pytest.fixture(scope="module")
def registry() -> dict[str, Any]:
    """The offline assets (fetched when missing): MiniLM and SQuAD v1.1."""
    try:
        reg = asset_registry.load_registry()
        if "all-MiniLM-L6-v2" in reg["models"] and "squad" in reg["tasks"]:
            return reg
    except FileNotFoundError:
        pass
    return assets.fetch(["all-MiniLM-L6-v2", "squad"])


def tiny_config(tiny, **settings: Any):
    model, task = tiny
    values = {
        "model": str(model),
        "task": "squad",
        "data-path": str(task),
        "max-seq-length": 48,
        "doc-stride": 16,
        **settings,
    }
    return resolve_config(values)


# --------------------------------------------------------------------------- loading


def test_squad_task_is_qa_and_falls_back_to_the_hub(tmp_path, monkeypatch):
    assert resolve_task("rajpurkar/squad").hub_path == "rajpurkar/squad"
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    spec = resolve_task("squad", cache_dir=tmp_path)  # nothing fetched there
    assert (spec.kind, spec.hub_path, spec.text_fields) == (
        "extractive-qa",
        "rajpurkar/squad",
        ("question", "context"),
    )
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(FileNotFoundError, match="assets fetch"):
        resolve_task("squad", cache_dir=tmp_path)


def test_official_json_and_jsonl_load_alike(tiny, tmp_path):
    _, task = tiny
    spec = resolve_task("squad", task)
    train, valid = load_qa_splits(spec)
    assert (len(train), len(valid)) == (60, 24)
    assert set(train.column_names) == {
        "id",
        "title",
        "context",
        "question",
        "answers",
        TITLE_BUCKET,
    }
    rows = [json.loads(line) for line in (task / "validation.jsonl").read_text().splitlines()]
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "validation.json").write_text(json.dumps(official_squad(rows)))
    again, nested = load_qa_splits(resolve_task("squad", tmp_path))
    assert again.to_list() == valid.to_list()
    assert sorted(nested.to_list(), key=lambda r: r["id"]) == sorted(
        valid.to_list(), key=lambda r: r["id"]
    )  # the nested document groups by title
    assert all(0 <= b < TITLE_BUCKETS for b in valid[TITLE_BUCKET])
    # subsets are seeded shuffles of whole examples
    a, _ = load_qa_splits(spec, max_train=10, seed=1)
    b, _ = load_qa_splits(spec, max_train=10, seed=1)
    assert a["id"] == b["id"] and len(set(a["id"])) == 10


@pytest.mark.parametrize(
    "change,match",
    [
        (lambda r: r.pop("context"), "missing column"),
        (lambda r: r["answers"]["answer_start"].__setitem__(0, 1), "is not at character"),
        (lambda r: r.update(answers={"text": [], "answer_start": []}), "no answer"),
        (lambda r: r["answers"]["text"].pop(), "differ in length"),
        (lambda r: r.update(id="q60"), "not unique"),  # row 0's id
    ],
)
def test_bad_qa_rows_are_refused(tiny, tmp_path, change, match):
    rows = [json.loads(line) for line in (tiny[1] / "validation.jsonl").read_text().splitlines()]
    change(rows[1])
    if "context" not in rows[1]:
        for r in rows:
            r.pop("context", None)
    for split in ("train", "validation"):
        (tmp_path / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(ValueError, match=match):
        load_qa_splits(resolve_task("squad", tmp_path))


# --------------------------------------------------------------------------- features


def _covering(offsets, start: int, end: int, s: int, e: int) -> bool:
    """Token s starts the answer's first token and token e ends its last one."""
    return offsets[s][0] <= start < offsets[s][1] and offsets[e][0] < end <= offsets[e][1]


def test_positions_map_back_to_the_exact_answer(tiny, tiny_tokenizer):
    train, _ = load_qa_splits(resolve_task("squad", tiny[1]))
    features = qa_features(train, tiny_tokenizer, 48, 16, keep_mapping=True)
    assert len(features) > len(train)  # long contexts give several windows
    inside = 0
    for f in features:
        ex = train[f[EXAMPLE_INDEX]]
        s, e = f["start_positions"], f["end_positions"]
        gold = ex["answers"]["text"][0]
        if s == 0:
            assert e == 0
            continue
        inside += 1
        offsets = f[CONTEXT_OFFSETS]
        assert ex["context"][offsets[s][0] : offsets[e][1]] == gold
    assert inside >= len(train)  # every answer lies inside at least one window


def test_real_squad_positions_cover_the_answer(registry):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(registry["models"]["all-MiniLM-L6-v2"])
    _, valid = load_qa_splits(resolve_task("squad"), max_eval=150, seed=3)
    features = qa_features(valid, tokenizer, 128, 32, keep_mapping=True)
    found, inside, exact = set(), 0, 0
    for f in features:
        s, e = f["start_positions"], f["end_positions"]
        if s == 0:
            continue
        ex = valid[f[EXAMPLE_INDEX]]
        start = ex["answers"]["answer_start"][0]
        end = start + len(ex["answers"]["text"][0])
        assert _covering(f[CONTEXT_OFFSETS], start, end, s, e)
        inside += 1
        exact += (
            ex["context"][f[CONTEXT_OFFSETS][s][0] : f[CONTEXT_OFFSETS][e][1]]
            == (ex["answers"]["text"][0])
        )
        found.add(f[EXAMPLE_INDEX])
    assert len(found) == len(valid)  # 128 tokens with stride 32: every answer in some window
    assert exact / inside > 0.6  # the rest start or end inside a word piece


def test_windows_stride_and_cls_outside(tiny_tokenizer):
    import datasets

    words = [WORDS[i % len(WORDS)] for i in range(70)]
    context = " ".join(words)
    text = " ".join(words[-2:])
    examples = datasets.Dataset.from_list(
        [
            {
                "question": "where is it",
                "context": context,
                "answers": {"text": [text], "answer_start": [context.rindex(text)]},
            }
        ]
    )
    features = qa_features(examples, tiny_tokenizer, 32, 8, keep_mapping=True)
    room = 32 - 3 - 3  # question 3 tokens + [CLS] [SEP] [SEP]
    windows = [[o for o in f[CONTEXT_OFFSETS] if o[0] >= 0] for f in features]
    assert [len(w) for w in windows[:-1]] == [room] * (len(windows) - 1)
    assert len(windows) == math.ceil((70 - room) / (room - 8)) + 1
    for a, b in zip(windows, windows[1:], strict=False):
        assert a[-8:] == b[:8]  # consecutive windows share doc_stride context tokens
    assert windows[0][0][0] == 0 and windows[-1][-1][1] == len(context)
    cls = tiny_tokenizer.cls_token_id
    for f in list(features)[:-1]:  # the answer (the last two words) is only in the last one
        assert f["input_ids"][f["start_positions"]] == cls and f["end_positions"] == 0
    last = features[-1]
    assert context[last[CONTEXT_OFFSETS][last["start_positions"]][0] :] == text


def test_doc_stride_too_large_is_a_config_error(tiny, tiny_tokenizer):
    with pytest.raises(ValueError, match="doc-stride 40"):
        check_window(tiny_tokenizer, 48, 40)
    assert max_question_tokens(384) == 64 and max_question_tokens(48) == 12
    from flower_app.task_data import tokenized_split

    with pytest.raises(ConfigError, match="^doc-stride"):
        tokenized_split(tiny_config(tiny, **{"doc-stride": 40}), "train")


# --------------------------------------------------------------------------- post-processing


def test_postprocessing_picks_the_best_valid_span():
    context = "Paris is the capital of France."
    #           0    5  8   12      20 23     30
    spans = [(0, 5), (6, 8), (9, 12), (13, 20), (21, 23), (24, 30), (30, 31)]
    question = [(-1, -1)] * 3  # [CLS] question [SEP]
    offsets = np.array(question + spans + [(-1, -1)] * 2)  # [SEP] [PAD]
    start = np.full(len(offsets), -5.0)
    end = np.full(len(offsets), -5.0)
    start[0] = end[0] = 50.0  # [CLS] wins but is no context span
    start[8], end[8], end[9] = 2.0, 1.0, 6.0  # "France" 3, "France." 8
    start[4] = 6.0  # "is the capital of France." 12, but 6 tokens
    end[3] = 12.0  # ends before the good starts; "Paris" alone 7
    assert best_span(start, end, offsets, max_answer_length=5) == (8.0, 24, 31)
    assert best_span(start, end, offsets, max_answer_length=30) == (12.0, 6, 31)
    assert best_span(start, end, offsets, n_best=1) is None  # only [CLS] considered
    # two windows of one example: the better span of the second wins
    second = offsets.copy()
    s2, e2 = np.full(len(offsets), -5.0), np.full(len(offsets), -5.0)
    s2[3], e2[3] = 8.0, 8.0  # "Paris", 16 > 10
    texts = postprocess_predictions(
        [context, "nothing valid"],
        np.array([0, 0, 1]),
        np.stack([offsets, second, np.full_like(offsets, -1)]),
        np.stack([start, s2, start]),
        np.stack([end, e2, end]),
        max_answer_length=5,
    )
    assert texts == ["Paris", ""]
    with pytest.raises(ValueError, match="3 features"):
        postprocess_predictions(
            [context], np.array([0, 0, 0]), offsets[None], start[None], end[None]
        )


# --------------------------------------------------------------------------- partitioning


@pytest.mark.parametrize("scheme", ["iid", "dirichlet"])
def test_partitions_split_examples_never_features(tiny, scheme):
    from flower_app.task_data import SplitView, load_task_data, tokenized_split
    from flower_app.task_kinds.extractive_qa import qa_eval_set

    config = tiny_config(tiny, partitioner=scheme, **{"dirichlet-alpha": 0.3})
    data = load_task_data(config)
    ids = []
    for pid in range(3):
        part = qa_eval_set(SplitView(config, "eval", pid, 3))
        ids += part.examples["id"]
        assert set(part.example_index) == set(range(len(part.examples)))
        assert len(part.features) == len(part.example_index) >= len(part.examples) > 0
        assert len(tokenized_split(config, "eval", pid, 3)) == len(part.features)
    assert sorted(ids) == sorted(data.eval["id"])  # disjoint, covering, by example
    if scheme == "dirichlet":  # the skew is over the article-title buckets
        from flower_app.data.partition import partition_dataset

        for pid in range(3):
            by_title = partition_dataset(
                data.eval, 3, pid, "dirichlet", 0.3, config.seed, label_field=TITLE_BUCKET
            )
            assert qa_eval_set(SplitView(config, "eval", pid, 3)).examples["id"] == by_title["id"]


@pytest.mark.parametrize("method", METHODS)
def test_every_method_trains_and_scores_the_span_head_in_process(tiny, method):
    """One client round of every method on the span task, in process (the ClientApp's
    round, flower_app/client/round.py), then the server's QA evaluation: the shared arrays
    move, the span head is among them where the method trains it, the scores are SQuAD's."""
    import numpy as np
    import torch

    from flower_app.cache.per_process import cached_adapted_model
    from flower_app.client.round import train_round
    from flower_app.task_data import load_task_data
    from flower_app.task_eval import evaluate_task

    config = tiny_config(
        tiny, method=method, rank=2, **{"local-steps": 2, "batch-size": 8, "learning-rate": 0.01}
    )
    data = load_task_data(config)
    adapted = cached_adapted_model(config, data.num_labels, data.spec.kind)
    before = {k: v.copy() for k, v in adapted.shared_state().items()}
    reply = train_round(config, adapted, server_round=1, partition_id=0, num_partitions=2)
    assert reply.metrics["train-loss"] > 0
    moved = [k for k in reply.shared if not np.array_equal(reply.shared[k], before[k])]
    assert moved, method
    assert any(k.startswith("qa_outputs.") for k in reply.shared)  # the head travels
    scores = evaluate_task(config, adapted.model, torch.device("cpu"))
    assert 0.0 <= scores["f1"] <= 100.0 and scores["score"] == pytest.approx(scores["f1"] / 100)


# --------------------------------------------------------------------------- end to end


@pytest.fixture(scope="module")
def superlink(tmp_path_factory):
    # One Ray cluster for the module's runs (tests/harness/ray_harness.py says why).
    from tests.harness.ray_harness import shared_ray_simulation_superlink

    with shared_ray_simulation_superlink(
        tmp_path_factory.mktemp("qa-sim"), num_supernodes=2
    ) as sim:
        yield sim


@pytest.mark.integration
@pytest.mark.parametrize("method", E2E_METHODS)
def test_span_head_trains_through_the_flower_simulation(tiny, superlink, tmp_path, method):
    from florg_tools.flwr_cli import run_flower_app

    model, task = tiny
    home, connection = superlink
    config = {
        "method": method,
        "model": str(model),
        "task": "squad",
        "data-path": str(task),
        "max-seq-length": 48,
        "doc-stride": 16,
        "rank": 2,
        "num-server-rounds": 2,
        "min-available-nodes": 2,
        "batch-size": 8,
        "learning-rate": 0.01,
        "client-eval": "on",
        "output-dir": str(tmp_path / "outputs"),
        "run-name": f"qa-{method}",
    }
    outcome = run_flower_app(ROOT, connection, config, home, timeout=600, stream=None)
    assert outcome.ok, f"{outcome.message}\n{outcome.log_text[-4000:]}"
    run_dir = tmp_path / "outputs" / f"qa-{method}"
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["round"] for r in rows] == [0, 1, 2]
    for r in rows:
        assert 0.0 <= r["f1"] <= 100.0 and 0.0 <= r["exact-match"] <= 100.0
        assert r["score"] == pytest.approx(r["f1"] / 100) and r["score-metric"] == "f1"
        assert r["accuracy"] is None and np.isfinite(r["loss"])
    assert rows[2]["clients"] == 2 and rows[2]["cum-up-params"] > 0
    assert 0.0 <= rows[2]["personalized-f1"] <= 100.0
    assert rows[2]["personalized-score"] == pytest.approx(rows[2]["personalized-f1"] / 100)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["final-f1"] == rows[-1]["f1"] and summary["score-metric"] == "f1"
    from safetensors.numpy import load_file

    adapter = load_file(str(run_dir / "adapter.safetensors"))
    assert {"qa_outputs.weight", "qa_outputs.bias"} <= set(adapter)  # the head travels
    if method.startswith("florg"):
        assert any(k.endswith("query.A") for k in adapter)
        assert (run_dir / "peft_lora" / "adapter_model.safetensors").exists()


# --------------------------------------------------------------------------- metrics rows


def test_rows_carry_the_headline_score(tmp_path):
    from flower_app.run_output.recorder import RunRecorder
    from flower_app.task_kinds import get_kind

    config = resolve_config({})
    (tmp_path / "cls").mkdir()
    cls = RunRecorder(tmp_path / "cls", config)
    row = cls.record(0, {"accuracy": 0.75, "loss": 0.5, "score": 0.75}, {})
    assert (row["score"], row["score-metric"], row["accuracy"]) == (0.75, "accuracy", 0.75)
    assert "f1" not in row
    (tmp_path / "qa").mkdir()
    qa = RunRecorder(tmp_path / "qa", config, kind=get_kind("extractive-qa"))
    qa.record(0, {"exact-match": 10.0, "f1": 20.0, "loss": 3.0, "score": 0.2}, {})
    qa.record(1, {"exact-match": 30.0, "f1": 45.0, "loss": 2.0, "score": 0.45}, {"up-params": 8})
    rows = [
        json.loads(line) for line in (tmp_path / "qa" / "metrics.jsonl").read_text().splitlines()
    ]
    assert rows[1]["f1"] == 45.0 and rows[1]["exact-match"] == 30.0 and rows[1]["score"] == 0.45
    assert rows[1]["accuracy"] is None and rows[1]["score-metric"] == "f1"
    summary = qa.write_summary({})
    assert (summary["final-f1"], summary["final-exact-match"], summary["final-score"]) == (
        45.0,
        30.0,
        0.45,
    )
    assert summary["initial-score"] == 0.2 and summary["score-metric"] == "f1"

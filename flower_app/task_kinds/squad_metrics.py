"""SQuAD v1.1 evaluation (exact match and token F1), following the official definition."""

from __future__ import annotations

import re
import string
from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from typing import Any

__all__ = ["evaluate_predictions", "exact_match", "f1_score", "normalize_answer"]

_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCTUATION = frozenset(string.punctuation)


def normalize_answer(s: str) -> str:
    """Lower-case, drop punctuation, drop the articles a/an/the, collapse whitespace."""
    text = s.lower()
    text = "".join(ch for ch in text if ch not in _PUNCTUATION)
    text = _ARTICLES.sub(" ", text)
    return " ".join(text.split())


def _exact_match_single(prediction: str, ground_truth: str) -> float:
    """1.0 when both strings normalise to the same text, else 0.0."""
    return float(normalize_answer(prediction) == normalize_answer(ground_truth))


def _f1_single(prediction: str, ground_truth: str) -> float:
    """Token-level F1 between two answers on their normalised tokens."""
    pred_tokens = normalize_answer(prediction).split()
    gold_tokens = normalize_answer(ground_truth).split()
    common = sum((Counter(pred_tokens) & Counter(gold_tokens)).values())
    if common == 0:
        # As in the v1.1 script: no shared token (an empty side included) scores 0.
        return 0.0
    precision = common / len(pred_tokens)
    recall = common / len(gold_tokens)
    return 2 * precision * recall / (precision + recall)


def _best(
    score: Callable[[str, str], float], prediction: str, ground_truths: Iterable[str]
) -> float:
    """Maximum of ``score(prediction, gold)`` over the gold answers (0.0 if there are none)."""
    return max((score(prediction, gold) for gold in ground_truths), default=0.0)


def exact_match(prediction: str, ground_truths: list[str]) -> float:
    """Exact match of ``prediction`` against the best of the gold answers (0.0 or 1.0)."""
    return _best(_exact_match_single, prediction, ground_truths)


def f1_score(prediction: str, ground_truths: list[str]) -> float:
    """Token-level F1 of ``prediction`` against the best of the gold answers, in [0, 1]."""
    return _best(_f1_single, prediction, ground_truths)


def evaluate_predictions(
    dataset_rows: Iterable[Mapping[str, Any]], predictions: Mapping[str, str]
) -> dict[str, float | int]:
    """Score ``predictions`` (id -> text) over rows in the HF ``squad`` schema.

    Returns ``exact_match`` and ``f1`` as percentages over all rows (a row without a
    prediction scores 0), the row ``count`` and the number of ``missing`` predictions.
    """
    total_em = 0.0
    total_f1 = 0.0
    count = 0
    missing = 0
    for row in dataset_rows:
        count += 1
        row_id = row["id"]
        if row_id not in predictions:
            missing += 1
            continue
        golds = list(row["answers"]["text"])
        prediction = predictions[row_id]
        total_em += exact_match(prediction, golds)
        total_f1 += f1_score(prediction, golds)
    scale = 100.0 / count if count else 0.0
    return {
        "exact_match": total_em * scale,
        "f1": total_f1 * scale,
        "count": count,
        "missing": missing,
    }

"""Extractive-QA evaluation: start/end logits -> answer texts -> SQuAD v1.1 EM and F1.

Post-processing as in Hugging Face's ``run_qa``: for every feature of an example take the
``n_best`` highest start and end logits, keep the pairs that lie inside the context, with
end >= start and at most ``max_answer_length`` tokens, score them start + end logit, and
answer with the context characters of the best pair over all the example's features
(SQuAD v1.1: every question has an answer, so the null answer is never chosen; an example
with no valid pair answers "").
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import datasets
import numpy as np
import torch
from torch import nn
from torch.utils.data import DataLoader

from flower_app.task_kinds.squad_metrics import evaluate_predictions

N_BEST = 20
MAX_ANSWER_LENGTH = 30


@dataclass(frozen=True)
class QAEvalSet:
    """What QA evaluation needs: the examples (id, context, answers), the model-input
    features, and per feature its example's row and its tokens' context character spans."""

    examples: datasets.Dataset
    features: datasets.Dataset  # torch format: model inputs + start/end positions
    example_index: np.ndarray  # (num_features,) int
    context_offsets: np.ndarray  # (num_features, max_length, 2) int; -1 outside the context


@dataclass(frozen=True)
class QAEvalResult:
    loss: float
    exact_match: float  # percent, official SQuAD v1.1 definition
    f1: float  # percent
    num_examples: int
    num_features: int


def best_span(
    start_logits: np.ndarray,
    end_logits: np.ndarray,
    offsets: np.ndarray,
    n_best: int = N_BEST,
    max_answer_length: int = MAX_ANSWER_LENGTH,
) -> tuple[float, int, int] | None:
    """(score, start char, end char) of the best valid span of one feature, or None."""
    start_logits, end_logits = np.asarray(start_logits), np.asarray(end_logits)
    offsets = np.asarray(offsets).reshape(-1, 2)
    length = min(len(start_logits), len(end_logits), len(offsets))
    k = min(n_best, length)
    starts = np.argsort(-start_logits[:length], kind="stable")[:k]
    ends = np.argsort(-end_logits[:length], kind="stable")[:k]
    starts = starts[offsets[starts, 0] >= 0]
    ends = ends[offsets[ends, 0] >= 0]
    if len(starts) == 0 or len(ends) == 0:
        return None
    width = ends[None, :] - starts[:, None] + 1
    valid = (width >= 1) & (width <= max_answer_length)
    if not valid.any():
        return None
    scores = np.where(valid, start_logits[starts][:, None] + end_logits[ends][None, :], -np.inf)
    i, j = np.unravel_index(int(np.argmax(scores)), scores.shape)
    s, e = int(starts[i]), int(ends[j])
    return float(scores[i, j]), int(offsets[s][0]), int(offsets[e][1])


def postprocess_predictions(
    contexts: Sequence[str],
    example_index: np.ndarray,
    context_offsets: np.ndarray,
    start_logits: np.ndarray,
    end_logits: np.ndarray,
    n_best: int = N_BEST,
    max_answer_length: int = MAX_ANSWER_LENGTH,
) -> list[str]:
    """One predicted answer text per example (``contexts[i]``) from its features' logits."""
    num_features = len(example_index)
    if not len(start_logits) == len(end_logits) == len(context_offsets) == num_features:
        raise ValueError(
            f"{num_features} features but {len(start_logits)} start / {len(end_logits)} end "
            f"logit rows and {len(context_offsets)} offset rows"
        )
    best: list[tuple[float, int, int] | None] = [None] * len(contexts)
    for f in range(num_features):
        i = int(example_index[f])
        if not 0 <= i < len(contexts):
            raise ValueError(f"feature {f} points to example {i} of {len(contexts)}")
        span = best_span(
            start_logits[f], end_logits[f], context_offsets[f], n_best, max_answer_length
        )
        if span is not None and (best[i] is None or span[0] > best[i][0]):  # type: ignore[index]
            best[i] = span
    return ["" if b is None else contexts[i][b[1] : b[2]] for i, b in enumerate(best)]


@torch.no_grad()
def predict_logits(
    model: nn.Module, loader: DataLoader, device: torch.device, max_length: int
) -> tuple[np.ndarray, np.ndarray, float]:
    """Start and end logits (num_features, max_length; -inf past a trimmed batch's length)
    and the mean span loss over the features."""
    model.to(device).eval()
    starts, ends = [], []
    loss_sum, count = 0.0, 0
    for batch in loader:
        batch = {k: v.to(device) for k, v in batch.items()}
        out = model(**batch)
        n = int(batch["input_ids"].shape[0])
        if out.loss is not None:
            loss_sum += float(out.loss) * n
        count += n
        for logits, into in ((out.start_logits, starts), (out.end_logits, ends)):
            padded = torch.full((n, max_length), -math.inf)
            padded[:, : logits.shape[1]] = logits.float().cpu()
            into.append(padded.numpy())
    if count == 0:
        empty = np.zeros((0, max_length), np.float32)
        return empty, empty, math.nan
    return np.concatenate(starts), np.concatenate(ends), loss_sum / count


def evaluate_qa(
    model: nn.Module, eval_set: QAEvalSet, loader: DataLoader, device: torch.device
) -> QAEvalResult:
    """Span loss, exact match and F1 (percent, over all gold answers) of ``model``."""
    num_examples = len(eval_set.examples)
    if num_examples == 0:
        return QAEvalResult(math.nan, math.nan, math.nan, 0, 0)
    max_length = eval_set.context_offsets.shape[1]
    start_logits, end_logits, loss = predict_logits(model, loader, device, max_length)
    texts = postprocess_predictions(
        eval_set.examples["context"],
        eval_set.example_index,
        eval_set.context_offsets,
        start_logits,
        end_logits,
    )
    ids = eval_set.examples["id"]
    rows = [{"id": i, "answers": a} for i, a in zip(ids, eval_set.examples["answers"], strict=True)]
    scores = evaluate_predictions(rows, dict(zip(ids, texts, strict=True)))
    return QAEvalResult(
        loss, float(scores["exact_match"]), float(scores["f1"]), num_examples, len(start_logits)
    )

"""Causal-LM evaluation: the held-out response loss and perplexity, and greedy generation
scored by SQuAD's exact match and F1 against every gold answer.

``response_loss``: the cross-entropy of the response tokens (their labels; the prompt and
the padding are -100), averaged over tokens, not examples; perplexity = exp(loss).
``generate_answers``: per example the prompt alone (left-padded into a batch), greedy
decoding of up to ``max_new_tokens`` tokens, stopped at EOS; the answer is the decoded text
up to its first line break. EM and F1 are the official SQuAD v1.1 ones
(``flower_app.task_kinds.squad_metrics``: normalised text, the best over the gold answers), percent.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader

from flower_app.task_kinds.squad_metrics import exact_match, f1_score


@torch.no_grad()
def response_loss(model: nn.Module, loader: DataLoader, device: torch.device) -> tuple[float, int]:
    """(mean cross-entropy per response token, number of response tokens) over ``loader``."""
    model.to(device).eval()
    total, tokens = 0.0, 0
    for batch in loader:
        batch = {k: v.to(device) for k, v in batch.items()}
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        # Token t predicts token t + 1: shift, as the model's own loss does.
        shifted = logits[:, :-1].float()
        targets = batch["labels"][:, 1:]
        total += float(
            nn.functional.cross_entropy(
                shifted.reshape(-1, shifted.shape[-1]),
                targets.reshape(-1),
                ignore_index=-100,
                reduction="sum",
            )
        )
        tokens += int((targets != -100).sum())
    return (total / tokens if tokens else math.nan), tokens


@torch.no_grad()
def generate_answers(
    model: nn.Module,
    prompts: Sequence[Sequence[int]],
    tokenizer: Any,
    device: torch.device,
    *,
    max_new_tokens: int,
    batch_size: int,
) -> list[str]:
    """Greedy continuations of the tokenised ``prompts`` (module docstring)."""
    model.to(device).eval()
    pad_id = (
        tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    )
    answers: list[str] = []
    for start in range(0, len(prompts), batch_size):
        chunk = prompts[start : start + batch_size]
        width = max(len(p) for p in chunk)
        ids = torch.full((len(chunk), width), pad_id, dtype=torch.long)
        mask = torch.zeros((len(chunk), width), dtype=torch.long)
        for i, p in enumerate(chunk):  # left padding: every prompt ends at the same column
            ids[i, width - len(p) :] = torch.tensor(list(p), dtype=torch.long)
            mask[i, width - len(p) :] = 1
        out = model.generate(
            input_ids=ids.to(device),
            attention_mask=mask.to(device),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            pad_token_id=pad_id,
            eos_token_id=tokenizer.eos_token_id,
        )
        for row in out[:, width:].tolist():
            if tokenizer.eos_token_id in row:
                row = row[: row.index(tokenizer.eos_token_id)]
            text = tokenizer.decode(row, skip_special_tokens=True)
            answers.append(text.strip().split("\n", 1)[0].strip())
    return answers


def generation_scores(
    predictions: Sequence[str], golds: Sequence[Sequence[str]]
) -> dict[str, float]:
    """``gen-exact-match`` and ``gen-f1`` (percent, best over each example's gold answers)."""
    if len(predictions) != len(golds):
        raise ValueError(f"{len(predictions)} predictions for {len(golds)} examples")
    if not predictions:
        return {"gen-exact-match": math.nan, "gen-f1": math.nan}
    em = sum(exact_match(p, list(g)) for p, g in zip(predictions, golds, strict=True))
    f1 = sum(f1_score(p, list(g)) for p, g in zip(predictions, golds, strict=True))
    return {
        "gen-exact-match": 100.0 * em / len(predictions),
        "gen-f1": 100.0 * f1 / len(predictions),
    }

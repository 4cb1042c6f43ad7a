"""Tokenise a task's texts to fixed-length tensors and wrap them in DataLoaders."""

from __future__ import annotations

from typing import Any

import datasets
import torch
from torch.utils.data import DataLoader

from flower_app.data.tasks import TaskSpec

MODEL_INPUTS = ("input_ids", "attention_mask", "token_type_ids")


def tokenize_dataset(
    ds: datasets.Dataset, tokenizer: Any, spec: TaskSpec, max_length: int
) -> datasets.Dataset:
    """Columns input_ids, attention_mask (, token_type_ids) padded to ``max_length`` and
    labels, as torch tensors. A tokenizer without a pad token pads with its EOS token."""
    if max_length < 1:
        raise ValueError(f"max_length must be >= 1, got {max_length}")
    if tokenizer.pad_token is None:
        if tokenizer.eos_token is None:
            raise ValueError("tokenizer has neither a pad nor an eos token")
        tokenizer.pad_token = tokenizer.eos_token

    def encode(batch: dict[str, list[Any]]) -> dict[str, Any]:
        texts = [batch[f] for f in spec.text_fields]
        enc = tokenizer(*texts, truncation=True, padding="max_length", max_length=max_length)
        out = {k: enc[k] for k in MODEL_INPUTS if k in enc}
        out["labels"] = batch[spec.label_field]
        return out

    tokenized = ds.map(
        encode,
        batched=True,
        batch_size=1000,
        remove_columns=ds.column_names,
        desc=f"tokenize {spec.name}",
    )
    return tokenized.with_format("torch")


def make_loader(
    ds: datasets.Dataset, batch_size: int, shuffle: bool = False, seed: int = 0
) -> DataLoader:
    """DataLoader over a tokenised dataset; shuffling is seeded."""
    generator = torch.Generator().manual_seed(seed) if shuffle else None
    return DataLoader(ds, batch_size=batch_size, shuffle=shuffle, generator=generator)

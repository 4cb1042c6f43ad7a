"""Batches of tokenised features trimmed to their longest example (static -> dynamic)."""

from __future__ import annotations

import datasets
import torch
from torch.utils.data import DataLoader


def trim_collate(batch: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Stack a batch and cut the padding columns no example in it uses (static -> dynamic);
    right padding only (every feature here is right-padded)."""
    out = {k: torch.stack([ex[k] for ex in batch]) for k in batch[0]}
    if "attention_mask" in out:
        length = int(out["attention_mask"].sum(dim=1).max())
        for k in ("input_ids", "attention_mask", "token_type_ids"):
            if k in out:
                out[k] = out[k][:, :length]
        if "labels" in out and out["labels"].dim() == 2:  # per-token labels (causal LM)
            out["labels"] = out["labels"][:, :length]
    return out


def make_loader(ds: datasets.Dataset, batch_size: int, shuffle: bool, seed: int) -> DataLoader:
    generator = torch.Generator().manual_seed(seed) if shuffle else None
    return DataLoader(
        ds, batch_size=batch_size, shuffle=shuffle, generator=generator, collate_fn=trim_collate
    )

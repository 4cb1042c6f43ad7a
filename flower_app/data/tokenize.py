"""Tokenise a task's texts to fixed-length tensors and wrap them in DataLoaders."""

from __future__ import annotations

import hashlib
import inspect
import sys
from functools import cache
from typing import Any

import datasets
import torch
from torch.utils.data import DataLoader

from flower_app.data.tasks import TaskSpec

MODEL_INPUTS = ("input_ids", "attention_mask", "token_type_ids")
# id(tokenizer) -> (the tokenizer, datasets' hash of it): see ``_fingerprint``.
_TOKENIZER_HASHES: dict[int, tuple[Any, str]] = {}


@cache
def _source_hash() -> str:
    """This module's source: a change to the encoding changes every fingerprint."""
    return hashlib.sha256(inspect.getsource(sys.modules[__name__]).encode()).hexdigest()


def _tokenizer_hash(tokenizer: Any) -> str:
    """``datasets``' own hash of the tokenizer (a dill pickle of it), computed once per
    tokenizer object and pad token."""
    from datasets.fingerprint import Hasher

    known = _TOKENIZER_HASHES.get(id(tokenizer))
    if known is None or known[0] is not tokenizer:
        known = _TOKENIZER_HASHES[id(tokenizer)] = (tokenizer, Hasher.hash(tokenizer))
    return known[1]


def _fingerprint(ds: datasets.Dataset, tokenizer: Any, spec: TaskSpec, max_length: int) -> str:
    """The tokenised dataset's ``datasets`` fingerprint, from everything ``encode`` reads.

    ``Dataset.map`` would otherwise hash ``encode`` with its closure, the tokenizer
    included, on every call: a dill pickle of the whole tokenizer per partition, which
    dominated a client's time outside training when a thousand simulated clients each
    tokenised their partition (py-spy over ``benchmarks.scale.scale_benchmark``). The
    fingerprint names ``datasets``' cache files of the result, so it must change with
    the input rows, the tokenizer, the fields, the length and this code; it does.
    """
    from datasets.fingerprint import Hasher

    parts = [
        ds._fingerprint,
        _tokenizer_hash(tokenizer),
        tokenizer.pad_token,
        list(spec.text_fields),
        spec.label_field,
        int(max_length),
        _source_hash(),
    ]
    return Hasher.hash(parts)


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
        new_fingerprint=_fingerprint(ds, tokenizer, spec, max_length),
    )
    return tokenized.with_format("torch")


def make_loader(
    ds: datasets.Dataset, batch_size: int, shuffle: bool = False, seed: int = 0
) -> DataLoader:
    """DataLoader over a tokenised dataset; shuffling is seeded."""
    generator = torch.Generator().manual_seed(seed) if shuffle else None
    return DataLoader(ds, batch_size=batch_size, shuffle=shuffle, generator=generator)

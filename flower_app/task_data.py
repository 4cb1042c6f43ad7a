"""The run's data: the task's splits, a client's partition, and batches trimmed to their length.

Both the server (validation split) and every client (its Dirichlet or IID share of
the training pool, plus the same share of the validation split for personalised
evaluation) go through ``load_task_data``, which is cached per process so a round
never reloads or re-tokenises anything.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import datasets
import torch
from torch.utils.data import DataLoader

from flower_app.config import ConfigError, RunConfig
from flower_app.data.loading import load_task_splits
from flower_app.data.partition import partition_dataset
from flower_app.data.tasks import TaskSpec, resolve_task
from flower_app.data.tokenize import tokenize_dataset

datasets.disable_progress_bars()  # one line per round on the console is enough


@dataclass(frozen=True)
class TaskData:
    spec: TaskSpec
    train: datasets.Dataset
    eval: datasets.Dataset
    num_labels: int


def task_spec(config: RunConfig) -> TaskSpec:
    overrides: dict[str, Any] = {}
    if config.num_labels > 0:
        overrides["num_labels"] = config.num_labels
    try:
        return resolve_task(
            config.task,
            config.data_path or None,
            text_fields=config.text_fields or None,
            label_field=config.label_field if config.data_path else None,
            **overrides,
        )
    except ValueError as err:
        raise ConfigError(f"task: {err}") from err


@lru_cache(maxsize=4)
def load_task_data(config: RunConfig) -> TaskData:
    """The task's (subsetted) train pool and validation split; cached per process and run."""
    spec = task_spec(config)
    train, evaluation = load_task_splits(
        spec,
        max_train=config.max_train_examples or None,
        max_eval=config.max_eval_examples or None,
        seed=config.seed,
    )
    num_labels = train.features[spec.label_field].num_classes
    return TaskData(spec, train, evaluation, num_labels)


def trim_collate(batch: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Stack a batch and cut the padding columns no example in it uses (static -> dynamic)."""
    out = {k: torch.stack([ex[k] for ex in batch]) for k in batch[0]}
    if "attention_mask" in out:
        length = int(out["attention_mask"].sum(dim=1).max())
        for k in ("input_ids", "attention_mask", "token_type_ids"):
            if k in out:
                out[k] = out[k][:, :length]
    return out


def make_loader(ds: datasets.Dataset, batch_size: int, shuffle: bool, seed: int) -> DataLoader:
    generator = torch.Generator().manual_seed(seed) if shuffle else None
    return DataLoader(
        ds, batch_size=batch_size, shuffle=shuffle, generator=generator, collate_fn=trim_collate
    )


@lru_cache(maxsize=64)
def tokenized_split(
    config: RunConfig, split: str, partition_id: int = 0, num_partitions: int = 1
) -> datasets.Dataset:
    """Tokenised ``split`` ('train' or 'eval'), optionally one client's partition of it."""
    from flower_app.runtime import cached_tokenizer

    if num_partitions > 1 and not 0 <= partition_id < num_partitions:
        raise ValueError(f"partition-id {partition_id} outside [0, {num_partitions})")
    data = load_task_data(config)
    ds = data.train if split == "train" else data.eval
    if num_partitions > 1:
        ds = partition_dataset(
            ds,
            num_partitions,
            partition_id,
            scheme=config.partitioner,
            alpha=config.dirichlet_alpha,
            seed=config.seed,
            label_field=data.spec.label_field,
        )
    return tokenize_dataset(ds, cached_tokenizer(config.model), data.spec, config.max_seq_length)

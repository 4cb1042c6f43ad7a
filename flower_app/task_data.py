"""The run's data: the task's splits, a client's partition, and batches trimmed to their length.

Both the server (validation split) and every client (its Dirichlet or IID share of
the training pool, plus the same share of the validation split for personalised
evaluation) go through ``load_task_data``, which is cached per process so a round
never reloads or re-tokenises anything.

Extractive QA (``TaskSpec.kind == "extractive-qa"``, e.g. ``task=squad``) is partitioned
and subset by example (a question never straddles clients), IID or Dirichlet over the
article-title buckets (``flower_app.data.qa_loading``); its features are question +
context windows (``flower_app.data.qa_features``), and ``qa_eval_set`` keeps what
post-processing needs to map logits back to answer texts.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import datasets
import numpy as np
import torch
from torch.utils.data import DataLoader

from flower_app.config import DATA, DEFAULTS, TOKENISATION, ConfigError, RunConfig
from flower_app.data.loading import load_task_splits, load_task_test
from flower_app.data.partition import partition_dataset
from flower_app.data.qa_features import CONTEXT_OFFSETS, EXAMPLE_INDEX, check_window, qa_features
from flower_app.data.qa_loading import TITLE_BUCKET, load_qa_splits
from flower_app.data.tasks import EXTRACTIVE_QA, TASKS, TaskSpec, resolve_task
from flower_app.data.tokenize import MODEL_INPUTS, tokenize_dataset
from flower_app.disk_cache import disk_cached_dataset, path_identity
from flower_app.qa_eval import QAEvalSet
from flower_app.tokenizer import cached_tokenizer

datasets.disable_progress_bars()  # one line per round on the console is enough


@dataclass(frozen=True)
class TaskData:
    spec: TaskSpec
    train: datasets.Dataset
    eval: datasets.Dataset
    num_labels: int  # classes; 2 (start, end) for extractive QA

    @property
    def is_qa(self) -> bool:
        return self.spec.kind == EXTRACTIVE_QA

    @property
    def score_metric(self) -> str:
        """The headline metric: accuracy, or F1 for extractive QA."""
        return "f1" if self.is_qa else "accuracy"


def task_spec(config: RunConfig) -> TaskSpec:
    overrides: dict[str, Any] = {}
    if config.num_labels > 0:
        overrides["num_labels"] = config.num_labels
    label_field = config.label_field if config.data_path else None
    base = TASKS.get(config.task)
    if base is not None and base.kind == EXTRACTIVE_QA and label_field == DEFAULTS["label-field"]:
        label_field = None  # QA keeps its answers column unless label-field names another
    try:
        return resolve_task(
            config.task,
            config.data_path or None,
            text_fields=config.text_fields or None,
            label_field=label_field,
            **overrides,
        )
    except ValueError as err:
        raise ConfigError(f"task: {err}") from err


@lru_cache(maxsize=4)
def load_task_data(config: RunConfig) -> TaskData:
    """The task's (subsetted) train pool and validation split; cached per process and run."""
    spec = task_spec(config)
    if spec.kind == EXTRACTIVE_QA:
        train, evaluation = load_qa_splits(
            spec,
            max_train=config.max_train_examples or None,
            max_eval=config.max_eval_examples or None,
            seed=config.seed,
        )
        return TaskData(spec, train, evaluation, 2)
    train, evaluation = load_task_splits(
        spec,
        max_train=config.max_train_examples or None,
        max_eval=config.max_eval_examples or None,
        seed=config.seed,
    )
    num_labels = train.features[spec.label_field].num_classes
    return TaskData(spec, train, evaluation, num_labels)


@lru_cache(maxsize=4)
def load_test_data(config: RunConfig) -> datasets.Dataset:
    """The held-out test subset (``max-test-examples`` rows, the same for every seed)."""
    spec = task_spec(config)
    if spec.kind == EXTRACTIVE_QA:
        raise ConfigError("max-test-examples: extractive-QA tasks have no test split yet")
    try:
        return load_task_test(spec, config.max_test_examples or None)
    except ValueError as err:
        raise ConfigError(f"max-test-examples: {err}") from err


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


def _partition(
    config: RunConfig, data: TaskData, ds: datasets.Dataset, partition_id: int, num_partitions: int
) -> datasets.Dataset:
    """One client's share of ``ds`` (by example; QA's Dirichlet skews over title buckets)."""
    if num_partitions > 1 and not 0 <= partition_id < num_partitions:
        raise ValueError(f"partition-id {partition_id} outside [0, {num_partitions})")
    if num_partitions <= 1:
        return ds
    return partition_dataset(
        ds,
        num_partitions,
        partition_id,
        scheme=config.partitioner,
        alpha=config.dirichlet_alpha,
        seed=config.seed,
        label_field=TITLE_BUCKET if data.is_qa else data.spec.label_field,
    )


def _qa_features(config: RunConfig, examples: datasets.Dataset, keep_mapping: bool):
    tokenizer = cached_tokenizer(config.model)
    try:
        check_window(tokenizer, config.max_seq_length, config.doc_stride)
    except ValueError as err:
        key = "model" if "fast tokenizer" in str(err) else "doc-stride"
        raise ConfigError(f"{key}: {err}") from err
    return qa_features(
        examples, tokenizer, config.max_seq_length, config.doc_stride, keep_mapping=keep_mapping
    )


def _data_source(config: RunConfig) -> dict[str, Any]:
    """What a tokenised split depends on beyond the settings: the task the settings
    resolve to and the identity (names, sizes, mtimes) of its local files."""
    spec = task_spec(config)
    return {"spec": repr(spec), "data": path_identity(spec.local_dir or spec.data_file)}


# A SuperNode starts a fresh ClientApp process per message: the disk cache serves those.
@lru_cache(maxsize=64)
@disk_cached_dataset(groups=(DATA, TOKENISATION), source=_data_source)
def tokenized_split(
    config: RunConfig, split: str, partition_id: int = 0, num_partitions: int = 1
) -> datasets.Dataset:
    """Tokenised ``split`` ('train', 'eval' or 'test'), optionally one client's partition
    of it (the test split is never partitioned: every scorer of it scores it whole).

    Classification: inputs + ``labels``; extractive QA: the features (windows) of the
    partition's examples, inputs + ``start_positions`` / ``end_positions``."""
    data = load_task_data(config)
    if split == "test":
        ds = load_test_data(config)
    else:
        source = data.train if split == "train" else data.eval
        ds = _partition(config, data, source, partition_id, num_partitions)
    if data.is_qa:
        features = _qa_features(config, ds, keep_mapping=False)
        return features.with_format("torch")
    return tokenize_dataset(ds, cached_tokenizer(config.model), data.spec, config.max_seq_length)


@lru_cache(maxsize=8)
def qa_eval_set(config: RunConfig, partition_id: int = 0, num_partitions: int = 1) -> QAEvalSet:
    """The (partition of the) QA validation examples with their features and mapping."""
    data = load_task_data(config)
    if not data.is_qa:
        raise ValueError(f"task {config.task!r} is not an extractive-QA task")
    examples = _partition(config, data, data.eval, partition_id, num_partitions)
    features = _qa_features(config, examples, keep_mapping=True)
    mapping = features.select_columns([EXAMPLE_INDEX, CONTEXT_OFFSETS]).with_format("numpy")
    offsets = np.asarray(mapping[CONTEXT_OFFSETS], dtype=np.int64).reshape(
        len(features), config.max_seq_length, 2
    )
    inputs = [
        c for c in (*MODEL_INPUTS, "start_positions", "end_positions") if c in features.column_names
    ]
    return QAEvalSet(
        examples=examples,
        features=features.select_columns(inputs).with_format("torch"),
        example_index=np.asarray(mapping[EXAMPLE_INDEX], dtype=np.int64),
        context_offsets=offsets,
    )

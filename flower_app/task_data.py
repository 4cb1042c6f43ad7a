"""The run's data: the task's splits, a client's partition, and batches trimmed to their length.

The server (validation split) and every client (its Dirichlet or IID share of the training
pool, plus the same share of the validation split for personalised evaluation) go through
``load_task_data``, cached per process so a round never reloads or re-tokenises anything.
What differs between kinds of task is the task kind's (flower_app/task_kinds/): how the examples
are read (``load_splits``), the column a Dirichlet partition skews over (``partition_field``)
and the features (``features``). This module subsets, partitions and caches them;
``SplitView`` hands a split or a partition to the kind's evaluation."""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import datasets

from flower_app.cache.disk import disk_cached_dataset, path_identity
from flower_app.cache.tokenizer import cached_tokenizer
from flower_app.data.batching import make_loader, trim_collate
from flower_app.data.partition import partition_dataset
from flower_app.data.tasks import TASKS, TaskSpec, resolve_task
from flower_app.settings.config import DATA, TOKENISATION, ConfigError, RunConfig, defaults
from flower_app.task_kinds import TaskKind, get_kind

__all__ = [
    "SplitView",
    "TaskData",
    "load_task_data",
    "load_test_data",
    "make_loader",
    "split_examples",
    "task_spec",
    "tokenized_split",
    "trim_collate",
]

datasets.disable_progress_bars()  # one line per round on the console is enough


@dataclass(frozen=True)
class TaskData:
    spec: TaskSpec
    train: datasets.Dataset
    eval: datasets.Dataset
    num_labels: int  # the head's outputs: classes; 2 (start, end) for extractive QA

    @property
    def kind(self) -> TaskKind:
        """The task's kind (flower_app/task_kinds/)."""
        return get_kind(self.spec.kind)

    @property
    def score_metric(self) -> str:
        """The headline metric (the kind's): accuracy, F1 for extractive QA, ..."""
        return self.kind.score_metric


def task_spec(config: RunConfig) -> TaskSpec:
    overrides: dict[str, Any] = {}
    if config.num_labels > 0:
        overrides["num_labels"] = config.num_labels
    label_field = config.label_field if config.data_path else None
    # "a,b": two columns (never one column named "a,b").
    fields = tuple(f.strip() for f in config.text_fields.split(",") if f.strip())
    if config.task_kind:
        overrides["kind"] = config.task_kind
    overrides["prompt_format"] = config.prompt_format
    if config.task in TASKS and label_field == defaults()["label-field"]:
        label_field = None  # a known task keeps its target column unless label-field names another
    try:
        spec = resolve_task(
            config.task,
            config.data_path or None,
            text_fields=fields or None,
            label_field=label_field,
            **overrides,
        )
    except ValueError as err:
        raise ConfigError(f"task: {err}") from err
    try:
        kind = get_kind(spec.kind)
    except ValueError as err:
        raise ConfigError(f"task-kind: {err}") from err
    try:
        kind.check_spec(spec)
    except ValueError as err:
        raise ConfigError(f"task: {err}") from err
    return spec


@lru_cache(maxsize=4)
def load_task_data(config: RunConfig) -> TaskData:
    """The task's (subsetted) train pool and validation split; cached per process and run."""
    spec = task_spec(config)
    train, evaluation, num_labels = get_kind(spec.kind).load_splits(
        spec,
        max_train=config.max_train_examples or None,
        max_eval=config.max_eval_examples or None,
        seed=config.seed,
    )
    return TaskData(spec, train, evaluation, num_labels)


@lru_cache(maxsize=4)
def load_test_data(config: RunConfig) -> datasets.Dataset:
    """The held-out test subset (``max-test-examples`` rows, the same for every seed)."""
    spec = task_spec(config)
    try:
        return get_kind(spec.kind).load_test(spec, config.max_test_examples or None)
    except ValueError as err:
        raise ConfigError(f"max-test-examples: {err}") from err


def _partition(
    config: RunConfig, data: TaskData, ds: datasets.Dataset, partition_id: int, num_partitions: int
) -> datasets.Dataset:
    """One client's share of ``ds`` (by example; a Dirichlet partition skews over the
    kind's ``partition_field``: the label, QA's title bucket)."""
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
        label_field=data.kind.partition_field(data.spec),
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
    """The kind's features (``TaskKind.features``) of ``split_examples``: tokenised
    ``split`` ('train', 'eval' or 'test'), optionally one client's partition of it.

    Classification: inputs + ``labels``; extractive QA: the features (windows) of the
    partition's examples, inputs + ``start_positions`` / ``end_positions``."""
    data = load_task_data(config)
    examples = split_examples(config, split, partition_id, num_partitions)
    return data.kind.features(config, data.spec, cached_tokenizer(config.model), examples)


def split_examples(
    config: RunConfig, split: str, partition_id: int = 0, num_partitions: int = 1
) -> datasets.Dataset:
    """The examples of ``split`` ('train', 'eval' or 'test'), optionally one client's
    partition of it (the test split is never partitioned: every scorer of it scores it
    whole)."""
    if split == "test":
        return load_test_data(config)
    data = load_task_data(config)
    source = data.train if split == "train" else data.eval
    return _partition(config, data, source, partition_id, num_partitions)


@dataclass(frozen=True)
class SplitView:
    """A split or one client's partition of it, handed to the kind's ``evaluate``
    (``flower_app.task_kinds.base.SplitView``): its examples and its cached features."""

    config: RunConfig
    split: str = "eval"
    partition_id: int = 0
    num_partitions: int = 1

    def examples(self) -> datasets.Dataset:
        return split_examples(self.config, self.split, self.partition_id, self.num_partitions)

    def features(self) -> datasets.Dataset:
        return tokenized_split(self.config, self.split, self.partition_id, self.num_partitions)

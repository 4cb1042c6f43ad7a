"""Data layer: task specs, loading, federated partitioning and tokenisation."""

from flower_app.data.loading import load_task_splits, load_task_test
from flower_app.data.partition import partition_dataset
from flower_app.data.tasks import TASKS, TaskSpec, resolve_task
from flower_app.data.tokenize import make_loader, tokenize_dataset

__all__ = [
    "TASKS",
    "TaskSpec",
    "load_task_splits",
    "load_task_test",
    "make_loader",
    "partition_dataset",
    "resolve_task",
    "tokenize_dataset",
]

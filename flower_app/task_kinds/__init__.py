"""The task-kind registry: every kind of task this app trains, by its ``TaskSpec.kind`` name.

A kind is one module in this folder (its data, features, model head, loss and evaluation,
see ``base.py``, ending with ``KINDS = (...)``) plus its line in ``KIND_MODULES`` below.
Everything else reads the registry: the task's data (``flower_app/task_data.py``: splits,
partitions, features), the model (``flower_app/cache/per_process.py``), training
(``flower_app/client/round.py``: the kind's loss), evaluation (``flower_app/task_eval.py``)
and the run's records (``flower_app/run_output/recorder.py``: the metric names, the console line).
Nothing here imports flower_app.task_data, task_eval or the apps.
"""

from __future__ import annotations

from importlib import import_module

from flower_app.task_kinds.base import SplitView, TaskKind

__all__ = ["SplitView", "TaskKind", "get_kind", "kind_names", "register_kind"]

_REGISTRY: dict[str, TaskKind] = {}


def register_kind(kind: TaskKind) -> TaskKind:
    """Add ``kind`` under ``kind.name`` (a name can be registered once)."""
    if kind.name in _REGISTRY:
        raise ValueError(f"task kind {kind.name!r} is registered already")
    _REGISTRY[kind.name] = kind
    return kind


def kind_names() -> tuple[str, ...]:
    return tuple(_REGISTRY)


def get_kind(name: str) -> TaskKind:
    """The registered kind ``name``; ValueError listing the known kinds otherwise."""
    try:
        return _REGISTRY[name]
    except KeyError:
        raise ValueError(
            f"unknown task kind {name!r}; choose one of {', '.join(_REGISTRY)}"
        ) from None


# The registry: one line per kind module; each module's KINDS are registered in order.
KIND_MODULES = (
    "classification",
    "extractive_qa",
    "causal_lm",
)
for _module in KIND_MODULES:
    for _kind in import_module(f"{__name__}.{_module}").KINDS:
        register_kind(_kind)

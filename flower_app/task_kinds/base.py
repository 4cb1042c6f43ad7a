"""What a task kind is: everything the app does differently for classification, extractive QA or
any other kind of task, behind one interface, ``TaskKind``.

A task (``flower_app.data.tasks.TaskSpec``) names its kind (``TaskSpec.kind``); the kind says how
its data is checked and read (``check_spec``, ``load_splits``, ``load_test``), what a Dirichlet
partition skews over (``partition_field``), its features (``features``), its model
(``load_model``), its training loss (``training_loss``, by default the model's own) and its
evaluation (``evaluate``, ``metric_names``, ``score_metric``, ``console``). One module per kind
in this folder ends with ``KINDS = (...)``, named in one line of the registry
(``flower_app/task_kinds/__init__.py``); kind modules never import flower_app.task_data,
task_eval or the apps. docs/architecture.md, "Adding a task kind", has each hook."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

if TYPE_CHECKING:
    import datasets
    import torch
    from torch import nn

    from flower_app.data.tasks import TaskSpec
    from flower_app.settings.config import RunConfig


class SplitView(Protocol):
    """One split (``'eval'`` or ``'test'``) or one client's partition of it, as the app
    holds it (``flower_app.task_data.SplitView``): hashable, so a kind may cache what it
    derives from it (``functools.lru_cache``)."""

    config: RunConfig
    split: str
    partition_id: int
    num_partitions: int

    def examples(self) -> datasets.Dataset:
        """The split's (partition's) examples as ``load_splits`` / ``load_test`` gave them."""
        ...

    def features(self) -> datasets.Dataset:
        """``TaskKind.features`` of ``examples()``, cached per process and on disk."""
        ...


class TaskKind(ABC):
    """One kind of task; subclass it and override what differs (see the module docstring).

    ``name`` is what ``TaskSpec.kind`` says; ``score_metric`` is the metric ``score`` comes
    from (``score`` itself is always in [0, 1]); ``metric_names`` are the metrics
    ``evaluate`` reports besides ``loss``, ``score`` and ``num-examples`` (rows and the
    summary keep them: ``final-<name>``)."""

    name: ClassVar[str]
    score_metric: ClassVar[str]
    metric_names: ClassVar[tuple[str, ...]]
    # The adapters' targets when ``target-modules`` is '' (its default): BERT-style
    # ``query,value``; a decoder kind names ``q_proj,v_proj``.
    default_target_modules: ClassVar[str] = "query,value"
    # Whether the task's label column holds classes, so that always guessing the majority
    # class is a chance level (the evidence report's); answers and responses are not.
    has_classes: ClassVar[bool] = False
    # Why dp=example (DP-SGD, flower_app/privacy/dp_sgd.py) cannot train this kind; '' where its
    # training loss is the batch's mean of per-example losses, as Opacus' scaling assumes.
    example_dp_refusal: ClassVar[str] = ""

    # ----------------------------------------------------------------- data
    def check_spec(self, spec: TaskSpec) -> None:
        """Raise ValueError when ``spec`` cannot be a task of this kind (default: any
        spec can)."""
        return None

    @abstractmethod
    def load_splits(
        self, spec: TaskSpec, *, max_train: int | None, max_eval: int | None, seed: int
    ) -> tuple[datasets.Dataset, datasets.Dataset, int]:
        """(train, eval, num_labels): the seeded subsets of the task's examples and the
        number of outputs the model's head needs."""

    def load_test(self, spec: TaskSpec, max_test: int | None) -> datasets.Dataset:
        """The held-out test examples (the same ``max_test`` rows for every seed); raise
        ValueError when the task has none."""
        raise ValueError(f"{self.name} tasks have no test split yet")

    @abstractmethod
    def partition_field(self, spec: TaskSpec) -> str:
        """The column of the examples a Dirichlet partition skews over (its pseudo-label)."""

    @abstractmethod
    def features(
        self, config: RunConfig, spec: TaskSpec, tokenizer: Any, examples: datasets.Dataset
    ) -> datasets.Dataset:
        """The model inputs and training targets of ``examples``, in torch format (a batch
        of them is what ``training_loss`` gets). Bad settings raise ConfigError."""

    # ----------------------------------------------------------------- model and training
    def target_modules(self, config: RunConfig) -> str:
        """The modules the run's adapter targets: ``target-modules`` when it names any (a
        value given always wins), else this kind's own (``default_target_modules``)."""
        return config.target_modules if config.targets else self.default_target_modules

    @abstractmethod
    def load_model(
        self,
        name: str,
        num_labels: int,
        seed: int,
        pad_token_id: int | None,
        **from_pretrained: Any,
    ) -> nn.Module:
        """The base model ``name`` with this kind's head (its initialisation seeded).

        ``from_pretrained``: extra ``from_pretrained`` arguments the run's ``precision`` and
        ``quantization`` need (``dtype``, ``quantization_config``); passed only when either
        is not its default, so a kind that ignores them still serves fp32 runs, and one
        that forwards them to ``flower_app.modeling.load_with_head`` serves them all."""

    def training_loss(self, model: nn.Module, batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """The loss one training step minimises: the model's own, the batch carrying its
        targets (``labels``, ``start_positions`` / ``end_positions``...)."""
        return model(**batch).loss

    # ----------------------------------------------------------------- evaluation
    @abstractmethod
    def evaluate(self, model: nn.Module, data: SplitView, device: torch.device) -> dict[str, float]:
        """The metrics of ``model`` on ``data``: ``metric_names``, ``loss``, ``score`` (in
        [0, 1]) and ``num-examples`` (examples, not features)."""

    def console(self, row: Mapping[str, Any], prefix: str = "") -> str | None:
        """The console's words for the metrics of a metrics row (``prefix``: the keys'
        prefix, ``personalized-`` for the clients' personalised models); None when the
        row has none of them."""
        key = prefix + self.score_metric
        if prefix:
            return f"personal {self.score_metric} {row[key]:.4f}" if key in row else None
        if row.get(key) is None:
            return None
        return f"{self.score_metric} {row[key]:.4f} loss {row['loss']:.4f}"

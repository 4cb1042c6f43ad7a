"""Text classification: one or two text columns and an integer label.

The model is ``AutoModelForSequenceClassification`` with ``num_labels`` outputs (a seeded,
freshly initialised head); the features are the tokenised texts padded to
``max-seq-length`` with ``labels``; the loss is the model's cross-entropy; evaluation
reports ``accuracy`` and the mean cross-entropy ``loss``, and ``score`` = accuracy. A
Dirichlet partition skews over the labels.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from flower_app.task_kinds.base import SplitView, TaskKind

if TYPE_CHECKING:
    import datasets
    import torch
    from torch import nn

    from flower_app.data.tasks import TaskSpec
    from flower_app.settings.config import RunConfig


def load_classifier(
    name: str, num_labels: int, seed: int, pad_token_id: int | None, **from_pretrained: Any
) -> nn.Module:
    """The base model with a sequence-classification head; the head's init is seeded."""
    from transformers import AutoModelForSequenceClassification

    from flower_app.modeling import load_with_head

    return load_with_head(
        AutoModelForSequenceClassification,
        name,
        seed,
        pad_token_id,
        num_labels=num_labels,
        **from_pretrained,
    )


class Classification(TaskKind):
    name = "classification"
    score_metric = "accuracy"
    has_classes = True
    metric_names = ("accuracy",)

    def load_splits(
        self, spec: TaskSpec, *, max_train: int | None, max_eval: int | None, seed: int
    ) -> tuple[datasets.Dataset, datasets.Dataset, int]:
        from flower_app.data.loading import load_task_splits

        train, evaluation = load_task_splits(
            spec, max_train=max_train, max_eval=max_eval, seed=seed
        )
        return train, evaluation, train.features[spec.label_field].num_classes

    def load_test(self, spec: TaskSpec, max_test: int | None) -> datasets.Dataset:
        from flower_app.data.loading import load_task_test

        return load_task_test(spec, max_test)

    def partition_field(self, spec: TaskSpec) -> str:
        return spec.label_field

    def features(
        self, config: RunConfig, spec: TaskSpec, tokenizer: Any, examples: datasets.Dataset
    ) -> datasets.Dataset:
        from flower_app.data.tokenize import tokenize_dataset

        return tokenize_dataset(examples, tokenizer, spec, config.max_seq_length)

    def load_model(
        self,
        name: str,
        num_labels: int,
        seed: int,
        pad_token_id: int | None,
        **from_pretrained: Any,
    ) -> nn.Module:
        return load_classifier(name, num_labels, seed, pad_token_id, **from_pretrained)

    def evaluate(self, model: nn.Module, data: SplitView, device: torch.device) -> dict[str, float]:
        from flower_app.data.batching import make_loader
        from flower_app.training.loop import evaluate

        loader = make_loader(data.features(), data.config.eval_batch_size, shuffle=False, seed=0)
        result = evaluate(model, loader, device)
        return {
            "accuracy": result.accuracy,
            "loss": result.loss,
            "score": result.accuracy,
            "num-examples": result.num_examples,
        }

    def console(self, row: Mapping[str, Any], prefix: str = "") -> str | None:
        if prefix:
            key = f"{prefix}accuracy"
            return f"personal acc {row[key]:.4f}" if key in row else None
        if row.get("accuracy") is None:
            return None
        return f"acc {row['accuracy']:.4f} loss {row['loss']:.4f}"


KINDS = (Classification(),)

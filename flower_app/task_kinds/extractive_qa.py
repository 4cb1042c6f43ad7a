"""Extractive QA, SQuAD v1.1-style: (question, context) and the answers column
``{"text": [...], "answer_start": [...]}``; every question is answerable.

Examples are read, subset and partitioned by question (``flower_app.data.qa_loading``; a
question never straddles clients), IID or Dirichlet over the article-title buckets
(``title-bucket``). The features are question + context windows with start/end token
positions (``flower_app.data.qa_features``); the model is
``AutoModelForQuestionAnswering`` (a seeded span head ``qa_outputs``: start and end
logits); the loss is the model's mean start/end cross-entropy. Evaluation maps the logits
back to answer texts (``flower_app.task_kinds.qa_eval``) and reports ``exact-match`` and ``f1``
(percent, the official SQuAD v1.1 script over all gold answers), ``loss`` (over the
features), ``score`` = F1 / 100 and ``num-examples`` (questions, not windows).
"""

from __future__ import annotations

from collections.abc import Mapping
from functools import lru_cache
from typing import TYPE_CHECKING, Any

from flower_app.task_kinds.base import SplitView, TaskKind

if TYPE_CHECKING:
    import datasets
    import torch
    from torch import nn

    from flower_app.data.tasks import TaskSpec
    from flower_app.settings.config import RunConfig
    from flower_app.task_kinds.qa_eval import QAEvalSet


def load_question_answerer(
    name: str, seed: int, pad_token_id: int | None, **from_pretrained: Any
) -> nn.Module:
    """The base model with an extractive-QA span head (``qa_outputs``: start and end logits,
    hence ``num_labels=2`` whatever the checkpoint's config says); the head's init is seeded."""
    from transformers import AutoModelForQuestionAnswering

    from flower_app.modeling import load_with_head

    try:
        return load_with_head(
            AutoModelForQuestionAnswering, name, seed, pad_token_id, num_labels=2, **from_pretrained
        )
    except ValueError as err:  # an architecture without a QA head
        raise ValueError(f"model {name!r} has no question-answering head: {err}") from err


def qa_features(
    config: RunConfig, tokenizer: Any, examples: datasets.Dataset, keep_mapping: bool
) -> datasets.Dataset:
    """The windows of ``examples`` (``flower_app.data.qa_features``); a slow tokenizer or a
    stride that leaves no new context raises ConfigError naming the setting."""
    from flower_app.data import qa_features as features
    from flower_app.settings.config import ConfigError

    try:
        features.check_window(tokenizer, config.max_seq_length, config.doc_stride)
    except ValueError as err:
        key = "model" if "fast tokenizer" in str(err) else "doc-stride"
        raise ConfigError(f"{key}: {err}") from err
    return features.qa_features(
        examples, tokenizer, config.max_seq_length, config.doc_stride, keep_mapping=keep_mapping
    )


@lru_cache(maxsize=8)
def qa_eval_set(data: SplitView) -> QAEvalSet:
    """The examples of ``data`` with their features and the mapping post-processing needs."""
    import numpy as np

    from flower_app.cache.tokenizer import cached_tokenizer
    from flower_app.data.qa_features import CONTEXT_OFFSETS, EXAMPLE_INDEX
    from flower_app.data.tokenize import MODEL_INPUTS
    from flower_app.task_kinds.qa_eval import QAEvalSet

    config = data.config
    examples = data.examples()
    features = qa_features(config, cached_tokenizer(config.model), examples, keep_mapping=True)
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


class ExtractiveQA(TaskKind):
    name = "extractive-qa"
    # DP-SGD's unit would be a window, not a question: a long context becomes several
    # training windows (qa_features.py), which DP-SGD would sample, clip and count one by
    # one, so a question of k windows would have group privacy k.
    example_dp_refusal = (
        "its training examples are context windows, several for a long context, so DP-SGD "
        "would sample, clip and count windows and one question of k windows would be "
        "protected only k times less (group privacy); DP-SGD per question is not built"
    )
    score_metric = "f1"
    metric_names = ("exact-match", "f1")

    def check_spec(self, spec: TaskSpec) -> None:
        if len(spec.text_fields) != 2:
            raise ValueError(f"{spec.name}: extractive QA needs text-fields=question,context")

    def load_splits(
        self, spec: TaskSpec, *, max_train: int | None, max_eval: int | None, seed: int
    ) -> tuple[datasets.Dataset, datasets.Dataset, int]:
        from flower_app.data.qa_loading import load_qa_splits

        train, evaluation = load_qa_splits(spec, max_train=max_train, max_eval=max_eval, seed=seed)
        return train, evaluation, 2  # the span head's start and end logits

    def load_test(self, spec: TaskSpec, max_test: int | None) -> datasets.Dataset:
        raise ValueError("extractive-QA tasks have no test split yet")

    def partition_field(self, spec: TaskSpec) -> str:
        from flower_app.data.qa_loading import TITLE_BUCKET

        return TITLE_BUCKET

    def features(
        self, config: RunConfig, spec: TaskSpec, tokenizer: Any, examples: datasets.Dataset
    ) -> datasets.Dataset:
        return qa_features(config, tokenizer, examples, keep_mapping=False).with_format("torch")

    def load_model(
        self,
        name: str,
        num_labels: int,
        seed: int,
        pad_token_id: int | None,
        **from_pretrained: Any,
    ) -> nn.Module:
        return load_question_answerer(name, seed, pad_token_id, **from_pretrained)

    def evaluate(self, model: nn.Module, data: SplitView, device: torch.device) -> dict[str, float]:
        from flower_app.data.batching import make_loader
        from flower_app.settings.config import ConfigError
        from flower_app.task_kinds.qa_eval import evaluate_qa

        if data.split != "eval":
            raise ConfigError(
                f"extractive-QA tasks are evaluated on 'eval' only, not {data.split!r}"
            )
        eval_set = qa_eval_set(data)
        loader = make_loader(eval_set.features, data.config.eval_batch_size, shuffle=False, seed=0)
        qa = evaluate_qa(model, eval_set, loader, device)
        return {
            "exact-match": qa.exact_match,
            "f1": qa.f1,
            "loss": qa.loss,
            "score": qa.f1 / 100.0,
            "num-examples": qa.num_examples,
        }

    def console(self, row: Mapping[str, Any], prefix: str = "") -> str | None:
        if prefix:
            key = f"{prefix}f1"
            return f"personal F1 {row[key]:.2f}" if key in row else None
        if row.get("f1") is None:
            return None
        return f"EM {row['exact-match']:.2f} F1 {row['f1']:.2f} loss {row['loss']:.4f}"


KINDS = (ExtractiveQA(),)

"""Causal-LM fine-tuning (instruction tuning, as FlowerTune does): (prompt, response) examples,
the loss on the response tokens only, generative scores (docs/usage.md, "Causal-LM fine-tuning").

The model is ``AutoModelForCausalLM`` with no task head; its adapters go on ``q_proj,v_proj``
when ``target-modules`` is left at its default (``default_target_modules``). The examples and
features are ``flower_app.data.sft``'s (the source format follows from the task's columns;
``prompt-format``, ``prompt-template``). Evaluation (``flower_app.task_kinds.sft_eval``):
``response-loss`` (= ``loss``) and ``perplexity``, and, where the examples have short gold
answers, greedy generation scored by ``gen-exact-match`` and ``gen-f1``; ``score`` is
``gen-f1`` / 100 where there is generation, else -``response-loss``."""

from __future__ import annotations

from functools import lru_cache
from typing import TYPE_CHECKING, Any

from flower_app.task_kinds.base import SplitView, TaskKind

if TYPE_CHECKING:
    import datasets
    import torch
    from torch import nn

    from flower_app.data.tasks import TaskSpec
    from flower_app.settings.config import RunConfig

SQUAD, LABELS, INSTRUCTIONS = "squad", "labels", "instructions"


def source_format(spec: TaskSpec) -> str:
    """Which rows a causal-LM task has (module docstring)."""
    if spec.label_field == "answers":
        return SQUAD
    if spec.label_field == "label":
        return LABELS
    return INSTRUCTIONS


def load_causal_lm(
    name: str, seed: int, pad_token_id: int | None, **from_pretrained: Any
) -> nn.Module:
    """The base model as ``AutoModelForCausalLM`` (float32; nothing newly initialised)."""
    from transformers import AutoModelForCausalLM

    from flower_app.modeling import load_with_head

    try:
        return load_with_head(AutoModelForCausalLM, name, seed, pad_token_id, **from_pretrained)
    except ValueError as err:  # an encoder without a language-modelling head
        raise ValueError(f"model {name!r} is no causal language model: {err}") from err


def _sft(spec: TaskSpec, ds: datasets.Dataset) -> datasets.Dataset:
    from flower_app.data import sft
    from flower_app.data.qa_loading import TITLE_BUCKET

    fmt = source_format(spec)
    if fmt == SQUAD:
        return sft.from_squad(ds, TITLE_BUCKET)
    if fmt == LABELS:
        return sft.from_classification(ds, spec.text_fields, spec.label_field)
    return sft.from_instructions(ds, spec.text_fields, spec.label_field, spec.prompt_format)


def _instruction_splits(
    spec: TaskSpec, max_train: int | None, max_eval: int | None, seed: int
) -> tuple[datasets.Dataset, datasets.Dataset]:
    from flower_app.data.loading import _load_raw, _subset, require_splits, with_eval_split

    raw = _load_raw(spec)
    require_splits(spec, raw, spec.train_split, spec.eval_split)
    evaluation = raw[spec.eval_split] if spec.eval_split is not None else None
    train, evaluation = with_eval_split(spec, raw[spec.train_split], evaluation)
    return _subset(train, max_train, seed), _subset(evaluation, max_eval, seed)


@lru_cache(maxsize=8)
def _eval_prompts(
    data: SplitView,
) -> tuple[tuple[tuple[int, ...], ...], tuple[tuple[str, ...], ...]]:
    """The tokenised prompts and gold answers of the examples of ``data`` that have any."""
    from flower_app.cache.tokenizer import cached_tokenizer
    from flower_app.data import sft

    config = data.config
    tokenizer = cached_tokenizer(config.model)
    examples = data.examples()
    prompts, golds = [], []
    room = max(1, config.max_seq_length - config.max_new_tokens)
    for prompt, answers in zip(examples[sft.PROMPT], examples[sft.ANSWERS], strict=True):
        if answers:
            ids = sft.prompt_ids(tokenizer, prompt, config.prompt_template)
            prompts.append(tuple(ids[-room:]))
            golds.append(tuple(answers))
    return tuple(prompts), tuple(golds)


class CausalLM(TaskKind):
    name = "causal-lm"
    score_metric = "gen-f1"
    metric_names = ("response-loss", "perplexity", "gen-exact-match", "gen-f1")
    default_target_modules = "q_proj,v_proj"
    example_dp_refusal = (
        "the causal-LM loss is the mean over all response tokens of the batch, so one "
        "example's gradient is scaled by the other examples' lengths, and Opacus' per-example "
        "gradients (the batch's mean loss times its size) are not each example's own"
    )

    def check_spec(self, spec: TaskSpec) -> None:
        if source_format(spec) == SQUAD and len(spec.text_fields) != 2:
            raise ValueError(f"{spec.name}: SQuAD-style data needs text-fields=question,context")

    def load_splits(
        self, spec: TaskSpec, *, max_train: int | None, max_eval: int | None, seed: int
    ) -> tuple[datasets.Dataset, datasets.Dataset, int]:
        fmt = source_format(spec)
        if fmt == SQUAD:
            from flower_app.data.qa_loading import load_qa_splits

            train, evaluation = load_qa_splits(
                spec, max_train=max_train, max_eval=max_eval, seed=seed
            )
        elif fmt == LABELS:
            from flower_app.data.loading import load_task_splits

            train, evaluation = load_task_splits(
                spec, max_train=max_train, max_eval=max_eval, seed=seed
            )
        else:
            train, evaluation = _instruction_splits(spec, max_train, max_eval, seed)
        return _sft(spec, train), _sft(spec, evaluation), 0  # no head: num_labels is unused

    def load_test(self, spec: TaskSpec, max_test: int | None) -> datasets.Dataset:
        fmt = source_format(spec)
        if fmt == SQUAD:
            from flower_app.data.qa_loading import load_qa_test

            return _sft(spec, load_qa_test(spec, max_test))
        if fmt == LABELS:
            from flower_app.data.loading import load_task_test

            return _sft(spec, load_task_test(spec, max_test))
        raise ValueError(
            f"{spec.name}: instruction data has no scored test split here (its answers are "
            "long); use a SQuAD-style or labelled task for held-out test scores"
        )

    def partition_field(self, spec: TaskSpec) -> str:
        from flower_app.data.sft import BUCKET

        return BUCKET

    def features(
        self, config: RunConfig, spec: TaskSpec, tokenizer: Any, examples: datasets.Dataset
    ) -> datasets.Dataset:
        from flower_app.data.sft import sft_features
        from flower_app.settings.config import ConfigError

        try:
            return sft_features(examples, tokenizer, config.max_seq_length, config.prompt_template)
        except ValueError as err:
            key = "prompt-template" if "template" in str(err) else "model"
            raise ConfigError(f"{key}: {err}") from err

    def load_model(
        self,
        name: str,
        num_labels: int,
        seed: int,
        pad_token_id: int | None,
        **from_pretrained: Any,
    ) -> nn.Module:
        return load_causal_lm(name, seed, pad_token_id, **from_pretrained)

    def evaluate(self, model: nn.Module, data: SplitView, device: torch.device) -> dict[str, float]:
        import math

        from flower_app.cache.tokenizer import cached_tokenizer
        from flower_app.data.batching import make_loader
        from flower_app.task_kinds.sft_eval import (
            generate_answers,
            generation_scores,
            response_loss,
        )

        config = data.config
        loader = make_loader(data.features(), config.eval_batch_size, shuffle=False, seed=0)
        loss, _ = response_loss(model, loader, device)
        metrics = {
            "response-loss": loss,
            "perplexity": math.exp(min(loss, 700.0)) if math.isfinite(loss) else math.nan,
            "loss": loss,
        }
        prompts, golds = _eval_prompts(data)
        if prompts:
            answers = generate_answers(
                model,
                prompts,
                cached_tokenizer(config.model),
                device,
                max_new_tokens=config.max_new_tokens,
                batch_size=config.eval_batch_size,
            )
            metrics |= generation_scores(answers, golds)
            metrics["score"] = metrics["gen-f1"] / 100.0
        else:
            metrics["score"] = -loss
        metrics["num-examples"] = len(data.examples())
        return metrics

    def console(self, row: Any, prefix: str = "") -> str | None:
        key = prefix + "response-loss"
        if prefix:
            if prefix + "gen-f1" in row:
                return f"personal gen-F1 {row[prefix + 'gen-f1']:.2f}"
            return f"personal response loss {row[key]:.4f}" if key in row else None
        if row.get(key) is None:
            return None
        words = f"response loss {row[key]:.4f} ppl {row['perplexity']:.2f}"
        if row.get("gen-f1") is not None:
            words += f" gen EM {row['gen-exact-match']:.2f} F1 {row['gen-f1']:.2f}"
        return words


KINDS = (CausalLM(),)

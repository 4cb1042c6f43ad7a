"""Per-process caches: one tokenizer and one adapted model per run, built once and reused.

A Flower simulation keeps its ClientApp workers alive between rounds, so a worker
loads the model and tokenises its partition once; every round then only loads the
received global arrays into the cached model.
"""

from __future__ import annotations

from dataclasses import replace
from functools import lru_cache

from flower_app.adapted import AdaptedModel
from flower_app.adapters.targets import AdapterSettingError
from flower_app.cache.disk import disk_cached_model
from flower_app.cache.tokenizer import cached_tokenizer
from flower_app.modeling import pick_device
from flower_app.settings.config import MODEL, ConfigError, RunConfig
from flower_app.task_kinds import get_kind
from flower_app.training.precision import (
    check_precision_supported,
    check_quantization_supported,
    from_pretrained_kwargs,
    keep_trainable_float32,
    prepare_base_model,
)

__all__ = ["cached_adapted_model", "cached_tokenizer"]


@lru_cache(maxsize=2)
@disk_cached_model(groups=(MODEL,))  # a SuperNode starts a fresh ClientApp process per message
def cached_adapted_model(
    config: RunConfig, num_labels: int, kind: str = "classification"
) -> AdaptedModel:
    """The base model with the head of the task ``kind`` (its ``load_model``,
    flower_app/task_kinds/) and the run's adapter (on the kind's ``default_target_modules``
    when ``target-modules`` is left at its default); bad adapter settings raise ConfigError."""
    task_kind = get_kind(kind)
    config = replace(config, target_modules=task_kind.target_modules(config))
    tokenizer = cached_tokenizer(config.model)
    device = pick_device(config.device)
    # The precision settings (flower_app/training/precision.py): refused before loading where this
    # machine cannot serve them; the frozen base in the dtype of `precision` (or quantised),
    # checkpointed if asked; what trains (adapter, head) kept float32.
    check_quantization_supported(config.quantization, device)
    check_precision_supported(config.precision, device)
    load_kwargs = (
        from_pretrained_kwargs(config.precision, config.quantization)
        if (config.precision, config.quantization) != ("fp32", "none")
        else {}
    )
    try:
        model = task_kind.load_model(
            config.model, num_labels, config.seed, tokenizer.pad_token_id, **load_kwargs
        )
        model = prepare_base_model(
            model, config.precision, config.quantization, config.gradient_checkpointing
        )
    except ValueError as err:
        raise ConfigError(f"model: {err}") from err
    try:
        adapted = AdaptedModel(model, config)
        keep_trainable_float32(adapted.model)
        return adapted
    except AdapterSettingError as err:  # the adapter names the setting at fault
        raise ConfigError(f"{err.key}: {err}") from err

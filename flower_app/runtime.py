"""Per-process caches: one tokenizer and one adapted model per run, built once and reused.

A Flower simulation keeps its ClientApp workers alive between rounds, so a worker
loads the model and tokenises its partition once; every round then only loads the
received global arrays into the cached model.
"""

from __future__ import annotations

from dataclasses import replace
from functools import lru_cache

from flower_app.adapted import AdaptedModel
from flower_app.config import DEFAULTS, MODEL, ConfigError, RunConfig
from flower_app.disk_cache import disk_cached_model
from flower_app.task_kinds import get_kind
from flower_app.tokenizer import cached_tokenizer

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
    if task_kind.default_target_modules and config.target_modules == DEFAULTS["target-modules"]:
        config = replace(config, target_modules=task_kind.default_target_modules)
    tokenizer = cached_tokenizer(config.model)
    try:
        model = task_kind.load_model(config.model, num_labels, config.seed, tokenizer.pad_token_id)
    except ValueError as err:
        raise ConfigError(f"model: {err}") from err
    try:
        return AdaptedModel(model, config)
    except ValueError as err:
        message = str(err)
        key = "rank" if "exceeds k" in message or "r must" in message else "target-modules"
        if "head_modules" in message:
            key = "head-modules"
        raise ConfigError(f"{key}: {message}") from err

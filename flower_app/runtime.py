"""Per-process caches: one tokenizer and one adapted model per run, built once and reused.

A Flower simulation keeps its ClientApp workers alive between rounds, so a worker
loads the model and tokenises its partition once; every round then only loads the
received global arrays into the cached model.
"""

from __future__ import annotations

from functools import lru_cache

from flower_app.adapted import AdaptedModel
from flower_app.config import ConfigError, RunConfig
from flower_app.modeling import load_classifier, load_tokenizer


@lru_cache(maxsize=4)
def cached_tokenizer(model_name: str):
    return load_tokenizer(model_name)


@lru_cache(maxsize=2)
def cached_adapted_model(config: RunConfig, num_labels: int) -> AdaptedModel:
    """The base model with the run's adapter; bad adapter settings raise ConfigError."""
    tokenizer = cached_tokenizer(config.model)
    model = load_classifier(config.model, num_labels, config.seed, tokenizer.pad_token_id)
    try:
        return AdaptedModel(model, config)
    except ValueError as err:
        message = str(err)
        key = "rank" if "exceeds k" in message or "r must" in message else "target-modules"
        if "head_modules" in message:
            key = "head-modules"
        raise ConfigError(f"{key}: {message}") from err

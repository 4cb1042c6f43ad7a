"""Loading the base model and tokenizer: a Hub name, a local folder, or a registered asset."""

from __future__ import annotations

import os
from pathlib import Path

import torch
from torch import nn


def resolve_model_source(name: str) -> str:
    """A local folder as is; a name registered by ``python -m flower_app.assets fetch``;
    otherwise the name is passed to transformers as a Hub id."""
    if Path(name).expanduser().is_dir():
        return str(Path(name).expanduser())
    from flower_app.assets import load_registry

    try:
        models = load_registry().get("models", {})
    except Exception:  # no registry yet: fall through to the Hub
        models = {}
    if name in models:
        return str(models[name]["path"] if isinstance(models[name], dict) else models[name])
    return name


def load_tokenizer(name: str):
    from transformers import AutoTokenizer

    source = resolve_model_source(name)
    try:
        tokenizer = AutoTokenizer.from_pretrained(source)
    except OSError as err:
        raise OSError(_not_found(name, source, err)) from err
    if tokenizer.pad_token is None:  # decoder LLMs (Llama, OPT...) ship without one
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def load_classifier(name: str, num_labels: int, seed: int, pad_token_id: int | None) -> nn.Module:
    """The base model with a sequence-classification head; the head's init is seeded."""
    from transformers import AutoModelForSequenceClassification
    from transformers.utils import logging as hf_logging

    source = resolve_model_source(name)
    torch.manual_seed(seed)
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # the "newly initialized head" notice is expected here
    hf_logging.disable_progress_bar()
    try:
        model = AutoModelForSequenceClassification.from_pretrained(
            source, num_labels=num_labels, torch_dtype=torch.float32
        )
    except OSError as err:
        raise OSError(_not_found(name, source, err)) from err
    finally:
        hf_logging.set_verbosity(verbosity)
    if model.config.pad_token_id is None and pad_token_id is not None:
        model.config.pad_token_id = pad_token_id
    return model


def pick_device(setting: str) -> torch.device:
    if setting == "cuda" or (setting == "auto" and torch.cuda.is_available()):
        return torch.device("cuda")
    return torch.device("cpu")


def _not_found(name: str, source: str, err: Exception) -> str:
    offline = os.environ.get("HF_HUB_OFFLINE") == "1"
    return (
        f"model {name!r} could not be loaded from {source!r}: {err}. "
        "Pass a local folder, a Hub name"
        + (" (the Hub is disabled: HF_HUB_OFFLINE=1)" if offline else "")
        + ", or run `python -m flower_app.assets fetch` to register the offline models."
    )

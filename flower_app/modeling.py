"""Loading the base model and tokenizer: a Hub name, a local folder, or a registered asset."""

from __future__ import annotations

import os
from pathlib import Path

import torch
from torch import nn


def resolve_model_source(name: str) -> str:
    """A local folder as is; a name registered by ``python -m florg_tools.assets fetch``;
    otherwise the name is passed to transformers as a Hub id."""
    if Path(name).expanduser().is_dir():
        return str(Path(name).expanduser())
    from flower_app.cache.assets import load_registry

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


def load_with_head(
    auto_class, name: str, seed: int, pad_token_id: int | None, **kwargs: object
) -> nn.Module:
    """``auto_class.from_pretrained`` with a seeded, freshly initialised head (each task
    kind's ``load_model``, flower_app/task_kinds/, names its class and head); in float32
    unless ``kwargs`` say otherwise (``dtype``, ``quantization_config``: the run's
    ``precision`` and ``quantization``,
    ``flower_app.training.precision.from_pretrained_kwargs``)."""
    from transformers.utils import logging as hf_logging

    source = resolve_model_source(name)
    torch.manual_seed(seed)
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # the "newly initialized head" notice is expected here
    hf_logging.disable_progress_bar()
    try:
        kwargs.setdefault("dtype", torch.float32)
        model = auto_class.from_pretrained(source, **kwargs)
    except OSError as err:
        raise OSError(_not_found(name, source, err)) from err
    finally:
        hf_logging.set_verbosity(verbosity)
    if model.config.pad_token_id is None and pad_token_id is not None:
        model.config.pad_token_id = pad_token_id
    return model


def pick_device(setting: str) -> torch.device:
    """The torch device for the run-config key ``device``.

    ``auto``: CUDA when this process sees a GPU, else the CPU; ``cuda`` insists on a GPU
    and raises ``RuntimeError`` (saying why) when there is none; ``cpu``: the CPU. In the
    simulation every ClientApp runs in a Ray actor that sees only the GPUs Ray gave it:
    with ``client-resources`` ``num-gpus = 0`` Ray 2.x sets ``CUDA_VISIBLE_DEVICES=""``
    for the actor, so ``auto`` trains on the CPU even on a GPU machine; ``num-gpus > 0``
    (0.25 packs four ClientApps on one GPU) exposes its GPU as ``cuda:0``.
    """
    if setting == "cpu":
        return torch.device("cpu")
    if setting not in ("auto", "cuda"):
        raise ValueError(f"device must be 'auto', 'cpu' or 'cuda', got {setting!r}")
    if torch.cuda.is_available():
        return torch.device("cuda")
    if setting == "cuda":
        if torch.version.cuda is None:
            why = f"this torch build ({torch.__version__}) has no CUDA support"
        else:
            visible = os.environ.get("CUDA_VISIBLE_DEVICES")
            why = "no CUDA device is visible to this process" + (
                f" (CUDA_VISIBLE_DEVICES={visible!r}; in the simulation set the "
                "connection's client-resources num-gpus > 0)"
                if visible is not None
                else ""
            )
        raise RuntimeError(f"device='cuda' but {why}; use device='auto' or 'cpu'")
    return torch.device("cpu")


def _not_found(name: str, source: str, err: Exception) -> str:
    offline = os.environ.get("HF_HUB_OFFLINE") == "1"
    return (
        f"model {name!r} could not be loaded from {source!r}: {err}. "
        "Pass a local folder, a Hub name"
        + (" (the Hub is disabled: HF_HUB_OFFLINE=1)" if offline else "")
        + ", or run `python -m florg_tools.assets fetch` to register the offline models."
    )

"""The template comparison's run-time patch of flowertune-llm, put on the template's PYTHONPATH.

Python imports ``sitecustomize`` at every interpreter's start; this one installs an import
hook that edits two of the template's modules just after they run, in memory (the checkout
is not touched, nothing of it is copied here):

- ``flowertune_llm.models``, with ``TEMPLATE_COMPARISON_BASE=float32``: the base loads in
  float32 without bitsandbytes (its ``from_pretrained`` gets no quantization config), and
  its LoRA dropout is 0 (this app's), so both apps train the same numerics;
- ``flowertune_llm.client_app``, with ``TEMPLATE_COMPARISON_SEED=N``: its Trainer's seed
  (data order, initialisation) is N instead of the fixed 42, so repetitions vary as this
  app's seeds do.

Each patched load and seed is appended as a JSON line to ``TEMPLATE_COMPARISON_MARKER``:
the benchmark refuses a run whose template did not load its base as asked.
"""

from __future__ import annotations

import importlib.abc
import json
import os
import sys
from typing import Any

MODELS = "flowertune_llm.models"
CLIENT_APP = "flowertune_llm.client_app"


def _mark(**event: Any) -> None:
    """One line of what the patch did, for the benchmark to check."""
    path = os.environ.get("TEMPLATE_COMPARISON_MARKER")
    if path:
        with open(path, "a", encoding="utf-8") as out:
            out.write(json.dumps(event) + "\n")


def _patch_models(module: Any) -> None:
    """The base in float32 without quantization, the LoRA dropout 0."""
    import torch

    if os.environ.get("TEMPLATE_COMPARISON_BASE") != "float32":
        return
    real_loader, real_lora_config = module.AutoModelForCausalLM, module.LoraConfig

    class Float32Base:
        @staticmethod
        def from_pretrained(name: str, *args: Any, **kwargs: Any) -> Any:
            kwargs.pop("quantization_config", None)
            kwargs["torch_dtype"] = torch.float32
            model = real_loader.from_pretrained(name, *args, **kwargs)
            quantized = bool(getattr(model, "is_loaded_in_4bit", False)) or bool(
                getattr(model, "is_loaded_in_8bit", False)
            )
            _mark(event="base", dtype=str(model.dtype), quantized=quantized)
            return model

    def lora_config(*args: Any, **kwargs: Any) -> Any:
        kwargs["lora_dropout"] = 0.0
        return real_lora_config(*args, **kwargs)

    module.AutoModelForCausalLM = Float32Base
    module.LoraConfig = lora_config


def _patch_client_app(module: Any) -> None:
    """The Trainer's seed from the environment."""
    seed = os.environ.get("TEMPLATE_COMPARISON_SEED")
    if seed is None:
        return
    real_arguments = module.TrainingArguments

    def training_arguments(*args: Any, **kwargs: Any) -> Any:
        kwargs["seed"] = int(seed)
        _mark(event="seed", seed=int(seed))
        return real_arguments(*args, **kwargs)

    module.TrainingArguments = training_arguments


PATCHES = {MODELS: _patch_models, CLIENT_APP: _patch_client_app}


class _PatchAfterImport(importlib.abc.MetaPathFinder):
    """Finds the patched modules through the other finders and wraps their loader's
    ``exec_module``: the module runs as it is, then its patch."""

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        patch = PATCHES.get(fullname)
        if patch is None:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None and spec.loader is not None:
                run_module = spec.loader.exec_module

                def exec_module(module: Any, run_module: Any = run_module) -> None:
                    run_module(module)
                    patch(module)

                spec.loader.exec_module = exec_module  # type: ignore[method-assign]
                return spec
        return None


if __name__ == "sitecustomize":  # Python's start-up import; as benchmarks.overhead...: nothing
    sys.meta_path.insert(0, _PatchAfterImport())

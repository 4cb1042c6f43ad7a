"""What a run refers to by name, checked once before anything starts: by the launcher before it
starts a SuperLink and by the ServerApp before it makes the run folder (``resolve_config`` runs
everywhere and reads no file). Each failure is a one-line ``ConfigError`` naming the key:
``task`` (a known task whose data is fetched, local data that exists, or a Hub data set cached
here or with the Hub reachable, ``flower_app.preflight.hub``), ``model`` (a local folder, a name
registered by ``florg assets fetch``, or a Hub name), ``dp=example`` with a task kind DP-SGD
cannot train (``TaskKind.example_dp_refusal``) and ``target-modules`` (every name a module of
the model, built from its config on the meta device, where that config is on this machine)."""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from flower_app.settings.config import ConfigError, RunConfig, resolve_config

# A Hugging Face Hub repo id: a name, or an owner and a name, of word characters, '-' and
# '.', without '--' or '..' (huggingface_hub's own rule).
_HUB_ID = re.compile(r"^(?!.*(--|\.\.))[\w][\w.-]{0,95}(/[\w][\w.-]{0,95})?$")


def check_run(run_config: Mapping[str, Any]) -> RunConfig:
    """``resolve_config`` plus ``check_names``: the launcher's validation of a run."""
    config = resolve_config(run_config)
    check_names(config)
    return config


def check_names(config: RunConfig) -> None:
    """ConfigError naming the key when the task, the data, the model or an adapted module
    the run names does not exist (see the module docstring)."""
    from flower_app.task_data import task_spec

    try:
        spec = task_spec(config)
    except FileNotFoundError as err:  # local data, or a known task's data not fetched
        key = "data-path" if config.data_path else "task"
        raise ConfigError(f"{key}: {err}") from None
    if spec.hub_path is not None:
        from flower_app.preflight.hub import hub_problem

        problem = hub_problem(spec.hub_path, "dataset")
        if problem is not None:
            raise ConfigError(f"task: {problem}; or give a local copy as data-path")
    if config.dp == "example":
        from flower_app.task_kinds import get_kind

        kind = get_kind(spec.kind)
        if kind.example_dp_refusal:
            raise ConfigError(
                f"dp: dp=example refused for task kind {kind.name!r}: {kind.example_dp_refusal}"
            )
    source = check_model(config.model)
    if source is not None:
        check_module_names(config, source, spec.kind)


def check_model(name: str) -> Path | None:
    """The local folder holding ``name``'s config (a folder, or a fetched model), None for
    a Hub name; ConfigError for anything else."""
    from flower_app.modeling import resolve_model_source

    source = Path(resolve_model_source(name)).expanduser()
    if source.is_dir():
        if not (source / "config.json").is_file():
            raise ConfigError(f"model: {str(source)!r} is a folder without a config.json")
        return source
    if not _HUB_ID.match(name):
        raise ConfigError(
            f"model: {name!r} is not a local folder, a model registered by `florg assets "
            "fetch`, or a Hub name (name or org/name)"
        )
    return None


def check_module_names(config: RunConfig, source: Path, kind: str) -> None:
    """Every adapted module name (``target-modules``, or the task kind's own) matches a
    linear layer of the model built from ``source``'s config on the meta device (no
    weights read; the base model, whose layer names the task's model shares)."""
    import torch
    from torch import nn
    from transformers import AutoConfig, AutoModel

    from flower_app.task_kinds import get_kind

    targets = [t.strip() for t in get_kind(kind).target_modules(config).split(",") if t.strip()]
    with torch.device("meta"):
        model = AutoModel.from_config(AutoConfig.from_pretrained(source))
    linear = [n for n, m in model.named_modules() if isinstance(m, nn.Linear)]
    unmatched = [t for t in targets if not any(n == t or n.endswith("." + t) for n in linear)]
    if unmatched:
        leaves = sorted({n.rsplit(".", 1)[-1] for n in linear})
        raise ConfigError(
            f"target-modules: {unmatched} match no linear layer of {config.model!r}; its "
            f"linear layers are named {leaves}"
        )

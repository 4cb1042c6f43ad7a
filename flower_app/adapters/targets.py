"""Finding the modules an adapter targets and the task head, on any Hugging Face model."""

from __future__ import annotations

import re
from collections.abc import Sequence

from torch import nn

# Task heads of transformers' *ForSequenceClassification / *ForQuestionAnswering models.
HEAD_CANDIDATES: tuple[str, ...] = ("classifier", "score", "qa_outputs")


class AdapterSettingError(ValueError):
    """A bad adapter setting, with the run-config ``key`` it comes from (``rank``,
    ``alpha``, ``target-modules``, ``head-modules``), so that the caller names the key
    without reading the message."""

    def __init__(self, key: str, message: str) -> None:
        super().__init__(message)
        self.key = key


def check_rank_and_alpha(r: int, alpha: float) -> None:
    """The settings every adapter shares: a positive integer rank and alpha > 0 (s = alpha / r)."""
    if int(r) != r or r < 1:
        raise AdapterSettingError("rank", f"r must be a positive integer, got {r!r}")
    if not alpha > 0:
        raise AdapterSettingError("alpha", f"alpha must be > 0, got {alpha!r}")


def _matches(name: str, targets: str | Sequence[str]) -> bool:
    """PEFT's rule: a string is a full-match regex; a list matches the name or its suffix."""
    if isinstance(targets, str):
        return re.fullmatch(targets, name) is not None
    return any(name == t or name.endswith("." + t) for t in targets)


def find_target_linears(
    model: nn.Module, targets: str | Sequence[str], exclude: Sequence[str] = ()
) -> dict[str, nn.Linear]:
    """All nn.Linear modules whose qualified name matches ``targets`` (outside ``exclude``)."""
    if not targets:
        raise AdapterSettingError(
            "target-modules", "target_modules is empty: name at least one module (e.g. 'query')"
        )
    found: dict[str, nn.Linear] = {}
    matched_other: list[str] = []
    for name, module in model.named_modules():
        if any(name == e or name.startswith(e + ".") for e in exclude):
            continue
        if _matches(name, targets):
            if isinstance(module, nn.Linear):
                found[name] = module
            else:
                matched_other.append(f"{name} ({type(module).__name__})")
    if not found:
        leaves = sorted(
            {n.rsplit(".", 1)[-1] for n, m in model.named_modules() if isinstance(m, nn.Linear)}
        )
        extra = f"; matched non-Linear modules: {matched_other}" if matched_other else ""
        raise AdapterSettingError(
            "target-modules",
            f"target_modules {targets!r} match no nn.Linear in {type(model).__name__}; "
            f"its Linear module names end in {leaves}{extra}",
        )
    return found


def find_head_modules(model: nn.Module, head_modules: Sequence[str] | None) -> list[str]:
    """Qualified names of the task-head modules; ``None`` auto-detects transformers' heads."""
    names = dict(model.named_modules())
    if head_modules is None:
        heads = [n for n in names if n and n.rsplit(".", 1)[-1] in HEAD_CANDIDATES]
        return [n for n in heads if not any(n.startswith(h + ".") for h in heads)]
    missing = [h for h in head_modules if h not in names]
    if missing:
        raise AdapterSettingError(
            "head-modules", f"head_modules {missing} not found in {type(model).__name__}"
        )
    return list(head_modules)


def adapter_layout(
    model: nn.Module, target_modules: str | Sequence[str], head_modules: Sequence[str] | None
) -> tuple[dict[str, tuple[int, int]], int]:
    """(adapted layer name -> (d_out, d_in), number of head parameters) of an un-adapted model."""
    heads = find_head_modules(model, head_modules)
    linears = find_target_linears(model, target_modules, exclude=heads)
    shapes = {name: (int(m.out_features), int(m.in_features)) for name, m in linears.items()}
    modules = dict(model.named_modules())
    head_params = sum(p.numel() for h in heads for p in modules[h].parameters())
    return shapes, int(head_params)

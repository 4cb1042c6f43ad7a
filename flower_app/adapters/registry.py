"""The adapter-kind registry: every adapter a method's clients can train, by its name
(``Method.adapter``).

A kind is one folder beside this module: its ``kind.py`` (its parts and shapes, injection,
state and export, see ``base.py``, ending with ``KINDS = (...)``) with the layers and models
it injects, plus its line in ``KIND_MODULES`` below.
Everything else reads the registry: the method contract (``flower_app/methods/contract.py``:
a method's parts, what travels up, the communication count), the adapted model
(``flower_app/adapted.py``) and the rank settings (``flower_app/settings/client_ranks.py``).
"""

from __future__ import annotations

from importlib import import_module

from flower_app.adapters.base import AdapterKind, Part

__all__ = ["AdapterKind", "Part", "adapter_kind_names", "get_adapter_kind", "register_adapter_kind"]

_REGISTRY: dict[str, AdapterKind] = {}


def register_adapter_kind(kind: AdapterKind) -> AdapterKind:
    """Add ``kind`` under ``kind.name`` (a name can be registered once)."""
    if kind.name in _REGISTRY:
        raise ValueError(f"adapter kind {kind.name!r} is registered already")
    _REGISTRY[kind.name] = kind
    return kind


def adapter_kind_names() -> tuple[str, ...]:
    return tuple(_REGISTRY)


def get_adapter_kind(name: str) -> AdapterKind:
    """The registered kind ``name``; ValueError listing the known kinds otherwise."""
    try:
        return _REGISTRY[name]
    except KeyError:
        raise ValueError(
            f"unknown adapter kind {name!r}; choose one of {', '.join(_REGISTRY)}"
        ) from None


# The registry: one line per kind folder; each folder's kind.py KINDS are registered in order.
KIND_MODULES = (
    "florg",
    "lora",
    "lora_sb",
)
for _module in KIND_MODULES:
    for _kind in import_module(f"flower_app.adapters.{_module}.kind").KINDS:
        register_adapter_kind(_kind)

"""The method registry: every federated method this app runs, by its run-config name.

The core reads methods only through here: the run-config validation (the ``method``
setting's check, ``RegisteredMethod``), model building (``flower_app/adapted.py``), the
communication accounting (``communication.py``) and both apps (``build_strategy``). The
methods register themselves: ``strategies/registry.py`` imports each method folder and
calls ``register_method``; the ClientApp, the ServerApp and the tooling import it before
they resolve a run config. Nothing here imports ``strategies``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import numpy as np

from flower_app.methods.contract import Method

if TYPE_CHECKING:
    from flwr.serverapp.strategy import Strategy

    from flower_app.settings.run_settings import RunSettings

__all__ = [
    "Method",
    "RegisteredMethod",
    "build_strategy",
    "get_method",
    "method_names",
    "method_sources",
    "register_method",
]

_REGISTRY: dict[str, Method] = {}
# The modules that registered methods: the disk cache hashes their code (and what they
# import) into a cached model's key, since a method's hooks build the model.
_SOURCES: set[str] = set()
NOTHING_REGISTERED = (
    "no method is registered: import strategies.registry first (the ClientApp, the "
    "ServerApp and the florg tooling do)"
)


def register_method(method: Method, source: str) -> Method:
    """Add ``method`` under ``method.name``; ``source``: the module that registers it (a
    name can be registered once)."""
    if method.name in _REGISTRY:
        raise ValueError(f"method {method.name!r} is registered already")
    _REGISTRY[method.name] = method
    _SOURCES.add(source)
    return method


def method_names() -> tuple[str, ...]:
    return tuple(_REGISTRY)


def method_sources() -> tuple[str, ...]:
    """The modules that registered the methods, sorted."""
    return tuple(sorted(_SOURCES))


def get_method(name: str) -> Method:
    """The registered method ``name``; ValueError listing the known names otherwise."""
    try:
        return _REGISTRY[name]
    except KeyError:
        if not _REGISTRY:
            raise ValueError(f"unknown method {name!r}: {NOTHING_REGISTERED}") from None
        raise ValueError(f"unknown method {name!r}; choose one of {', '.join(_REGISTRY)}") from None


class RegisteredMethod:
    """The check of the ``method`` setting (flower_app/settings/config.py): a registered name."""

    __name__ = "registered_method"

    def __call__(self, x: str) -> bool:
        return x in _REGISTRY

    @property
    def options(self) -> tuple[str, ...]:
        return method_names()


def build_strategy(
    config: RunSettings, initial_state: Mapping[str, np.ndarray], **kwargs: Any
) -> Strategy:
    """The Flower strategy of the run ``config`` (a RunSettings): its method's
    ``build_strategy`` (keywords: ``fingerprint``, ``run_dir``)."""
    return get_method(config.method).build_strategy(config, initial_state, **kwargs)

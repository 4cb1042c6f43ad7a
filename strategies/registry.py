"""The method registry: every federated method this app runs, by its run-config name.

A method is one module in this folder (its client side, server side and communication,
see ``base.py``, ending with ``METHODS = (...)``) plus its line in ``METHOD_MODULES``
below. Everything else reads the registry: the run-config validation (the ``method``
setting's check, ``RegisteredMethod``, used by flower_app/config.py), model building
(``flower_app/adapted.py``), the strategy (``build_strategy``: the method builds it from
the run's settings), the communication accounting (``communication.py``) and both apps.
Nothing here imports flower_app.config (see ``base.py``).
"""

from __future__ import annotations

from collections.abc import Mapping
from importlib import import_module
from typing import TYPE_CHECKING, Any

import numpy as np

from strategies.method import Method, RunSettings

if TYPE_CHECKING:
    from strategies.common.strategy import AdapterStrategy

__all__ = [
    "Method",
    "RegisteredMethod",
    "build_strategy",
    "get_method",
    "method_names",
    "register_method",
]

_REGISTRY: dict[str, Method] = {}


def register_method(method: Method) -> Method:
    """Add ``method`` under ``method.name`` (a name can be registered once)."""
    if method.name in _REGISTRY:
        raise ValueError(f"method {method.name!r} is registered already")
    _REGISTRY[method.name] = method
    return method


def method_names() -> tuple[str, ...]:
    return tuple(_REGISTRY)


def get_method(name: str) -> Method:
    """The registered method ``name``; ValueError listing the known names otherwise."""
    try:
        return _REGISTRY[name]
    except KeyError:
        raise ValueError(f"unknown method {name!r}; choose one of {', '.join(_REGISTRY)}") from None


class RegisteredMethod:
    """The check of the ``method`` setting (flower_app/config.py): a registered name."""

    __name__ = "registered_method"

    def __call__(self, x: str) -> bool:
        return x in _REGISTRY

    @property
    def options(self) -> tuple[str, ...]:
        return method_names()


def build_strategy(
    config: RunSettings, initial_state: Mapping[str, np.ndarray], **kwargs: Any
) -> AdapterStrategy:
    """The Flower strategy of the run ``config`` (a RunConfig): its method's
    ``build_strategy`` (keywords: ``fingerprint``, ``run_dir``)."""
    return get_method(config.method).build_strategy(config, initial_state, **kwargs)


# The registry: one line per method folder (strategies/<folder>/); the METHODS of each
# folder's method.py are registered in order.
METHOD_FOLDERS = (
    "florg",  # florg, florg-no-procrustes
    "florg_signed",
    "fedit",
    "federa",
    "ffa_lora",
    "fedsa_lora",
    "fedex_lora",
    "hetlora",
    "flexlora",
    "rolora",
    "fedsvd",
    "flora",
    "fed_sb",
)
for _folder in METHOD_FOLDERS:
    for _method in import_module(f"strategies.{_folder}.method").METHODS:
        register_method(_method)

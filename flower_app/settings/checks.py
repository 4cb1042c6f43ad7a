"""The checks of run-setting values and the coercion of a raw value to a setting's type.

A check is a predicate on the coerced value; ``coerce`` names what a failing value must
be in the ``ConfigError`` it raises: the check's ``hint`` when it has one, else ``one of``
its ``options`` when it has those, else its name (``positive``, ``fraction``, ...).  The
checks are used by the declaration of every setting, ``RunConfig`` in flower_app/settings/config.py
(the ``method`` setting's, ``RegisteredMethod``, is the method registry's:
flower_app/methods/registry.py).
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from typing import Any


class ConfigError(ValueError):
    """A run setting that is unknown or has a bad value; the message names the key."""


def positive(x: float) -> bool:
    return x > 0


def non_negative(x: float) -> bool:
    return x >= 0


def positive_finite(x: float) -> bool:
    return x > 0 and math.isfinite(x)


positive_finite.hint = "finite and > 0"  # type: ignore[attr-defined]


def non_negative_finite(x: float) -> bool:
    return x >= 0 and math.isfinite(x)


non_negative_finite.hint = "finite and >= 0"  # type: ignore[attr-defined]


def fraction(x: float) -> bool:
    return 0 < x <= 1


def at_least_one(x: float) -> bool:
    return x >= 1


def at_least_one_finite(x: float) -> bool:
    return x >= 1 and math.isfinite(x)


at_least_one_finite.hint = "finite and >= 1"  # type: ignore[attr-defined]


def open_unit_interval(x: float) -> bool:
    return 0 < x < 1


open_unit_interval.hint = "strictly between 0 and 1"  # type: ignore[attr-defined]


def zero_or_below_one(x: float) -> bool:
    return 0 <= x < 1


zero_or_below_one.hint = "0 (the default rule) or strictly between 0 and 1"  # type: ignore[attr-defined]


# Grid run ids look like "method=florg,seed=0,task=snli" (lab/florg_lab/grid.py).
_FOLDER_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._=,+:@%~-]{0,254}")
FOLDER_NAME_HINT = (
    "a plain folder name: letters, digits and . _ = , + : @ % ~ -, starting with a letter "
    "or digit, at most 255 characters, no path separators or '..'"
)


def is_folder_name(x: str) -> bool:
    """A single, safe folder name (flower_app/paths.py confines where runs write)."""
    return bool(_FOLDER_NAME_RE.fullmatch(x)) and ".." not in x


def folder_name_or_empty(x: str) -> bool:
    return x == "" or is_folder_name(x)


folder_name_or_empty.hint = FOLDER_NAME_HINT  # type: ignore[attr-defined]


def empty(x: str) -> bool:
    return x == ""


empty.hint = (  # type: ignore[attr-defined]
    "'': a preset is a TOML layer resolved before the run starts: "
    "`flwr run . CONNECTION --run-config conf/NAME.toml`, or "
    "`python -m florg_tools.launch --preset NAME [--set key=value ...]`"
)


# The values of the settings ``precision`` and ``quantization`` (applied by
# flower_app/training/precision.py; here so that resolving settings does not import torch).
PRECISIONS: tuple[str, ...] = ("fp32", "bf16", "fp16")
QUANTIZATIONS: tuple[str, ...] = ("none", "4bit", "4bit-fp4", "8bit")


def rank_list(x: str) -> bool:
    """'' or a comma list of positive integers ('2,4,8')."""
    parts = [p.strip() for p in x.split(",")] if x.strip() else []
    return all(p.isdigit() and int(p) >= 1 for p in parts)


rank_list.hint = "'' or a comma list of positive integer ranks, e.g. '2,4,8'"  # type: ignore[attr-defined]


def partition_list(x: str) -> bool:
    """'' or a comma list of partition ids, integers >= 0 ('0,3,7')."""
    parts = [p.strip() for p in x.split(",")] if x.strip() else []
    return all(p.isdigit() for p in parts)


partition_list.hint = "'' or a comma list of partition ids (integers >= 0), e.g. '0,3,7'"  # type: ignore[attr-defined]


def one_of(*options: str) -> Callable[[str], bool]:
    def check(x: str) -> bool:
        return x in options

    check.options = options  # type: ignore[attr-defined]
    return check


def comma_list_of(*options: str) -> Callable[[str], bool]:
    """A comma list of one or more of ``options`` ('nan' or 'raise,nan')."""

    def check(x: str) -> bool:
        return all(part.strip() in options for part in x.split(","))

    check.options = options  # type: ignore[attr-defined]
    check.hint = f"one of {', '.join(options)}, or a comma list of them"  # type: ignore[attr-defined]
    return check


def coerce(key: str, value: Any, kind: type, check: Callable[[Any], bool] | None) -> Any:
    """``value`` as a ``kind`` (str, int, float or bool; 'true' / 'false' strings are
    bools, a float equal to an int is an int) that passes ``check``; ConfigError naming
    ``key`` otherwise."""
    try:
        if kind is bool:
            if isinstance(value, str) and value.lower() in ("true", "false"):
                value = value.lower() == "true"
            if not isinstance(value, bool):
                raise TypeError
        elif kind is int:
            if isinstance(value, bool) or float(value) != int(float(value)):
                raise TypeError
            value = int(float(value))
        elif kind is float:
            if isinstance(value, bool):
                raise TypeError
            value = float(value)
        else:
            value = str(value)
    except (TypeError, ValueError):
        raise ConfigError(f"{key}: expected {kind.__name__}, got {value!r}") from None
    if check is not None and not check(value):
        options = getattr(check, "options", None)
        hint = f"one of {', '.join(options)}" if options else check.__name__.strip("_")
        hint = getattr(check, "hint", hint)
        raise ConfigError(f"{key}: bad value {value!r} (must be {hint})")
    return value

"""The federated fine-tuning methods this project runs, by their run-config names."""

from __future__ import annotations

FLORG_METHODS: tuple[str, ...] = ("florg", "florg-no-procrustes")
LORA_METHODS: tuple[str, ...] = ("fedit", "federa", "ffa-lora", "fedsa-lora", "fedex-lora")
METHODS: tuple[str, ...] = FLORG_METHODS + LORA_METHODS


def check_method(method: str) -> str:
    """Return ``method`` if known, else raise a ValueError listing the known names."""
    if method not in METHODS:
        raise ValueError(f"unknown method {method!r}; choose one of {', '.join(METHODS)}")
    return method

"""The methods' per-layer loop: each adapted layer of a state (``adapter_layers``), in its
order, the keys of the parts a rule reads, and a rule applied to every client's arrays of them."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Any

import numpy as np

from flower_app.methods.contract import adapter_layers, stacked

# A LoRA layer's parts, in the order the LoRA rules take them: B, then A.
LORA_PARTS = ("lora_B", "lora_A")


def layer_keys(
    state: Mapping[str, np.ndarray], parts: tuple[str, ...]
) -> Iterator[tuple[str, ...]]:
    """For each adapted layer of ``state``, in its order, the keys of its ``parts``
    (``"<layer>.<part>"``, in the order of ``parts``)."""
    for layer in adapter_layers(state):
        yield tuple(f"{layer}.{part}" for part in parts)


def aggregate_per_layer(
    sent: Mapping[str, np.ndarray],
    payloads: list[dict[str, np.ndarray]],
    weights: Any,
    parts: tuple[str, ...],
    rule: Callable[..., Any],
    **options: Any,
) -> tuple[dict[str, np.ndarray], list[Any]]:
    """The new arrays of every adapted layer of ``sent``, and what else the rule returned.

    Per layer, in ``sent``'s order: ``rule(every client's array of each part (float64,
    ``stacked``), ..., weights, **options)``. A rule of one part returns the new array; a
    rule of several returns one new array per part, in the order of ``parts``, and may
    add the layer's info after them (collected in the second list, layer by layer)."""
    new: dict[str, np.ndarray] = {}
    infos: list[Any] = []
    for keys in layer_keys(sent, parts):
        out = rule(*(stacked(payloads, key) for key in keys), weights, **options)
        if len(keys) == 1:
            out = (out,)
        new.update(zip(keys, out[: len(keys)], strict=True))
        infos.extend(out[len(keys) :])
    return new, infos

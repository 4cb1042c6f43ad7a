"""Moving named tensors between a torch model and NumPy float32 arrays (what travels)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import numpy as np
import torch
from torch import nn


def to_numpy(t: torch.Tensor) -> np.ndarray:
    """Detached float32 NumPy copy (ArrayRecord cannot carry bfloat16)."""
    return t.detach().to("cpu", torch.float32).numpy().copy()


def module_parameters(model: nn.Module, module_names: Iterable[str]) -> dict[str, nn.Parameter]:
    """Parameters of the named modules, keyed by their qualified parameter names."""
    modules = dict(model.named_modules())
    out: dict[str, nn.Parameter] = {}
    for mod_name in module_names:
        for p_name, p in modules[mod_name].named_parameters():
            out[f"{mod_name}.{p_name}"] = p
    return out


def load_arrays(targets: Mapping[str, torch.Tensor], arrays: Mapping[str, np.ndarray]) -> None:
    """Copy ``arrays`` into ``targets`` in place; keys and shapes must match exactly."""
    missing = sorted(set(targets) - set(arrays))
    unexpected = sorted(set(arrays) - set(targets))
    if missing or unexpected:
        raise KeyError(f"state keys differ: missing {missing[:5]}, unexpected {unexpected[:5]}")
    with torch.no_grad():
        for key, tensor in targets.items():
            value = np.asarray(arrays[key])
            if tuple(value.shape) != tuple(tensor.shape):
                raise ValueError(f"{key}: shape {value.shape} != expected {tuple(tensor.shape)}")
            if not np.all(np.isfinite(value)):
                raise ValueError(f"{key}: contains NaN/Inf")
            tensor.copy_(torch.as_tensor(value, dtype=tensor.dtype, device=tensor.device))

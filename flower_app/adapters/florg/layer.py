"""FLoRGLinear: a frozen nn.Linear plus the Gram update s * L A^T D A R (paper, section 3.1).

W0 (d_out x d_in), L (d_out x k), A (r x k), R (k x d_in), k = min(d_in, d_out), and
D = diag(signs) (a method's ``Method.florg_signs``, entries +-1; I without them). The forward
is a rank-r LoRA with factors LAt = L A^T D and AR = A R, never a k x k or d_out x d_in matrix:

    y = W0 x + b + s * LAt (AR x)

``form_pass_factors`` (a model pre-hook ``inject_florg`` installs) forms every layer's factors
once per training forward, one product per group sharing L and R (``set_group_pass_factors``).
A, L and R are float32 (float64 over a float64 base); the per-token products follow
``compute_dtype`` (custom_adapter.py). Cost, cache rules, precision: docs/architecture.md."""

from __future__ import annotations

import contextlib
import weakref
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from flower_app.adapters.custom_adapter import AdapterLinear, adapter_dtype, compute_dtype


def _adapter_autocast_off(device_type: str) -> contextlib.AbstractContextManager:
    """Autocast disabled where it is on: the factor products run in the adapter's dtype."""
    if torch.is_autocast_enabled(device_type):
        return torch.autocast(device_type=device_type, enabled=False)
    return contextlib.nullcontext()


@dataclass(eq=False)
class _PassFactors:
    """One training pass's (L A^T D, A R) of a layer, in the pass's compute dtype, and the A
    they were formed from (its storage and version: an in-place change of A, such as an
    optimiser step or a loaded state, bumps the version, a replaced ``A.data`` moves the
    storage)."""

    left: torch.Tensor
    right: torch.Tensor
    a_data_ptr: int
    a_version: int
    token: object = field(default_factory=object)


def _drop_when_used(layer_refs: list[weakref.ref], token: object):
    """A gradient hook for a group's stored LAt product: once the backward pass has its
    whole gradient, every use of the pairs in this pass (the forwards and checkpointing's
    recomputations) is behind it, so the layers drop their pairs (unless a later pass has
    replaced them)."""

    def hook(_grad: torch.Tensor) -> None:
        for layer_ref in layer_refs:
            layer = layer_ref()
            if layer is not None:
                stored = layer._pass_factors
                if stored is not None and stored.token is token:
                    layer.__dict__["_pass_factors"] = None  # a plain attribute (see below)

    return hook


class FLoRGProjections(nn.Module):
    """The fixed L and R as non-persistent buffers.  One instance may be the child of many
    FLoRGLinear layers (``projection-sharing=shape``): ``model.to(...)`` then converts it
    once, in place, so the layers keep sharing it on every device."""

    def __init__(
        self, L: np.ndarray, R: np.ndarray, dtype: torch.dtype, device: torch.device
    ) -> None:
        super().__init__()
        self.register_buffer("L", torch.as_tensor(L, dtype=dtype, device=device), persistent=False)
        self.register_buffer("R", torch.as_tensor(R, dtype=dtype, device=device), persistent=False)

    def extra_repr(self) -> str:
        return f"L={tuple(self.L.shape)}, R={tuple(self.R.shape)}"


class FLoRGLinear(AdapterLinear):
    """Wraps ``base_layer`` (frozen) with the trainable FLoRG matrix ``A`` (r x k).

    ``projections``: an existing FLoRGProjections holding these L and R (shared with other
    layers); by default the layer gets its own.
    """

    def __init__(
        self,
        base_layer: nn.Linear,
        L: np.ndarray,
        R: np.ndarray,
        A_init: np.ndarray,
        scaling: float,
        subtract_init: bool = False,
        projections: FLoRGProjections | None = None,
        signs: np.ndarray | None = None,
    ) -> None:
        # in/out_features, not weight.shape: a bitsandbytes Linear4bit packs its weight
        d_out, d_in = base_layer.out_features, base_layer.in_features
        k = min(d_in, d_out)
        r = A_init.shape[0]
        if L.shape != (d_out, k) or R.shape != (k, d_in) or A_init.shape != (r, k):
            raise ValueError(
                f"FLoRG shapes do not fit W0 {(d_out, d_in)}: L {L.shape}, R {R.shape}, "
                f"A {A_init.shape} (expected L {(d_out, k)}, R {(k, d_in)}, A (r, {k}))"
            )
        # checked before the base layer is frozen, so a refused one is left as it was
        super().__init__(base_layer, scaling)
        self.r, self.k = r, k
        dtype, device = adapter_dtype(base_layer.weight.dtype), base_layer.weight.device
        if projections is None:
            projections = FLoRGProjections(L, R, dtype, device)
        elif projections.L.shape != (d_out, k) or projections.R.shape != (k, d_in):
            raise ValueError(
                f"shared projections L {tuple(projections.L.shape)}, R "
                f"{tuple(projections.R.shape)} do not fit W0 {(d_out, d_in)}"
            )
        self.projections = projections
        self.A = nn.Parameter(torch.as_tensor(A_init, dtype=dtype, device=device).clone())
        if signs is not None:
            signs = np.asarray(signs, dtype=np.float64)
            if signs.shape != (r,) or not np.all(np.abs(signs) == 1.0):
                raise ValueError(f"signs must be r = {r} entries of +1 or -1, got {signs}")
            self.register_buffer("signs", torch.as_tensor(signs, dtype=dtype, device=device))
        else:
            self.signs = None
        # D as Python numbers, for grouping layers without reading the buffer each step
        self.signs_key = None if signs is None else tuple(float(x) for x in signs)
        # Option: W0 <- W0 - s L A1^T D A1 R (float64), so the output is unchanged before
        # training (D = I without signs).
        self.subtract_init = bool(subtract_init)
        if self.subtract_init:
            d = np.ones(r) if signs is None else signs
            delta = self.scaling * ((L @ A_init.T) * d) @ (A_init @ R)
            with torch.no_grad():
                w64 = base_layer.weight.detach().to(torch.float64)
                w_new = w64 - torch.as_tensor(delta, device=device)
                base_layer.weight.copy_(w_new.to(base_layer.weight.dtype))
            self.register_buffer("A_init", torch.as_tensor(A_init, dtype=dtype, device=device))
        else:
            self.A_init = None
        # This training pass's factors (form_pass_factors); a plain attribute, never state.
        self._pass_factors: _PassFactors | None = None

    def __getstate__(self) -> dict:
        # deepcopy and pickle: the stored factors (non-leaf tensors of one pass) stay behind
        state = self.__dict__.copy()
        state["_pass_factors"] = None
        return state

    @property
    def L(self) -> torch.Tensor:  # noqa: N802 (the paper's name)
        return self.projections.L

    @property
    def R(self) -> torch.Tensor:  # noqa: N802 (the paper's name)
        return self.projections.R

    @property
    def trained_matrix(self) -> torch.Tensor:
        return self.A

    def lora_factors(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(L A^T D, A R): the d_out x r and r x d_in factors with Delta W = s * (L A^T D)(A R)
        (D = I without ``signs``)."""
        left = (self.A @ self.L.T).T  # as the pre-hook's group product forms it
        return (left if self.signs is None else left * self.signs), self.A @ self.R

    @property
    def holds_pass_factors(self) -> bool:
        """Whether a training pass's factors are stored (until its backward has used them)."""
        return self._pass_factors is not None

    def _factors_in(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """(L A^T D, A R) formed in the adapter's dtype with autocast off, then cast to
        ``dtype`` (no copy where it is the adapter's)."""
        with _adapter_autocast_off(self.A.device.type):
            left, right = self.lora_factors()
            return left.to(dtype), right.to(dtype)

    def _forward_factors(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """The stored pair where this is a training forward with grad, A is as it was when
        the pair was formed and the pair is in ``dtype``; otherwise the factors formed now."""
        stored = self._pass_factors
        if (
            stored is not None
            and self.training
            and torch.is_grad_enabled()
            and stored.a_version == self.A._version
            and stored.a_data_ptr == self.A.data_ptr()
            and stored.left.dtype == dtype
        ):
            return stored.left, stored.right
        return self._factors_in(dtype)

    def delta_weight(self) -> torch.Tensor:
        """s * L A^T A R (d_out x d_in); for tests and export only, never in the forward."""
        left, right = self.lora_factors()
        return self.scaling * left @ right

    def low_rank_update(self, x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """LAt (AR x), the factors formed in float32 and rounded to ``dtype`` (the module
        docstring); the scaling and the cast to the output's dtype are AdapterLinear's."""
        left, right = self._forward_factors(dtype)
        # Operands in autocast's dtype where it is on: autocast leaves these products as
        # they are (no context switch needed, which costs a step more than the products
        # at small shapes on a GPU).
        return F.linear(F.linear(x.to(dtype), right), left)

    def extra_repr(self) -> str:
        signed = "" if self.signs is None else f", signs={self.signs.tolist()}"
        base = f"r={self.r}, k={self.k}, scaling={self.scaling:g}, subtract={self.subtract_init}"
        return base + signed


def set_group_pass_factors(layers: list[FLoRGLinear], dtype: torch.dtype) -> None:
    """Form and store the pass factors of ``layers``, which share one FLoRGProjections, r,
    signs, dtype and device, with one product for all their L A^T D and one for all their
    A R (module docstring), in the adapter's dtype (autocast must be off here), rounded to
    ``dtype``. Each layer's pair are views of the group's two products."""
    first = layers[0]
    r = first.r
    stacked = torch.cat([layer.A for layer in layers]) if len(layers) > 1 else first.A
    left_t = stacked @ first.L.T  # row block i: (L A_i^T)^T
    if first.signs is not None:  # (L A^T D)^T = D A L^T: rows scaled by +-1, exact
        left_t = left_t * first.signs.repeat(len(layers))[:, None]
    left_t = left_t.to(dtype)
    right = (stacked @ first.R).to(dtype)
    token = object()
    for layer, left_block, right_block in zip(layers, left_t.split(r), right.split(r), strict=True):
        stored = _PassFactors(
            left_block.T, right_block, layer.A.data_ptr(), layer.A._version, token
        )
        # a plain attribute, written past nn.Module.__setattr__'s parameter / buffer /
        # module checks (a step writes it twice per layer)
        layer.__dict__["_pass_factors"] = stored
    left_t.register_hook(_drop_when_used([weakref.ref(layer) for layer in layers], token))


def _florg_layers_of(model: nn.Module) -> list[FLoRGLinear]:
    """The model's FLoRGLinear layers, found by one walk of its modules and kept on the
    model (a plain attribute: copies and pickles of the model map it to their own layers).
    The walk cost a training step a few per cent at small shapes. A layer added later is
    not in the list: it forms its factors in its forward, as without the hook (correct,
    only slower)."""
    layers = model.__dict__.get("_florg_layers_cache")
    if layers is None:
        layers = [m for m in model.modules() if isinstance(m, FLoRGLinear)]
        model.__dict__["_florg_layers_cache"] = layers
    return layers


def form_pass_factors(model: nn.Module, _args: object) -> None:
    """Forward pre-hook of a model carrying FLoRG layers (``inject_florg`` registers it):
    in a training forward with grad enabled, every FLoRGLinear's factors are formed once,
    here, outside the (checkpointed) blocks, for groups of layers that share L and R, with
    autocast off once per group (module docstring)."""
    if not (model.training and torch.is_grad_enabled()):
        return
    groups: dict[tuple, list[FLoRGLinear]] = {}
    for layer in _florg_layers_of(model):
        if layer.training and layer.A.requires_grad:
            key = (id(layer.projections), layer.r, layer.signs_key, layer.A.dtype, layer.A.device)
            groups.setdefault(key, []).append(layer)
    for layers in groups.values():
        device_type = layers[0].A.device.type
        dtype = compute_dtype(device_type, layers[0].A.dtype)  # before autocast is off
        with _adapter_autocast_off(device_type):
            set_group_pass_factors(layers, dtype)

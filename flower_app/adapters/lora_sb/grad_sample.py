"""Per-example gradients of LoRA-SB's R for Opacus (``dp=example``, docs/privacy.md section 9).

LoRASBLinear is not an nn.Linear, so this module registers Opacus' grad sampler for it. The
layer adds y_t = s B R A x_t, so from its input x and output gradient g of each example:

    G_i = s sum_t (B^T g_t) (A x_t)^T  =  s H_i^T U_i,   H_i = G_i B,  U_i = X_i A^T  (T x r)

two skinny products per example and an r x r sum over tokens. The frozen base (W0, its bias)
and the fixed B, A take no gradient."""

from __future__ import annotations

import torch

from flower_app.adapters.lora_sb.layer import LoRASBLinear


def lora_sb_grad_sample(
    layer: LoRASBLinear, activations: list[torch.Tensor], backprops: torch.Tensor
) -> dict[torch.nn.Parameter, torch.Tensor]:
    """{R: n x r x r}, the per-example gradients of ``layer.R`` from the layer's inputs
    ``activations[0]`` (n x ... x d_in) and output gradients ``backprops`` (n x ... x d_out)
    (Opacus' grad-sampler signature; nothing when R is frozen)."""
    if not layer.R.requires_grad:
        return {}
    dtype = layer.R.dtype
    x = activations[0].to(dtype)
    g = backprops.to(dtype)
    n = x.shape[0]
    x = x.reshape(n, -1, x.shape[-1])  # n x T x d_in (T = 1 for a 2-d input)
    g = g.reshape(n, -1, g.shape[-1])  # n x T x d_out
    u = x @ layer.A.T  # n x T x r: A x_t
    h = g @ layer.B  # n x T x r: B^T g_t
    return {layer.R: layer.scaling * torch.einsum("ntr,nts->nrs", h, u)}


def register_lora_sb_grad_sampler() -> None:
    """Register ``lora_sb_grad_sample`` as Opacus' sampler for LoRASBLinear (idempotent)."""
    from opacus.grad_sample.utils import register_grad_sampler

    register_grad_sampler(LoRASBLinear)(lora_sb_grad_sample)

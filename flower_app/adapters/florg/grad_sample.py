"""Per-example gradients of FLoRG's A for Opacus (``dp=example``, docs/privacy.md section 9).

FLoRGLinear is not an nn.Linear, so this module registers Opacus' grad sampler for it. From the
layer's input x and output gradient g of each example (Z = X R^T, H = G L, T x k each):

    G_i = s D A (Z_i^T H_i + H_i^T Z_i)

the paper's eq. gradient_A per example (D = diag(signs), I without them), computed with the
rank-r products first, A Z_i^T H_i = (U_i^T G_i) L and A H_i^T Z_i = (V_i^T X_i) R^T with
U = X (A R)^T and V = G (L A^T): about a LoRA layer's per-example cost, and only x and g enter
(the pass-factor cache does not change it)."""

from __future__ import annotations

import torch

from flower_app.adapters.florg.layer import FLoRGLinear


def florg_grad_sample(
    layer: FLoRGLinear, activations: list[torch.Tensor], backprops: torch.Tensor
) -> dict[torch.nn.Parameter, torch.Tensor]:
    """{A: n x r x k}, the per-example gradients of ``layer.A`` from the layer's inputs
    ``activations[0]`` (n x ... x d_in) and output gradients ``backprops`` (n x ... x d_out)
    (Opacus' grad-sampler signature; nothing when A is frozen)."""
    if not layer.A.requires_grad:
        return {}
    dtype = layer.A.dtype
    x = activations[0].to(dtype)
    g = backprops.to(dtype)
    n = x.shape[0]
    x = x.reshape(n, -1, x.shape[-1])  # n x T x d_in (T = 1 for a 2-d input)
    g = g.reshape(n, -1, g.shape[-1])  # n x T x d_out
    a = layer.A.detach()
    u = x @ (a @ layer.R).T  # n x T x r: A R x_t
    v = g @ (layer.L @ a.T)  # n x T x r: A L^T g_t
    ug = torch.einsum("ntr,nto->nro", u, g)  # n x r x d_out: sum_t (A R x_t) g_t^T
    vx = torch.einsum("ntr,nti->nri", v, x)  # n x r x d_in: sum_t (A L^T g_t) x_t^T
    grad = ug @ layer.L + vx @ layer.R.T  # n x r x k
    if layer.signs is not None:
        grad = grad * layer.signs[None, :, None]
    return {layer.A: layer.scaling * grad}


def register_florg_grad_sampler() -> None:
    """Register ``florg_grad_sample`` as Opacus' sampler for FLoRGLinear (idempotent)."""
    from opacus.grad_sample.utils import register_grad_sampler

    register_grad_sampler(FLoRGLinear)(florg_grad_sample)

"""Per-example gradients of FLoRG's A for Opacus (``dp=example``, docs/privacy.md).

Opacus computes per-example gradients with forward / backward hooks on every module that
holds a trained parameter: the module's input x (n x T x d_in) and the gradient of the loss
with respect to its output, g (n x T x d_out), per example, scaled so that g_i is the
gradient of example i's own loss. nn.Linear has Opacus' own sampler (PEFT's lora_A / lora_B
and the task head are nn.Linear); FLoRGLinear is not one, so this module registers one.

The layer adds y = s L A^T D A R x (D = diag(signs), I without them; paper section 3.1).
With z = R x and h = L^T g per token (k-vectors), example i's loss depends on A through
sum_t s h_t^T A^T D A z_t, whose gradient is

    G_i = s D sum_t [ (A z_t) h_t^T + (A h_t) z_t^T ]  =  s D A (Z_i^T H_i + H_i^T Z_i)

(Z_i, H_i: T x k), the paper's eq. gradient_A, A (H + H^T) with H = L^T (grad W) R^T, per
example. The rank-r products come first, so no token is ever projected onto the k-wide
frame: with U = X (A R)^T and V = G (L A^T) (T x r each),

    A Z_i^T H_i = (U_i^T G_i) L,    A H_i^T Z_i = (V_i^T X_i) R^T,

an r x d sum over tokens per example, then one r x d by d x k product: n r (2 T (d_in +
d_out) + k (d_in + d_out)) flops, about a LoRA layer's per-example cost, where projecting
every token first (Z = X R^T, H = G L) costs n T k (d_in + d_out), k / r times more. The
result does not depend on how the forward formed its factors
(the pass-factor cache of florg_layer.py forms L A^T D and A R outside the layer): only x and
g enter, and tests/runtime/test_dp_sgd.py holds it to a per-example autograd loop with the cache on.
"""

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

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
example. It is computed as two r x k products per example from U = Z A^T and V = H A^T
(T x r each), never a k x k matrix: n T k (d_in + d_out + 4 r) flops, a LoRA layer's per-example
cost plus the projections. The result does not depend on how the forward formed its factors
(the pass-factor cache of florg_layer.py forms L A^T D and A R outside the layer): only x and
g enter, and tests/test_dp_sgd.py holds it to a per-example autograd loop with the cache on.
"""

from __future__ import annotations

import torch

from flower_app.adapters.florg_layer import FLoRGLinear


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
    z = x @ layer.R.T  # n x T x k
    h = g @ layer.L  # n x T x k
    a = layer.A.detach()
    u = z @ a.T  # n x T x r: A z_t
    v = h @ a.T  # n x T x r: A h_t
    grad = torch.einsum("ntr,ntk->nrk", u, h) + torch.einsum("ntr,ntk->nrk", v, z)
    if layer.signs is not None:
        grad = grad * layer.signs[None, :, None]
    return {layer.A: layer.scaling * grad}


def register_florg_grad_sampler() -> None:
    """Register ``florg_grad_sample`` as Opacus' sampler for FLoRGLinear (idempotent)."""
    from opacus.grad_sample.utils import register_grad_sampler

    register_grad_sampler(FLoRGLinear)(florg_grad_sample)

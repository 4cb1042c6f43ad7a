"""Fed-SB's round 0 on a client under ``dp=example`` (``answer_private_query``): the gradient
estimate of every adapted W0 as one Gaussian mechanism on per-example clipped gradients,
composed into the client's DP-SGD ledger (docs/privacy.md sections 2.1 and 9).

    G~ = sum_{i in S} g_i min(1, C / ||g_i||) + N(0, (z0 C)^2 I)      (``private_gradient_sum``)

g_i the gradient of example i's loss with respect to every adapted W0 (all layers jointly),
C = ``dp-sgd-clipping-norm``, z0 = ``fed-sb-init-noise-multiplier``, S a Poisson sample at
q0 = min(1, N / n) (``init_sample_rate``), N = ``fed-sb-init-examples``, n the client's
training examples. The release is the Poisson-sampled Gaussian mechanism (z0, q0), composed
once into the ledger (``ClientAccountant.record_release``) before any training round, whose
noise multiplier is then calibrated for what is left of ``dp-sgd-target-epsilon``.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

# the reply's metrics of a client's ledger after round 0 (as a training round's reply,
# flower_app/client/round.py; the server's record reads dp-sgd-epsilon)
EPSILON, NOISE, DELTA = "dp-sgd-epsilon", "dp-sgd-noise-multiplier", "dp-sgd-delta"
KEY = "fed-sb-init-noise-multiplier"  # the setting named where round 0 exceeds a budget


def init_sample_rate(init_examples: int, num_examples: int) -> float:
    """q0 = min(1, N / n): each example's probability of being in round 0's sum."""
    if num_examples < 1:
        raise ValueError("fed-sb-init-examples: this client's partition has no training example")
    return min(1.0, init_examples / num_examples)


def clip_factor(norm: float, clipping_norm: float) -> float:
    """min(1, C / ||g||): the factor that brings a gradient of norm ``norm`` within C."""
    return clipping_norm / max(norm, clipping_norm)


def private_gradient_sum(
    adapted: Any,
    batches: Any,
    *,
    sample_rate: float,
    clipping_norm: float,
    noise_multiplier: float,
    seed: int | None,
) -> tuple[dict[str, np.ndarray], list[float]]:
    """({'<layer>.grad': G~ of the layer (float64)}, the norms ||g_i|| before clipping, in
    the order the sampled examples were taken): the module docstring's estimate over
    ``batches`` (``flower_app.client.round.LocalBatches``; its loader's dataset and
    collation, the task's loss, the device, round 0's seed).

    The sampling and the noise come from the generators of DP-SGD's rounds
    (``flower_app.privacy.dp_sgd.round_generators``): OS entropy, or round 0's seed with
    ``dp-sgd-seeded-noise`` (tests: reproducible, not private). Each example's gradient is
    taken alone (a batch of one, its own padding only: exact, and N is small). The noise is
    drawn in float64 on the CPU, layer by layer in the model's order of LoRA-SB layers, each
    as ``randn(d_out, d_in) * z0 C``. As in the non-private estimate (gradient.py) the
    model runs in training mode with torch seeded with round 0's seed (dropout), only the
    adapted W0 take gradients, and R and the head are frozen meanwhile and restored
    after."""
    import torch

    from flower_app.privacy.dp_sgd import round_generators
    from strategies.fed_sb.gradient import gradient_key, training_base_weights

    model = adapted.model
    dataset, collate = batches.loader.dataset, batches.loader.collate_fn
    sampling, noise = round_generators(seed, torch.device("cpu"))
    # Poisson sampling as Opacus' DPDataLoader draws it: one uniform per example, in < q
    chosen = torch.nonzero(torch.rand(len(dataset), generator=sampling) < sample_rate)
    norms: list[float] = []
    with training_base_weights(adapted, batches) as weights:
        sums = {name: torch.zeros(w.shape, dtype=torch.float64) for name, w in weights.items()}
        for i in chosen.flatten().tolist():
            batch = {k: v.to(batches.device) for k, v in collate([dataset[i]]).items()}
            with batches.mixed.autocast():
                loss = batches.loss_fn(model, batch)  # a batch of one: the example's loss
            if not torch.isfinite(loss):
                raise FloatingPointError("non-finite loss in the gradient estimate of round 0")
            grads = torch.autograd.grad(loss, list(weights.values()))
            grads = [g.detach().to("cpu", torch.float64) for g in grads]
            norm = math.sqrt(sum(float(g.square().sum()) for g in grads))  # all layers jointly
            factor = clip_factor(norm, clipping_norm)
            for total, g in zip(sums.values(), grads, strict=True):
                total.add_(g, alpha=factor)
            norms.append(norm)
    std = noise_multiplier * clipping_norm  # per entry, on the sum (sensitivity C)
    for total in sums.values():
        total.add_(torch.randn(total.shape, generator=noise, dtype=torch.float64), alpha=std)
    return {gradient_key(name): s.numpy() for name, s in sums.items()}, norms


def answer_private_query(
    config: Any, adapted: Any, batches: Any, accountant: Any
) -> tuple[dict[str, np.ndarray], dict[str, float]]:
    """Round 0's reply under dp=example: (the private estimate, {'num-examples': the expected
    count min(N, n), dp-sgd-epsilon / -noise-multiplier / -delta after it}). The release is
    refused before anything is computed where it alone would reach
    ``dp-sgd-target-epsilon`` (nothing left for training) or take the client past
    ``dp-max-epsilon``; it is composed into ``accountant`` (``ClientAccountant``, the
    node's ledger the caller keeps) once computed."""
    from flower_app.privacy.dp_sgd import check_release

    n = len(batches.loader.dataset)
    q = init_sample_rate(config.fed_sb_init_examples, n)
    z = float(config.fed_sb_init_noise_multiplier)
    where = f"round 0 (q = {q:.4g}, {KEY} = {z:g})"
    check_release(config, accountant, n, z, q, where=where, key=KEY)
    arrays, _ = private_gradient_sum(
        adapted,
        batches,
        sample_rate=q,
        clipping_norm=config.dp_sgd_clipping_norm,
        noise_multiplier=z,
        seed=batches.seed if config.dp_sgd_seeded_noise else None,
    )
    accountant.record_release(config, n, z, q)
    metrics = {
        # the number of sampled examples would reveal the sampling; its expectation does not
        "num-examples": min(config.fed_sb_init_examples, n),
        EPSILON: accountant.epsilon(),
        NOISE: z,
        DELTA: accountant.ledger.delta,
    }
    return arrays, metrics

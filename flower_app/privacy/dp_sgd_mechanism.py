"""What DP-SGD's mechanism did in a client's round (``dp=example``, docs/privacy.md section 9).

``MechanismStats`` is Opacus' ``DPOptimizer`` step hook: it reads the per-example gradients
(``p.grad_sample``) and their clipped sum (``p.summed_grad``) and writes nothing, so what is
trained is bit for bit what it is without it. The round's reply carries (``metrics``)
``dp-sgd-clipped-fraction``, ``dp-sgd-grad-norm-median`` and ``dp-sgd-clipped-mean-norm``,
statistics of the client's data computed without noise (``DATA_DEPENDENT_KEYS``: outside the
(epsilon, delta) guarantee; ``dp-unnoised-metrics=withhold`` keeps them on the node), and
``dp-sgd-sum-noise-std`` (z C), ``dp-sgd-expected-batch`` (B) and ``dp-sgd-trained-params`` (d),
which follow from the settings and the client's example count."""

from __future__ import annotations

import statistics
from typing import Any

import torch

__all__ = ["DATA_DEPENDENT_KEYS", "MechanismStats"]

# The reply keys computed from the client's examples without noise (module docstring).
DATA_DEPENDENT_KEYS = (
    "dp-sgd-clipped-fraction",
    "dp-sgd-grad-norm-median",
    "dp-sgd-clipped-mean-norm",
)


class MechanismStats:
    """Per-step norms of one client's round, read from Opacus' DP optimizer (``observe``
    is its step hook)."""

    def __init__(self, clipping_norm: float, noise_multiplier: float, expected_batch: float):
        self.clipping_norm = float(clipping_norm)
        self.noise_multiplier = float(noise_multiplier)
        self.expected_batch = float(expected_batch)
        self.example_norms: list[torch.Tensor] = []  # one 1-d tensor per step (on device)
        self.mean_norms: list[torch.Tensor] = []  # one scalar per step (on device)
        self.trained_params = 0

    @torch.no_grad()
    def observe(self, optimizer: Any) -> None:
        """The DP optimizer's step hook: read the step's per-example gradients and their
        clipped sum; nothing is written to the optimizer or its parameters."""
        params = optimizer.params
        self.trained_params = sum(p.numel() for p in params)
        samples = optimizer.grad_samples  # flat views of p.grad_sample, as Opacus clips them
        if len(samples[0]):
            per_param = [g.reshape(len(g), -1).norm(2, dim=-1) for g in samples]
            device = per_param[0].device
            norms = torch.stack([n.to(device) for n in per_param], dim=1).norm(2, dim=1)
            self.example_norms.append(norms.detach().clone())
        summed = [p.summed_grad.reshape(-1) for p in params if p.summed_grad is not None]
        if summed:
            device = summed[0].device
            total = torch.stack([s.norm(2).to(device) for s in summed]).norm(2)
            # the mean over the expected batch, as Opacus' scale_grad divides the noised sum
            scale = optimizer.expected_batch_size * optimizer.accumulated_iterations
            self.mean_norms.append((total / scale).detach().clone())

    def metrics(self) -> dict[str, float]:
        """The round's reply metrics (module docstring); no per-example key where no
        example was drawn."""
        sum_std = self.noise_multiplier * self.clipping_norm
        found: dict[str, float] = {
            "dp-sgd-sum-noise-std": sum_std,
            "dp-sgd-expected-batch": self.expected_batch,
            "dp-sgd-trained-params": float(self.trained_params),
        }
        if self.example_norms:
            norms = torch.cat([n.double().cpu() for n in self.example_norms])
            clipped = int((norms > self.clipping_norm).sum())
            found["dp-sgd-clipped-fraction"] = clipped / int(norms.numel())
            found["dp-sgd-grad-norm-median"] = statistics.median(norms.tolist())
        if self.mean_norms:
            means = [float(m) for m in self.mean_norms]
            found["dp-sgd-clipped-mean-norm"] = statistics.median(means)
        return found

"""Outlier screening of a round's checked replies (``screen-updates``; docs/faults.md).

``screen``: for each client n and each group of tensors it sends (the adapter: every layer's
A, or lora_A / lora_B; the task head), d_n = ||x_n - x_prev||_F over the group, x_prev the
global state the round started from. A client is rejected when d_n > kappa * median(d) in
any group (the lower median, ``_low_median``); claimed example counts above kappa times the
median claim are clipped to it. FLoRG's server sums Q = sum_n w_n A_n^T A_n, quadratic in
A_n (a client sending c * A weighs c^2 times its share), so it is screened on
||A_n - A_prev||, linear in the attack. Every round also reports ``update-norm-median`` and
``update-norm-max``: ||x_n - x_start|| over all the arrays a client sends, the unit that
``dp=central`` clips to C (docs/privacy.md, "Choosing C").
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping, Sequence

import numpy as np

from flower_app.wire.records import split_state
from strategies.server.replies import Reply

log = logging.getLogger("flwr.florg")  # propagates to Flower's console handler

DEFAULT_KAPPA = 10.0  # docs/faults.md: honest spreads measured up to ~6x the median


def _low_median(values: np.ndarray) -> float:
    """The lower median: the median for an odd count, the smaller middle value otherwise
    (with two clients, the larger one is compared with the smaller)."""
    ordered = np.sort(np.asarray(values, np.float64))
    return float(ordered[(len(ordered) - 1) // 2])


def _distances(
    replies: Sequence[Reply],
    global_state: Mapping[str, np.ndarray],
    starts: Sequence[Mapping[str, np.ndarray]] | None,
    keys: Sequence[str],
) -> np.ndarray:
    """d_n = ||x_n - x_start||_F over ``keys`` (x_start: ``starts[n]`` where given, else
    ``global_state``)."""
    return np.array(
        [
            math.sqrt(
                sum(
                    float(np.sum((r.arrays[k] - (starts[i] if starts else global_state)[k]) ** 2))
                    for k in keys
                )
            )
            for i, r in enumerate(replies)
        ]
    )


def screen(
    server_round: int,
    replies: list[Reply],
    global_state: Mapping[str, np.ndarray],
    *,
    kappa: float,
    enabled: bool,
    starts: Sequence[Mapping[str, np.ndarray]] | None = None,
) -> tuple[list[Reply], list[float], dict]:
    """Outlier screening of ``replies`` to a round that started from ``global_state``
    (module doc); ``starts``: per reply the state that client started from, where
    clients of different rank were sent different states.  With ``enabled``
    false nothing is rejected or clipped, but the largest ratio, ``screen-ratio-max``, is
    still measured.  Returns the kept replies, their (clipped) example counts and the
    metrics."""
    metrics: dict[str, float] = {"screened": 0, "clipped": 0}
    sizes = [r.num_examples for r in replies]
    head = split_state(global_state)[1]
    adapter_keys = [k for k in global_state if k not in head]
    groups = {"adapter": adapter_keys, "head": list(head)}
    distances = {
        group: _distances(replies, global_state, starts, keys)
        for group, keys in groups.items()
        if keys
    }
    if replies:  # the groups cover every array sent: the joint norm is DP's clipped unit
        norms = np.sqrt(sum(d**2 for d in distances.values()))
        metrics["update-norm-median"] = float(np.median(norms))
        metrics["update-norm-max"] = float(np.max(norms))
    if len(replies) < 2:
        return replies, sizes, metrics
    reasons: dict[int, str] = {}
    worst = 0.0
    for group, d in distances.items():
        keys = groups[group]
        prev = global_state
        scale = math.sqrt(sum(float(np.sum(prev[k] ** 2)) for k in keys))
        median = max(_low_median(d), 1e-12 * (1.0 + scale))
        ratios = d / median
        worst = max(worst, float(ratios.max()))
        for i in np.flatnonzero(ratios > kappa):
            reasons.setdefault(
                int(i),
                f"{group} update distance {d[i]:.4g} = {ratios[i]:.1f} x the round's "
                f"median {median:.4g} (kappa {kappa:g})",
            )
    metrics["screen-ratio-max"] = worst  # measured also with screening off
    if not enabled:
        return replies, sizes, metrics
    kept: list[Reply] = []
    for i, r in enumerate(replies):
        if i in reasons:
            log.warning(
                "round %d: screened out update from partition %s (node %s): %s",
                server_round,
                r.partition,
                r.node,
                reasons[i],
            )
        else:
            kept.append(r)
    metrics["screened"] = len(reasons)
    claims = np.array([r.num_examples for r in kept])
    cap = kappa * _low_median(claims)
    for r in kept:
        if r.num_examples > cap:
            log.warning(
                "round %d: partition %s (node %s) claims %.6g examples, clipped to %.6g "
                "(kappa %g x the round's median claim)",
                server_round,
                r.partition,
                r.node,
                r.num_examples,
                cap,
                kappa,
            )
    metrics["clipped"] = int(np.sum(claims > cap))
    return kept, np.minimum(claims, cap).tolist(), metrics

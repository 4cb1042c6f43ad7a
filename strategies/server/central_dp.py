"""Central differential privacy: the settings, clipping, the noised mean, a run's ledger.

User-level DP with a trusted server (add/remove-one neighbours, the Gaussian mechanism, RDP
accounting), driven by ``dp`` (off | central), ``dp-clipping-norm`` C, ``dp-noise-multiplier``
z and ``dp-delta``. Each client's contribution to a sum is clipped to a sensitivity Delta,
the sum gets Gaussian noise of std z * Delta per released coordinate, and the rest is
post-processing. The mean mechanism (``mean_mechanism``): u_n = reply - sent over all shared
arrays jointly, clipped to ||u_n|| <= C in float64 (``clip_update``), released as
``noised_mean`` = (sum_n u_n + N(0, (zC)^2 I)) / m, m public (``public_divisor``): in
distribution Flower's ``DifferentialPrivacyServerSideFixedClipping``. ``CentralDP`` holds
the settings, the noise source (OS entropy, never the public ``seed``) and the ledger.
Other mechanisms: strategies/server/product_mean.py, strategies/florg/dp.py; docs/privacy.md.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np

from flower_app.privacy.accounting import DpAccountant
from flower_app.privacy.checks import (
    KEY_DELTA,
    check_clipping_norm,
    check_noise_multiplier,
    check_sample_rate,
)

log = logging.getLogger("flwr.florg")  # propagates to Flower's console handler
EPS64 = float(np.finfo(np.float64).eps)
# A clipped input may exceed C by float64 rounding of the scale factor, never by more.
CLIP_SLACK = 1e-9


# --------------------------------------------------------------------------- structures

# A client's arrays: a mapping name -> array (the app's state dicts) or a plain sequence.
Arrays = Mapping[str, Any] | Sequence[Any]


def _items(arrays: Arrays) -> list[tuple[Any, np.ndarray]]:
    if isinstance(arrays, np.ndarray):
        raise TypeError("expected a mapping or a sequence of arrays, got one array")
    pairs = arrays.items() if isinstance(arrays, Mapping) else enumerate(arrays)
    out = []
    for key, value in pairs:
        arr = np.asarray(value, dtype=np.float64)
        if not np.all(np.isfinite(arr)):
            raise ValueError(f"array {key!r}: contains NaN/Inf entries")
        out.append((key, arr))
    return out


def _rebuild(like: Arrays, items: list[tuple[Any, np.ndarray]]) -> Any:
    if isinstance(like, Mapping):
        return {key: arr for key, arr in items}
    return [arr for _, arr in items]


def flat_norm(arrays: Arrays) -> float:
    """L2 norm of all arrays flattened and concatenated (Flower's ``get_norm``)."""
    return math.sqrt(sum(float(np.sum(a * a)) for _, a in _items(arrays)))


# --------------------------------------------------------------------------- mean mechanism


def clip_update(update: Arrays, clipping_norm: float) -> Any:
    """The update (reply - sent, over every shared array of one client, head included)
    scaled by min(1, C / ||update||), ||.|| the L2 norm of all arrays flattened jointly.

    Returns float64 copies in the input's structure (mapping or list); an all-zero update
    is returned unchanged.  Equal to Flower's ``clip_inputs_inplace`` wherever that one
    does not raise (module docstring).
    """
    c = check_clipping_norm(clipping_norm)
    items = _items(update)
    norm = math.sqrt(sum(float(np.sum(a * a)) for _, a in items))
    scale = min(1.0, c / norm) if norm > 0 else 1.0
    return _rebuild(update, [(key, a * scale) for key, a in items])


def public_divisor(num_sampled: float | None, n: int) -> float:
    """m, the public number a noised sum of ``n`` clients' terms is divided by.

    None: ``n``.  An int: the count of clients sampled with a fixed sample size (Flower's
    ``num_sampled_clients``), at least the ``n`` updates (a sampled client that did not
    reply counts as one that did not move).  A float: the expected count q N of Poisson
    sampling (``client-sampling=poisson``, strategies/server/client_sampling.py), the
    fixed-denominator estimator of DP-FedAvg (McMahan, Ramage, Talwar, Zhang, ICLR 2018):
    the round's count is Binomial(N, q) and may exceed it, so only m > 0 is required.
    Either way m is public and data-independent, so the division is post-processing."""
    if num_sampled is None:
        return float(n)
    if isinstance(num_sampled, bool) or not isinstance(
        num_sampled, (int, float, np.integer, np.floating)
    ):
        raise ValueError(f"num_sampled must be a number, got {num_sampled!r}")
    if isinstance(num_sampled, (int, np.integer)):
        if num_sampled < max(n, 1):
            raise ValueError(f"num_sampled={num_sampled} is smaller than the {n} updates")
        return float(num_sampled)
    m = float(num_sampled)
    if not (math.isfinite(m) and m > 0):
        raise ValueError(f"the expected number of sampled clients must be > 0, got {m!r}")
    return m


def noise_std_mean(clipping_norm: float, noise_multiplier: float, num_clients: float) -> float:
    """sigma = z C / m, the per-coordinate std of ``noised_mean`` (Flower's ``compute_stdv``);
    m a count of clients (int, >= 1) or the expected count q N of Poisson sampling (float)."""
    c = check_clipping_norm(clipping_norm)
    z = check_noise_multiplier(noise_multiplier, allow_zero=True)
    return z * c / public_divisor(num_clients, 0)


def _check_clipped(norm: float, bound: float, what: str) -> None:
    if norm > bound * (1.0 + CLIP_SLACK):
        raise ValueError(f"{what}: norm {norm:.6g} exceeds the clipping bound {bound:.6g}")


def noised_mean(
    clipped_updates: Iterable[Arrays],
    clipping_norm: float,
    noise_multiplier: float,
    rng: np.random.Generator,
    *,
    num_sampled: float | None = None,
) -> Any:
    """(sum_n u_n + N(0, (zC)^2 I)) / m, i.e. the uniform mean of the clipped updates plus
    iid Gaussian noise of std sigma = z C / m on every coordinate.

    Privacy: under add/remove-one the sum moves by one clipped update, ||u_n|| <= C, so the
    sum with N(0, (zC)^2) noise is the Gaussian mechanism with noise multiplier z;
    dividing by m is post-processing when m is public.  ``num_sampled`` is that public m
    (``public_divisor``: the number of sampled clients, as Flower's ``num_sampled_clients``,
    or the expected count q N under Poisson sampling); None uses the number of updates,
    which is the same whenever every sampled client replied.
    The updates are read one at a time (a generator keeps one client's dense product
    update in memory, not all of them).
    Each input must already be clipped (checked: ||u_n|| <= C up to rounding).  Noise is
    drawn array by array in the first update's key order.  Returns float64 arrays in the
    inputs' structure.  Equal in distribution to Flower's
    ``DifferentialPrivacyServerSideFixedClipping`` on the same replies (module docstring).
    """
    c = check_clipping_norm(clipping_norm)
    z = check_noise_multiplier(noise_multiplier, allow_zero=True)
    first: Arrays | None = None
    keys: list[Any] = []
    total: list[np.ndarray] = []
    n = 0
    for i, update in enumerate(clipped_updates):
        items = _items(update)
        if first is None:
            first, keys, total = (
                update,
                [key for key, _ in items],
                [np.zeros_like(a) for _, a in items],
            )
        if [key for key, _ in items] != keys:
            raise ValueError(f"client {i}: arrays {[k for k, _ in items]} differ from {keys}")
        norm = math.sqrt(sum(float(np.sum(a * a)) for _, a in items))
        _check_clipped(norm, c, f"client {i} update")
        for j, (key, a) in enumerate(items):
            if a.shape != total[j].shape:
                raise ValueError(f"client {i}: array {key!r} has shape {a.shape}")
            total[j] += a
        n += 1
    if first is None:
        raise ValueError("noised_mean: no client updates")
    m = public_divisor(num_sampled, n)
    sigma = noise_std_mean(c, z, m)
    out = [
        (key, s / m + rng.normal(0.0, sigma, s.shape)) for key, s in zip(keys, total, strict=True)
    ]
    return _rebuild(first, out)


# --------------------------------------------------------------------------- a run's DP

# With ``client-sampling=fixed`` Flower samples a fixed number of nodes per round without
# replacement (FedAvg's ``configure_train``), not Poisson: no amplification is claimed,
# q = 1 (as Flower's own fixed-clipping wrapper accounts it).  With ``client-sampling=poisson``
# each node takes part with probability q = ``fraction-train`` independently
# (strategies/server/client_sampling.py), and the accountant composes the Poisson-subsampled
# Gaussian mechanism at that q.
SAMPLE_RATE = 1.0


class CentralDP:
    """One run's central DP as a strategy holds it: the mechanism the method declares
    (its ``Method.dp_mechanism``), C, z, delta, the noise source and
    the ledger.

    ``rng``: OS entropy by default (``np.random.default_rng()`` without a seed), never the
    run's ``seed`` setting; tests pass their own.  z = 0 is accepted for tests only (the
    run settings refuse it): the mechanisms then add no noise and ``release`` reports
    epsilon = inf without recording a round.  ``sample_rate``: q, the probability with
    which each client takes part in a round under Poisson sampling; 1 (``SAMPLE_RATE``)
    with a fixed sample size, which claims no amplification.
    """

    def __init__(
        self,
        mechanism: str,
        clipping_norm: float,
        noise_multiplier: float,
        delta: float,
        rng: np.random.Generator | None = None,
        sample_rate: float = SAMPLE_RATE,
    ) -> None:
        if not mechanism:
            raise ValueError("CentralDP needs the name of the method's mechanism")
        self.mechanism = mechanism
        self.clipping_norm = check_clipping_norm(clipping_norm)
        self.noise_multiplier = check_noise_multiplier(noise_multiplier, allow_zero=True)
        self.sample_rate = check_sample_rate(sample_rate)
        self.rng = np.random.default_rng() if rng is None else rng
        self.accountant = DpAccountant(delta)
        self.clipped = 0  # clients whose update was scaled down in the current round

    @property
    def delta(self) -> float:
        return self.accountant.delta

    def clip(self, update: Arrays) -> Any:
        """``clip_update`` with C, counting the clients it scales down (``clipped``)."""
        if flat_norm(update) > self.clipping_norm:
            self.clipped += 1
        return clip_update(update, self.clipping_norm)

    def release(self) -> dict[str, float]:
        """Record one released round (at q = ``sample_rate``); its metrics: ``dp-epsilon``,
        the run's epsilon at delta after it, and ``dp-clipped``, how many clients were
        scaled down (an unprotected count, like every metric: docs/privacy.md).  Resets the
        count."""
        clipped, self.clipped = self.clipped, 0
        if self.noise_multiplier == 0:
            return {"dp-epsilon": math.inf, "dp-clipped": clipped}
        self.accountant.record(self.noise_multiplier, self.sample_rate)
        return {"dp-epsilon": self.accountant.epsilon(), "dp-clipped": clipped}

    def epsilon(self) -> float:
        return self.accountant.epsilon()

    def state_dict(self) -> dict[str, Any]:
        """The ledger (JSON): what a checkpoint keeps, so that a resumed run continues it."""
        return self.accountant.state_dict()

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        accountant = DpAccountant.from_state_dict(state)
        if accountant.delta != self.delta:
            raise ValueError(f"{KEY_DELTA}: checkpoint {accountant.delta!r}, run {self.delta!r}")
        self.accountant = accountant


def mean_mechanism(
    dp: CentralDP,
    sent: Mapping[str, np.ndarray],
    payloads: Iterable[Mapping[str, Any]],
    num_sampled: float,
) -> tuple[dict[str, np.ndarray], dict[str, float]]:
    """The mean mechanism (docs/privacy.md section 2): the update reply - sent over every
    shared array, adapter and head jointly, clipped to C (``clip_update``), then
    ``noised_mean``: the sum plus N(0, (zC)^2 I), divided by m (``public_divisor``: the
    count sampled, or q N under Poisson sampling); the new state is sent + that.
    Returns the whole new state and the round's ``dp-noise-std``."""
    updates = ({k: np.asarray(p[k], np.float64) - v for k, v in sent.items()} for p in payloads)
    mean = noised_mean(
        (dp.clip(u) for u in updates),
        dp.clipping_norm,
        dp.noise_multiplier,
        dp.rng,
        num_sampled=num_sampled,
    )
    new_state = {k: v + mean[k] for k, v in sent.items()}
    return new_state, {
        "dp-noise-std": noise_std_mean(dp.clipping_norm, dp.noise_multiplier, num_sampled)
    }


def check_strategy_dp(method: Any, dp: CentralDP, weighting: str, updates_dir: Any) -> None:
    """What the run settings check (``Method.check_settings``), again where a strategy is
    built directly: the method's mechanism, uniform weights, no saved client updates."""
    mechanism = method.check_dp_supported()  # a refusal says why there is none
    if dp.mechanism != mechanism:
        raise ValueError(
            f"dp=central: method {method.name!r} implements the mechanism "
            f"{mechanism!r}, not {dp.mechanism!r}"
        )
    if weighting != "uniform":
        raise ValueError("dp=central needs aggregation-weights='uniform'")
    if updates_dir is not None:
        raise ValueError("dp=central: save-client-updates would store the raw updates")


def release_private(
    strategy: Any, server_round: int, payloads: list[dict[str, np.ndarray]]
) -> tuple[dict[str, np.ndarray], dict[str, float]]:
    """One round of the common strategy under dp=central: the method's mechanism
    (``strategy.aggregate_private``) over the kept replies, m = ``strategy.private_divisor``,
    the round recorded by the accountant. With no reply kept the mechanism still releases
    (the sent state plus noise: as if one client had not moved), so that whether a round is
    released never depends on the clients' data."""
    assert strategy.dp is not None
    m, sampled = strategy.private_divisor(server_round, len(payloads))  # q N: Poisson
    if not payloads:
        log.warning("round %d: no valid client update; dp=central releases noise only",
                    server_round)  # fmt: skip
    new_state, info = strategy.aggregate_private(
        server_round, payloads or [dict(strategy.uplink_state(server_round))], m
    )
    return new_state, {**info, **sampled, **strategy.dp.release()}

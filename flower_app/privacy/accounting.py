"""The privacy accountant of central DP: epsilon of a run's released rounds (RDP, through
Google's dp-accounting, the backend of Flower's own accountant), and the noise multiplier
for a target epsilon."""

from __future__ import annotations

import logging
import math
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

from flower_app.privacy.checks import (
    _check_steps,
    _real,
    check_delta,
    check_noise_multiplier,
    check_sample_rate,
)

# --------------------------------------------------------------------------- accounting
#
# Library: Flower's own accountant, ``flwr.serverapp.RdpAccountant`` (defined in
# ``flwr.supercore.privacy_accounting``), is a ledger around Google's
# ``dp-accounting`` RDP accountant, installed by the ``flwr[dp]`` extra (dp-accounting
# >= 0.6, < 0.7).  Its events are integer (sample_size, population_size) pairs under one
# fixed population per accountant, and its state schema embeds that configuration; the
# app's settings give a sampling rate (fraction-train).  So the computation here goes to the
# same backend, built exactly as Flower builds it (``RdpAccountant._to_backend_event``:
# GaussianDpEvent(z) without amplification, PoissonSampledDpEvent(q, GaussianDpEvent(z))
# otherwise; dp_accounting's default RDP orders, add/remove-one), and the tests hold the
# result to Flower's accountant and to dp_accounting called directly.  Opacus' RDP
# accountant computes the same RDP curve but would pull opacus (and its torch pin) into the
# server for one function; dp_accounting is what Flower itself depends on.
#
# Sampling: the amplification of q < 1 holds for Poisson sampling of clients.  Flower's
# FedAvg samples a fixed number of nodes without replacement, and Flower's own fixed-clipping
# wrapper accounts it with no amplification; so does the app (``SAMPLE_RATE`` = 1 below).


@contextmanager
def _quiet_absl() -> Iterator[None]:
    """dp_accounting logs through absl a warning for every fractional RDP order whose series
    does not converge (those orders are excluded, Flower's numbers alike); mute those."""

    class _Drop(logging.Filter):
        def filter(self, record: logging.LogRecord) -> bool:
            return "failed to converge" not in record.getMessage()

    logger, drop = logging.getLogger("absl"), _Drop()
    logger.addFilter(drop)
    try:
        yield
    finally:
        logger.removeFilter(drop)


def _dp_accounting() -> Any:
    try:
        import dp_accounting
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise ImportError('privacy accounting needs dp-accounting: pip install "flwr[dp]"') from exc
    return dp_accounting


def _backend_event(noise_multiplier: float, sample_rate: float) -> Any:
    dpa = _dp_accounting()
    gaussian = dpa.GaussianDpEvent(noise_multiplier)
    if sample_rate == 1.0:
        return gaussian
    return dpa.PoissonSampledDpEvent(sample_rate, gaussian)


def _epsilon(compositions: Sequence[tuple[float, float, int]], delta: float) -> float:
    dpa = _dp_accounting()
    accountant = dpa.rdp.RdpAccountant(
        neighboring_relation=dpa.NeighboringRelation.ADD_OR_REMOVE_ONE
    )
    steps = 0
    for z, q, count in compositions:
        if count:
            accountant.compose(_backend_event(z, q), count)
            steps += count
    if steps == 0:
        return 0.0
    with _quiet_absl():
        return float(accountant.get_epsilon(delta))


def epsilon_for(noise_multiplier: float, sample_rate: float, steps: int, delta: float) -> float:
    """epsilon after ``steps`` rounds of the Gaussian mechanism with multiplier z, clients
    sampled with probability q (Poisson; 1 = every client, no amplification), at delta
    (RDP accountant of dp-accounting, as Flower's; see the comment above ``_quiet_absl``)."""
    z = check_noise_multiplier(noise_multiplier)
    q = check_sample_rate(sample_rate)
    return _epsilon([(z, q, _check_steps(steps))], check_delta(delta))


def noise_multiplier_for(
    target_epsilon: float,
    sample_rate: float,
    steps: int,
    delta: float,
    tol: float = 1e-4,
) -> float:
    """The smallest z (within ``tol``) with ``epsilon_for(z, q, steps, delta) <= target``.

    dp_accounting's ``calibrate_dp_mechanism``: a bracket search from z = 1, Brent's method,
    and a bisection fallback that guarantees the returned z does not exceed the target."""
    eps, q, n, d = _calibration_inputs(target_epsilon, sample_rate, steps, delta)
    dpa = _dp_accounting()
    return _calibrate(lambda z: dpa.SelfComposedDpEvent(_backend_event(z, q), n), eps, d, tol)


def _calibration_inputs(
    target_epsilon: float, sample_rate: float, steps: int, delta: float
) -> tuple[float, float, int, float]:
    """(epsilon, q, steps, delta) checked for a calibration."""
    eps = _real(target_epsilon, "target epsilon")
    if not (math.isfinite(eps) and eps > 0):
        raise ValueError(f"target epsilon must be finite and > 0, got {target_epsilon!r}")
    q = check_sample_rate(sample_rate)
    n = _check_steps(steps)
    d = check_delta(delta)
    if n == 0:
        raise ValueError("steps must be >= 1 to calibrate a noise multiplier")
    return eps, q, n, d


def _calibrate(event: Any, eps: float, delta: float, tol: float) -> float:
    """dp_accounting's ``calibrate_dp_mechanism`` of ``event(z)`` to ``eps`` at ``delta``
    under RDP (add or remove one): bracket from z = 1, Brent, bisection fallback."""
    dpa = _dp_accounting()

    def fresh() -> Any:
        return dpa.rdp.RdpAccountant(neighboring_relation=dpa.NeighboringRelation.ADD_OR_REMOVE_ONE)

    with _quiet_absl():
        z = dpa.calibrate_dp_mechanism(
            fresh,
            event,
            eps,
            delta,
            bracket_interval=dpa.LowerEndpointAndGuess(0.0, 1.0),
            tol=tol,
        )
    return float(z)


def noise_multiplier_after(
    target_epsilon: float,
    prior: Sequence[tuple[float, float, int]],
    sample_rate: float,
    steps: int,
    delta: float,
    tol: float = 1e-4,
) -> float:
    """The smallest z (within ``tol``) with epsilon(``prior`` composed with ``steps`` steps
    of (z, q)) <= target: ``noise_multiplier_for`` when releases (z', q', steps') are already
    in a ledger. RDP composes by adding the curves order by order (Mironov 2017, Prop. 1),
    so the event is the composition of the prior releases and the new steps, handed to the
    same calibration (bracket from z = 1, Brent, bisection fallback: never above target).
    Without prior releases it is ``noise_multiplier_for`` itself, bit for bit. ValueError
    when the prior releases alone reach the target (no z can meet it)."""
    prior = [(z, q, n) for z, q, n in prior if n]
    if not prior:
        return noise_multiplier_for(target_epsilon, sample_rate, steps, delta, tol)
    eps, q, n, d = _calibration_inputs(target_epsilon, sample_rate, steps, delta)
    spent = _epsilon(prior, d)
    if spent >= eps:
        raise ValueError(
            f"the releases already composed ({prior}) reach epsilon {spent:.4g} >= the target "
            f"{eps:g} at delta {d:.3g}: no noise multiplier leaves room for the new steps"
        )
    dpa = _dp_accounting()
    before = [
        dpa.SelfComposedDpEvent(_backend_event(check_noise_multiplier(z), check_sample_rate(r)), c)
        for z, r, c in prior
    ]

    def event(z: float) -> Any:
        return dpa.ComposedDpEvent([*before, dpa.SelfComposedDpEvent(_backend_event(z, q), n)])

    return _calibrate(event, eps, d, tol)


class DpAccountant:
    """The run's privacy ledger: compositions (z, q, steps), epsilon at a delta.

    ``state_dict()`` is JSON-able ({"delta", "compositions": [[z, q, steps], ...]}) and
    ``from_state_dict`` rebuilds it, so a resumed run continues the count; consecutive rounds
    with the same (z, q) are merged into one entry.
    """

    def __init__(self, delta: float, compositions: Sequence[Sequence[float | int]] = ()) -> None:
        self.delta = check_delta(delta)
        self.compositions: list[tuple[float, float, int]] = []
        for entry in compositions:
            if len(entry) != 3:
                raise ValueError(f"a composition is (z, q, steps), got {entry!r}")
            z, q, steps = entry
            self.record(z, q, steps)

    def record(self, noise_multiplier: float, sample_rate: float, steps: int = 1) -> None:
        """Compose ``steps`` more rounds of multiplier z at sampling rate q."""
        z = check_noise_multiplier(noise_multiplier)
        q = check_sample_rate(sample_rate)
        n = _check_steps(steps)
        if n == 0:
            return
        if self.compositions and self.compositions[-1][:2] == (z, q):
            self.compositions[-1] = (z, q, self.compositions[-1][2] + n)
        else:
            self.compositions.append((z, q, n))

    @property
    def steps(self) -> int:
        return sum(n for _, _, n in self.compositions)

    def epsilon(self, delta: float | None = None) -> float:
        """Cumulative epsilon at ``delta`` (default: the ledger's ``dp-delta``)."""
        return _epsilon(self.compositions, self.delta if delta is None else check_delta(delta))

    def state_dict(self) -> dict[str, Any]:
        return {"delta": self.delta, "compositions": [list(c) for c in self.compositions]}

    @classmethod
    def from_state_dict(cls, state: Mapping[str, Any]) -> DpAccountant:
        try:
            return cls(state["delta"], state["compositions"])
        except (KeyError, TypeError) as exc:
            raise ValueError(f"not a DpAccountant state: {state!r}") from exc

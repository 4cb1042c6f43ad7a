"""Poisson client sampling (``client-sampling=poisson``): in every round each available node
takes part with probability q = ``fraction-train``, independently of the other nodes and
of the other rounds, so a round's count is Binomial(N, q) for N nodes available
(``PoissonSampler``; ``ClientSampling``, held by the common strategy, picks a round's nodes
in either mode). The accountant composes the Poisson-subsampled Gaussian mechanism at this
q. Under ``dp=central`` the noised sum is divided by the expected count q N, a public divisor
(``private_divisor``): E[sum over the sampled clients of u_n] / (q N) = (1/N) sum over all N
of u_n. The sample is drawn from OS entropy under ``dp=central`` (hidden, like the noise),
else from the run's ``seed`` and the round (a resumed run samples the same nodes); nodes are
visited in ascending node-id order. The privacy argument and what it does not cover:
docs/privacy.md, section 5a.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

import numpy as np
from flwr.app import MessageType, RecordDict
from flwr.common.logger import log as flwr_log
from flwr.serverapp import Grid
from flwr.serverapp.strategy.strategy_utils import sample_nodes

from flower_app.privacy.checks import check_sample_rate

SAMPLING_MODES = ("fixed", "poisson")
# Mixed into the seed sequence of the seeded sampler, so that its stream is not that of any
# other generator seeded from the run's seed.
_STREAM = 0x5A3D_91C7


class PoissonSampler:
    """Each node in a round with probability ``rate``; remembers each round's N and count.

    ``seed``: an int derives round t's draws from (seed, t) (reproducible); None draws a
    secret from OS entropy once (what dp=central uses)."""

    def __init__(self, rate: float, seed: int | None = None) -> None:
        self.rate = check_sample_rate(rate)
        self.secret = seed is None
        self.entropy = int(np.random.SeedSequence().entropy) if seed is None else int(seed)
        if self.entropy < 0:
            raise ValueError(f"seed must be >= 0, got {seed!r}")
        self.rounds: dict[int, tuple[int, int]] = {}  # round -> (N available, count sampled)

    def generator(self, server_round: int) -> np.random.Generator:
        return np.random.default_rng([_STREAM, self.entropy, int(server_round)])

    def sample(self, node_ids: Iterable[int], server_round: int) -> list[int]:
        """The nodes of ``node_ids`` that take part in ``server_round``: node i is in when
        its uniform draw u_i (in ascending node-id order) is below q."""
        nodes = sorted({int(n) for n in node_ids})
        draws = self.generator(server_round).random(len(nodes))
        chosen = [n for n, u in zip(nodes, draws, strict=True) if u < self.rate]
        self.rounds[server_round] = (len(nodes), len(chosen))
        return chosen

    def expected_count(self, server_round: int) -> float:
        """q N of ``server_round``: the divisor of its noised sum under dp=central."""
        if server_round not in self.rounds:
            raise ValueError(f"round {server_round}: no Poisson sample was drawn")
        return self.rate * self.rounds[server_round][0]

    def metrics(self, server_round: int) -> dict[str, float]:
        """The round's row: ``sample-rate`` q, ``population`` N, ``sampled`` the count."""
        population, count = self.rounds.get(server_round, (0, 0))
        return {"sample-rate": self.rate, "population": population, "sampled": count}


class ClientSampling:
    """Which nodes a round trains (``client-sampling``), held by the common strategy:
    FedAvg's fixed sample size (``sampler`` None) or the Poisson sample at q =
    ``fraction-train``, secret (OS entropy) under central DP (``dp``, a ``CentralDP``,
    whose accountant must use the same q: 1 with a fixed sample size), else derived from
    ``seed``."""

    def __init__(self, mode: str, rate: float, seed: int | None, dp: Any = None) -> None:
        if mode not in SAMPLING_MODES:
            raise ValueError(f"client-sampling must be one of {SAMPLING_MODES}, got {mode!r}")
        private = dp is not None
        self.sampler = None if mode == "fixed" else PoissonSampler(rate, None if private else seed)
        q = 1.0 if self.sampler is None else self.sampler.rate
        if private and dp.sample_rate != q:
            raise ValueError(
                f"dp=central: the accountant's sample rate {dp.sample_rate} is not the "
                f"sampling's {q} (client-sampling, fraction-train)"
            )

    def poisson_sample(
        self, grid: Grid, server_round: int, min_available: int, caller: str
    ) -> list[int]:
        """The round's Poisson sample of the connected nodes, once ``min_available`` are
        connected (logged as ``caller``'s): each of the N nodes with probability q
        (possibly none; ``min-train-nodes`` does not apply, it would change the sampling
        the accountant assumes)."""
        assert self.sampler is not None
        _, available = sample_nodes(grid, min_available, 0)
        node_ids = self.sampler.sample(available, server_round)
        flwr_log(
            logging.INFO,
            "%s: Poisson sampling q=%s: %s nodes (out of %s)",
            caller,
            self.sampler.rate,
            len(node_ids),
            len(available),
        )
        return node_ids

    def poisson_messages(
        self, strategy: Any, server_round: int, arrays: Any, config: Any, grid: Grid
    ) -> Iterable[Any]:
        """``strategy``'s (a Flower FedAvg) training messages, sent to the round's Poisson
        sample instead of its fixed-size one, once ``min-available-nodes`` are connected."""
        node_ids = self.poisson_sample(
            grid, server_round, strategy.min_available_nodes, "configure_train"
        )
        config["server-round"] = server_round
        record = RecordDict({strategy.arrayrecord_key: arrays, strategy.configrecord_key: config})
        return strategy._construct_messages(record, node_ids, MessageType.TRAIN)

    def round_sample(
        self,
        grid: Grid,
        server_round: int,
        caller: str,
        *,
        fraction: float,
        min_train: int,
        min_available: int,
    ) -> list[int]:
        """The nodes a round before training (a method's round 0) queries: those a training
        round would sample, FedAvg's fixed size (``fraction`` of the connected nodes, at
        least ``min_train``) or the Poisson sample, so that under dp=central the
        accountant's q holds for it as for the training rounds."""
        if self.sampler is not None:
            return self.poisson_sample(grid, server_round, min_available, caller)
        sample_size = max(int(len(list(grid.get_node_ids())) * fraction), min_train)
        node_ids, _ = sample_nodes(grid, min_available, sample_size)
        return node_ids

    def metrics(self, server_round: int) -> dict[str, float]:
        """The round's ``sample-rate``, ``population`` and ``sampled`` (Poisson only)."""
        return {} if self.sampler is None else self.sampler.metrics(server_round)

    def private_divisor(self, server_round: int, sent: int) -> tuple[float, dict[str, float]]:
        """m for dp=central and its metrics: with a fixed sample size the nodes sent a
        message (``sent``); with Poisson sampling q N, ``dp-sampled`` then the count and
        ``dp-divisor`` q N."""
        if self.sampler is None:
            return sent, {"dp-sampled": sent}
        m = self.sampler.expected_count(server_round)
        return m, {"dp-sampled": self.sampler.rounds[server_round][1], "dp-divisor": m}

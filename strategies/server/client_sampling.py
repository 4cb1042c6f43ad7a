"""Poisson client sampling (``client-sampling=poisson``): in every round each available node
takes part with probability q = ``fraction-train``, independently of the other nodes and
of the other rounds, so a round's count is Binomial(N, q) for N nodes available.

Why: amplification by subsampling.  The RDP bound of the Poisson-subsampled Gaussian
mechanism (Mironov, Talwar, Zhang 2019; dp-accounting's ``PoissonSampledDpEvent``, what
``flower_app/privacy/accounting.py`` composes at this q) holds for this sampling, not for
Flower's fixed-size sampling without replacement (``client-sampling=fixed``, FedAvg's
``configure_train``), which the app accounts at q = 1.  Under ``dp=central`` the noised
sum is then divided by the expected count q N, not by the round's count (the
fixed-denominator estimator of DP-FedAvg, McMahan, Ramage, Talwar, Zhang, ICLR 2018): a
public, data-independent divisor, so the division stays post-processing, and
E[sum over the sampled clients of u_n] / (q N) = (1/N) sum over all N of u_n, an unbiased
estimate of the population mean.

Randomness.  The amplification argument needs the sample to be unknown to whoever sees the
released model, like the noise (strategies/server/central_dp.py: never from the public
``seed``).  So under ``dp=central`` the sampler draws from OS entropy (a resumed run samples
its remaining rounds afresh: each round is an independent Poisson sample either way).
Without DP nothing is claimed, and the sample is derived from the run's ``seed`` and the
round, so that a run, and a resumed run, sample the same nodes.  Nodes are visited in
ascending node-id order, so the sample does not depend on the order the grid lists them.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Message, MessageType, RecordDict
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


class SampledRounds:
    """Mixed into the common strategy, before Flower's FedAvg: its ``configure_train`` sends
    the round's training message to FedAvg's sample (``sampler`` None: a fixed sample
    size) or to the Poisson sample. ``use_sampling`` sets it up."""

    sampler: PoissonSampler | None = None

    def use_sampling(self, mode: str, rate: float, seed: int | None, dp: Any = None) -> None:
        """``client-sampling``: 'fixed' (FedAvg's) or 'poisson' at q = ``rate``, secret
        (OS entropy) under central DP (``dp``, a ``CentralDP``, whose accountant must use
        the same q: 1 with a fixed sample size), else derived from ``seed``."""
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

    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """FedAvg's, or with the Poisson sampler: once ``min-available-nodes`` are
        connected, each of the N connected nodes is sent the round's training message with
        probability q (possibly none; ``min-train-nodes`` does not apply, it would change
        the sampling the accountant assumes)."""
        if self.sampler is None:
            return super().configure_train(server_round, arrays, config, grid)  # type: ignore[misc]
        node_ids = self.poisson_sample(grid, server_round, "configure_train")
        config["server-round"] = server_round
        keys = (self.arrayrecord_key, self.configrecord_key)  # type: ignore[attr-defined]
        record = RecordDict({keys[0]: arrays, keys[1]: config})
        return self._construct_messages(record, node_ids, MessageType.TRAIN)  # type: ignore[attr-defined]

    def poisson_sample(self, grid: Grid, server_round: int, caller: str) -> list[int]:
        """The round's Poisson sample of the connected nodes, once ``min-available-nodes``
        are connected (logged as ``caller``'s)."""
        assert self.sampler is not None
        _, available = sample_nodes(grid, self.min_available_nodes, 0)  # type: ignore[attr-defined]
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

    def round_sample(self, grid: Grid, server_round: int, caller: str) -> list[int]:
        """The nodes a round before training (a method's round 0) queries: those a training
        round would sample, FedAvg's fixed size (``fraction-train`` of the connected nodes,
        at least ``min-train-nodes``) or the Poisson sample, so that under dp=central the
        accountant's q holds for it as for the training rounds."""
        if self.sampler is not None:
            return self.poisson_sample(grid, server_round, caller)
        fraction = self.fraction_train  # type: ignore[attr-defined]
        sample_size = max(
            int(len(list(grid.get_node_ids())) * fraction),
            self.min_train_nodes,  # type: ignore[attr-defined]
        )
        node_ids, _ = sample_nodes(grid, self.min_available_nodes, sample_size)  # type: ignore[attr-defined]
        return node_ids

    def sampling_metrics(self, server_round: int) -> dict[str, float]:
        """The round's ``sample-rate``, ``population`` and ``sampled`` (Poisson only)."""
        return {} if self.sampler is None else self.sampler.metrics(server_round)

    def private_divisor(self, server_round: int, replies: int) -> tuple[float, dict[str, float]]:
        """m for dp=central and its metrics: with a fixed sample size the nodes sent a
        message (``CommunicationLedger.num_sampled``, at least the ``replies``); with
        Poisson sampling q N, ``dp-sampled`` then the count and ``dp-divisor`` q N."""
        if self.sampler is None:
            count = self.communication.num_sampled(server_round, replies)  # type: ignore[attr-defined]
            return count, {"dp-sampled": count}
        m = self.sampler.expected_count(server_round)
        return m, {"dp-sampled": self.sampler.rounds[server_round][1], "dp-divisor": m}

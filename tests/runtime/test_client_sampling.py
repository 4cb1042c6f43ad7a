"""Poisson client sampling (``client-sampling=poisson``; strategies/server/client_sampling.py,
docs/privacy.md): each node takes part with probability q, the accountant composes the
Poisson-subsampled Gaussian mechanism at that q, and under dp=central the noised sum is
divided by the expected count q N. Hand-built Flower messages and a stand-in grid, no
simulation (the runs: tests/runtime/test_app_e2e.py)."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from flwr.app import ArrayRecord, ConfigRecord

from flower_app.settings.config import ConfigError, resolve_config
from flower_app.wire.records import from_array_record, to_array_record
from strategies.florg.dp import noised_gram_sum
from strategies.server.central_dp import CentralDP, mean_mechanism, public_divisor
from strategies.server.client_sampling import PoissonSampler
from tests.harness.strategy_helpers import strategy_for
from tests.runtime.test_dp_app import client_states, initial_state, reply, uplink

C, Z, DELTA, Q = 0.5, 1.3, 1e-4, 0.3
POISSON_DP = {
    "dp": "central",
    "dp_clipping_norm": C,
    "dp_noise_multiplier": Z,
    "dp_delta": DELTA,
    "client_sampling": "poisson",
    "fraction_train": Q,
}


class Grid:
    """What the strategy's sampling asks of Flower's grid: the connected node ids."""

    def __init__(self, nodes: list[int]) -> None:
        self.nodes = nodes

    def get_node_ids(self) -> list[int]:
        return list(self.nodes)


def binomial_z(successes: int, trials: int, p: float) -> float:
    """The standardised distance of a Binomial(trials, p) count from its mean (normal
    approximation, accurate at the sizes below: trials p (1 - p) in the thousands)."""
    return (successes - trials * p) / math.sqrt(trials * p * (1 - p))


def sampling_frequency_z(sampler: PoissonSampler, nodes: list[int], rounds: int, q: float):
    """(z of the total count against Binomial(N T, q), z of each node's count against
    Binomial(T, q), the per-round counts)."""
    hits = dict.fromkeys(nodes, 0)
    counts = []
    for t in range(1, rounds + 1):
        chosen = sampler.sample(nodes, t)
        counts.append(len(chosen))
        for n in chosen:
            hits[n] += 1
    total = binomial_z(sum(counts), len(nodes) * rounds, q)
    per_node = np.array([binomial_z(h, rounds, q) for h in hits.values()])
    return total, per_node, counts


def test_the_sampling_frequency_over_many_rounds_matches_q():
    """Binomial tests at 1e-5 two-sided (|z| < 4.42): the total count over 300 rounds of
    200 nodes, and each node's count (Bonferroni over nodes: |z| < 5.3 for 200 tests).
    The same test rejects a sampler whose rate is off by 0.02, so it can fail."""
    nodes = list(np.random.default_rng(0).choice(10**9, size=200, replace=False))
    for seed in (0, None):  # the run's seed; OS entropy (dp=central)
        total, per_node, counts = sampling_frequency_z(PoissonSampler(Q, seed), nodes, 300, Q)
        assert abs(total) < 4.42
        assert np.max(np.abs(per_node)) < 5.3
        assert len(set(counts)) > 5  # the count varies from round to round
        # its spread is the binomial one: var N q (1 - q) = 42 (sample variance over 300)
        assert 42 * 0.7 < np.var(counts, ddof=1) < 42 * 1.4
    off, _, _ = sampling_frequency_z(PoissonSampler(Q + 0.02, 0), nodes, 300, Q)
    assert abs(off) > 4.42


def test_the_sample_is_seeded_without_dp_secret_with_it_and_ignores_node_order():
    nodes = list(range(100, 160))
    a, b = PoissonSampler(0.5, seed=7), PoissonSampler(0.5, seed=7)
    assert a.sample(nodes, 3) == b.sample(list(reversed(nodes)), 3)  # a resumed run: the same
    assert a.sample(nodes, 3) != a.sample(nodes, 4)
    assert PoissonSampler(0.5, seed=8).sample(nodes, 3) != a.sample(nodes, 3)
    secret = [PoissonSampler(0.5).sample(nodes, 3) for _ in range(2)]
    assert secret[0] != secret[1]  # OS entropy: not reproducible from anything public
    assert PoissonSampler(1.0, seed=0).sample(nodes, 1) == nodes
    assert a.metrics(3) == {
        "sample-rate": 0.5,
        "population": 60,
        "sampled": len(a.sample(nodes, 3)),
    }
    assert a.expected_count(3) == 30.0
    with pytest.raises(ValueError, match="no Poisson sample"):
        a.expected_count(9)
    with pytest.raises(ValueError, match="sample rate"):
        PoissonSampler(0.0)


def test_the_divisor_is_a_count_at_least_the_updates_or_an_expected_count():
    assert public_divisor(None, 3) == 3.0 and public_divisor(4, 3) == 4.0
    with pytest.raises(ValueError, match="smaller than"):
        public_divisor(2, 3)  # a fixed count below the updates: a bug upstream
    assert public_divisor(1.5, 3) == 1.5  # Poisson: more replies than q N is normal
    for bad in (0.0, -1.0, math.nan, math.inf):
        with pytest.raises(ValueError, match="expected number"):
            public_divisor(bad, 3)


# --------------------------------------------------------------------------- estimator


def _poisson_means(population, q, trials, rng, divisor):
    """Released means (z = 0, no clipping active) over ``trials`` Poisson rounds."""
    dp = CentralDP("mean", 1e6, 0.0, DELTA, rng)
    sent = {"x": np.zeros(population.shape[1])}
    out = []
    for _ in range(trials):
        chosen = population[rng.random(population.shape[0]) < q]
        payloads = [{"x": u} for u in chosen] or [sent]  # none sampled: a zero update
        new, _ = mean_mechanism(dp, sent, payloads, divisor)
        out.append(new["x"])
    return np.array(out)


def test_the_noised_sum_over_q_n_is_an_unbiased_estimate_of_the_population_mean():
    """z = 0, C above every norm: the average of 4000 rounds' releases is within 4.5
    standard errors of the mean over all N clients, coordinate by coordinate; dividing by
    N instead of q N, with the same test, is rejected (the test can fail)."""
    rng = np.random.default_rng(11)
    n, q = 40, 0.2
    population = rng.standard_normal((n, 5)) + np.linspace(-1.0, 2.0, 5)
    target = population.mean(axis=0)
    for divisor, unbiased in ((q * n, True), (float(n), False)):
        means = _poisson_means(population, q, 4000, rng, divisor)
        se = means.std(axis=0, ddof=1) / math.sqrt(len(means))
        zs = (means.mean(axis=0) - target) / se
        assert (np.max(np.abs(zs)) < 4.5) == unbiased, (divisor, zs)


def test_florgs_noised_gram_over_q_n_is_unbiased_too():
    """The Gram mechanism with the update clipped: Q^ = P^T P + (sum over the sampled of
    g(D_n) + E) / (q N), with z = 0, averages to the mean Gram of all N clients."""
    rng = np.random.default_rng(12)
    n, q, r, k = 30, 0.25, 2, 4
    prev = rng.standard_normal((r, k))
    clients = [prev + 0.1 * rng.standard_normal((r, k)) for _ in range(n)]
    target = np.mean([a.T @ a for a in clients], axis=0)
    qs = []
    for _ in range(3000):
        chosen = [a for a, u in zip(clients, rng.random(n), strict=True) if u < q] or [prev]
        qs.append(noised_gram_sum(chosen, 10.0, 0.0, rng, prev_A=prev, num_sampled=q * n))
    qs = np.array(qs)
    se = qs.std(axis=0, ddof=1) / math.sqrt(len(qs))
    assert np.max(np.abs((qs.mean(axis=0) - target) / se)) < 4.5


# --------------------------------------------------------------------------- the strategy


def _epsilon_direct(z: float, q: float, steps: int, delta: float) -> float:
    """epsilon from dp-accounting called here, independently of strategies/server."""
    import dp_accounting as dpa

    accountant = dpa.rdp.RdpAccountant(
        neighboring_relation=dpa.NeighboringRelation.ADD_OR_REMOVE_ONE
    )
    accountant.compose(dpa.PoissonSampledDpEvent(q, dpa.GaussianDpEvent(z)), steps)
    return accountant.get_epsilon(delta)


def _train_round(strategy, server_round, grid, states):
    """configure_train on ``grid``, then a reply from every node it sampled."""
    arrays = to_array_record(strategy.global_state)
    messages = list(strategy.configure_train(server_round, arrays, ConfigRecord(), grid))
    nodes = [m.metadata.dst_node_id for m in messages]
    replies = [
        reply(uplink(strategy.method.name, states[i % len(states)]), i) for i in range(len(nodes))
    ]
    _, metrics = strategy.aggregate_train(server_round, replies)
    return nodes, metrics


@pytest.mark.parametrize("method", ["fedit", "florg", "federa"])
def test_each_round_records_q_the_count_and_epsilon_at_q(method):
    """The strategy sends the round's message to the Poisson sample, and its row has q,
    N, the count, the divisor q N and the accountant's epsilon at q, which equals
    dp-accounting's own computation for the Poisson-subsampled Gaussian."""
    rng = np.random.default_rng(3)
    sent = initial_state(method, rng)
    states = client_states(sent, rng, n=4)
    strategy = strategy_for(method, sent, **POISSON_DP)
    assert strategy.dp.sample_rate == Q and strategy.sampling.sampler.secret
    grid = Grid(list(range(1, 41)))
    for t in (1, 2, 3):
        nodes, metrics = _train_round(strategy, t, grid, states)
        assert metrics["sample-rate"] == Q and metrics["population"] == 40
        assert metrics["sampled"] == metrics["dp-sampled"] == len(nodes)
        assert metrics["clients"] == len(nodes)
        assert metrics["dp-divisor"] == pytest.approx(Q * 40)
        assert metrics["dp-noise-std"] > 0
        assert metrics["dp-epsilon"] == pytest.approx(_epsilon_direct(Z, Q, t, DELTA), rel=1e-9)
    assert strategy.dp.state_dict()["compositions"] == [[Z, Q, 3]]
    # amplification: well below the epsilon of the same rounds with every client (q = 1)
    assert metrics["dp-epsilon"] < 0.5 * _epsilon_direct(Z, 1.0, 3, DELTA)


def test_the_mean_is_divided_by_q_n_not_by_the_count():
    rng = np.random.default_rng(5)
    sent = initial_state("fedit", rng)
    states = client_states(sent, rng, n=3, scale=0.01)  # below C: nothing clipped
    strategy = strategy_for("fedit", sent, **POISSON_DP)
    strategy.dp.noise_multiplier = 0.0
    grid = Grid(list(range(1, 21)))
    arrays = to_array_record(strategy.global_state)
    nodes = [
        m.metadata.dst_node_id for m in strategy.configure_train(1, arrays, ConfigRecord(), grid)
    ]
    replies = [reply(uplink("fedit", states[i % 3]), i) for i in range(len(nodes))]
    arrays, metrics = strategy.aggregate_train(1, replies)
    got = from_array_record(arrays)
    for key in sent:
        total = sum(
            np.asarray(states[i % 3][key], np.float32).astype(np.float64) - sent[key]
            for i in range(len(nodes))
        )
        want = sent[key] + total / (Q * 20)
        np.testing.assert_allclose(got[key], want.astype(np.float32), rtol=1e-5, atol=1e-6)
    assert metrics["dp-clipped"] == 0


def test_a_round_that_samples_no_node_still_releases_and_is_accounted():
    rng = np.random.default_rng(6)
    sent = initial_state("florg", rng)
    strategy = strategy_for("florg", sent, **POISSON_DP)
    strategy.sampling.sampler.rate = 1e-12  # no node drawn (the accountant keeps q)
    arrays = to_array_record(strategy.global_state)
    assert list(strategy.configure_train(1, arrays, ConfigRecord(), Grid([1, 2, 3]))) == []
    new, metrics = strategy.aggregate_train(1, [])
    assert new is not None and metrics["sampled"] == 0 and metrics["clients"] == 0
    assert metrics["dp-epsilon"] == pytest.approx(_epsilon_direct(Z, Q, 1, DELTA), rel=1e-9)


def test_a_resumed_run_continues_the_ledger_at_q():
    rng = np.random.default_rng(7)
    sent = initial_state("florg", rng)
    states = client_states(sent, rng, n=4)
    strategy = strategy_for("florg", sent, **POISSON_DP)
    grid = Grid(list(range(1, 31)))
    for t in (1, 2):
        _train_round(strategy, t, grid, states)
    state = json.loads(json.dumps(strategy.state_json()))
    assert state["dp"] == {"delta": DELTA, "compositions": [[Z, Q, 2]]}
    resumed = strategy_for("florg", sent, **POISSON_DP)
    resumed.restore(strategy.state_arrays(), state)
    _, metrics = _train_round(resumed, 3, grid, states)
    assert metrics["dp-epsilon"] == pytest.approx(_epsilon_direct(Z, Q, 3, DELTA), rel=1e-9)
    assert resumed.dp.state_dict()["compositions"] == [[Z, Q, 3]]


def test_without_dp_the_sample_follows_the_run_seed_and_fixed_sampling_is_unchanged():
    rng = np.random.default_rng(8)
    sent = initial_state("fedit", rng)
    grid = Grid(list(range(1, 51)))
    arrays = ArrayRecord()
    picks = []
    for _ in range(2):
        s = strategy_for("fedit", sent, client_sampling="poisson", fraction_train=0.4, seed=3)
        assert s.dp is None and not s.sampling.sampler.secret
        picks.append(
            [m.metadata.dst_node_id for m in s.configure_train(2, arrays, ConfigRecord(), grid)]
        )
    assert picks[0] == picks[1] and 0 < len(picks[0]) < 50
    fixed = strategy_for("fedit", sent, fraction_train=0.4, dp="central")
    assert fixed.sampling.sampler is None and fixed.dp.sample_rate == 1.0
    assert len(list(fixed.configure_train(1, arrays, ConfigRecord(), grid))) == 20


def test_the_setting_is_checked_naming_its_key():
    with pytest.raises(ConfigError, match="client-sampling"):
        resolve_config({}, {"client-sampling": "bernoulli"})
    config = resolve_config({}, {"client-sampling": "poisson", "fraction-train": 0.1})
    assert config.client_sampling == "poisson"

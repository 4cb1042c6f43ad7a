"""SecAgg+ secure summation (strategies/server/secure_sum.py with the client stages of
flower_app/secure/secaggplus_client.py) over an in-process grid: exact sums within the
quantisation bound, no unmasked contribution reaching the server, dropouts, refusals."""

from __future__ import annotations

import random

import numpy as np
import pytest
from flwr.app import ConfigRecord, Context, Error, Message, RecordDict
from flwr.common import bytes_to_ndarray
from flwr.common.secure_aggregation.quantization import dequantize
from flwr.common.secure_aggregation.secaggplus_constants import (
    RECORD_KEY_CONFIGS,
    RECORD_KEY_STATE,
    Key,
    Stage,
)
from flwr.supercore.task_identity import TaskIdentity

import flower_app.secure.secaggplus_client as client_module
from flower_app.secure.secaggplus_client import (
    WEIGHT_KEY,
    checked_contribution,
    secaggplus_client,
    weighted_contribution,
)
from flower_app.secure.settings import SecAggPlusSettings
from strategies.server.secure_sum import SecureSumFailed, resolve_shares, secure_sum

SHAPES = {"a": (3, 4), "b": (5,), "c": (2, 2, 2)}
STAGES = Stage.all()


@pytest.fixture(autouse=True)
def server_identity(monkeypatch):
    """Messages take their sender's identity from the process (the ServerApp's, here)."""
    for name in ("_run_id", "_task_id", "_node_id"):
        monkeypatch.setattr(TaskIdentity, name, 1)


class InProcessGrid:
    """Routes each message to ``secaggplus_client`` with the node's own Context. A node in
    ``silent`` sends no reply from that stage on; a node in ``failing`` answers that stage
    with an error (as a ClientApp whose handler raised). Records what the server receives."""

    def __init__(self, contributions, silent=None, failing=None):
        self.contributions = contributions
        self.contexts = {
            nid: Context(run_id=1, node_id=nid, node_config={}, state=RecordDict(), run_config={})
            for nid in contributions
        }
        self.silent = silent or {}
        self.failing = failing or {}
        self.replies: dict[str, dict[int, Message]] = {}
        self.current: int | None = None
        self.sent_keys: dict[str, set[str]] = {}  # stage -> the config keys the server sent

    def get_node_ids(self):
        return list(self.contributions)

    def send_and_receive(self, messages, *, timeout=None):
        out = []
        for msg in messages:
            nid = msg.metadata.dst_node_id
            cfg = msg.content.config_records[RECORD_KEY_CONFIGS]
            stage = cfg[Key.STAGE]
            self.sent_keys.setdefault(stage, set()).update(cfg)
            if nid in self.silent and STAGES.index(stage) >= STAGES.index(self.silent[nid]):
                continue
            if self.failing.get(nid) == stage:
                out.append(Message(Error(code=0, reason="simulated failure"), reply_to=msg))
                continue
            self.current = nid
            try:
                reply = secaggplus_client(msg, self.contexts[nid], self.contributions[nid])
            except Exception as exc:  # a ClientApp reports a raised handler as an error
                reply = Message(Error(code=0, reason=repr(exc)), reply_to=msg)
            self.replies.setdefault(stage, {})[nid] = reply
            out.append(reply)
        return out


def make_clients(n, seed, scale=1.0):
    rng = np.random.default_rng(seed)
    xs, ws, contributions = {}, {}, {}
    for nid in rng.choice(10**9, size=n, replace=False).tolist():
        xs[nid] = {k: scale * rng.uniform(-1, 1, s) for k, s in SHAPES.items()}
        ws[nid] = float(rng.uniform(0.1, 1.0))
        contributions[nid] = weighted_contribution(xs[nid], ws[nid])
    return xs, ws, contributions


def expected(xs, ws, nodes):
    sums = {k: sum(ws[n] * xs[n][k] for n in nodes) for k in SHAPES}
    return sums, sum(ws[n] for n in nodes)


def quantisation_bound(settings, m):
    """Each value is stochastically rounded to a step 2c/Q (error below one step), so the
    sum of m contributions is off by less than m * 2c/Q per entry."""
    return m * 2 * settings.clipping_range / settings.quantization_range


def assert_sum(result, xs, ws, nodes, settings):
    sums, weight_sum = expected(xs, ws, nodes)
    bound = quantisation_bound(settings, len(nodes))
    assert set(result.weighted_sums) == set(SHAPES)
    for k in SHAPES:
        assert result.weighted_sums[k].shape == SHAPES[k]
        assert np.max(np.abs(result.weighted_sums[k] - sums[k])) < bound
    assert abs(result.weight_sum - weight_sum) < bound
    return max(float(np.max(np.abs(result.weighted_sums[k] - sums[k]))) for k in SHAPES)


SETTINGS = SecAggPlusSettings(num_shares=1.0, reconstruction_threshold=0.5)


@pytest.mark.parametrize("n", [5, 8])
def test_the_unmasked_sum_is_the_weighted_sum_within_the_quantisation_bound(n):
    xs, ws, contributions = make_clients(n, seed=n)
    grid = InProcessGrid(contributions)
    result = secure_sum(grid, grid.get_node_ids(), SHAPES, SETTINGS, rng=random.Random(0))
    assert_sum(result, xs, ws, list(xs), SETTINGS)
    report = result.report
    assert report.threshold_met and report.survivors == tuple(sorted(xs))
    assert report.dropped_after_keys == report.dropped_before == report.silent_at_unmask == ()
    assert (report.num_shares, report.threshold) == (n, max(round(0.5 * n), 2))
    # The messages read like Flower's SecAgg+: its stage names and config keys.
    assert grid.sent_keys[Stage.SETUP] == {
        Key.STAGE, Key.SAMPLE_NUMBER, Key.SHARE_NUMBER, Key.THRESHOLD, Key.CLIPPING_RANGE,
        Key.TARGET_RANGE, Key.MOD_RANGE, Key.MAX_WEIGHT,
    }  # fmt: skip
    assert grid.sent_keys[Stage.SHARE_KEYS] == {Key.STAGE} | {str(i) for i in xs}
    assert grid.sent_keys[Stage.COLLECT_MASKED_VECTORS] == {
        Key.STAGE, Key.CIPHERTEXT_LIST, Key.SOURCE_LIST,
    }  # fmt: skip
    assert grid.sent_keys[Stage.UNMASK] == {
        Key.STAGE, Key.ACTIVE_NODE_ID_LIST, Key.DEAD_NODE_ID_LIST,
    }  # fmt: skip
    mean = result.weighted_mean()
    assert np.allclose(mean["a"], sum(ws[i] * xs[i]["a"] for i in xs) / sum(ws.values()), atol=1e-4)


def test_coarse_quantisation_errs_but_within_the_derived_bound():
    """With Q = 2**10 the rounding shows, and stays below m * 2c / Q."""
    settings = SecAggPlusSettings(3, 2, clipping_range=2.0, quantization_range=2**10)
    xs, ws, contributions = make_clients(6, seed=3)
    grid = InProcessGrid(contributions)
    result = secure_sum(grid, list(xs), SHAPES, settings, rng=random.Random(1))
    worst = assert_sum(result, xs, ws, list(xs), settings)
    assert worst > 1e-4  # the bound is not vacuous: the error is visible
    assert result.report.num_shares == 3  # SecAgg+ proper: neighbourhoods of 3, not all 6


def test_the_server_never_sees_an_unmasked_contribution(monkeypatch):
    n = 6
    xs, ws, contributions = make_clients(n, seed=11)
    grid = InProcessGrid(contributions)
    plain = {}  # each client's quantised vector before masking, recorded on the client
    quantize = client_module.quantize

    def recording_quantize(arrays, clipping_range, target_range):
        out = quantize(arrays, clipping_range, target_range)
        plain[grid.current] = [arr.copy() for arr in out]
        return out

    monkeypatch.setattr(client_module, "quantize", recording_quantize)
    result = secure_sum(grid, list(xs), SHAPES, SETTINGS, rng=random.Random(2))
    assert_sum(result, xs, ws, list(xs), SETTINGS)

    received = {
        nid: [
            bytes_to_ndarray(b)
            for b in reply.content.config_records[RECORD_KEY_CONFIGS][Key.MASKED_PARAMETERS]
        ]
        for nid, reply in grid.replies[Stage.COLLECT_MASKED_VECTORS].items()
    }
    assert set(received) == set(plain) == set(xs)
    for nid, masked in received.items():
        # Names sorted: "a", "b", "c", then the weight. Masks are uniform mod 2**32, so a
        # masked entry equal to its plain value would be a one-in-billions coincidence.
        for arr, q in zip(masked, plain[nid], strict=True):
            assert not np.any(arr == q), nid
    # The masked vectors alone, summed and dequantised, are nowhere near the answer.
    total = [sum(parts) % SETTINGS.modulus_range for parts in zip(*received.values(), strict=True)]
    naive = dequantize(total, SETTINGS.clipping_range, SETTINGS.quantization_range)
    sums, _ = expected(xs, ws, list(xs))
    offset = -(n - 1) * SETTINGS.clipping_range
    assert np.min(np.abs(naive[0] + offset - sums["a"])) > 100 * quantisation_bound(SETTINGS, n)
    # The client's secrets stay in its own Context (Flower's state record).
    assert RECORD_KEY_STATE in grid.contexts[next(iter(xs))].state.config_records


@pytest.mark.parametrize("lost", [1, 2])
@pytest.mark.parametrize("how", ["silent", "error"])
def test_dropouts_after_share_keys_still_give_the_survivors_sum(lost, how):
    xs, ws, contributions = make_clients(7, seed=20 + lost)
    dropped = list(xs)[:lost]
    kwargs = {
        how if how == "silent" else "failing": {n: Stage.COLLECT_MASKED_VECTORS for n in dropped}
    }
    grid = InProcessGrid(contributions, **kwargs)
    settings = SecAggPlusSettings(num_shares=5, reconstruction_threshold=3)
    result = secure_sum(grid, list(xs), SHAPES, settings, rng=random.Random(lost))
    survivors = [n for n in xs if n not in dropped]
    assert_sum(result, xs, ws, survivors, settings)
    assert result.report.survivors == tuple(sorted(survivors))
    assert result.report.dropped_after_keys == tuple(sorted(dropped))
    assert result.report.dropped_before == ()
    errors = result.report.errors
    if how == "error":  # the reason reaches the report; a silent node leaves none
        assert all("simulated failure" in errors[n] for n in dropped)
    else:
        assert not set(errors) & set(dropped)


def test_a_node_lost_before_sharing_keys_is_simply_left_out():
    xs, ws, contributions = make_clients(6, seed=5)
    early, late = list(xs)[0], list(xs)[1]
    grid = InProcessGrid(contributions, silent={early: Stage.SHARE_KEYS, late: Stage.UNMASK})
    result = secure_sum(grid, list(xs), SHAPES, SETTINGS, rng=random.Random(5))
    survivors = [n for n in xs if n != early]  # `late` sent its vector, then no shares
    assert_sum(result, xs, ws, survivors, SETTINGS)
    assert result.report.dropped_before == (early,)
    assert result.report.silent_at_unmask == (late,)


def test_a_refused_contribution_counts_as_a_dropout():
    xs, ws, contributions = make_clients(5, seed=8)
    bad = list(xs)[2]
    contributions[bad] = dict(contributions[bad], a=np.full(SHAPES["a"], 9.0))  # beyond c = 8
    grid = InProcessGrid(contributions)
    result = secure_sum(grid, list(xs), SHAPES, SETTINGS, rng=random.Random(8))
    assert_sum(result, xs, ws, [n for n in xs if n != bad], SETTINGS)
    error = result.report.errors[bad]
    assert "'a': values beyond the clipping range 8" in error and "9" not in error  # no values


class LyingGrid(InProcessGrid):
    """A server that asks one node for both shares of its neighbours (the mask seed and the
    private key, which together unmask a vector): that node refuses."""

    def send_and_receive(self, messages, *, timeout=None):
        messages = list(messages)
        cfg = messages[0].content.config_records[RECORD_KEY_CONFIGS]
        if cfg[Key.STAGE] == Stage.UNMASK:
            self.asked = messages[0].metadata.dst_node_id
            cfg[Key.DEAD_NODE_ID_LIST] = [
                *cfg[Key.DEAD_NODE_ID_LIST],
                *cfg[Key.ACTIVE_NODE_ID_LIST],
            ]
        return super().send_and_receive(messages, timeout=timeout)


def test_a_client_never_hands_over_both_shares_of_a_node():
    xs, ws, contributions = make_clients(6, seed=13)
    grid = LyingGrid(contributions)
    result = secure_sum(grid, list(xs), SHAPES, SETTINGS, rng=random.Random(13))
    assert_sum(result, xs, ws, list(xs), SETTINGS)  # the other five hold enough shares
    assert "listed both active and dropped" in result.report.errors[grid.asked]


def test_too_many_dropouts_raise_secure_sum_failed():
    xs, _, contributions = make_clients(6, seed=9)
    dropped = list(xs)[:3]
    grid = InProcessGrid(contributions, silent={n: Stage.COLLECT_MASKED_VECTORS for n in dropped})
    settings = SecAggPlusSettings(num_shares=1.0, reconstruction_threshold=1.0)  # all 6
    with pytest.raises(SecureSumFailed, match="below the reconstruction threshold 6") as info:
        secure_sum(grid, list(xs), SHAPES, settings, rng=random.Random(9))
    report = info.value.report
    assert not report.threshold_met and report.dropped_after_keys == tuple(sorted(dropped))
    assert "after collecting masked vectors" in info.value.reason


def test_too_few_shares_at_unmask_raise_secure_sum_failed():
    xs, _, contributions = make_clients(5, seed=12)
    grid = InProcessGrid(contributions, silent={n: Stage.UNMASK for n in list(xs)[:3]})
    settings = SecAggPlusSettings(num_shares=1.0, reconstruction_threshold=3)
    with pytest.raises(SecureSumFailed, match=r"unmask: 2 shares .* threshold 3"):
        secure_sum(grid, list(xs), SHAPES, settings, rng=random.Random(12))


def test_too_few_nodes_raise_secure_sum_failed():
    _, _, contributions = make_clients(1, seed=1)
    with pytest.raises(SecureSumFailed, match="at least 2 nodes"):
        secure_sum(InProcessGrid(contributions), list(contributions), SHAPES, SETTINGS)
    with pytest.raises(SecureSumFailed, match="threshold 4 exceeds the 3 shares"):
        resolve_shares(SecAggPlusSettings(5, 4), 3)


BASE = {"num_shares": 5, "reconstruction_threshold": 3}


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        ({"num_shares": 2, "reconstruction_threshold": 0.5}, "num_shares as an int must be >= 3"),
        ({"num_shares": 1.5}, "num_shares must be"),
        ({"num_shares": True}, "num_shares must be"),
        ({"reconstruction_threshold": 1}, "must be >= 2"),
        ({"reconstruction_threshold": 5}, "must be below num_shares"),
        ({"reconstruction_threshold": 0.0}, "reconstruction_threshold must be"),
        ({"clipping_range": 0}, "clipping_range"),
        ({"clipping_range": float("inf")}, "clipping_range"),
        ({"quantization_range": 2.0**20}, "quantization_range must be an int"),
        ({"quantization_range": 2**31}, "quantization_range must be an int"),
        ({"modulus_range": 3 * 2**30}, "power of 2"),
        ({"modulus_range": 2**22}, "above quantization_range"),
        ({"modulus_range": 2**33}, "at most 2"),
        ({"max_weight": 0}, "max_weight must be > 0"),
        ({"max_weight": 9.0}, "at most clipping_range"),
        ({"timeout": -1}, "timeout must be"),
    ],
)
def test_bad_settings_are_refused_with_a_clear_error(overrides, match):
    with pytest.raises(ValueError, match=match):
        SecAggPlusSettings(**{**BASE, **overrides})


def test_bad_calls_and_contributions_are_refused():
    _, _, contributions = make_clients(4, seed=4)
    grid = InProcessGrid(contributions)
    nodes = list(contributions)
    with pytest.raises(ValueError, match="distinct"):
        secure_sum(grid, nodes + nodes[:1], SHAPES, SETTINGS)
    with pytest.raises(ValueError, match="weight entry"):
        secure_sum(grid, nodes, {**SHAPES, WEIGHT_KEY: (2,)}, SETTINGS)
    tight = SecAggPlusSettings(1.0, 0.5, quantization_range=2**30, modulus_range=2**32)
    with pytest.raises(ValueError, match="wraps around"):
        secure_sum(grid, nodes, SHAPES, tight)
    with pytest.raises(ValueError, match="reserved name"):
        weighted_contribution({WEIGHT_KEY: np.ones(1)}, 0.5)
    with pytest.raises(ValueError, match="weight must be finite"):
        weighted_contribution({"a": np.ones(1)}, float("nan"))
    with pytest.raises(ValueError, match="has no weight"):
        checked_contribution({"a": np.ones(2)}, 8.0, 1.0)
    with pytest.raises(ValueError, match="NaN/Inf"):
        checked_contribution(weighted_contribution({"a": [np.inf]}, 0.5), 8.0, 1.0)
    with pytest.raises(ValueError, match=r"max_weight=1\]"):
        checked_contribution(weighted_contribution({"a": [1.0]}, 2.0), 8.0, 1.0)


def test_the_client_refuses_a_stage_out_of_order():
    _, _, contributions = make_clients(2, seed=6)
    nid = next(iter(contributions))
    grid = InProcessGrid(contributions)
    cfg = {Key.STAGE: Stage.UNMASK, Key.ACTIVE_NODE_ID_LIST: [], Key.DEAD_NODE_ID_LIST: []}
    msg = Message(
        RecordDict({RECORD_KEY_CONFIGS: ConfigRecord(cfg)}), dst_node_id=nid, message_type="train"
    )
    with pytest.raises(ValueError, match="expect setup stage"):
        secaggplus_client(msg, grid.contexts[nid], contributions[nid])

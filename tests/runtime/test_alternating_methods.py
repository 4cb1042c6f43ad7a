"""RoLoRA and FedSVD: methods whose clients train part of the shared adapter in a round.

RoLoRA trains B in odd rounds and A in even ones; FedSVD trains B against the global A,
which its server re-factorises into an orthonormal A after every round. Checked here: each
rule against a dense float64 reference of the exact update (1e-10), FedSVD against a
transcription of its authors' re-factorisation, the strategy's round (what it accepts and
what it keeps), a client's round (what it trains and what it sends), and the refusals.
Communication: tests/runtime/test_communication.py; central DP: tests/runtime/test_dp_app.py;
resumption: tests/runtime/test_checkpoint.py; the runs: tests/runtime/test_app_e2e.py,
tests/runtime/test_causal_lm.py.
"""

from __future__ import annotations

import logging

import numpy as np
import pytest
from flwr.app import Message, MessageType, MetricRecord, RecordDict
from flwr.supercore.task_identity import TaskIdentity

from flower_app.cache.per_process import cached_adapted_model
from flower_app.client.round import receive, train_round
from flower_app.methods.registry import get_method
from flower_app.settings.config import ConfigError, resolve_config
from flower_app.wire.records import from_array_record, to_array_record
from strategies.fedsvd.rule import aggregate_fedsvd, refactorise
from strategies.rolora.rule import aggregate_rolora, rolora_part
from tests.harness.strategy_helpers import strategy_for

TaskIdentity.run_id = 1
TaskIdentity.task_id = 1
TaskIdentity.node_id = 1

D_OUT, D_IN, R, N = 9, 7, 3, 4


def clients(rng, shape, n=N):
    return [rng.standard_normal(shape) for _ in range(n)]


def weights(rng, n=N):
    w = rng.uniform(0.5, 2.0, n)
    return w / w.sum()


# --------------------------------------------------------------------------- the rules


def test_rolora_trains_b_first_then_alternates():
    assert [rolora_part(t) for t in range(1, 6)] == ["B", "A", "B", "A", "B"]
    with pytest.raises(ValueError, match="start at 1"):
        rolora_part(0)


@pytest.mark.parametrize("seed", range(5))
def test_rolora_mean_is_the_exact_mean_of_the_products(seed):
    """B-round: (sum w_n B_n) A = sum w_n B_n A; A-round: B (sum w_n A_n) = sum w_n B A_n."""
    rng = np.random.default_rng(seed)
    w = weights(rng)
    A, B = rng.standard_normal((R, D_IN)), rng.standard_normal((D_OUT, R))
    Bs, As = clients(rng, (D_OUT, R)), clients(rng, (R, D_IN))
    dense_b = sum(wn * Bn @ A for wn, Bn in zip(w, Bs, strict=True))
    dense_a = sum(wn * B @ An for wn, An in zip(w, As, strict=True))
    np.testing.assert_allclose(aggregate_rolora(Bs, w) @ A, dense_b, rtol=0, atol=1e-10)
    np.testing.assert_allclose(B @ aggregate_rolora(As, w), dense_a, rtol=0, atol=1e-10)


@pytest.mark.parametrize("shape", [(9, 7), (7, 9), (16, 16)])
@pytest.mark.parametrize("seed", range(3))
def test_fedsvd_is_the_exact_mean_with_an_orthonormal_a(shape, seed):
    d_out, d_in = shape
    rng = np.random.default_rng(seed)
    w = weights(rng)
    A = rng.standard_normal((R, d_in))
    Bs = clients(rng, (d_out, R))
    new_B, new_A = aggregate_fedsvd(Bs, A, w)
    dense = sum(wn * Bn @ A for wn, Bn in zip(w, Bs, strict=True))
    np.testing.assert_allclose(new_B @ new_A, dense, rtol=0, atol=1e-10)
    np.testing.assert_allclose(new_A @ new_A.T, np.eye(R), rtol=0, atol=1e-12)
    # B' = U S: its columns are orthogonal, with norms the singular values, descending
    gram = new_B.T @ new_B
    np.testing.assert_allclose(gram, np.diag(np.diag(gram)), rtol=0, atol=1e-10)
    s = np.sqrt(np.diag(gram))
    np.testing.assert_allclose(s, np.linalg.svd(dense, compute_uv=False)[:R], rtol=1e-10)
    assert np.all(np.diff(s) <= 1e-12)


def authors_reinit_lora(B: np.ndarray, A: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The re-factorisation of seanie12/fed-svd (misc/utils.py ``reinit_lora``), transcribed
    (its math, in numpy): the thin SVD of the dense product B A = V S U^H, A <- U^H[:r],
    B <- V[:, :r] diag(S[:r])."""
    prod = B @ A
    V, S, Uh = np.linalg.svd(prod, full_matrices=False)
    r = A.shape[0]
    return V[:, :r] @ np.diag(S[:r]), Uh[:r]


@pytest.mark.parametrize("seed", range(5))
def test_fedsvd_refactorisation_equals_the_authors_up_to_the_sign_of_each_direction(seed):
    """Their dense SVD and our QR + r x r SVD give the same directions and scales; the sign
    of each (row of A, column of B) pair is LAPACK's choice there and fixed here."""
    rng = np.random.default_rng(seed)
    B, A = rng.standard_normal((D_OUT, R)), rng.standard_normal((R, D_IN))
    theirs_B, theirs_A = authors_reinit_lora(B, A)
    ours_B, ours_A = refactorise(B, A)
    signs = np.sign(np.sum(ours_A * theirs_A, axis=1))
    assert np.all(np.abs(signs) == 1)
    np.testing.assert_allclose(ours_A, signs[:, None] * theirs_A, rtol=0, atol=1e-10)
    np.testing.assert_allclose(ours_B, theirs_B * signs, rtol=0, atol=1e-10)
    np.testing.assert_allclose(ours_B @ ours_A, theirs_B @ theirs_A, rtol=0, atol=1e-10)


def test_fedsvd_of_a_product_that_did_not_move_keeps_it_and_an_orthonormal_a():
    rng = np.random.default_rng(0)
    A = rng.standard_normal((R, D_IN))
    new_B, new_A = refactorise(np.zeros((D_OUT, R)), A)
    assert np.all(new_B == 0)
    np.testing.assert_allclose(new_A @ new_A.T, np.eye(R), atol=1e-12)
    # rank 1 < r: still r orthonormal rows, the product kept exactly
    B = np.outer(rng.standard_normal(D_OUT), np.array([1.0, 0.0, 0.0]))
    new_B, new_A = refactorise(B, A)
    np.testing.assert_allclose(new_B @ new_A, B @ A, atol=1e-12)
    np.testing.assert_allclose(new_A @ new_A.T, np.eye(R), atol=1e-12)


# --------------------------------------------------------------------------- the strategy


HEAD = "classifier.weight"


def global_state(rng) -> dict[str, np.ndarray]:
    return {
        "l.lora_A": rng.standard_normal((R, D_IN)),
        "l.lora_B": rng.standard_normal((D_OUT, R)),
        HEAD: rng.standard_normal((2, D_IN)),
    }


def reply(state: dict[str, np.ndarray], pid: int, n: int = 10) -> Message:
    metrics = {"num-examples": n, "train-loss": 1.0, "partition-id": pid}
    content = RecordDict({"arrays": to_array_record(state), "metrics": MetricRecord(metrics)})
    return Message(content=content, dst_node_id=1, message_type=MessageType.TRAIN)


def moved(state, rng, keys):
    return {k: state[k] + 0.1 * rng.standard_normal(state[k].shape) for k in keys}


def test_a_rolora_round_averages_the_rounds_factor_and_keeps_the_other_exactly(caplog):
    rng = np.random.default_rng(3)
    sent = global_state(rng)
    strategy = strategy_for("rolora", sent, screen_updates=False)
    for server_round, trained, kept in [(1, "l.lora_B", "l.lora_A"), (2, "l.lora_A", "l.lora_B")]:
        start = dict(strategy.global_state)
        ups = [moved(start, rng, [trained, HEAD]) for _ in range(3)]
        # a client that sends the factor it was not to train is rejected, with the reason
        wrong = moved(start, rng, [trained, kept, HEAD])
        messages = [reply(u, i) for i, u in enumerate(ups)] + [reply(wrong, 3)]
        with caplog.at_level(logging.WARNING, logger="flwr.florg"):
            _, metrics = strategy.aggregate_train(server_round, messages)
        assert metrics["clients"] == 3 and metrics["rejected"] == 1
        assert f"unexpected ['{kept}']" in caplog.text
        new = strategy.global_state
        # what the server received: float32, widened
        want = np.mean([np.float32(u[trained]).astype(np.float64) for u in ups], axis=0)
        np.testing.assert_allclose(new[trained], want, rtol=0, atol=1e-12)
        assert np.array_equal(new[kept], start[kept])  # exactly: it never left the server
        caplog.clear()


def test_a_fedsvd_round_takes_b_alone_and_sends_back_the_refactorised_pair():
    rng = np.random.default_rng(4)
    sent = global_state(rng)
    strategy = strategy_for("fedsvd", sent, screen_updates=False)
    for server_round in (1, 2):
        start = dict(strategy.global_state)
        ups = [moved(start, rng, ["l.lora_B", HEAD]) for _ in range(3)]
        arrays, metrics = strategy.aggregate_train(
            server_round, [reply(u, i) for i, u in enumerate(ups)]
        )
        assert metrics["clients"] == 3
        got = from_array_record(arrays)
        assert set(got) == set(sent)
        mean_B = np.mean([np.float32(u["l.lora_B"]).astype(np.float64) for u in ups], axis=0)
        new = strategy.global_state
        np.testing.assert_allclose(
            new["l.lora_B"] @ new["l.lora_A"], mean_B @ start["l.lora_A"], rtol=0, atol=1e-10
        )
        np.testing.assert_allclose(new["l.lora_A"] @ new["l.lora_A"].T, np.eye(R), atol=1e-12)


def test_fedsvd_with_num_examples_weights_is_the_authors_dataset_size_weighting():
    """seanie12/fed-svd averages the clients' B by their dataset sizes (n_k / sum n) before
    ``reinit_lora``; ``aggregation-weights=num-examples`` is that, uniform (our protocol's
    default) is not, with unequal sizes."""
    rng = np.random.default_rng(7)
    sent = global_state(rng)
    sizes = [10, 30, 160]
    ups = [moved(sent, rng, ["l.lora_B", HEAD]) for _ in sizes]
    ratio = np.array(sizes) / sum(sizes)
    mean_B = sum(
        p * np.float32(u["l.lora_B"]).astype(np.float64) for p, u in zip(ratio, ups, strict=True)
    )
    theirs_B, theirs_A = authors_reinit_lora(mean_B, sent["l.lora_A"])
    products = {}
    for weighting in ("num-examples", "uniform"):
        strategy = strategy_for("fedsvd", sent, screen_updates=False,
                                aggregation_weights=weighting)  # fmt: skip
        replies = [reply(u, i, n) for i, (u, n) in enumerate(zip(ups, sizes, strict=True))]
        strategy.aggregate_train(1, replies)
        new = strategy.global_state
        products[weighting] = new["l.lora_B"] @ new["l.lora_A"]
    np.testing.assert_allclose(products["num-examples"], theirs_B @ theirs_A, atol=1e-10)
    assert not np.allclose(products["uniform"], theirs_B @ theirs_A, atol=1e-3)


# --------------------------------------------------------------------------- a client's round


@pytest.fixture(scope="module")
def client_settings(tiny_client_settings):
    return {**tiny_client_settings, "learning-rate": 5e-2}


@pytest.mark.parametrize(
    ("method", "trained_by_round"),
    [("rolora", {1: "lora_B", 2: "lora_A", 3: "lora_B"}), ("fedsvd", {1: "lora_B", 2: "lora_B"})],
)
def test_a_client_trains_and_sends_only_the_rounds_part(client_settings, method, trained_by_round):
    config = resolve_config({}, {**client_settings, "method": method})
    adapted = cached_adapted_model(config, 2)
    sent = adapted.shared_state()
    rng = np.random.default_rng(0)
    # a global state where both factors are nonzero (B starts at 0, A's gradient with it)
    sent = {k: v + 0.05 * rng.standard_normal(v.shape).astype(np.float32) for k, v in sent.items()}
    for server_round, part in trained_by_round.items():
        receive(adapted, sent)
        reply = train_round(config, adapted, server_round=server_round, partition_id=0,
                            num_partitions=2)  # fmt: skip
        other = "lora_A" if part == "lora_B" else "lora_B"
        assert any(k.endswith(part) for k in reply.shared)
        assert not any(k.endswith(other) for k in reply.shared), server_round
        assert HEAD_OF_BERT in reply.shared  # the head trains and travels every round
        now = adapted.shared_state()
        for key in sent:
            changed = not np.array_equal(now[key], sent[key])
            assert changed == (not key.endswith(other)), (server_round, key)


HEAD_OF_BERT = "classifier.weight"


# --------------------------------------------------------------------------- refusals


@pytest.mark.parametrize("method", ["rolora", "fedsvd"])
def test_clients_of_different_rank_are_refused_naming_the_method(method):
    assert not get_method(method).heterogeneous_ranks
    with pytest.raises(ConfigError, match=f"client-ranks: method '{method}' aggregates one"):
        resolve_config({}, {"method": method, "client-ranks": "2,4"})

"""FLoRA: the stacked update against a dense float64 reference (1e-10), clients of different
rank included, and against a transcription of its authors' aggregation; the strategy's
rounds (the fold kept and resent, a fresh LoRA drawn by round); a client folding the update
into W0; the merged export. Communication: tests/runtime/test_communication.py; the refusal of
dp=central: tests/runtime/test_dp_app.py; resumption: tests/runtime/test_checkpoint.py; the runs:
tests/runtime/test_app_e2e.py, tests/runtime/test_causal_lm.py."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from flwr.app import Message, MessageType, MetricRecord, RecordDict
from flwr.supercore.task_identity import TaskIdentity

from flower_app.cache.per_process import cached_adapted_model
from flower_app.methods.registry import get_method
from flower_app.settings.config import resolve_config
from flower_app.wire.records import to_array_record
from strategies.flora.rule import stack_flora
from strategies.server.fold_messages import residuals_record
from strategies.shared.folds import read_base, read_residuals
from tests.harness.strategy_helpers import strategy_for

TaskIdentity.run_id = 1
TaskIdentity.task_id = 1
TaskIdentity.node_id = 1

D_OUT, D_IN = 9, 7


def factors(rng, ranks):
    return (
        [rng.standard_normal((D_OUT, r)) for r in ranks],
        [rng.standard_normal((r, D_IN)) for r in ranks],
    )


@pytest.mark.parametrize("ranks", [(3, 3, 3, 3), (1, 2, 4), (5,)])
@pytest.mark.parametrize("seed", range(3))
def test_the_stack_is_the_exact_weighted_mean_of_the_products(ranks, seed):
    rng = np.random.default_rng(seed)
    Bs, As = factors(rng, ranks)
    w = rng.uniform(0.5, 2.0, len(ranks))
    w /= w.sum()
    dense = sum(wn * b @ a for wn, b, a in zip(w, Bs, As, strict=True))
    fold = stack_flora(Bs, As, w)
    assert fold.P.shape == (D_OUT, sum(ranks)) and fold.Q.shape == (sum(ranks), D_IN)
    np.testing.assert_allclose(fold.to_dense(), dense, rtol=0, atol=1e-10)


def authors_agg_flora(W, Bs, As, ratio, scaling):
    """seanie12/fed-svd fedmm/fedavg/server.py ``_agg_flora``, transcribed (its math, in
    numpy): A_n weighted by ratio_n and stacked by rows, B_n stacked by columns, unweighted;
    W <- W + scaling * B_stack @ A_stack (ATP-1010/FederatedLLM's ``stacking`` is the same
    stack)."""
    A_stack = np.concatenate([a * p for a, p in zip(As, ratio, strict=True)], axis=0)
    B_stack = np.concatenate(Bs, axis=1)
    return W + scaling * B_stack @ A_stack


@pytest.mark.parametrize("seed", range(5))
def test_the_merge_equals_the_authors_aggregation(seed):
    rng = np.random.default_rng(seed)
    Bs, As = factors(rng, (4, 4, 4))
    ratio = rng.uniform(size=3)
    ratio /= ratio.sum()
    W, s = rng.standard_normal((D_OUT, D_IN)), 16.0 / 4
    ours = W + s * stack_flora(Bs, As, ratio).to_dense()
    np.testing.assert_allclose(ours, authors_agg_flora(W, Bs, As, ratio, s), rtol=0, atol=1e-10)


def test_bad_stacks_are_refused():
    rng = np.random.default_rng(0)
    Bs, As = factors(rng, (2, 3))
    with pytest.raises(ValueError, match="ranks differ"):
        stack_flora([Bs[0]], [As[1]], None)
    with pytest.raises(ValueError, match="one A per B"):
        stack_flora(Bs, As[:1], None)
    Bs[1][0, 0] = np.nan
    with pytest.raises(ValueError, match="NaN"):
        stack_flora(Bs, As, None)


# --------------------------------------------------------------------------- the strategy

HEAD = "classifier.weight"
R = 2


def initial(rng):
    return {
        "l.lora_A": rng.uniform(-0.3, 0.3, (R, D_IN)),
        "l.lora_B": np.zeros((D_OUT, R)),
        HEAD: rng.standard_normal((2, D_IN)),
    }


def reply(state, pid, rank=R, n=10):
    metrics = {"num-examples": n, "train-loss": 1.0, "partition-id": pid, "rank": rank}
    content = RecordDict({"arrays": to_array_record(state), "metrics": MetricRecord(metrics)})
    return Message(content=content, dst_node_id=1, message_type=MessageType.TRAIN)


def trained(start, rng, rank=R):
    return {
        "l.lora_A": start["l.lora_A"][:rank] + 0.1 * rng.standard_normal((rank, D_IN)),
        "l.lora_B": 0.1 * rng.standard_normal((D_OUT, rank)),
        HEAD: start[HEAD] + 0.1 * rng.standard_normal(start[HEAD].shape),
    }


def f64(x):
    return np.float32(x).astype(np.float64)  # what the server receives


def test_each_round_folds_the_exact_update_and_starts_a_fresh_lora():
    rng = np.random.default_rng(1)
    sent = initial(rng)
    strategy = strategy_for("flora", sent, screen_updates=False, seed=3)
    other = strategy_for("flora", sent, screen_updates=False, seed=3)
    cumulative = np.zeros((D_OUT, D_IN))
    fresh, recorded = [], {}
    for t in (1, 2):
        ups = [trained(strategy.global_state, rng) for _ in range(3)]
        strategy.aggregate_train(t, [reply(u, i) for i, u in enumerate(ups)])
        other.aggregate_train(t, [reply(u, i) for i, u in enumerate(ups)])
        cumulative += np.mean([f64(u["l.lora_B"]) @ f64(u["l.lora_A"]) for u in ups], axis=0)
        np.testing.assert_allclose(strategy.cumulative["l"], cumulative, rtol=0, atol=1e-10)
        recorded[t] = strategy.residuals[t]  # the server keeps only the latest round's
        assert strategy.residuals.keys() == {t} and strategy.base_round == t - 1
        np.testing.assert_allclose(
            recorded[t]["l"].to_dense(), strategy.cumulative["l"] - sum(
                recorded[s]["l"].to_dense() for s in range(1, t)
            ), atol=1e-12,
        )  # fmt: skip
        new = strategy.global_state
        assert np.all(new["l.lora_B"] == 0)  # a fresh LoRA: B = 0 ...
        bound = 1 / np.sqrt(D_IN)
        assert np.all(np.abs(new["l.lora_A"]) <= bound)  # ... and A re-drawn
        np.testing.assert_array_equal(new["l.lora_A"], other.global_state["l.lora_A"])
        fresh.append(new["l.lora_A"])
    assert not np.allclose(fresh[0], fresh[1])  # drawn by round
    assert not np.allclose(fresh[0], strategy_for("flora", sent, seed=4).global_state["l.lora_A"])
    # a node that folded nothing gets round 1's update as the base, then round 2's, exactly
    record = residuals_record(strategy.residuals, 0, (strategy.base_round, strategy.base))
    (h, base), got = read_base(record), read_residuals(record)
    assert h == 1 and got.keys() == {2}
    np.testing.assert_allclose(base["l"] + got[2]["l"], cumulative, atol=1e-5)


def test_flora_with_num_examples_weights_is_the_authors_dataset_size_weighting():
    """The authors weight each client's A_n by its dataset size, ratio_n = n_k / sum n
    (``_agg_flora``'s ratio); ``aggregation-weights=num-examples`` folds exactly that,
    uniform (our protocol's default) does not, with unequal sizes."""
    rng = np.random.default_rng(5)
    sent = initial(rng)
    sizes = [10, 30, 160]
    ups = [trained(sent, rng) for _ in sizes]
    Bs = [f64(u["l.lora_B"]) for u in ups]
    As = [f64(u["l.lora_A"]) for u in ups]
    theirs = authors_agg_flora(np.zeros((D_OUT, D_IN)), Bs, As, np.array(sizes) / sum(sizes), 1.0)
    folds = {}
    for weighting in ("num-examples", "uniform"):
        strategy = strategy_for("flora", sent, screen_updates=False, seed=3,
                                aggregation_weights=weighting)  # fmt: skip
        replies = [reply(u, i, n=n) for i, (u, n) in enumerate(zip(ups, sizes, strict=True))]
        strategy.aggregate_train(1, replies)
        folds[weighting] = strategy.cumulative["l"]
    np.testing.assert_allclose(folds["num-examples"], theirs, rtol=0, atol=1e-10)
    assert not np.allclose(folds["uniform"], theirs, atol=1e-3)


def test_clients_of_different_rank_stack_as_they_are():
    assert get_method("flora").heterogeneous_ranks
    resolve_config({}, {"method": "flora", "client-ranks": "1,2"})  # accepted
    rng = np.random.default_rng(2)
    sent = initial(rng)
    strategy = strategy_for("flora", sent, screen_updates=False, client_ranks="1,2")
    ups = [trained(sent, rng, rank=1), trained(sent, rng, rank=2)]
    _, metrics = strategy.aggregate_train(1, [reply(u, i, u["l.lora_B"].shape[1]) for i, u in
                                              enumerate(ups)])  # fmt: skip
    assert metrics["clients"] == 2 and metrics["rejected"] == 0
    dense = np.mean([f64(u["l.lora_B"]) @ f64(u["l.lora_A"]) for u in ups], axis=0)
    np.testing.assert_allclose(strategy.cumulative["l"], dense, rtol=0, atol=1e-10)
    assert strategy.residuals[1]["l"].P.shape == (D_OUT, 3)
    assert strategy.global_state["l.lora_A"].shape == (R, D_IN)  # the server's LoRA at r_max


# --------------------------------------------------------------------------- a client, export


@pytest.fixture(scope="module")
def adapted(tiny_bert_dir, sentiment_task_dir):
    config = resolve_config(
        {},
        {"model": str(tiny_bert_dir), "task": "local", "data-path": str(sentiment_task_dir),
         "text-fields": "sentence", "rank": 2, "method": "flora", "progress-bar": False},
    )  # fmt: skip
    return cached_adapted_model(config, 2)


class _Context:
    def __init__(self):
        self.state = RecordDict()


def test_a_client_folds_every_update_it_missed_once_and_the_merged_export_holds_them(
    adapted, tmp_path
):
    from flower_app.adapters.lora.layer import lora_layers
    from strategies.shared.folds import Residual

    method = get_method("flora")
    layers = lora_layers(adapted.model)
    rng = np.random.default_rng(5)
    folds = {
        t: {n: Residual(P=rng.standard_normal((32, 4)), Q=rng.standard_normal((4, 32)))
            for n in layers}
        for t in (1, 2)
    }  # fmt: skip
    context = _Context()
    pristine = {n: w.clone() for n, w in adapted.held_tensors[method.pristine_key].items()}
    for since in (0, 1):  # round 2's message repeats nothing the node folded in round 1
        content = RecordDict({"residuals": residuals_record(folds, since)})
        msg = Message(content=content, dst_node_id=1, message_type=MessageType.TRAIN)
        assert method.receive_on_client(msg, context, adapted) == {"residual-round": 2}
    for name, layer in layers.items():
        dense = sum(np.float32(f[name].P) @ np.float32(f[name].Q) for f in folds.values())
        expected = pristine[name].double() + layer.scaling["default"] * torch.as_tensor(
            np.asarray(dense, np.float64)
        )
        torch.testing.assert_close(
            layer.get_base_layer().weight.double(), expected, rtol=1e-6, atol=1e-5
        )

    # the merged model: W0 with the folds and B A merged, as a plain checkpoint
    from transformers import AutoModelForSequenceClassification

    with torch.no_grad():
        for layer in layers.values():
            layer.lora_B["default"].weight.normal_(0, 0.1)  # a nonzero adapter on top
    out = adapted.save_merged(tmp_path / "merged_model")
    loaded = AutoModelForSequenceClassification.from_pretrained(out).eval()
    adapted.model.eval()
    x = torch.randint(0, loaded.config.vocab_size, (2, 6))
    with torch.no_grad():
        torch.testing.assert_close(loaded(x).logits, adapted.model(x).logits, atol=1e-5, rtol=0)
    assert len(lora_layers(adapted.model)) == len(layers)  # the adapter is still there
    method.receive_on_client(  # restore W0 for the module's other users of the cached model
        Message(content=RecordDict({}), dst_node_id=1, message_type=MessageType.TRAIN),
        _Context(),
        adapted,
    )

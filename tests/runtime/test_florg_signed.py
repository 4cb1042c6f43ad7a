"""florg-signed: the adapter s L AᵀDA R (dense formula, export), its server step (two FLoRG
blocks, exact where each block's rank fits, the batched strategy equal to the numpy
reference), its traffic, and the FedAvg-gap diagnostic every FLoRG round records."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from flwr.app import Message, MessageType, MetricRecord, RecordDict
from flwr.supercore.task_identity import TaskIdentity
from peft import PeftModel

from flower_app.adapters.florg.layer import FLoRGLinear
from flower_app.adapters.florg.model import export_peft_lora, inject_florg
from flower_app.adapters.florg.projections import make_projections
from flower_app.methods.communication import round_communication
from flower_app.methods.registry import get_method
from flower_app.wire.records import from_array_record, to_array_record
from strategies.florg.rule import aggregate_florg
from strategies.florg_signed.rule import aggregate_florg_signed, row_signs, sign_blocks
from tests.harness.strategy_helpers import strategy_for
from tests.runtime.test_adapter import TARGETS, florg_config, perturb_As, tiny_bert, tokens

TaskIdentity.run_id = 1
TaskIdentity.task_id = 1
TaskIdentity.node_id = 1


def test_row_signs_are_plus_for_the_first_half_rounded_up():
    assert row_signs(1) == (1.0,)
    assert row_signs(4) == (1.0, 1.0, -1.0, -1.0)
    assert row_signs(5) == (1.0, 1.0, 1.0, -1.0, -1.0)
    assert sign_blocks(5) == [slice(0, 3), slice(3, 5)] and sign_blocks(1) == [slice(0, 1)]
    assert get_method("florg-signed").florg_signs(4) == row_signs(4)
    assert get_method("florg").florg_signs(4) is None


@pytest.mark.parametrize("d_out,d_in", [(12, 7), (7, 12), (9, 9)])
def test_signed_layer_output_equals_dense_formula(d_out, d_in):
    torch.manual_seed(0)
    base = torch.nn.Linear(d_in, d_out).double()
    k, r, s = min(d_in, d_out), 4, 16 / 4
    L, R = make_projections(d_out, d_in, seed=1, name="x")
    A = np.random.default_rng(2).standard_normal((r, k))
    D = np.diag(row_signs(r))
    layer = FLoRGLinear(base, L, R, A, s, signs=np.asarray(row_signs(r)))
    x = torch.randn(5, 4, d_in, dtype=torch.float64)
    W = base.weight.detach().numpy() + s * L @ A.T @ D @ A @ R
    expected = x.numpy() @ W.T + base.bias.detach().numpy()
    np.testing.assert_allclose(layer(x).detach().numpy(), expected, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(
        layer.delta_weight().detach().numpy(), s * L @ A.T @ D @ A @ R, rtol=1e-12, atol=1e-12
    )
    core = A.T @ D @ A  # symmetric and indefinite: outside FLoRG's reachable PSD cores
    eigenvalues = np.linalg.eigvalsh(core)
    assert eigenvalues.min() < -1e-6 and eigenvalues.max() > 1e-6


def test_bad_signs_are_refused():
    base = torch.nn.Linear(6, 6)
    L, R = make_projections(6, 6, seed=1, name="x")
    with pytest.raises(ValueError, match="signs"):
        FLoRGLinear(base, L, R, np.ones((2, 6)), 1.0, signs=np.array([1.0, 0.5]))
    with pytest.raises(ValueError, match="signs"):
        florg_config(r=2, signs=(1.0, 1.0, -1.0))


@pytest.mark.parametrize("subtract_init", [False, True])
def test_signed_model_exports_to_peft_with_the_same_logits(tmp_path, subtract_init):
    x = tokens()
    model = tiny_bert()
    config = florg_config(
        r=4, target_modules=TARGETS, subtract_init=subtract_init, a_init_std=0.1,
        signs=row_signs(4),
    )  # fmt: skip
    inject_florg(model, config)
    if subtract_init:  # the output is unchanged before training, with D too
        torch.testing.assert_close(model(x).logits, tiny_bert()(x).logits, rtol=0, atol=1e-5)
    perturb_As(model)
    expected = model(x).logits
    out = export_peft_lora(model, tmp_path / "adapter")
    loaded = PeftModel.from_pretrained(tiny_bert(), out).eval()
    torch.testing.assert_close(loaded(x).logits, expected, rtol=0, atol=1e-5)


def _core(A: np.ndarray) -> np.ndarray:
    return A.T @ np.diag(row_signs(A.shape[0])) @ A


def test_blocks_average_the_core_exactly_when_each_block_rank_fits():
    """Clients whose + rows share one p-dimensional row space (and - rows another): each
    block's Gram average has rank <= its rows, so the new core is the mean core exactly."""
    rng = np.random.default_rng(0)
    r, k, n = 4, 10, 5
    plus_space, minus_space = rng.standard_normal((2, k)), rng.standard_normal((2, k))
    As = [
        np.concatenate([rng.standard_normal((2, 2)) @ plus_space,
                        rng.standard_normal((2, 2)) @ minus_space])
        for _ in range(n)
    ]  # fmt: skip
    weights = rng.uniform(0.5, 2.0, n)
    prev = rng.standard_normal((r, k))
    new, infos = aggregate_florg_signed(As, weights, prev)
    dense = sum(w * _core(a) for w, a in zip(weights / weights.sum(), As, strict=True))
    np.testing.assert_allclose(_core(new), dense, rtol=1e-10, atol=1e-10)
    assert [info["rank"] for info in infos] == [2, 2]
    # each block is FLoRG's step on that block (the Procrustes anchor is the previous block)
    plus, _ = aggregate_florg([a[:2] for a in As], weights, prev[:2])
    np.testing.assert_allclose(new[:2], plus, rtol=1e-12, atol=1e-12)


def reply(arrays) -> Message:
    content = RecordDict({
        "arrays": to_array_record(arrays),
        "metrics": MetricRecord({"num-examples": 10, "train-loss": 1.0}),
    })  # fmt: skip
    return Message(content=content, dst_node_id=1, message_type=MessageType.TRAIN)


@pytest.mark.parametrize("rank_mismatch", ["procrustes", "truncate"])
def test_signed_strategy_equals_the_numpy_reference(rank_mismatch):
    rng = np.random.default_rng(1)
    state = {
        "enc.q.A": rng.standard_normal((4, 8)),
        "enc.v.A": rng.standard_normal((3, 8)),  # odd r: blocks of 2 and 1 rows
        "classifier.weight": rng.standard_normal((2, 8)),
    }
    strategy = strategy_for("florg-signed", state, server_device="cpu", rank_mismatch=rank_mismatch)
    clients = [{k: v + 0.3 * rng.standard_normal(v.shape) for k, v in state.items()}
               for _ in range(3)]  # fmt: skip
    arrays, metrics = strategy.aggregate_train(1, [reply(c) for c in clients])
    new = from_array_record(arrays)
    for key in ("enc.q.A", "enc.v.A"):
        As = [c[key].astype(np.float32) for c in clients]
        expected, _ = aggregate_florg_signed(As, None, state[key], rank_mismatch=rank_mismatch)
        np.testing.assert_allclose(new[key], expected, rtol=1e-5, atol=1e-6)
    assert "fedavg_gap_procrustes" in metrics and "fedavg_gap_truncate" in metrics


def test_signed_traffic_is_florgs():
    shapes, head = {"q": (32, 32), "up": (48, 32)}, 66
    signed = round_communication("florg-signed", shapes, 4, head, num_clients=3)
    plain = round_communication("florg", shapes, 4, head, num_clients=3)
    assert (signed.up_params, signed.down_params) == (plain.up_params, plain.down_params)


def test_fedavg_gap_is_the_distance_to_the_plain_mean_over_the_move():
    rng = np.random.default_rng(2)
    state = {"enc.q.A": rng.standard_normal((2, 6)), "classifier.weight": np.zeros((2, 6))}
    strategy = strategy_for("florg", state, server_device="cpu")
    clients = [{k: v + 0.2 * rng.standard_normal(v.shape) for k, v in state.items()}
               for _ in range(4)]  # fmt: skip
    _, metrics = strategy.aggregate_train(1, [reply(c) for c in clients])
    As = [c["enc.q.A"].astype(np.float32).astype(np.float64) for c in clients]
    mean = np.mean(As, axis=0)
    for policy in ("procrustes", "truncate"):
        new, _ = aggregate_florg(As, None, state["enc.q.A"], rank_mismatch=policy)
        expected = np.linalg.norm(new - mean) / np.linalg.norm(new - state["enc.q.A"])
        assert metrics[f"fedavg_gap_{policy}"] == pytest.approx(expected, rel=1e-6)
    # the two policies differ here (r' = 4 r > r), so the key tells them apart
    assert metrics["fedavg_gap_procrustes"] != pytest.approx(metrics["fedavg_gap_truncate"])


@pytest.mark.parametrize("rank_mismatch", ["procrustes", "truncate"])
def test_fedavg_gap_own_keeps_the_runs_policy_and_off_records_none(rank_mismatch):
    rng = np.random.default_rng(3)
    state = {"enc.q.A": rng.standard_normal((2, 6)), "classifier.weight": np.zeros((2, 6))}
    clients = [{k: v + 0.2 * rng.standard_normal(v.shape) for k, v in state.items()}
               for _ in range(4)]  # fmt: skip
    results = {}
    for choice in ("both", "own", "off"):
        strategy = strategy_for(
            "florg", state, server_device="cpu", rank_mismatch=rank_mismatch, fedavg_gap=choice
        )
        results[choice] = strategy.aggregate_train(1, [reply(c) for c in clients])
    other = "truncate" if rank_mismatch == "procrustes" else "procrustes"
    own_key, other_key = f"fedavg_gap_{rank_mismatch}", f"fedavg_gap_{other}"
    both, own, off = (results[c][1] for c in ("both", "own", "off"))
    assert own[own_key] == both[own_key] and other_key in both and other_key not in own
    assert own_key not in off and other_key not in off
    # the diagnostic never changes the model
    for choice in ("own", "off"):
        for key, value in results["both"][0].items():
            np.testing.assert_array_equal(results[choice][0][key], value)


def test_a_bad_fedavg_gap_choice_is_refused():
    from flower_app.settings.config import ConfigError

    with pytest.raises(ConfigError, match="fedavg-gap"):
        strategy_for("florg", {"enc.q.A": np.ones((2, 6))}, fedavg_gap="sometimes")

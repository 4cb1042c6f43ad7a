"""Fed-SB (Singhal et al. 2025, arXiv 2502.15436): the mean of R against the exact dense update,
the initialisation against a transcription of the authors' math, the LoRA-SB layer against
the dense W0 + s B R A, its PEFT export, round 0 on the strategy (weights, checks, the
communication row, central DP), B and A sent once per node and checkpointed, the client's
hooks and the refusals. The runs through the simulation: tests/test_app_e2e.py and
tests/test_causal_lm.py (parametrised over every method)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from flwr.app import ArrayRecord, Message, MessageType, MetricRecord, RecordDict
from flwr.supercore.task_identity import TaskIdentity
from peft import PeftModel
from transformers import BertForSequenceClassification

from florg_tools.synthetic import tiny_bert_config
from flower_app.adapters.lora_sb import (
    LoRASBConfig,
    LoRASBLinear,
    export_peft_lora_sb,
    get_lora_sb_state,
    inject_lora_sb,
    lora_sb_layers,
    set_lora_sb_basis,
    set_lora_sb_state,
)
from flower_app.client.round import local_batches
from flower_app.config import ConfigError, resolve_config
from flower_app.records import from_array_record, to_array_record
from flower_app.runtime import cached_adapted_model
from strategies.common.central_dp import CentralDP, clip_update
from strategies.common.dp_accounting import epsilon_for
from strategies.fed_sb.gradient import gradient_key
from strategies.fed_sb.keys import BASIS, BASIS_CONTEXT, BASIS_HELD
from strategies.fed_sb.method import EXAMPLE_DP_REFUSAL
from strategies.fed_sb.rule import aggregate_fed_sb, initial_factors
from strategies.registry import get_method
from tests.strategy_helpers import strategy_for

TaskIdentity.run_id = 1
TaskIdentity.task_id = 1
TaskIdentity.node_id = 1

METHOD = "fed-sb"
HEAD = "classifier.weight"
D_OUT, D_IN, R = 9, 7, 3


# --------------------------------------------------------------------------- the rules


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_mean_of_R_is_the_exact_mean_update(seed):
    """B (sum_n w_n R_n) A = sum_n w_n B R_n A (eq. 1), to 1e-10 against the dense float64
    mean of the clients' updates."""
    rng = np.random.default_rng(seed)
    B, A = rng.standard_normal((D_OUT, R)), rng.standard_normal((R, D_IN))
    Rs = [rng.standard_normal((R, R)) for _ in range(4)]
    weights = rng.uniform(0.1, 1.0, 4)
    w = weights / weights.sum()
    dense = sum(wn * B @ Rn @ A for wn, Rn in zip(w, Rs, strict=True))
    np.testing.assert_allclose(B @ aggregate_fed_sb(Rs, weights) @ A, dense, rtol=0, atol=1e-10)


def authors_initialisation(G: np.ndarray, lr: float, r: int) -> np.ndarray:
    """The authors' ΔW / s, transcribed (fed_sb/utils: gradient_utils'
    ``-1 * lr * torch.sign(grad)``, initialization_utils' ``get_replacement_module_grad``
    on ``named_grads[key].T`` and latent_utils' ``lora_B @ latent @ lora_A``), with the
    exact SVD in place of ``torch.svd_lowrank``."""
    processed = -1 * lr * torch.sign(torch.as_tensor(G, dtype=torch.float64))
    U, S, Vh = torch.linalg.svd(processed.T, full_matrices=False)  # of the transposed grad
    enc, dec, Sr = U[:, :r], Vh[:r], torch.diag(S[:r])  # final_enc = Ur, final_dec = Vrt
    lora_B, lora_A, latent = dec.T, enc.T, Sr  # replace_module_weights(lora_B, dec.T), ...
    return (lora_B @ latent @ lora_A).numpy()


@pytest.mark.parametrize("shape,r,lr", [((9, 7), 3, 0.01), ((16, 24), 4, 1e-3), ((6, 6), 6, 2.0)])
def test_the_initialisation_is_the_truncation_of_the_sign_step(shape, r, lr):
    rng = np.random.default_rng(sum(shape) + r)
    G = rng.standard_normal(shape)
    B, Rm, A = initial_factors(G, lr, r)
    P = -lr * np.sign(G)
    u, s, vt = np.linalg.svd(P, full_matrices=False)
    truncation = (u[:, :r] * s[:r]) @ vt[:r]
    np.testing.assert_allclose(B @ Rm @ A, truncation, rtol=0, atol=1e-10)
    np.testing.assert_allclose(B @ Rm @ A, authors_initialisation(G, lr, r), rtol=0, atol=1e-10)
    # B, A orthonormal, R diagonal and non-negative; signs fixed: A's largest entry positive
    np.testing.assert_allclose(B.T @ B, np.eye(r), atol=1e-12)
    np.testing.assert_allclose(A @ A.T, np.eye(r), atol=1e-12)
    assert np.allclose(Rm, np.diag(np.diag(Rm))) and np.all(np.diag(Rm) >= 0)
    assert np.all(A[np.arange(r), np.argmax(np.abs(A), axis=1)] > 0)


def test_bad_initialisation_input_is_refused():
    with pytest.raises(ValueError, match="rank r=8"):
        initial_factors(np.ones((4, 5)), 0.1, 8)
    with pytest.raises(ValueError, match="lr must be > 0"):
        initial_factors(np.ones((4, 5)), 0.0, 2)
    with pytest.raises(ValueError, match="finite matrix"):
        initial_factors(np.full((4, 5), np.nan), 0.1, 2)


# --------------------------------------------------------------------------- the layer

TINY = tiny_bert_config(num_labels=3, intermediate_size=48)
TARGETS = ("query", "value", "intermediate.dense", "output.dense")


def tiny_bert(seed: int = 0) -> BertForSequenceClassification:
    torch.manual_seed(seed)
    return BertForSequenceClassification(TINY).eval()


def random_basis(model, rng) -> dict[str, np.ndarray]:
    return {
        f"{name}.{part}": rng.standard_normal(shape)
        for name, layer in lora_sb_layers(model).items()
        for part, shape in (("B", tuple(layer.B.shape)), ("A", tuple(layer.A.shape)))
    }


def test_the_layer_is_the_dense_update_in_float64():
    torch.manual_seed(0)
    base = torch.nn.Linear(D_IN, D_OUT).double()
    layer = LoRASBLinear(base, R, scaling=16 / R)
    rng = np.random.default_rng(0)
    B, A = rng.standard_normal((D_OUT, R)), rng.standard_normal((R, D_IN))
    layer.set_basis(B, A)
    with torch.no_grad():
        layer.R.copy_(torch.as_tensor(rng.standard_normal((R, R))))
    x = torch.as_tensor(rng.standard_normal((2, 5, D_IN)))
    W = base.weight.detach().numpy() + (16 / R) * B @ layer.R.detach().numpy() @ A
    expected = x.numpy() @ W.T + base.bias.detach().numpy()
    np.testing.assert_allclose(layer(x).detach().numpy(), expected, rtol=0, atol=1e-12)
    delta = W - base.weight.detach().numpy()
    np.testing.assert_allclose(layer.delta_weight().detach().numpy(), delta, atol=1e-12)
    assert [n for n, p in layer.named_parameters() if p.requires_grad] == ["R"]
    with pytest.raises(ValueError, match="shape"):
        layer.set_basis(B.T, A)


def test_state_travels_as_R_and_the_head_and_the_export_is_a_peft_lora(tmp_path):
    model = tiny_bert()
    inject_lora_sb(model, LoRASBConfig(r=R, target_modules=TARGETS))
    state = get_lora_sb_state(model)
    assert {k for k in state if k.endswith(".R")} == {f"{n}.R" for n in lora_sb_layers(model)}
    assert set(state) - {k for k in state if k.endswith(".R")} == {HEAD, "classifier.bias"}
    x = torch.randint(0, TINY.vocab_size, (3, 9), generator=torch.Generator().manual_seed(1))
    before = model(x).logits
    torch.testing.assert_close(before, tiny_bert()(x).logits)  # R = 0: the base model
    rng = np.random.default_rng(4)
    set_lora_sb_basis(model, random_basis(model, rng))
    set_lora_sb_state(model, {k: v + 0.3 * rng.standard_normal(v.shape) for k, v in state.items()})
    expected = model(x).logits
    assert (expected - before).abs().max() > 1e-3
    out = export_peft_lora_sb(model, tmp_path / "adapter")
    loaded = PeftModel.from_pretrained(tiny_bert(), out).eval()
    torch.testing.assert_close(loaded(x).logits, expected, rtol=0, atol=1e-5)
    with pytest.raises(KeyError, match="basis keys differ"):
        set_lora_sb_basis(model, {})


# --------------------------------------------------------------------------- the strategy


def sb_state(rng) -> dict[str, np.ndarray]:
    return {"l1.R": np.zeros((R, R)), "l2.R": np.zeros((R, R)), HEAD: rng.standard_normal((2, 5))}


SHAPES = {"l1": (D_OUT, D_IN), "l2": (6, 8)}


class FakeGrid:
    """A grid whose nodes answer round 0's query with ``answer(node)`` (arrays, metrics)."""

    def __init__(self, answers):
        self.answers = answers
        self.sent: list[Message] = []

    def get_node_ids(self):
        return list(self.answers)

    def send_and_receive(self, messages, timeout=None):
        self.sent = list(messages)
        out = []
        for m in self.sent:
            assert m.metadata.message_type == MessageType.QUERY
            arrays, metrics = self.answers[m.metadata.dst_node_id]
            content = RecordDict(
                {"arrays": to_array_record(arrays), "metrics": MetricRecord(metrics)}
            )
            out.append(Message(content=content, dst_node_id=1, message_type=MessageType.QUERY))
        return out


def gradients(rng, scale=1.0):
    return {gradient_key(k): scale * rng.standard_normal(s) for k, s in SHAPES.items()}


def f32(x):
    return np.float32(x).astype(np.float64)


def test_round_0_averages_the_gradients_and_factorises_their_sign_step():
    rng = np.random.default_rng(0)
    grads = [gradients(rng) for _ in range(3)]
    sizes = [10, 30, 20]
    answers = {
        node: (g, {"num-examples": n, "partition-id": node - 101})
        for node, g, n in zip((101, 102, 103), grads, sizes, strict=True)
    }
    answers[104] = (  # a bad reply: one layer's gradient of another shape
        {gradient_key("l1"): np.ones((2, 2)), gradient_key("l2"): np.ones(SHAPES["l2"])},
        {"num-examples": 5, "partition-id": 3},
    )
    strategy = strategy_for(
        METHOD, sb_state(rng), aggregation_weights="num-examples", learning_rate=0.01,
        min_available_nodes=4, min_train_nodes=4,
    )  # fmt: skip
    grid = FakeGrid(answers)
    strategy.initialise(grid, timeout=10)
    assert len(grid.sent) == 4 and all(not m.content.array_records for m in grid.sent)
    w = np.array(sizes) / sum(sizes)
    for layer in SHAPES:
        mean = sum(wn * f32(g[gradient_key(layer)]) for wn, g in zip(w, grads, strict=True))
        B, Rm, A = initial_factors(mean, 0.01, R)
        np.testing.assert_allclose(strategy.basis[layer][0], B, atol=1e-12)
        np.testing.assert_allclose(strategy.basis[layer][1], A, atol=1e-12)
        np.testing.assert_allclose(strategy.global_state[f"{layer}.R"], Rm, atol=1e-12)
    row = strategy.round_metrics[0]
    assert row["clients"] == 3 and row["rejected"] == 1 and row["failures"] == 0
    per_client = sum(o * i for o, i in SHAPES.values())
    assert row["up-params"] == 3 * per_client + 2 * 2 + 6 * 8 and row["down-params"] == 0
    assert row["examples"] == 60

    # B and A travel once: with the first message to a node that does not hold them
    message = Message(
        content=RecordDict({"arrays": to_array_record(strategy.global_state)}),
        dst_node_id=101, message_type=MessageType.TRAIN,
    )  # fmt: skip
    first = strategy.extend_train_message(1, message)
    basis = from_array_record(first.content[BASIS])
    assert set(basis) == {f"{k}.{p}" for k in SHAPES for p in ("B", "A")}
    strategy.node_synced.add(101)
    assert BASIS not in strategy.extend_train_message(2, message).content.array_records

    # the checkpoint keeps B and A; a resumed strategy holds them and sends them again
    resumed = strategy_for(METHOD, sb_state(rng), aggregation_weights="num-examples")
    resumed.restore(strategy.state_arrays(), strategy.state_json())
    for layer in SHAPES:
        np.testing.assert_array_equal(resumed.basis[layer][0], strategy.basis[layer][0])
    assert BASIS in resumed.extend_train_message(2, message).content.array_records
    with pytest.raises(ValueError, match="no B and A"):
        strategy_for(METHOD, sb_state(rng)).restore(
            {f"global/{k}": v for k, v in strategy.global_state.items()}, strategy.state_json()
        )


def test_a_round_aggregates_R_and_learns_which_nodes_hold_the_basis():
    rng = np.random.default_rng(1)
    sent = {**sb_state(rng), "l1.R": rng.standard_normal((R, R))}
    strategy = strategy_for(METHOD, sent, screen_updates=False)
    replies = []
    ups = [{k: v + 0.1 * rng.standard_normal(v.shape) for k, v in sent.items()} for _ in range(3)]
    for i, u in enumerate(ups):
        metrics = {"num-examples": 10, "train-loss": 1.0, "partition-id": i, BASIS_HELD: 1}
        content = RecordDict({"arrays": to_array_record(u), "metrics": MetricRecord(metrics)})
        replies.append(Message(content=content, dst_node_id=1, message_type=MessageType.TRAIN))
    strategy.aggregate_train(1, replies)
    for key in ("l1.R", "l2.R"):
        expected = aggregate_fed_sb([f32(u[key]) for u in ups], None)
        np.testing.assert_allclose(strategy.global_state[key], expected, atol=1e-12)
    assert strategy.node_synced == {TaskIdentity.node_id}


def test_round_0_under_central_dp_is_a_gaussian_mechanism_in_the_accountant():
    """z = 0: the clipped gradients' sum over m queried nodes (one failed); z > 0: one more
    release in the ledger, so round t's epsilon is that of t + 1 releases."""
    rng = np.random.default_rng(2)
    grads = [gradients(rng, scale=3.0) for _ in range(3)]
    answers = {100 + i: (g, {"num-examples": 5, "partition-id": i}) for i, g in enumerate(grads)}
    dp = {"dp": "central", "dp_clipping_norm": 0.5, "dp_noise_multiplier": 1.3}
    strategy = strategy_for(METHOD, sb_state(rng), min_available_nodes=3, min_train_nodes=3, **dp)
    strategy.dp = CentralDP("mean", 0.5, 0.0, 1e-5, np.random.default_rng(0))
    strategy.initialise(FakeGrid(answers), timeout=10)
    clipped = [clip_update({k: f32(v) for k, v in g.items()}, 0.5) for g in grads]
    for layer in SHAPES:
        k = gradient_key(layer)
        mean = sum(c[k] for c in clipped) / 3
        np.testing.assert_allclose(
            strategy.global_state[f"{layer}.R"], initial_factors(mean, 1e-3, R)[1], atol=1e-10
        )
    assert strategy.round_metrics[0]["dp-clipped"] == 3

    noised = strategy_for(METHOD, sb_state(rng), min_available_nodes=3, min_train_nodes=3, **dp)
    noised.initialise(FakeGrid(answers), timeout=10)
    row = noised.round_metrics[0]
    assert row["dp-epsilon"] == pytest.approx(epsilon_for(1.3, 1.0, 1, 1e-5), rel=1e-12)
    assert row["dp-noise-std"] == pytest.approx(1.3 * 0.5 / 3) and row["dp-sampled"] == 3
    metrics = noised.aggregate_train(1, [])[1]  # round 1: the second release
    assert metrics["dp-epsilon"] == pytest.approx(epsilon_for(1.3, 1.0, 2, 1e-5), rel=1e-12)


# --------------------------------------------------------------------------- the client


@pytest.fixture(scope="module")
def client(tiny_bert_dir, sentiment_task_dir):
    config = resolve_config(
        {},
        {"model": str(tiny_bert_dir), "task": "local", "data-path": str(sentiment_task_dir),
         "text-fields": "sentence", "rank": 2, "method": METHOD, "progress-bar": False,
         "batch-size": 8, "fed-sb-init-examples": 13},
    )  # fmt: skip
    return config, cached_adapted_model(config, 2)


class _Context:
    def __init__(self):
        self.state = RecordDict()


def test_the_clients_gradient_is_the_sum_over_its_first_examples(client):
    """13 examples in batches of 8: the first batch whole and 5 of the second, each batch's
    loss divided by its size (the authors' normalisation), against torch.autograd.grad."""
    config, adapted = client
    arrays, metrics = get_method(METHOD).answer_query(config, adapted, local_batches(config, 0, 3))
    assert metrics == {"num-examples": 13}
    layers = lora_sb_layers(adapted.model)
    assert set(arrays) == {gradient_key(n) for n in layers}
    batches = local_batches(config, 0, 3)
    torch.manual_seed(batches.seed)
    adapted.model.train()
    weights = [layer.base_layer.weight for layer in layers.values()]
    expected = [torch.zeros(w.shape, dtype=torch.float64) for w in weights]
    for batch, n in zip(batches.loader, (8, 5), strict=False):
        batch = {k: v[:n] for k, v in batch.items()}
        for w in weights:
            w.requires_grad_(True)
        loss = batches.loss_fn(adapted.model, batch) / n
        for total, g in zip(expected, torch.autograd.grad(loss, weights), strict=True):
            total += g.double()
        for w in weights:
            w.requires_grad_(False)
    adapted.model.eval()
    for name, total in zip(layers, expected, strict=True):
        np.testing.assert_allclose(arrays[gradient_key(name)], total.numpy(), atol=1e-7)
    assert not any(w.requires_grad for w in weights)
    assert all(layer.R.requires_grad for layer in layers.values())  # restored


def test_a_client_keeps_b_and_a_in_its_context_and_refuses_to_train_without(client):
    config, adapted = client
    method = get_method(METHOD)
    context = _Context()
    empty = Message(content=RecordDict({}), dst_node_id=1, message_type=MessageType.TRAIN)
    with pytest.raises(ValueError, match="holds no B and A"):
        method.receive_on_client(empty, context, adapted)
    basis = random_basis(adapted.model, np.random.default_rng(3))
    with_basis = Message(
        content=RecordDict({BASIS: to_array_record(basis)}), dst_node_id=1,
        message_type=MessageType.TRAIN,
    )  # fmt: skip
    assert method.receive_on_client(with_basis, context, adapted) == {BASIS_HELD: 1}
    assert isinstance(context.state[BASIS_CONTEXT], ArrayRecord)
    for layer in lora_sb_layers(adapted.model).values():  # another node's basis in between
        layer.set_basis(np.zeros(tuple(layer.B.shape)), np.zeros(tuple(layer.A.shape)))
    assert method.receive_on_client(empty, context, adapted) == {BASIS_HELD: 1}
    for name, layer in lora_sb_layers(adapted.model).items():
        np.testing.assert_allclose(layer.B.numpy(), basis[f"{name}.B"], rtol=1e-6)
        np.testing.assert_allclose(layer.A.numpy(), basis[f"{name}.A"], rtol=1e-6)


# --------------------------------------------------------------------------- refusals


def test_refusals_name_their_setting_and_reason():
    with pytest.raises(ConfigError, match="client-ranks: method 'fed-sb' aggregates one"):
        resolve_config({}, {"method": METHOD, "client-ranks": "2,4"})
    with pytest.raises(ConfigError) as err:
        resolve_config({}, {"method": METHOD, "dp": "example"})
    assert str(err.value).startswith("dp: dp=example refused for method 'fed-sb'")
    assert EXAMPLE_DP_REFUSAL in str(err.value)
    with pytest.raises(ConfigError, match="quantization: method 'fed-sb'"):
        resolve_config({}, {"method": METHOD, "quantization": "4bit", "device": "cuda"})
    with pytest.raises(ConfigError, match="fed-sb-init-examples"):
        resolve_config({}, {"method": METHOD, "fed-sb-init-examples": 0})
    config = resolve_config({}, {"method": METHOD, "dp": "central"})  # round 0 is private too
    assert get_method(METHOD).dp_mechanism == "mean" and config.dp == "central"


def test_the_projected_run_counts_round_0_and_b_and_a_once():
    from flower_app.comm_projection import project
    from flower_app.leaderboard import megabytes

    config = resolve_config({}, {"method": METHOD, "rank": 4, "num-server-rounds": 5})
    shapes = {"q": (64, 32), "v": (64, 32)}
    (sb,) = project(config, shapes, 3, (METHOD,))
    grads, basis, core = 2 * 64 * 32, 2 * 4 * (64 + 32), 2 * 4 * 4
    assert (sb.up_params, sb.down_params) == (core, core + basis)  # round 1
    assert sb.total_mb == pytest.approx(megabytes(3 * (grads + 5 * core + 5 * core + basis)))

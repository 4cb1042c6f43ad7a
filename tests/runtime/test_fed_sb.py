"""Fed-SB (Singhal et al. 2025, arXiv 2502.15436): the mean of R against the exact dense update,
the initialisation against a transcription of the authors' math, the LoRA-SB layer against
the dense W0 + s B R A, its PEFT export, round 0 on the strategy (weights, checks, the
communication row, central DP, the clients' epsilons under dp=example), B and A sent once
per node and checkpointed, the client's hooks, round 0's private estimate under dp=example
against an independent per-example loop and its accounting, and the refusals. The runs
through the simulation: tests/runtime/test_app_e2e.py, tests/runtime/test_causal_lm.py (the tiny
decoder) and tests/runtime/test_dp_sgd_app.py (dp=example)."""

from __future__ import annotations

import copy
import math

import numpy as np
import pytest
import torch
from flwr.app import ArrayRecord, Message, MessageType, MetricRecord, RecordDict
from flwr.supercore.task_identity import TaskIdentity
from peft import PeftModel
from transformers import BertForSequenceClassification

from florg_tools.synthetic import tiny_bert_config
from flower_app.adapters.lora_sb.layer import (
    LoRASBConfig,
    LoRASBLinear,
    export_peft_lora_sb,
    get_lora_sb_state,
    inject_lora_sb,
    lora_sb_layers,
    set_lora_sb_basis,
    set_lora_sb_state,
)
from flower_app.cache.per_process import cached_adapted_model
from flower_app.client.round import local_batches
from flower_app.methods.registry import get_method
from flower_app.privacy.accounting import epsilon_for
from flower_app.privacy.dp_sgd import ClientAccountant, DpBudgetExceeded
from flower_app.settings.config import ConfigError, resolve_config
from flower_app.wire.records import from_array_record, to_array_record
from strategies.fed_sb.gradient import gradient_key
from strategies.fed_sb.keys import BASIS, BASIS_CONTEXT, BASIS_HELD
from strategies.fed_sb.private_gradient import (
    clip_factor,
    init_sample_rate,
    private_gradient_sum,
)
from strategies.fed_sb.rule import aggregate_fed_sb, initial_factors
from strategies.server.central_dp import CentralDP, clip_update
from strategies.server.example_dp import ExampleDpRecord
from tests.harness.strategy_helpers import strategy_for

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


def test_round_0_pools_the_gradients_and_factorises_their_sign_step():
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
    for layer in SHAPES:
        # each reply is a sum over its examples: the pooled gradient is their sum over the
        # total count, not their example-weighted mean (which counts examples twice)
        mean = sum(f32(g[gradient_key(layer)]) for g in grads) / sum(sizes)
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


@pytest.mark.parametrize("weighting", ["uniform", "num-examples"])
def test_round_0_takes_the_sign_of_the_pooled_gradient_whatever_the_weights(weighting):
    """Counts 64, 64, 20, 5: the sign of the pooled gradient (the sum of the clients' sums),
    as the authors take it over one pooled dataset, under either aggregation weighting."""
    rng = np.random.default_rng(7)
    sizes = [64, 64, 20, 5]
    grads = [gradients(rng, scale=n) for n in sizes]  # sums grow with the examples summed
    answers = {
        101 + i: (g, {"num-examples": n, "partition-id": i})
        for i, (g, n) in enumerate(zip(grads, sizes, strict=True))
    }
    strategy = strategy_for(
        METHOD, sb_state(rng), aggregation_weights=weighting, learning_rate=0.01,
        min_available_nodes=4, min_train_nodes=4,
    )  # fmt: skip
    strategy.initialise(FakeGrid(answers), timeout=10)
    for layer in SHAPES:
        pooled = sum(f32(g[gradient_key(layer)]) for g in grads)
        B, A = strategy.basis[layer]
        step = B @ strategy.global_state[f"{layer}.R"] @ A
        np.testing.assert_allclose(step, authors_initialisation(pooled, 0.01, R), atol=1e-12)


def test_a_fed_sb_model_at_default_settings_starts_at_the_authors_model(client):
    """The authors' scripts set lora_alpha = lora_r: their model starts at W0 + B S_r A with
    (B, S_r, A) the truncated SVD of -lr sign(G). Ours, at the default ``alpha``, adds
    exactly that to every adapted W0 (s = 1), whatever alpha / rank would be."""
    config, adapted = client
    assert config.alpha / config.rank != 1  # the default alpha would scale by 8 here
    rng = np.random.default_rng(11)
    layers = lora_sb_layers(adapted.model)
    grads = {name: rng.standard_normal(tuple(layer.base_layer.weight.shape))
             for name, layer in layers.items()}  # fmt: skip
    basis, state = {}, get_lora_sb_state(adapted.model)
    for name, G in grads.items():
        B, Rm, A = initial_factors(G, 0.01, config.rank)
        basis[f"{name}.B"], basis[f"{name}.A"], state[f"{name}.R"] = B, A, Rm
    set_lora_sb_basis(adapted.model, basis)
    set_lora_sb_state(adapted.model, state)
    for name, layer in layers.items():
        expected = authors_initialisation(grads[name], 0.01, config.rank)
        delta = layer.delta_weight().detach().double().numpy()
        np.testing.assert_allclose(delta, expected, rtol=0, atol=1e-5)
    # the cached model back as built: R = 0 and no basis
    set_lora_sb_state(adapted.model, {k: np.zeros_like(v) if k.endswith(".R") else v
                                      for k, v in state.items()})  # fmt: skip
    set_lora_sb_basis(adapted.model, {k: np.zeros_like(v) for k, v in basis.items()})


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


def test_round_0_under_poisson_sampling_queries_the_poisson_sample_and_divides_by_q_n():
    """client-sampling=poisson: round 0 queries the round's Poisson sample (as a training
    round would: the accountant's q holds for it), divides the noised sum by q N, and
    records one release at q: Method.dp_initial_releases, which the cross-device sizing
    counts (lab/florg_lab/cross_device_sizing.py)."""
    rng = np.random.default_rng(3)
    answers = {
        100 + i: (gradients(rng, scale=3.0), {"num-examples": 5, "partition-id": i})
        for i in range(40)
    }
    settings = {"client_sampling": "poisson", "fraction_train": 0.25, "min_available_nodes": 40}
    plain = strategy_for(METHOD, sb_state(rng), seed=7, **settings)
    grid = FakeGrid(answers)
    plain.initialise(grid, timeout=10)
    sample = plain.sampling.sampler.rounds[0]
    assert sample == (40, len(grid.sent)) and 0 < len(grid.sent) < 40
    row = plain.round_metrics[0]
    assert row["sample-rate"] == 0.25 and row["population"] == 40 and row["sampled"] == sample[1]
    again = FakeGrid(answers)  # without DP the sample is the seed's: the same nodes again
    strategy_for(METHOD, sb_state(rng), seed=7, **settings).initialise(again, timeout=10)
    assert [m.metadata.dst_node_id for m in again.sent] == [
        m.metadata.dst_node_id for m in grid.sent
    ]

    dp = {"dp": "central", "dp_clipping_norm": 0.5, "dp_noise_multiplier": 1.3}
    private = strategy_for(METHOD, sb_state(rng), **settings, **dp)
    zero = CentralDP("mean", 0.5, 0.0, 1e-5, np.random.default_rng(0), sample_rate=0.25)
    private.dp, noised = zero, strategy_for(METHOD, sb_state(rng), **settings, **dp)
    grid = FakeGrid(answers)
    private.initialise(grid, timeout=10)
    queried = [answers[m.metadata.dst_node_id][0] for m in grid.sent]
    clipped = [clip_update({k: f32(v) for k, v in g.items()}, 0.5) for g in queried]
    for layer in SHAPES:  # z = 0: the clipped sum over q N = 10, not over the count
        mean = sum(c[gradient_key(layer)] for c in clipped) / 10
        np.testing.assert_allclose(
            private.global_state[f"{layer}.R"], initial_factors(mean, 1e-3, R)[1], atol=1e-10
        )
    assert private.round_metrics[0]["dp-divisor"] == 10
    noised.initialise(FakeGrid(answers), timeout=10)
    row = noised.round_metrics[0]
    assert row["dp-noise-std"] == pytest.approx(1.3 * 0.5 / 10) and row["dp-divisor"] == 10
    assert row["dp-epsilon"] == pytest.approx(epsilon_for(1.3, 0.25, 1, 1e-5), rel=1e-12)
    releases = get_method(METHOD).dp_initial_releases
    assert noised.dp.accountant.state_dict()["compositions"] == [[1.3, 0.25, releases]]


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


# --------------------------------------------------------------------------- dp=example

Z0, C_FIXED = 0.7, 0.05


def private_config(tiny_bert_dir, sentiment_task_dir, **overrides):
    return resolve_config(
        {},
        {"model": str(tiny_bert_dir), "task": "local", "data-path": str(sentiment_task_dir),
         "text-fields": "sentence", "rank": 2, "method": METHOD, "progress-bar": False,
         "batch-size": 8, "fed-sb-init-examples": 13, "dp": "example",
         "dp-sgd-seeded-noise": True, "fed-sb-init-noise-multiplier": Z0, **overrides},
    )  # fmt: skip


@pytest.fixture(scope="module")
def private_client(tiny_bert_dir, sentiment_task_dir):
    config = private_config(tiny_bert_dir, sentiment_task_dir)
    return config, cached_adapted_model(config, 2)


def reference_estimate(model, batches, q, C, z):
    """The estimate by an independent route: a fresh copy of the model, each sampled
    example's loss backpropagated alone (``.backward()``, the gradient read from ``.grad``),
    its gradient of every adapted W0 clipped jointly to C by hand, the clipped gradients
    summed, then the noise of the seeds round 0 uses (sampling: round 0's seed; noise: the
    seed + 1), layer by layer. Returns ({layer: sum}, [norm of each example's gradient])."""
    model = copy.deepcopy(model).train()
    dataset, collate = batches.loader.dataset, batches.loader.collate_fn
    mask = torch.rand(len(dataset), generator=torch.Generator().manual_seed(batches.seed)) < q
    layers = lora_sb_layers(model)
    weights = [layer.base_layer.weight for layer in layers.values()]
    for p in model.parameters():
        p.requires_grad_(False)
    for w in weights:
        w.requires_grad_(True)
    totals = [torch.zeros(w.shape, dtype=torch.float64) for w in weights]
    norms = []
    torch.manual_seed(batches.seed)
    for i in range(len(dataset)):
        if not mask[i]:
            continue
        model.zero_grad(set_to_none=True)
        batches.loss_fn(model, collate([dataset[i]])).backward()
        grads = [w.grad.double() for w in weights]
        norm = float(torch.cat([g.flatten() for g in grads]).norm())
        factor = min(1.0, C / norm)
        for total, g in zip(totals, grads, strict=True):
            total += factor * g
        norms.append(norm)
    noise = torch.Generator().manual_seed(batches.seed + 1)
    for total in totals:
        total += z * C * torch.randn(total.shape, generator=noise, dtype=torch.float64)
    return {name: t.numpy() for name, t in zip(layers, totals, strict=True)}, norms


def test_round_0_under_dp_example_is_the_clipped_sum_plus_seeded_noise(private_client):
    """The client's private estimate equals the independent reference, with C between the
    examples' gradient norms (some clipped, some not): without noise to 1e-6 of the sum's
    largest entry, then with the seeded noise (std z0 C, far above the gradients' entries)
    to the same absolute tolerance; clipping changes the sum, so the comparison can fail."""
    config, adapted = private_client
    batches = local_batches(config, 0, 3)
    q = init_sample_rate(13, len(batches.loader.dataset))
    assert 0 < q < 1

    def estimate(C, z):
        return private_gradient_sum(
            adapted, batches, sample_rate=q, clipping_norm=C, noise_multiplier=z, seed=batches.seed
        )

    _, norms = estimate(1.0, 0.0)
    C = float(np.median(norms))
    assert len(norms) >= 3 and sum(x > C for x in norms) >= 1 and sum(x < C for x in norms) >= 1
    clean, taken = estimate(C, 0.0)
    reference, ref_norms = reference_estimate(adapted.model, batches, q, C, 0.0)
    np.testing.assert_allclose(taken, ref_norms, rtol=1e-6)
    assert set(clean) == {gradient_key(name) for name in reference}
    scale = max(float(np.abs(v).max()) for v in reference.values())
    for name, value in reference.items():
        np.testing.assert_allclose(clean[gradient_key(name)], value, rtol=0, atol=1e-6 * scale)
    noised, _ = estimate(C, Z0)
    noised_reference, _ = reference_estimate(adapted.model, batches, q, C, Z0)
    for name, value in noised_reference.items():
        np.testing.assert_allclose(noised[gradient_key(name)], value, rtol=0, atol=1e-6 * scale)
        noise = noised[gradient_key(name)] - clean[gradient_key(name)]
        assert np.std(noise) == pytest.approx(Z0 * C, rel=0.2)  # std z0 C per entry
    unclipped, _ = reference_estimate(adapted.model, batches, q, 10 * max(norms), 0.0)
    assert not all(
        np.allclose(reference[name], unclipped[name], rtol=0, atol=1e-3 * scale)
        for name in reference
    )
    layers = lora_sb_layers(adapted.model)
    assert all(layer.R.requires_grad for layer in layers.values())  # restored
    assert not any(layer.base_layer.weight.requires_grad for layer in layers.values())


def test_each_examples_contribution_is_clipped_to_C(private_client):
    """The clip factor brings every norm within C (exactly C above it, untouched below);
    with C far below every example's norm and no noise, the sum's norm is at most |S| C and
    every example was clipped."""
    for norm in (0.0, 1e-9, 0.3, 1.0, 2.5, 1e6):
        factor = clip_factor(norm, 1.0)
        assert 0 < factor <= 1 and factor * norm <= 1.0 * (1 + 1e-15)
        assert factor == (1.0 if norm <= 1.0 else pytest.approx(1.0 / norm, rel=1e-15))
    config, adapted = private_client
    batches = local_batches(config, 0, 3)
    C = 1e-4
    arrays, norms = private_gradient_sum(
        adapted, batches, sample_rate=1.0, clipping_norm=C, noise_multiplier=0.0, seed=0
    )
    assert len(norms) == len(batches.loader.dataset) and min(norms) > C
    total = math.sqrt(sum(float(np.square(a).sum()) for a in arrays.values()))
    assert 0 < total <= len(norms) * C * (1 + 1e-9)


def test_round_0_under_dp_example_is_composed_into_the_clients_ledger(
    tiny_bert_dir, sentiment_task_dir
):
    """Through the method's ``answer_query``: N >= n gives q = 1, and the ledger holds one
    (z0, 1.0, 1) composition whose epsilon is that of one Gaussian mechanism at the client's
    delta, reported in the reply; the training rounds then continue this ledger."""
    config = private_config(tiny_bert_dir, sentiment_task_dir, **{"fed-sb-init-examples": 500})
    adapted = cached_adapted_model(config, 2)
    batches = local_batches(config, 0, 24)
    n = len(batches.loader.dataset)
    accountant = ClientAccountant()
    arrays, metrics = get_method(METHOD).answer_query(config, adapted, batches, accountant)
    assert accountant.ledger.compositions == [(Z0, 1.0, 1)]
    assert accountant.ledger.delta == 1 / (10 * n)  # the client's delta, as training's
    expected = epsilon_for(Z0, 1.0, 1, 1 / (10 * n))
    assert metrics["dp-sgd-epsilon"] == pytest.approx(expected, rel=1e-12) and expected > 0
    assert metrics["num-examples"] == n and metrics["dp-sgd-noise-multiplier"] == Z0
    assert accountant.noise_multiplier == 0  # the training rounds' z: not yet fixed
    plan = accountant.plan(config, n)
    accountant.record(plan)
    trained = (plan.noise_multiplier, plan.sample_rate, plan.steps)
    assert accountant.ledger.compositions == [(Z0, 1.0, 1), trained]
    with pytest.raises(ValueError, match="needs the client's DP-SGD accountant"):
        get_method(METHOD).answer_query(config, adapted, batches)


def test_round_0_is_refused_where_it_alone_reaches_the_target_or_the_limit(
    tiny_bert_dir, sentiment_task_dir
):
    """Refused before anything is computed, the ledger untouched: the target names
    fed-sb-init-noise-multiplier and the target; dp-max-epsilon raises DpBudgetExceeded."""
    config = private_config(tiny_bert_dir, sentiment_task_dir, **{"dp-sgd-target-epsilon": 0.05})
    adapted = cached_adapted_model(config, 2)
    batches = local_batches(config, 0, 3)
    accountant = ClientAccountant()
    with pytest.raises(ValueError) as err:
        get_method(METHOD).answer_query(config, adapted, batches, accountant)
    message = str(err.value)
    assert message.startswith("fed-sb-init-noise-multiplier: round 0")
    assert "dp-sgd-target-epsilon 0.05" in message and accountant.ledger is None
    limited = private_config(tiny_bert_dir, sentiment_task_dir, **{"dp-max-epsilon": 0.05})
    with pytest.raises(DpBudgetExceeded, match="dp-max-epsilon: round 0"):
        get_method(METHOD).answer_query(limited, adapted, batches, accountant)
    assert accountant.ledger is None


def test_round_0_under_dp_example_records_the_clients_epsilons_in_row_0():
    """The server averages the private replies as without DP (no server-side noise) and
    row 0 holds the largest epsilon they report; round 1's replies continue it."""
    rng = np.random.default_rng(5)
    grads = [gradients(rng) for _ in range(3)]
    eps = [0.4, 0.9, 0.6]
    answers = {
        100 + i: (g, {"num-examples": 5, "partition-id": i, "dp-sgd-epsilon": e})
        for i, (g, e) in enumerate(zip(grads, eps, strict=True))
    }
    strategy = strategy_for(METHOD, sb_state(rng), min_available_nodes=3, min_train_nodes=3)
    strategy.example_dp = ExampleDpRecord(target=3.0)
    grid = FakeGrid(answers)
    strategy.initialise(grid, timeout=10, lineage="abc")
    assert all(m.content["config"]["lineage"] == "abc" for m in grid.sent)  # the node's ledger
    row = strategy.round_metrics[0]
    assert row["dp-sgd-epsilon-max"] == 0.9 and row["dp-sgd-clients"] == 3
    assert row["dp-sgd-over-target"] == 0 and "dp-epsilon" not in row
    for layer in SHAPES:
        mean = sum(f32(g[gradient_key(layer)]) for g in grads) / 3
        np.testing.assert_allclose(
            strategy.global_state[f"{layer}.R"], initial_factors(mean, 1e-3, R)[1], atol=1e-10
        )
    assert strategy.example_dp.epsilon(1) == 0.9  # round 1's replies compare with these


# --------------------------------------------------------------------------- refusals


def test_refusals_name_their_setting_and_reason(tiny_bert_dir, sentiment_task_dir):
    with pytest.raises(ConfigError, match="client-ranks: method 'fed-sb' aggregates one"):
        resolve_config({}, {"method": METHOD, "client-ranks": "2,4"})
    # dp=example is taken: round 0 is private on each client (test_round_0_under_dp_example_*)
    config = resolve_config({}, {"method": METHOD, "dp": "example"})
    assert config.dp == "example" and not get_method(METHOD).example_dp_refusal
    from flower_app.preflight.references import check_run

    check_run(
        {"method": METHOD, "dp": "example", "model": str(tiny_bert_dir), "task": "local",
         "data-path": str(sentiment_task_dir), "text-fields": "sentence"}
    )  # fmt: skip
    with pytest.raises(ConfigError, match="fed-sb-init-noise-multiplier"):
        resolve_config({}, {"method": METHOD, "dp": "example", "fed-sb-init-noise-multiplier": 0})
    with pytest.raises(ConfigError, match="quantization: method 'fed-sb'"):
        resolve_config({}, {"method": METHOD, "quantization": "4bit", "device": "cuda"})
    with pytest.raises(ConfigError, match="fed-sb-init-examples"):
        resolve_config({}, {"method": METHOD, "fed-sb-init-examples": 0})
    config = resolve_config({}, {"method": METHOD, "dp": "central"})  # round 0 is private too
    assert get_method(METHOD).dp_mechanism == "mean" and config.dp == "central"


def test_the_projected_run_counts_round_0_and_b_and_a_once():
    from florg_tools.comm_projection import project
    from flower_app.preflight.leaderboard import megabytes

    config = resolve_config({}, {"method": METHOD, "rank": 4, "num-server-rounds": 5})
    shapes = {"q": (64, 32), "v": (64, 32)}
    (sb,) = project(config, shapes, 3, (METHOD,))
    grads, basis, core = 2 * 64 * 32, 2 * 4 * (64 + 32), 2 * 4 * 4
    assert (sb.up_params, sb.down_params) == (core, core + basis)  # round 1
    assert sb.total_mb == pytest.approx(megabytes(3 * (grads + 5 * core + 5 * core + basis)))

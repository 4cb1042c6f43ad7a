"""FedRot-LoRA: each client's (Bₙ, Aₙ) rotated by the orthogonal Procrustes solution toward the
round's global factor, then averaged factor-wise (strategies/fedrot_lora/).

Checked here: the aligned factor by round against a transcription of the authors' client
(haoran-zh/FedRot-LoRA, ``client.py``), each Rₙ against the Procrustes optimum computed
another way (the polar factor of M), the products unchanged, the aggregate against the
weighted mean of the aligned factors, the strategy's rounds (fp32 and int8 uplink),
dp=central's mean mechanism on the rotated replies, the declaration and the refusals;
``fedrot-rotation``: 'proper' against Kabsch's rotation computed another way on reflections,
'orthogonal' bit for bit as before the setting, and the setting through the strategy.
Central DP at round 1: tests/runtime/test_dp_app.py; resumption: tests/runtime/test_checkpoint.py.
"""

from __future__ import annotations

from dataclasses import fields

import numpy as np
import pytest
from flwr.app import Message, MessageType, MetricRecord, RecordDict
from flwr.supercore.task_identity import TaskIdentity

from flower_app.methods.registry import get_method, method_names
from flower_app.settings.config import ConfigError, resolve_config
from flower_app.wire.encoding import decode_record, encode_record, encoding_rng
from flower_app.wire.records import to_array_record
from strategies.fedit.rule import aggregate_fedit
from strategies.fedrot_lora.rule import (
    ROTATIONS,
    aggregate_fedrot_lora,
    aligned_pair,
    aligned_part,
    procrustes_rotation,
)
from strategies.fedrot_lora.settings import FedRotLoRASettings
from strategies.server.central_dp import CentralDP, clip_update
from strategies.shared.averaging import weighted_average
from strategies.shared.validation import AggregationInputError
from tests.harness.strategy_helpers import strategy_for

TaskIdentity.run_id = 1
TaskIdentity.task_id = 1
TaskIdentity.node_id = 1

D_OUT, D_IN, R, N = 9, 7, 3, 4
HEAD = "head.w"


def weights(rng, n=N):
    w = rng.uniform(0.5, 2.0, n)
    return w / w.sum()


def trained(rng, B, A, n=N, scale=0.3):
    """n clients that started from (B, A) and moved, each in its own rotated coordinates."""
    out = []
    for _ in range(n):
        q, _ = np.linalg.qr(rng.standard_normal((R, R)))
        b = B + scale * rng.standard_normal(B.shape)
        a = A + scale * rng.standard_normal(A.shape)
        out.append((b @ q, q.T @ a))
    return out


def polar_factor(m):
    """The orthogonal polar factor of a nonsingular M, M (MᵀM)^(-1/2), by eigh: the maximiser
    of tr(Rᵀ M) over orthogonal R, computed without an SVD."""
    lam, v = np.linalg.eigh(m.T @ m)
    return m @ (v @ np.diag(lam**-0.5) @ v.T)


# --------------------------------------------------------------------------- the rule


def authors_aligned_factor(state: int, initialshare: str = "A") -> str | None:
    """client.py: swap_offset = 0 if initialshare == 'A' else 1; rotate when state > 0 with
    align_matrix = 'A' if state % 2 != swap_offset else 'B' (state counts from 0)."""
    offset = 0 if initialshare == "A" else 1
    if state == 0:
        return None
    return "A" if state % 2 != offset else "B"


def test_the_aligned_factor_alternates_as_the_authors_client_with_initialshare_a():
    rounds = range(1, 8)  # the authors' state s is round - 1
    assert [aligned_part(t) for t in rounds] == [authors_aligned_factor(t - 1) for t in rounds]
    assert [aligned_part(t) for t in range(1, 6)] == [None, "A", "B", "A", "B"]
    with pytest.raises(ValueError, match="start at 1"):
        aligned_part(0)


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("part", ["A", "B"])
def test_each_rotation_is_orthogonal_optimal_and_keeps_the_product(seed, part):
    rng = np.random.default_rng(seed)
    gB, gA = rng.standard_normal((D_OUT, R)), rng.standard_normal((R, D_IN))
    for B, A in trained(rng, gB, gA):
        Bn, An, Rn = aligned_pair(B, A, gB, gA, part)
        np.testing.assert_allclose(Rn.T @ Rn, np.eye(R), atol=1e-12)
        assert abs(abs(np.linalg.det(Rn)) - 1.0) < 1e-12
        # the authors' M and its maximiser of tr(Rᵀ M), computed another way
        m = A @ gA.T if part == "A" else B.T @ gB
        np.testing.assert_allclose(Rn, polar_factor(m), atol=1e-10)
        factor, reference = (A, gA) if part == "A" else (B, gB)
        np.testing.assert_allclose(Rn, procrustes_rotation(factor, reference, part))
        # the rotated pair: (B R, Rᵀ A), the product Bₙ Aₙ unchanged
        np.testing.assert_allclose(Bn, B @ Rn, atol=1e-12)
        np.testing.assert_allclose(An, Rn.T @ A, atol=1e-12)
        np.testing.assert_allclose(Bn @ An, B @ A, atol=1e-12)
        # no orthogonal matrix brings the aligned factor closer to the global one
        gap = np.linalg.norm(An - gA) if part == "A" else np.linalg.norm(Bn - gB)
        for _ in range(20):
            q, _ = np.linalg.qr(rng.standard_normal((R, R)))
            other = np.linalg.norm(q.T @ A - gA) if part == "A" else np.linalg.norm(B @ q - gB)
            assert gap <= other + 1e-12
        unrotated = np.linalg.norm(A - gA) if part == "A" else np.linalg.norm(B - gB)
        assert gap <= unrotated + 1e-12


def test_a_reflection_is_kept_as_in_the_authors_default():
    """rotation_align_optimization (taken at their default rotate_lambda 1.5 > 1) returns
    U Vᵀ with no determinant fix; only their soft variant flips det -1. A client whose A
    is the global A with one row negated is aligned exactly by that reflection."""
    rng = np.random.default_rng(0)
    gA = rng.standard_normal((R, D_IN))
    flip = np.diag([1.0] * (R - 1) + [-1.0])
    B = rng.standard_normal((D_OUT, R))
    Bn, An, Rn = aligned_pair(B, flip @ gA, np.zeros((D_OUT, R)), gA, "A")
    assert np.linalg.det(Rn) == pytest.approx(-1.0, abs=1e-12)
    np.testing.assert_allclose(An, gA, atol=1e-12)
    np.testing.assert_allclose(Bn @ An, B @ flip @ gA, atol=1e-12)


@pytest.mark.parametrize("part", [None, "A", "B"])
def test_the_aggregate_is_the_weighted_mean_of_the_aligned_factors(part):
    rng = np.random.default_rng(11)
    gB, gA = rng.standard_normal((D_OUT, R)), rng.standard_normal((R, D_IN))
    pairs, w = trained(rng, gB, gA), weights(rng)
    rotations = []
    for B, A in pairs:
        if part is None:
            rotations.append(np.eye(R))
        else:
            rotations.append(polar_factor(A @ gA.T if part == "A" else B.T @ gB))
    want_B = sum(wn * B @ Rn for wn, (B, _), Rn in zip(w, pairs, rotations, strict=True))
    want_A = sum(wn * Rn.T @ A for wn, (_, A), Rn in zip(w, pairs, rotations, strict=True))
    new_B, new_A, norm = aggregate_fedrot_lora(
        [b for b, _ in pairs], [a for _, a in pairs], w, gB, gA, part
    )
    np.testing.assert_allclose(new_B, want_B, rtol=0, atol=1e-10)
    np.testing.assert_allclose(new_A, want_A, rtol=0, atol=1e-10)
    want_norm = np.mean([np.linalg.norm(Rn - np.eye(R)) for Rn in rotations])
    assert norm == pytest.approx(want_norm, abs=1e-10)
    fedit_B, fedit_A = aggregate_fedit([b for b, _ in pairs], [a for _, a in pairs], w)
    if part is None:  # round 1: nothing rotates, the factor-wise average itself
        np.testing.assert_array_equal(new_B, fedit_B)
        np.testing.assert_array_equal(new_A, fedit_A)
        assert norm == 0.0
    else:  # misaligned clients: the rotation changes the average and its product
        assert norm > 0.1
        assert not np.allclose(new_B @ new_A, fedit_B @ fedit_A, atol=1e-3)


@pytest.mark.parametrize("part", ["A", "B"])
def test_identical_clients_give_the_factor_wise_average(part):
    """Every client sends the same pair: one common R, so the model (the product) is the
    factor-wise average's exactly; clients still at the global pair are not rotated at all."""
    rng = np.random.default_rng(5)
    gB, gA = rng.standard_normal((D_OUT, R)), rng.standard_normal((R, D_IN))
    (B, A), w = trained(rng, gB, gA, n=1)[0], weights(rng)
    new_B, new_A, _ = aggregate_fedrot_lora([B] * N, [A] * N, w, gB, gA, part)
    fedit_B, fedit_A = aggregate_fedit([B] * N, [A] * N, w)
    np.testing.assert_allclose(new_B @ new_A, fedit_B @ fedit_A, rtol=0, atol=1e-12)
    same_B, same_A, norm = aggregate_fedrot_lora([gB] * N, [gA] * N, w, gB, gA, part)
    np.testing.assert_allclose(same_B, gB, atol=1e-12)
    np.testing.assert_allclose(same_A, gA, atol=1e-12)
    assert norm < 1e-12


def test_bad_inputs_are_refused_naming_them():
    rng = np.random.default_rng(0)
    A = rng.standard_normal((R, D_IN))
    with pytest.raises(ValueError, match="aligned factor must be one of"):
        procrustes_rotation(A, A, "C")
    with pytest.raises(AggregationInputError, match="shape"):
        procrustes_rotation(A, A[:, :-1], "A")
    with pytest.raises(AggregationInputError, match="NaN"):
        procrustes_rotation(np.full_like(A, np.nan), A, "A")
    with pytest.raises(AggregationInputError, match="got 2 B matrices but 1 A"):
        aggregate_fedrot_lora([A.T, A.T], [A], None, A.T, A, "A")


# --------------------------------------------------------------------------- the strategy


def global_state(rng):
    return {
        "l.lora_A": rng.standard_normal((R, D_IN)),
        "l.lora_B": rng.standard_normal((D_OUT, R)),
        "m.lora_A": rng.standard_normal((R, D_IN)),
        "m.lora_B": rng.standard_normal((D_OUT, R)),
        HEAD: rng.standard_normal((2, D_IN)),
    }


def client_states(rng, sent, n=3):
    out = []
    for _ in range(n):
        state = {HEAD: sent[HEAD] + 0.1 * rng.standard_normal(sent[HEAD].shape)}
        for layer in ("l", "m"):
            kb, ka = f"{layer}.lora_B", f"{layer}.lora_A"
            (state[kb], state[ka]), = trained(rng, sent[kb], sent[ka], n=1)  # fmt: skip
        out.append(state)
    return out


def reply(state, pid, n=10, arrays=None) -> Message:
    metrics = MetricRecord({"num-examples": n, "train-loss": 1.0, "partition-id": pid})
    record = to_array_record(state) if arrays is None else arrays
    content = RecordDict({"arrays": record, "metrics": metrics})
    return Message(content=content, dst_node_id=1, message_type=MessageType.TRAIN)


def f32(state):
    """What the server receives at fp32: the arrays as float32, widened."""
    return {k: np.asarray(v, np.float32).astype(np.float64) for k, v in state.items()}


def expected_round(sent, received, w, server_round):
    part = aligned_part(server_round)
    out = {HEAD: sum(wn * c[HEAD] for wn, c in zip(w, received, strict=True))}
    for layer in ("l", "m"):
        kb, ka = f"{layer}.lora_B", f"{layer}.lora_A"
        Bs, As = [c[kb] for c in received], [c[ka] for c in received]
        rot = [
            np.eye(R) if part is None else
            polar_factor(a @ sent[ka].T if part == "A" else b.T @ sent[kb])
            for b, a in zip(Bs, As, strict=True)
        ]  # fmt: skip
        out[kb] = sum(wn * b @ q for wn, b, q in zip(w, Bs, rot, strict=True))
        out[ka] = sum(wn * q.T @ a for wn, a, q in zip(w, As, rot, strict=True))
    return out


@pytest.mark.parametrize("weighting", ["uniform", "num-examples"])
def test_the_strategys_rounds_rotate_by_round_then_average(weighting):
    rng = np.random.default_rng(3)
    strategy = strategy_for("fedrot-lora", global_state(rng), screen_updates=False,
                            aggregation_weights=weighting)  # fmt: skip
    sizes = [10, 30, 160]
    w = np.full(3, 1 / 3) if weighting == "uniform" else np.array(sizes) / sum(sizes)
    for server_round in (1, 2, 3, 4):
        sent = dict(strategy.global_state)
        clients = client_states(rng, sent)
        _, metrics = strategy.aggregate_train(
            server_round,
            [reply(c, i, n) for i, (c, n) in enumerate(zip(clients, sizes, strict=True))],
        )
        assert metrics["clients"] == 3
        want = expected_round(sent, [f32(c) for c in clients], w, server_round)
        for key, value in want.items():
            np.testing.assert_allclose(strategy.global_state[key], value, rtol=0, atol=1e-10)
        assert (metrics["rotation_norm"] == 0.0) == (server_round == 1)


def test_an_int8_uplink_is_decoded_then_rotated():
    """uplink-encoding=int8 (and a lossy downlink): the server rotates what it decodes, so
    the round is the rule on the decoded replies, and each product is the decoded one's."""
    rng = np.random.default_rng(4)
    sent = global_state(rng)
    strategy = strategy_for("fedrot-lora", sent, screen_updates=False,
                            uplink_encoding="int8", downlink_encoding="int8")  # fmt: skip
    clients = client_states(rng, sent)
    records = [encode_record(c, "int8", encoding_rng(0, 2, 1, i)) for i, c in enumerate(clients)]
    decoded = [
        {k: v.numpy().astype(np.float64) for k, v in decode_record(r, "int8").items()}
        for r in records
    ]
    _, metrics = strategy.aggregate_train(
        2, [reply(c, i, arrays=r) for i, (c, r) in enumerate(zip(clients, records, strict=True))]
    )
    assert metrics["clients"] == 3 and metrics["rotation_norm"] > 0
    want = expected_round(sent, decoded, np.full(3, 1 / 3), 2)
    for key, value in want.items():
        np.testing.assert_allclose(strategy.global_state[key], value, rtol=0, atol=1e-10)


def test_dp_central_is_the_mean_mechanism_on_the_rotated_replies():
    """z = 0, C below the updates' norms: round 2 rotates each reply (A toward the global A),
    clips reply - sent over A, B and the head, and divides the sum by the m sampled; the
    rotation's diagnostic, read from the raw replies, is not released."""
    C = 0.5
    rng = np.random.default_rng(6)
    sent = global_state(rng)
    strategy = strategy_for("fedrot-lora", sent, dp="central", dp_clipping_norm=C)
    assert strategy.dp.mechanism == "mean"
    strategy.dp = CentralDP("mean", C, 0.0, 1e-5, np.random.default_rng(0))
    strategy.communication.sampled[2] = 4  # 4 sampled, 3 replied
    clients = client_states(rng, sent)
    _, metrics = strategy.aggregate_train(2, [reply(c, i) for i, c in enumerate(clients)])
    updates = []
    for c in map(f32, clients):
        rotated = dict(c)
        for layer in ("l", "m"):
            kb, ka = f"{layer}.lora_B", f"{layer}.lora_A"
            q = polar_factor(c[ka] @ sent[ka].T)
            rotated[kb], rotated[ka] = c[kb] @ q, q.T @ c[ka]
        updates.append(clip_update({k: rotated[k] - sent[k] for k in sent}, C))
    for key, value in sent.items():
        want = value + sum(u[key] for u in updates) / 4
        np.testing.assert_allclose(strategy.global_state[key], want, rtol=0, atol=1e-10)
    assert metrics["dp-clipped"] == 3 and "rotation_norm" not in metrics


# --------------------------------------------------------------------------- declaration


def test_the_method_is_registered_with_its_declaration():
    assert "fedrot-lora" in method_names()
    method = get_method("fedrot-lora")
    assert method.adapter == "lora" and method.shared == ("A", "B") and not method.personal
    assert not method.local and not method.frozen and method.settings is FedRotLoRASettings
    assert FedRotLoRASettings().fedrot_rotation == "orthogonal"  # the authors' default
    assert "Procrustes" in method.summary
    assert not method.heterogeneous_ranks and not method.writes_base_weights
    assert method.dp_mechanism == "mean" and method.example_dp_refusal == ""
    assert method.async_update is None and "synchronous" in method.async_refusal
    # the same traffic as the factor-wise average: both factors, every round, both ways
    fedit = get_method("fedit")
    for t in (1, 2, 3):
        assert method.trained_parts(t) == ("A", "B")
        assert method.up_adapter_params(D_OUT, D_IN, R, t) == fedit.up_adapter_params(
            D_OUT, D_IN, R, t
        ) == R * (D_OUT + D_IN)  # fmt: skip
    assert method.adapter_params(D_OUT, D_IN, R) == fedit.adapter_params(D_OUT, D_IN, R)
    assert type(strategy_for("fedrot-lora", global_state(np.random.default_rng(0)))).__name__ == (
        "FedRotLoRAStrategy"
    )


def test_the_rule_needs_the_round():
    rng = np.random.default_rng(0)
    sent = global_state(rng)
    with pytest.raises(ValueError, match="aligns by round"):
        get_method("fedrot-lora").aggregate(sent, client_states(rng, sent), np.full(3, 1 / 3))


def test_refused_settings_name_the_key_and_the_reason():
    with pytest.raises(ConfigError, match="client-ranks: method 'fedrot-lora' aggregates one"):
        resolve_config({}, {"method": "fedrot-lora", "client-ranks": "2,4"})
    with pytest.raises(ConfigError, match="round-mode: async is refused.*synchronous rounds"):
        resolve_config({}, {"method": "fedrot-lora", "round-mode": "async",
                            "async-concurrency": 2, "async-buffer-size": 2})  # fmt: skip
    with pytest.raises(ConfigError, match="aggregation-weights"):
        resolve_config({}, {"method": "fedrot-lora", "dp": "central",
                            "aggregation-weights": "num-examples"})  # fmt: skip
    with pytest.raises(ConfigError, match="method: bad value 'fedrot'"):
        resolve_config({}, {"method": "fedrot"})
    # what runs: dp=central (the mean mechanism), dp=example, the lossy encodings
    resolve_config({}, {"method": "fedrot-lora", "dp": "central"})
    resolve_config({}, {"method": "fedrot-lora", "dp": "example"})
    resolve_config({}, {"method": "fedrot-lora", "uplink-encoding": "int8",
                        "downlink-encoding": "bf16"})  # fmt: skip


# --------------------------------------------------------------------------- fedrot-rotation

# r up to 8: dimensions above it, so that M (r × r) is nonsingular and U Vᵀ unique
ROT_D_OUT, ROT_D_IN = 20, 16


def reflecting_client(rng, B, A, part, reflect=True, scale=0.3):
    """A client's (Bₙ, Aₙ) trained from (B, A) in its own coordinates, one rank direction of
    both factors negated where needed so that det M < 0 (``reflect``) or > 0 for the aligned
    ``part``: det(U Vᵀ) = sign det M, so the Procrustes U Vᵀ is then a reflection (or not).
    Negating the same direction of Bₙ's column and Aₙ's row keeps the product Bₙ Aₙ."""
    r = A.shape[0]
    q, _ = np.linalg.qr(rng.standard_normal((r, r)))
    b = (B + scale * rng.standard_normal(B.shape)) @ q
    a = q.T @ (A + scale * rng.standard_normal(A.shape))
    m = a @ A.T if part == "A" else b.T @ B
    if (np.linalg.det(m) > 0) == reflect:
        flip = np.ones(r)
        flip[rng.integers(r)] = -1.0
        b, a = b * flip, flip[:, None] * a
    return b, a


def procrustes_m(B, A, gB, gA, part):
    return A @ gA.T if part == "A" else B.T @ gB


def kabsch_by_eigh(m):
    """The rotation (det +1) maximising tr(Rᵀ M) for a nonsingular M, without an SVD:
    MᵀM = V Λ Vᵀ (eigh, Λ ascending), U = M V Λ^(-1/2), and R = U D Vᵀ with D negating the
    smallest singular direction (V's first column here) when det M < 0."""
    lam, v = np.linalg.eigh(m.T @ m)
    d = lam**-0.5
    d[0] *= np.sign(np.linalg.det(m))
    return m @ (v @ np.diag(d) @ v.T)


def random_rotation(rng, r):
    q, _ = np.linalg.qr(rng.standard_normal((r, r)))
    if np.linalg.det(q) < 0:
        q[:, 0] = -q[:, 0]
    return q


def todays_rotation(factor, reference, part):
    """``procrustes_rotation`` as it was before ``fedrot-rotation``, transcribed: U Vᵀ."""
    x, ref = np.asarray(factor, np.float64), np.asarray(reference, np.float64)
    m = x @ ref.T if part == "A" else x.T @ ref
    u, _, vt = np.linalg.svd(m)
    return u @ vt


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("r", [4, 8])
@pytest.mark.parametrize("part", ["A", "B"])
def test_proper_is_the_best_rotation_where_procrustes_gives_a_reflection(seed, r, part):
    rng = np.random.default_rng(100 + seed)
    gB, gA = rng.standard_normal((ROT_D_OUT, r)), rng.standard_normal((r, ROT_D_IN))
    B, A = reflecting_client(rng, gB, gA, part)
    m = procrustes_m(B, A, gB, gA, part)
    s = np.linalg.svd(m, compute_uv=False)
    factor, reference = (A, gA) if part == "A" else (B, gB)
    reflection = procrustes_rotation(factor, reference, part, "orthogonal")
    assert np.linalg.det(reflection) == pytest.approx(-1.0, abs=1e-10)  # the forced case
    Bn, An, Rn = aligned_pair(B, A, gB, gA, part, "proper")
    # orthogonal, det +1
    np.testing.assert_allclose(Rn.T @ Rn, np.eye(r), atol=1e-12)
    assert np.linalg.det(Rn) == pytest.approx(1.0, abs=1e-10)
    np.testing.assert_allclose(Rn, procrustes_rotation(factor, reference, part, "proper"))
    # Kabsch's rotation computed without an SVD, and its value Σ s − 2 s_min
    np.testing.assert_allclose(Rn, kabsch_by_eigh(m), atol=1e-10)
    best = float(np.trace(Rn.T @ m))
    assert best == pytest.approx(s.sum() - 2 * s[-1], abs=1e-10)
    # no rotation does better: random ones, and ones near Rn (Cayley: (I - K)(I + K)⁻¹, K skew)
    for _ in range(100):
        assert float(np.trace(random_rotation(rng, r).T @ m)) <= best + 1e-10
    for eps in (1e-1, 1e-3):
        k = rng.standard_normal((r, r))
        k = eps * (k - k.T)
        near = Rn @ (np.eye(r) - k) @ np.linalg.inv(np.eye(r) + k)
        assert np.linalg.det(near) == pytest.approx(1.0, abs=1e-10)
        assert float(np.trace(near.T @ m)) <= best + 1e-10
    # the reflection scores Σ s, above every rotation: the fix gives up 2 s_min for det +1
    assert float(np.trace(reflection.T @ m)) == pytest.approx(s.sum(), abs=1e-10)
    # the rotated pair, its product Bₙ Aₙ unchanged
    np.testing.assert_allclose(Bn, B @ Rn, atol=1e-12)
    np.testing.assert_allclose(An, Rn.T @ A, atol=1e-12)
    np.testing.assert_allclose(Bn @ An, B @ A, atol=1e-10)


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("r", [4, 8])
@pytest.mark.parametrize("part", ["A", "B"])
def test_orthogonal_is_todays_rotation_bit_for_bit_and_proper_differs_only_on_reflections(
    seed, r, part
):
    rng = np.random.default_rng(200 + seed)
    gB, gA = rng.standard_normal((ROT_D_OUT, r)), rng.standard_normal((r, ROT_D_IN))
    reflect = [True, False, True, False]
    pairs = [reflecting_client(rng, gB, gA, part, reflect=f) for f in reflect]
    w = weights(rng)
    today = []
    for (B, A), flipped in zip(pairs, reflect, strict=True):
        factor, reference = (A, gA) if part == "A" else (B, gB)
        q = todays_rotation(factor, reference, part)
        today.append(q)
        for R_now in (
            procrustes_rotation(factor, reference, part),
            procrustes_rotation(factor, reference, part, "orthogonal"),
        ):
            np.testing.assert_array_equal(R_now, q)
        Bn, An, Rn = aligned_pair(B, A, gB, gA, part, "orthogonal")
        np.testing.assert_array_equal(Rn, q)
        np.testing.assert_array_equal(Bn, B @ q)
        np.testing.assert_array_equal(An, q.T @ A)
        proper = procrustes_rotation(factor, reference, part, "proper")
        if flipped:
            assert not np.allclose(proper, q)
        else:  # det(U Vᵀ) = +1: the same matrix, bit for bit
            np.testing.assert_array_equal(proper, q)
    Bs, As = [b for b, _ in pairs], [a for _, a in pairs]
    want_B = weighted_average([b @ q for b, q in zip(Bs, today, strict=True)], w, "B")
    want_A = weighted_average([q.T @ a for a, q in zip(As, today, strict=True)], w, "A")
    want_norm = float(np.mean([np.linalg.norm(q - np.eye(r)) for q in today]))
    for got in (
        aggregate_fedrot_lora(Bs, As, w, gB, gA, part),
        aggregate_fedrot_lora(Bs, As, w, gB, gA, part, "orthogonal"),
    ):
        np.testing.assert_array_equal(got[0], want_B)
        np.testing.assert_array_equal(got[1], want_A)
        assert got[2] == want_norm


@pytest.mark.parametrize("r", [4, 8])
@pytest.mark.parametrize("part", ["A", "B"])
def test_the_proper_aggregate_is_the_weighted_mean_of_the_rotated_factors(r, part):
    rng = np.random.default_rng(300 + r)
    gB, gA = rng.standard_normal((ROT_D_OUT, r)), rng.standard_normal((r, ROT_D_IN))
    pairs = [reflecting_client(rng, gB, gA, part, reflect=f) for f in (True, True, False, True)]
    w = weights(rng)
    rotations = [kabsch_by_eigh(procrustes_m(B, A, gB, gA, part)) for B, A in pairs]
    want_B = sum(wn * B @ q for wn, (B, _), q in zip(w, pairs, rotations, strict=True))
    want_A = sum(wn * q.T @ A for wn, (_, A), q in zip(w, pairs, rotations, strict=True))
    Bs, As = [b for b, _ in pairs], [a for _, a in pairs]
    new_B, new_A, norm = aggregate_fedrot_lora(Bs, As, w, gB, gA, part, "proper")
    np.testing.assert_allclose(new_B, want_B, rtol=0, atol=1e-10)
    np.testing.assert_allclose(new_A, want_A, rtol=0, atol=1e-10)
    want_norm = np.mean([np.linalg.norm(q - np.eye(r)) for q in rotations])
    assert norm == pytest.approx(want_norm, abs=1e-10)
    # with reflections among the clients, 'orthogonal' averages other factors
    other_B, other_A, _ = aggregate_fedrot_lora(Bs, As, w, gB, gA, part, "orthogonal")
    assert not np.allclose(new_A if part == "A" else new_B, other_A if part == "A" else other_B)
    # round 1 rotates nothing, whichever the setting
    first = aggregate_fedrot_lora(Bs, As, w, gB, gA, None, "proper")
    np.testing.assert_array_equal(first[0], aggregate_fedrot_lora(Bs, As, w, gB, gA, None)[0])


def rotation_state(rng, r):
    return {
        "l.lora_A": rng.standard_normal((r, ROT_D_IN)),
        "l.lora_B": rng.standard_normal((ROT_D_OUT, r)),
        HEAD: rng.standard_normal((2, ROT_D_IN)),
    }


def reflecting_states(rng, sent, part, n=3):
    """n replies whose layer's Procrustes U Vᵀ (for ``part``) is a reflection."""
    out = []
    for _ in range(n):
        b, a = reflecting_client(rng, sent["l.lora_B"], sent["l.lora_A"], part)
        head = sent[HEAD] + 0.1 * rng.standard_normal(sent[HEAD].shape)
        out.append({"l.lora_B": b, "l.lora_A": a, HEAD: head})
    return out


def rotated_reply(c, sent, part, solver):
    """A received reply with its layer rotated by ``solver``'s R for ``part``."""
    q = solver(procrustes_m(c["l.lora_B"], c["l.lora_A"], sent["l.lora_B"], sent["l.lora_A"], part))
    return {**c, "l.lora_B": c["l.lora_B"] @ q, "l.lora_A": q.T @ c["l.lora_A"]}


SOLVERS = {"orthogonal": polar_factor, "proper": kabsch_by_eigh}


@pytest.mark.parametrize("rotation", ROTATIONS)
def test_the_strategy_rotates_as_its_fedrot_rotation_setting(rotation):
    """A strategy built with ``fedrot-rotation`` aggregates rounds 2 (A aligned) and 3 (B)
    of reflecting replies with that setting's R: U Vᵀ, or Kabsch's rotation for 'proper'."""
    rng = np.random.default_rng(9)
    strategy = strategy_for("fedrot-lora", rotation_state(rng, 4), screen_updates=False,
                            fedrot_rotation=rotation)  # fmt: skip
    assert strategy.rotation == rotation
    for server_round in (2, 3):
        part = aligned_part(server_round)
        sent = dict(strategy.global_state)
        clients = reflecting_states(rng, sent, part)
        _, metrics = strategy.aggregate_train(
            server_round, [reply(c, i) for i, c in enumerate(clients)]
        )
        assert metrics["rotation_norm"] > 0
        received = [f32(c) for c in clients]
        for c in received:  # still reflections once sent as float32
            m = procrustes_m(c["l.lora_B"], c["l.lora_A"], sent["l.lora_B"], sent["l.lora_A"], part)
            assert np.linalg.det(m) < 0
        w = np.full(3, 1 / 3)
        for setting, solver in SOLVERS.items():
            rotated = [rotated_reply(c, sent, part, solver) for c in received]
            want = {k: sum(wn * c[k] for wn, c in zip(w, rotated, strict=True)) for k in sent}
            if setting == rotation:
                for key, value in want.items():
                    np.testing.assert_allclose(
                        strategy.global_state[key], value, rtol=0, atol=1e-10
                    )
            else:  # the other setting's aggregate is visibly another
                key = f"l.lora_{part}"
                assert not np.allclose(strategy.global_state[key], want[key], atol=1e-3)


def test_dp_central_rotates_by_the_fedrot_rotation_setting():
    """dp=central (z = 0, C below the updates' norms): the replies are rotated by the
    proper R before they are clipped."""
    C = 0.5
    rng = np.random.default_rng(10)
    sent = rotation_state(rng, 4)
    strategy = strategy_for("fedrot-lora", sent, dp="central", dp_clipping_norm=C,
                            fedrot_rotation="proper")  # fmt: skip
    strategy.dp = CentralDP("mean", C, 0.0, 1e-5, np.random.default_rng(0))
    strategy.communication.sampled[2] = 3
    clients = reflecting_states(rng, sent, "A")
    _, metrics = strategy.aggregate_train(2, [reply(c, i) for i, c in enumerate(clients)])
    rotated = [rotated_reply(c, sent, "A", kabsch_by_eigh) for c in map(f32, clients)]
    updates = [clip_update({k: v - sent[k] for k, v in c.items()}, C) for c in rotated]
    for key, value in sent.items():
        want = value + sum(u[key] for u in updates) / 3
        np.testing.assert_allclose(strategy.global_state[key], want, rtol=0, atol=1e-10)
    assert metrics["dp-clipped"] == 3


def test_fedrot_rotation_is_checked_before_launch_naming_the_key():
    assert fields(FedRotLoRASettings)[0].metadata["check"].options == ROTATIONS
    assert resolve_config({}, {"method": "fedrot-lora"}).fedrot_rotation == "orthogonal"
    config = resolve_config({}, {"method": "fedrot-lora", "fedrot-rotation": "proper"})
    assert config.fedrot_rotation == "proper"
    refused = r"fedrot-rotation: bad value 'reflection' \(must be one of orthogonal, proper\)"
    with pytest.raises(ConfigError, match=refused):
        resolve_config({}, {"method": "fedrot-lora", "fedrot-rotation": "reflection"})
    A = np.random.default_rng(0).standard_normal((R, D_IN))
    with pytest.raises(ValueError, match="fedrot-rotation must be one of"):
        procrustes_rotation(A, A, "A", "SO(r)")

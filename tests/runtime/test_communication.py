"""Communication accounting: counts per method, checked against the tensors that travel."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from transformers import BertForSequenceClassification

from flower_app.adapters.florg.model import get_florg_state, inject_florg
from flower_app.adapters.lora.layer import LoRAConfig, get_lora_state, inject_lora
from flower_app.adapters.lora_sb.layer import (
    LoRASBConfig,
    get_lora_sb_state,
    inject_lora_sb,
    lora_sb_layers,
)
from flower_app.adapters.targets import adapter_layout
from flower_app.methods.communication import round_communication
from flower_app.methods.registry import method_names
from flower_app.settings.config import resolve_config
from strategies.fedex_lora.rule import aggregate_fedex_lora
from tests.runtime.test_adapter import florg_config

METHODS = method_names()

TARGETS = ("query", "intermediate.dense")


def model(config):
    torch.manual_seed(0)
    return BertForSequenceClassification(config)


def n_params(state: dict[str, np.ndarray]) -> int:
    return sum(int(v.size) for v in state.values())


@pytest.fixture(scope="module")
def layout(tiny_bert_config):
    return adapter_layout(model(tiny_bert_config), TARGETS, None)


def test_counts_match_the_tensors_each_method_sends(layout, tiny_bert_config):
    shapes, head = layout
    r = 3
    m = model(tiny_bert_config)
    inject_florg(m, florg_config(r=r, target_modules=TARGETS))
    florg = n_params(get_florg_state(m))
    lora = inject_lora(model(tiny_bert_config), LoRAConfig(r=r, target_modules=TARGETS))
    both = n_params(get_lora_state(lora, ("A", "B")))
    only_a = n_params(get_lora_state(lora, ("A",)))
    only_b = n_params(get_lora_state(lora, ("B",)))
    expected = {
        "florg": florg,
        "florg-no-procrustes": florg,
        "florg-signed": florg,
        "fedit": both,
        "federa": both,
        "fedex-lora": both,
        "ffa-lora": only_b,
        "fedsa-lora": only_a,
        # at rank r; a client of rank r_n: its r_n (tests/runtime/test_client_ranks.py)
        "hetlora": both,
        "flexlora": both,
        "fedrot-lora": both,  # its rotation runs on the server: the factor-wise average's
    }
    # up in rounds 1 and 2, down: B then A, both down (RoLoRA); B up, both down (FedSVD)
    by_round = {"rolora": ((only_b, only_a), both), "fedsvd": ((only_b, only_b), both)}
    # FLoRA: B and A up; down the fresh B and A and the last round's stacked factors
    stack = 4 * r * sum(d_out + d_in for d_out, d_in in shapes.values())
    flora = round_communication("flora", shapes, r, head, num_clients=4)
    assert (flora.up_params, flora.down_params) == (both, both + stack)
    expected["flora"] = both
    # Fed-SB: R (r x r) up and down every round; B and A (r (d_out + d_in)) down once, with
    # a node's first training message (round 1); round 0: each client's gradient of every
    # adapted W0 up, nothing down
    sb = model(tiny_bert_config)
    inject_lora_sb(sb, LoRASBConfig(r=r, target_modules=TARGETS))
    only_r = n_params(get_lora_sb_state(sb))
    basis = sum(int(m.B.numel() + m.A.numel()) for m in lora_sb_layers(sb).values())
    grads = sum(int(m.base_layer.weight.numel()) for m in lora_sb_layers(sb).values())
    assert only_r == head + r * r * len(shapes) and grads == sum(o * i for o, i in shapes.values())
    first, second = (
        round_communication("fed-sb", shapes, r, head, num_clients=4, server_round=t)
        for t in (1, 2)
    )
    assert (first.up_params, first.down_params) == (only_r, only_r + basis)
    assert (second.up_params, second.down_params) == (only_r, only_r)
    zeroth = round_communication("fed-sb", shapes, r, head, num_clients=4, server_round=0)
    assert (zeroth.up_params, zeroth.down_params) == (grads, 0)
    expected["fed-sb"] = only_r
    assert set(expected) | set(by_round) == set(METHODS)
    for method in METHODS:
        c = round_communication(method, shapes, r, head, num_clients=4)
        if method in by_round:
            (up1, up2), down = by_round[method]
            second = round_communication(method, shapes, r, head, num_clients=4, server_round=2)
            assert (c.up_params, second.up_params) == (up1, up2), method
            assert c.down_params == second.down_params == down, method
            continue
        assert c.up_params == expected[method], method
        assert c.up_bytes == 4 * c.up_params
        if method not in ("fedex-lora", "flora", "fed-sb"):
            assert c.down_params == c.up_params
        if method != "fed-sb":  # round 0 only evaluates: nothing travels
            zero = round_communication(method, shapes, r, head, num_clients=4, server_round=0)
            assert zero.total_params == 0, method


def test_fedex_residual_counted_dense_and_factored(layout):
    shapes, head = layout
    r, n = 2, 5
    rng = np.random.default_rng(0)
    dense_total = fact_total = 0
    for d_out, d_in in shapes.values():
        Bs = [rng.standard_normal((d_out, r)) for _ in range(n)]
        As = [rng.standard_normal((r, d_in)) for _ in range(n)]
        dense_total += aggregate_fedex_lora(Bs, As, None, "dense")[2].num_params
        fact_total += aggregate_fedex_lora(Bs, As, None, "factored")[2].num_params
    base = round_communication("fedit", shapes, r, head).down_params
    dense = round_communication("fedex-lora", shapes, r, head, n, factored(False))
    fact = round_communication("fedex-lora", shapes, r, head, n, factored(True))
    assert round_communication("fedex-lora", shapes, r, head, n) == dense  # the default
    assert dense.down_params == base + dense_total
    assert fact.down_params == base + fact_total
    assert dense.up_params == fact.up_params == base


def factored(yes: bool):
    """The run's settings with FedEx-LoRA's residual transport (``fedex-residual``)."""
    return resolve_config({"fedex-residual": "factored" if yes else "dense"})


def test_florg_sends_less_than_half_of_fedit_on_square_layers():
    shapes = {f"l{i}": (1024, 1024) for i in range(48)}  # RoBERTa-large q, v
    florg = round_communication("florg", shapes, 4, 0)
    fedit = round_communication("fedit", shapes, 4, 0)
    assert florg.up_params == 48 * 4 * 1024 and 2 * florg.up_params == fedit.up_params


def test_bad_input():
    with pytest.raises(ValueError, match="unknown method"):
        round_communication("fedavg", {"a": (2, 2)}, 1, 0)
    with pytest.raises(ValueError, match="fedex-residual"):  # a config that skipped its check
        unchecked = SimpleNamespace(fedex_residual="x")
        round_communication("fedex-lora", {"a": (2, 2)}, 1, 0, config=unchecked)
    with pytest.raises(ValueError, match="r >= 1"):
        round_communication("florg", {"a": (2, 2)}, 0, 0)


@pytest.mark.parametrize("encoding", ["fp32", "bf16", "fp16", "int8"])
@pytest.mark.parametrize("method", ["florg", "fedit", "ffa-lora", "rolora"])
def test_encoded_bytes_are_the_encoded_arrays_bytes(method, encoding):
    """``RoundCommunication.encoded`` (the projection's bytes) against the bytes of the
    arrays ``flower_app.wire.encoding.encode_record`` makes of a state of those shapes (no
    head: the count's head has no known rows)."""
    from flower_app.methods.registry import get_method
    from flower_app.wire.encoding import encode_record

    shapes, r = {"l0": (12, 20), "l1": (20, 12)}, 3
    spec = get_method(method)
    state = {
        f"{layer}.{spec.kind.part_key(part)}": np.ones(spec.kind.parts[part].shape(o, i, r))
        for layer, (o, i) in shapes.items()
        for part in spec.shared
    }
    rng = np.random.default_rng(0)
    sent = sum(a.numpy().nbytes for a in encode_record(state, encoding, rng).values())
    count = round_communication(method, shapes, r, 0)
    assert count.encoded(encoding, encoding)[1] == sent
    if set(spec.trained_parts(1)) == set(spec.shared):
        assert count.encoded(encoding, encoding)[0] == sent


def test_the_projection_counts_the_run_s_encodings():
    """The FlowerTune projection (florg_tools/comm_projection.py) in bytes under the run's
    encodings: at fp32 its parameters times 4, as before; with int8 up and bf16 down the
    encoded bytes of each round's arrays."""
    import strategies.registry  # noqa: F401
    from florg_tools.comm_projection import project
    from flower_app.preflight.leaderboard import megabytes

    shapes = {"l0": (64, 32), "l1": (32, 64)}
    for method in ("florg", "fedit"):
        base = {"method": method, "rank": 4, "num-server-rounds": 3, "min-train-nodes": 2}
        (plain,) = project(resolve_config(base), shapes, 10, methods=(method,))
        assert plain.total_mb == pytest.approx(
            megabytes(plain.clients_per_round * (plain.run_up_params + plain.run_down_params))
        )
        encoded = {**base, "uplink-encoding": "int8", "downlink-encoding": "bf16"}
        (small,) = project(resolve_config(encoded), shapes, 10, methods=(method,))
        per_round = sum(round_communication(method, shapes, 4, 0).encoded("int8", "bf16"))
        assert small.total_mb == pytest.approx(
            megabytes(small.clients_per_round * 3 * per_round, 1)
        )
        assert small.total_mb < plain.total_mb / 2

"""The folds into W0 (FedEx-LoRA's residuals, FLoRA's stacked updates) under any
participation: the server keeps a base (the sum of the folds up to round t - 1, as a client
sums them) and the latest round's folds, yet every node's float64 cumulative fold is bit for
bit that of the old rule, which kept every round and sent a node each round it missed, to be
folded one by one (written out here as the reference). With every node taking part, the
messages are the old ones; the server's memory and its checkpoint do not grow with the
rounds; a checkpoint of the old format (every round's fold) restores to the same messages.
The strategies' rounds: tests/runtime/test_flora.py, tests/runtime/test_checkpoint.py; the
runs, resumed ones included: tests/runtime/test_app_e2e.py."""

from __future__ import annotations

import json

import numpy as np
import pytest
from flwr.app import Message, MessageType, RecordDict
from flwr.supercore.task_identity import TaskIdentity

import strategies.shared.folds as folds_module
from flower_app.methods.registry import get_method
from flower_app.wire.records import from_array_record, record_params
from strategies.server.fold_messages import residuals_record
from strategies.shared.folds import Residual
from tests.harness.strategy_helpers import strategy_for

# a Message needs them outside a Flower app (as tests/runtime/test_flora.py)
TaskIdentity.run_id = 1
TaskIdentity.task_id = 1
TaskIdentity.node_id = 1

LAYERS = {"a": (6, 5), "b": (4, 7)}  # layer -> (d_out, d_in)
R = 2
ROUNDS = 8
NODES = range(1, 6)  # node 5 first takes part in round 6
# round -> the nodes sent a training message: some skip many rounds, node 5 is new at 6
PARTICIPATION = {
    1: {1, 2, 3},
    2: {1, 2},
    3: {1, 3},
    4: {1},
    5: {1, 2, 4},
    6: {1, 5},
    7: {1, 3},
    8: {1, 2, 3, 4, 5},
}
CASES = [("fedex-lora", "dense"), ("fedex-lora", "factored"), ("flora", None)]


def strategy(method: str, mode: str | None):
    initial = {}
    for layer, (d_out, d_in) in LAYERS.items():
        initial[f"{layer}.lora_A"] = np.full((R, d_in), 0.1)
        initial[f"{layer}.lora_B"] = np.zeros((d_out, R))
    settings = {"fedex_residual": mode} if mode else {}
    return strategy_for(method, initial, **settings)


def random_folds(rng, dense: bool) -> dict[str, Residual]:
    """One round's folds (float64, as the rules return them), dense or factored."""
    out = {}
    for layer, (d_out, d_in) in LAYERS.items():
        if dense:
            out[layer] = Residual(dense=rng.standard_normal((d_out, d_in)))
        else:
            k = 3 * R
            out[layer] = Residual(
                P=rng.standard_normal((d_out, k)), Q=rng.standard_normal((k, d_in))
            )
    return out


def old_rule(cumulative: dict, done: int, history: dict[int, dict[str, Residual]]) -> int:
    """The reference: fold every round after ``done`` one by one, as a client did when the
    server kept every round (float32 as sent, then float64; P @ Q in float64)."""
    for t in sorted(history):
        if t <= done:
            continue
        for layer, res in history[t].items():
            if res.dense is not None:
                dense = res.dense.astype(np.float32).astype(np.float64)
            else:
                p = res.P.astype(np.float32).astype(np.float64)
                dense = p @ res.Q.astype(np.float32).astype(np.float64)
            cumulative[layer] = cumulative.get(layer, 0.0) + dense
        done = t
    return done


class _Context:
    def __init__(self):
        self.state = RecordDict()


@pytest.fixture(autouse=True)
def no_model(monkeypatch):
    """The W0 write is checked on a model in tests/runtime/test_flora.py; here only the folds."""
    monkeypatch.setattr(folds_module, "fold_residual", lambda *args: None)


def message_to(strategy, server_round: int, node: int) -> Message:
    empty = Message(content=RecordDict({}), dst_node_id=node, message_type=MessageType.TRAIN)
    return strategy.extend_train_message(server_round, empty)


def cumulative_of(method, context) -> dict[str, np.ndarray]:
    return from_array_record(context.state[method.cumulative_key])


def assert_bitwise(got: dict[str, np.ndarray], expected: dict[str, np.ndarray]) -> None:
    assert got.keys() == expected.keys()
    for layer, value in expected.items():
        assert got[layer].dtype == np.float64
        assert np.array_equal(got[layer], value), layer
        assert got[layer].tobytes() == np.asarray(value, np.float64).tobytes(), layer


def same_record(a, b) -> bool:
    a, b = from_array_record(a), from_array_record(b)
    return list(a) == list(b) and all(
        a[k].dtype == b[k].dtype and a[k].tobytes() == b[k].tobytes() for k in a
    )


def run_rounds(method_name, mode, participation, seed=0):
    """Runs the rounds; checks every node against the old rule as it goes. Returns the
    strategy, the method, every round's folds, the nodes' contexts and the old rule's state."""
    rng = np.random.default_rng(seed)
    method, strat = get_method(method_name), strategy(method_name, mode)
    dense = mode == "dense"
    history: dict[int, dict[str, Residual]] = {}
    contexts = {n: _Context() for n in NODES}
    reference: dict[int, tuple[dict, int]] = {n: ({}, 0) for n in NODES}
    for t in sorted(participation):
        for node in sorted(participation[t]):
            msg = message_to(strat, t, node)
            since = strat.node_synced.get(node, 0)
            record = msg.content["residuals"]
            old_msg = residuals_record(history, since)  # every round kept, no base
            has_base = any(k.startswith("base/") for k in record)
            assert has_base == (since < strat.base_round)
            if not has_base:  # the old message, bit for bit (content and down-params)
                assert same_record(record, old_msg)
            else:  # the base, then the rounds after it
                assert {k.split("/")[1] for k in record if k.startswith("base/")} == {
                    str(strat.base_round)
                }
            out = method.receive_on_client(msg, contexts[node], None)
            strat.node_synced[node] = out["residual-round"]  # as aggregate_train reads it
            cum, done = reference[node]
            done = old_rule(cum, done, history)
            reference[node] = (cum, done)
            assert out["residual-round"] == done == max(history, default=0)
            assert_bitwise(cumulative_of(method, contexts[node]), cum)
        history[t] = random_folds(rng, dense)
        strat.record_folds(t, history[t])
        # the server keeps one round's folds whatever the participation
        assert strat.residuals.keys() == {t} and strat.base_round == t - 1
    return strat, method, history, contexts, reference


@pytest.mark.parametrize(("method_name", "mode"), CASES)
def test_every_node_folds_what_the_old_rule_gives_bit_for_bit(method_name, mode):
    strat, method, history, contexts, reference = run_rounds(method_name, mode, PARTICIPATION)
    # round 9: every node is sent what it lacks; all hold the sum of rounds 1..8, the same bits
    for node in NODES:
        method.receive_on_client(message_to(strat, ROUNDS + 1, node), contexts[node], None)
        cum, _ = reference[node]
        old_rule(cum, reference[node][1], history)
        assert_bitwise(cumulative_of(method, contexts[node]), cum)
        assert_bitwise(cumulative_of(method, contexts[node]), cumulative_of(method, contexts[1]))


@pytest.mark.parametrize("seed", range(3))
def test_random_participation_matches_the_old_rule(seed):
    rng = np.random.default_rng(100 + seed)
    participation = {t: {n for n in NODES if rng.random() < 0.4} for t in range(1, ROUNDS + 1)}
    for method_name, mode in CASES:
        run_rounds(method_name, mode, participation, seed=seed)


@pytest.mark.parametrize(("method_name", "mode"), CASES)
def test_full_participation_sends_what_it_sent_and_a_laggard_gets_the_base(method_name, mode):
    full = {t: set(NODES) for t in range(1, ROUNDS + 1)}
    strat, _, history, _, _ = run_rounds(method_name, mode, full)  # messages compared inside
    t = ROUNDS + 1
    messages = [message_to(strat, t, n) for n in NODES]
    old = sum(
        record_params(RecordDict({"residuals": residuals_record(history, t - 2)})) for _ in NODES
    )
    strat.communication.record_sent(t, messages)
    assert strat.communication.down(t) == old  # only round 8's folds, to each node
    # a node that folded only round 2: the base (rounds 1..7) and round 8's folds, counted
    strat.node_synced[3] = 2
    lagging = message_to(strat, t, 3)
    arrays = from_array_record(lagging.content["residuals"])
    base_keys = {f"base/{ROUNDS - 1}/{layer}/dense" for layer in LAYERS}
    assert base_keys <= arrays.keys() and all(arrays[k].dtype == np.float64 for k in base_keys)
    assert {k.split("/")[0] for k in arrays} == {"base", str(ROUNDS)}
    strat.communication.record_sent(t, [lagging])
    dense_size = sum(d_out * d_in for d_out, d_in in LAYERS.values())
    last = sum(res.num_params for res in history[ROUNDS].values())
    assert strat.communication.down(t) == dense_size + last


@pytest.mark.parametrize(("method_name", "mode"), CASES)
def test_the_checkpoint_does_not_grow_and_the_old_format_restores_the_same(method_name, mode):
    rng = np.random.default_rng(7)
    strat, method = strategy(method_name, mode), get_method(method_name)
    history, sizes = {}, []
    for t in range(1, ROUNDS + 1):
        history[t] = random_folds(rng, mode == "dense")
        strat.record_folds(t, history[t])
        arrays = strat.state_arrays()
        sizes.append((len(arrays), sum(np.asarray(v).size for v in arrays.values())))
    assert len(set(sizes[1:])) == 1  # from round 2 on: base + one round + cumulative
    state = json.loads(json.dumps(strat.state_json()))
    new = strategy(method_name, mode)
    new.restore(strat.state_arrays(), state)
    # the format before the base: every round's fold, no base
    prefix = strat.fold_prefix
    old_arrays = {
        k: v
        for k, v in strat.state_arrays().items()
        if not k.startswith((f"{prefix}/base/", f"{prefix}/residual/"))
    }
    for t, layers in history.items():
        for layer, res in layers.items():
            parts = {"dense": res.dense} if res.dense is not None else {"P": res.P, "Q": res.Q}
            old_arrays.update({f"{prefix}/residual/{t}/{layer}/{k}": v for k, v in parts.items()})
    old = strategy(method_name, mode)
    old.restore(old_arrays, state)
    expected: dict[str, np.ndarray] = {}
    old_rule(expected, 0, history)  # the uninterrupted run's node that folded every round
    for restored in (new, old):
        assert restored.node_synced == {} and restored.base_round == ROUNDS - 1
        assert restored.residuals.keys() == {ROUNDS}
        assert_bitwise(restored.base, strat.base)
        assert_bitwise(restored.cumulative, strat.cumulative)
        context = _Context()  # a resumed run's node: nothing folded
        msg = message_to(restored, ROUNDS + 1, 1)
        assert same_record(
            msg.content["residuals"], message_to(new, ROUNDS + 1, 1).content["residuals"]
        )
        assert method.receive_on_client(msg, context, None) == {"residual-round": ROUNDS}
        assert_bitwise(cumulative_of(method, context), expected)

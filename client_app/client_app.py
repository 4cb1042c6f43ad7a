"""The ClientApp: train the method's adapter on this node's partition and send the payload.

Everything method-specific comes from the method registry (flower_app/methods/registry.py),
filled when this module imports strategies.registry. A node keeps state between rounds in its
Flower ``Context`` (per run): a method's personal parts (``Method.local``) and what its hook
keeps (``receive_on_client``). A resumed run has fresh contexts: the strategy re-sends what a
node must fold again, and personal parts come back from the node's disk where the operator sets
``$FLORG_NODE_STATE_DIR`` (flower_app/client/node_state.py), else restart from zero. A round
itself is flower_app/client/round.py; the client mods flower_app/secure/client_mod.py and
flower_app/client/faults.py are attached here."""

from __future__ import annotations

import time
from dataclasses import asdict
from typing import TYPE_CHECKING

from flwr.app import Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.common.logger import log as flwr_log

import strategies.registry  # noqa: F401  (every method registers with the core's registry)
from flower_app.cache.per_process import cached_adapted_model
from flower_app.client.dp_state import load_accountant, save_accountant
from flower_app.client.error_feedback import encode_with_feedback
from flower_app.client.faults import inject_faults
from flower_app.client.node_config import node_delay, node_slowdown, use_node_data
from flower_app.client.node_speed import node_costs
from flower_app.client.node_state import (
    load_local_state,
    message_config,
    node_state_dir,
    save_local_state,
)
from flower_app.client.round import local_batches, receive, train_round
from flower_app.modeling import pick_device
from flower_app.secure.client_mod import secure_aggregation_mod
from flower_app.settings.client_ranks import config_at_rank, node_rank
from flower_app.settings.config import RunConfig, resolve_config
from flower_app.task_data import load_task_data, tokenized_split
from flower_app.task_eval import evaluate_task
from flower_app.wire.encoding import UP, decode_record, encode_record, encoding_rng
from flower_app.wire.ranks import truncate_to_rank
from flower_app.wire.records import from_array_record, to_array_record

if TYPE_CHECKING:
    from flower_app.adapted import AdaptedModel

# secure-aggregation's stages (flower_app/secure/client_mod.py: inactive unless the server
# runs them) around fault-* (testing: flower_app/client/faults.py)
app = ClientApp(mods=[secure_aggregation_mod, inject_faults])

LOCAL_STATE = "local-state"  # the context's record of a method's personal parts
WARNING = 30


def _partition(context: Context) -> tuple[int, int]:
    """(partition-id, num-partitions) from the node config; a lone node holds everything."""
    node = context.node_config
    return int(node.get("partition-id", 0)), int(node.get("num-partitions", 1))


def _node_model(context: Context) -> tuple[RunConfig, int, int, AdaptedModel, int]:
    """(config, partition id, num-partitions, adapted model, rank) of this node: the run's
    config with the node's own data settings, and the process's cached model at the node's
    rank, before any arrays are loaded into it."""
    config = resolve_config(context.run_config)
    partition_id, num_partitions = _partition(context)
    config, num_partitions = use_node_data(config, context.node_config, num_partitions)
    # the node's rank: flower_app/settings/client_ranks.py
    rank = node_rank(config, context.node_config, partition_id)
    data = load_task_data(config)
    adapted = cached_adapted_model(config_at_rank(config, rank), data.num_labels, data.spec.kind)
    return config, partition_id, num_partitions, adapted, rank


def _prepare(msg: Message, context: Context, *, training: bool):
    config, partition_id, num_partitions, adapted, rank = _node_model(context)
    # a state of a larger rank (the server does not know this node's rank yet): the top rows
    # downlink-encoding: the arrays as float32 before anything reads them
    received = decode_record(msg.content["arrays"], config.downlink_encoding)
    shared = truncate_to_rank(from_array_record(received), rank)
    local = context.state.array_records.get(LOCAL_STATE)
    state = from_array_record(local) if local is not None else None
    folder = node_state_dir(msg, partition_id) if adapted.method.personal else None
    if state is None and folder is not None:  # a fresh context: a resumed run or node
        server_round = int(message_config(msg).get("server-round", 0))
        state = load_local_state(folder, server_round + (0 if training else 1))
    try:
        receive(adapted, shared, state)
    except (KeyError, ValueError) as err:  # a persisted state of another shape
        if local is not None or state is None:
            raise
        flwr_log(WARNING, "[florg] ignoring persisted local state in %s: %s", folder, err)
        receive(adapted, shared, None)
    return config, partition_id, num_partitions, adapted, rank


@app.train()
def train(msg: Message, context: Context) -> Message:
    """One training round (flower_app/client/round.py); the node keeps its own parts. A
    straggler (``slowdown`` > 1, flower_app/client/node_config.py) then waits (slowdown - 1)
    times its local steps' time before replying, unless the virtual clock models it."""
    config, pid, num_partitions, adapted, rank = _prepare(msg, context, training=True)
    server_round = int(msg.content["config"].get("server-round", 0))
    metrics: dict[str, float] = {
        "partition-id": pid,
        "rank": rank,  # the server checks it against the arrays' shapes
        "lr-fingerprint": adapted.fingerprint(),
    }
    metrics |= adapted.method.receive_on_client(msg, context, adapted)  # the method's hook
    # dp=example: the node's DP-SGD ledger (flower_app/client/dp_state.py); a client past
    # dp-max-epsilon raises DpBudgetExceeded, which Flower returns as a failed reply
    accountant = load_accountant(context, msg, pid) if config.dp == "example" else None
    started = time.perf_counter()
    reply = train_round(
        config,
        adapted,
        server_round=server_round,
        partition_id=pid,
        num_partitions=num_partitions,
        metrics=metrics,
        accountant=accountant,
    )
    # its training's time: the local steps' (train-seconds), else the whole round's
    trained = float(reply.metrics.get("train-seconds", time.perf_counter() - started))
    if accountant is not None:
        save_accountant(context, msg, pid, accountant)
    if reply.local:
        context.state[LOCAL_STATE] = to_array_record(reply.local)
        folder = node_state_dir(msg, pid)
        if folder is not None:
            save_local_state(folder, server_round, reply.local)
    content = reply.content()
    if config.uplink_encoding != "fp32":  # the shared arrays as uplink-encoding sends them
        # an update holding NaN/inf raises NonFiniteArray (naming the array): left to raise,
        # as Flower logs a ClientApp's exception on the node and returns it to the server as
        # an error reply with the exception's text, which the strategy counts as a failure
        rng = encoding_rng(config.seed, server_round, UP, pid)
        if config.uplink_error_feedback:  # plus what earlier replies' encoding left out
            content["arrays"] = encode_with_feedback(
                msg, context, config, adapted, reply.shared,
                rank=rank, partition_id=pid, server_round=server_round, rng=rng,
            )  # fmt: skip
        else:
            content["arrays"] = encode_record(reply.shared, config.uplink_encoding, rng)
    # a straggler's wait: a multiple of its training time plus a fixed delay (under the
    # clock, the clock models both)
    wait = (node_slowdown(config, context.node_config, pid) - 1) * trained
    wait += node_delay(config, context.node_config, pid)
    if wait > 0 and not config.virtual_clock:
        time.sleep(wait)
    return Message(content=content, reply_to=msg)


@app.query()
def query(msg: Message, context: Context) -> Message:
    """A method's question before the training rounds (``Method.answer_query``; only a
    method whose strategy runs a round 0 asks one): its arrays and metrics, with the
    node's partition id and rank. Under dp=example the answer is a release the node's
    DP-SGD ledger must compose: loaded here as ``train`` loads it, handed to the method,
    and saved after, so the training rounds continue the same ledger (and a resumed run,
    which never redoes round 0, reads it from the node's disk)."""
    config, pid, num_partitions, adapted, rank = _node_model(context)
    batches = local_batches(config, pid, num_partitions)  # round 0's seed
    accountant = load_accountant(context, msg, pid) if config.dp == "example" else None
    arrays, answer = adapted.method.answer_query(config, adapted, batches, accountant)
    if accountant is not None:
        save_accountant(context, msg, pid, accountant)
    metrics = MetricRecord({"partition-id": pid, "rank": rank, **answer})
    content = RecordDict({"arrays": to_array_record(arrays), "metrics": metrics})
    return Message(content=content, reply_to=msg)


@app.query("profile")
def profile(msg: Message, context: Context) -> Message:
    """This node's profile for the server's virtual clock (``virtual-clock``;
    strategies/server/virtual_clock.py), without building the model: its partition id, its
    training examples (its tokenised share of the train split, the disk-cached one its
    rounds train on) and its costs (flower_app/client/node_speed.py)."""
    config = resolve_config(context.run_config)
    pid, num_partitions = _partition(context)
    config, num_partitions = use_node_data(config, context.node_config, num_partitions)
    costs = node_costs(config, context.node_config, pid)
    examples = len(tokenized_split(config, "train", pid, num_partitions))
    metrics = MetricRecord(
        {"partition-id": pid, "num-examples": examples,
         **{key.replace("_", "-"): value for key, value in asdict(costs).items()}}
    )  # fmt: skip
    return Message(content=RecordDict({"metrics": metrics}), reply_to=msg)


@app.evaluate()
def personalised_evaluate(msg: Message, context: Context) -> Message:
    """Evaluate the global arrays plus this node's own state (``Method.local``) on its share
    of the validation split (partitioned like the training data): the task's metrics
    (accuracy, or exact-match and f1), loss, score and num-examples.

    A method with personal parts has no single global model to compare with the other
    methods, so its node also scores its personalised model on the splits every method is
    compared on: the whole held-out test split where the server scores test
    (``RunConfig.tests_round``; metrics ``test-*``) and the whole validation split in the
    last three rounds, which tuning reads (``val-*``). The server averages these over
    nodes with equal weight (``personalized-test-score``: the mean node's model)."""
    config, pid, num_partitions, adapted, _ = _prepare(msg, context, training=False)
    adapted.method.receive_on_client(msg, context, adapted)  # the method's hook
    device = pick_device(config.device)
    metrics = evaluate_task(config, adapted.model, device, pid, num_partitions)
    if adapted.method.personal:
        server_round = int(message_config(msg).get("server-round", 0))
        if config.tests_round(server_round):
            test = evaluate_task(config, adapted.model, device, split="test")
            metrics |= {f"test-{key}": value for key, value in test.items()}
        if config.in_last_rounds(server_round):
            val = evaluate_task(config, adapted.model, device)
            metrics |= {f"val-{key}": value for key, value in val.items()}
    adapted.model.to("cpu")
    metrics["partition-id"] = pid
    return Message(content=RecordDict({"metrics": MetricRecord(metrics)}), reply_to=msg)

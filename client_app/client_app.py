"""The ClientApp: train the method's adapter on this node's partition and send the payload.

Everything method-specific comes from the method registry (strategies/). State a
node keeps between rounds lives in its Flower ``Context`` (per run): a method's personal
parts (FedSA-LoRA's own B) and whatever its hook keeps (FedEx-LoRA's folded residuals). A
resumed run (flower_app/checkpoint.py) is a new Flower run with fresh contexts:
FedEx-LoRA's server then re-sends every residual; personal parts are read back from the
node's disk when the node operator sets ``$FLORG_NODE_STATE_DIR``
(``<dir>/<run lineage>/partition-<id>/round-<t>.safetensors``, written after each training
round; the lineage id comes from the server and is checked to be 32 hex digits, so a run
setting cannot point these writes elsewhere), else they restart from zero.

A training round itself (receive, seed, train, reply) is flower_app/client_round.py, shared
with the benchmarks; the testing settings ``fault-*`` act through the client mod
flower_app/faults.py, attached here.
"""

from __future__ import annotations

import contextlib
import os
import re
import uuid
from pathlib import Path

import numpy as np
from flwr.app import Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.common.logger import log as flwr_log

from flower_app.client_ranks import config_at_rank, node_rank
from flower_app.client_round import receive, train_round
from flower_app.config import resolve_config
from flower_app.faults import inject_faults
from flower_app.modeling import pick_device
from flower_app.node_config import use_node_data
from flower_app.records import from_array_record, to_array_record
from flower_app.runtime import cached_adapted_model
from flower_app.task_data import load_task_data
from flower_app.task_eval import evaluate_task
from strategies.common.ranks import truncate_to_rank

app = ClientApp(mods=[inject_faults])  # fault-* (testing): flower_app/faults.py

LOCAL_STATE = "local-state"  # the context's record of a method's personal parts
NODE_STATE_ENV = "FLORG_NODE_STATE_DIR"
_LINEAGE_RE = re.compile(r"[0-9a-f]{32}")
WARNING = 30
KEEP_ROUNDS = 2


def _message_config(msg: Message) -> dict:
    return dict(msg.content["config"]) if "config" in msg.content.config_records else {}


def _node_state_dir(msg: Message, partition_id: int) -> Path | None:
    """This node's folder for the run lineage's persisted state, or None (not configured,
    or the server sent no valid lineage id)."""
    root = os.environ.get(NODE_STATE_ENV, "").strip()
    lineage = _message_config(msg).get("lineage")
    if not root or not isinstance(lineage, str) or not _LINEAGE_RE.fullmatch(lineage):
        return None
    if partition_id < 0:
        return None
    return Path(root).expanduser().resolve() / lineage / f"partition-{int(partition_id)}"


def _persisted_rounds(folder: Path) -> list[tuple[int, Path]]:
    found = []
    for path in folder.glob("round-*.safetensors"):
        digits = path.name[len("round-") : -len(".safetensors")]
        if digits.isdigit():
            found.append((int(digits), path))
    return sorted(found)


def _save_local_state(folder: Path, server_round: int, local: dict[str, np.ndarray]) -> None:
    """Atomically write this round's local state; keep the newest ``KEEP_ROUNDS``."""
    from safetensors.numpy import save_file

    folder.mkdir(parents=True, exist_ok=True)
    final = folder / f"round-{server_round:06d}.safetensors"
    tmp = folder / f".{final.name}.{uuid.uuid4().hex}"
    save_file({k: np.ascontiguousarray(v, np.float32) for k, v in local.items()}, str(tmp))
    os.replace(tmp, final)
    for _, old in _persisted_rounds(folder)[:-KEEP_ROUNDS]:
        with contextlib.suppress(OSError):
            old.unlink()


def _load_local_state(folder: Path, before_round: int) -> dict[str, np.ndarray] | None:
    """The newest persisted local state of a round < ``before_round`` (what the node held
    when that round's message arrived), or None."""
    from safetensors.numpy import load_file

    for t, path in reversed(_persisted_rounds(folder)):
        if t < before_round:
            try:
                return load_file(str(path))
            except Exception as err:  # damaged (safetensors has its own error type)
                flwr_log(WARNING, "[florg] ignoring unreadable %s: %s", path, err)
    return None


def _partition(context: Context) -> tuple[int, int]:
    """(partition-id, num-partitions) from the node config; a lone node holds everything."""
    node = context.node_config
    return int(node.get("partition-id", 0)), int(node.get("num-partitions", 1))


def _prepare(msg: Message, context: Context, *, training: bool):
    config = resolve_config(context.run_config)
    partition_id, num_partitions = _partition(context)
    config, num_partitions = use_node_data(config, context.node_config, num_partitions)
    rank = node_rank(config, context.node_config, partition_id)  # flower_app/client_ranks.py
    data = load_task_data(config)
    adapted = cached_adapted_model(config_at_rank(config, rank), data.num_labels, data.spec.kind)
    # a state of a larger rank (the server does not know this node's rank yet): the top rows
    shared = truncate_to_rank(from_array_record(msg.content["arrays"]), rank)
    local = context.state.array_records.get(LOCAL_STATE)
    state = from_array_record(local) if local is not None else None
    folder = _node_state_dir(msg, partition_id) if adapted.method.personal else None
    if state is None and folder is not None:  # a fresh context: a resumed run or node
        server_round = int(_message_config(msg).get("server-round", 0))
        state = _load_local_state(folder, server_round + (0 if training else 1))
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
    """One training round (flower_app/client_round.py); the node keeps its own parts."""
    config, pid, num_partitions, adapted, rank = _prepare(msg, context, training=True)
    server_round = int(msg.content["config"].get("server-round", 0))
    metrics: dict[str, float] = {
        "partition-id": pid,
        "rank": rank,  # the server checks it against the arrays' shapes
        "lr-fingerprint": adapted.fingerprint(),
    }
    metrics |= adapted.method.receive_on_client(msg, context, adapted)  # FedEx-LoRA's fold
    reply = train_round(
        config,
        adapted,
        server_round=server_round,
        partition_id=pid,
        num_partitions=num_partitions,
        metrics=metrics,
    )
    if reply.local:
        context.state[LOCAL_STATE] = to_array_record(reply.local)
        folder = _node_state_dir(msg, pid)
        if folder is not None:
            _save_local_state(folder, server_round, reply.local)
    return Message(content=reply.content(), reply_to=msg)


@app.evaluate()
def personalised_evaluate(msg: Message, context: Context) -> Message:
    """Evaluate the global arrays plus this node's own state (FedSA-LoRA's B) on its share
    of the validation split (partitioned like the training data): the task's metrics
    (accuracy, or exact-match and f1), loss, score and num-examples.

    A method with personal parts has no single global model to compare with the other
    methods, so its node also scores its personalised model on the splits every method is
    compared on: the whole held-out test split where the server scores test
    (``RunConfig.tests_round``; metrics ``test-*``) and the whole validation split in the
    last three rounds, which tuning reads (``val-*``). The server averages these over
    nodes with equal weight (``personalized-test-score``: the mean node's model)."""
    config, pid, num_partitions, adapted, _ = _prepare(msg, context, training=False)
    adapted.method.receive_on_client(msg, context, adapted)  # FedEx-LoRA's fold
    device = pick_device(config.device)
    metrics = evaluate_task(config, adapted.model, device, pid, num_partitions)
    if adapted.method.personal:
        server_round = int(_message_config(msg).get("server-round", 0))
        if config.tests_round(server_round):
            test = evaluate_task(config, adapted.model, device, split="test")
            metrics |= {f"test-{key}": value for key, value in test.items()}
        if server_round > config.num_server_rounds - 3:
            val = evaluate_task(config, adapted.model, device)
            metrics |= {f"val-{key}": value for key, value in val.items()}
    adapted.model.to("cpu")
    metrics["partition-id"] = pid
    return Message(content=RecordDict({"metrics": MetricRecord(metrics)}), reply_to=msg)

"""A client's DP-SGD accountant in its node state (``dp=example``, flower_app/privacy/dp_sgd.py).

Each client's epsilon composes over every round it trains in, so its ledger
(``ClientAccountant.state_dict()``, JSON) lives where the node keeps state between rounds:
the Flower context (``context.state``, a ConfigRecord, per run) and, where the node
operator sets ``$FLORG_NODE_STATE_DIR`` (flower_app/client/node_state.py), the file
``<dir>/<run lineage>/partition-<id>/dp-sgd-accountant.json``, written atomically after
every trained round and read back by a fresh context, so a resumed run (a new Flower run)
continues the count. Without that folder a resumed run's clients count from zero again; the
server notices a count that went down and reports the sum of the two counts, an upper bound
by basic composition (strategies/server/example_dp.py).
"""

from __future__ import annotations

import json
import os
import uuid

from flwr.app import ConfigRecord, Context, Message

from flower_app.client.node_state import node_state_dir
from flower_app.privacy.dp_sgd import ClientAccountant

RECORD = "dp-sgd-accountant"  # the context's ConfigRecord: {"state": JSON}
FILE = "dp-sgd-accountant.json"


def load_accountant(context: Context, msg: Message, partition_id: int) -> ClientAccountant:
    """The node's ledger: the context's, else the node-state folder's, else a new one."""
    record = context.state.config_records.get(RECORD)
    if record is not None:
        return ClientAccountant.from_state_dict(json.loads(str(record["state"])))
    folder = node_state_dir(msg, partition_id)
    if folder is not None and (folder / FILE).is_file():
        return ClientAccountant.from_state_dict(json.loads((folder / FILE).read_text()))
    return ClientAccountant()


def save_accountant(
    context: Context, msg: Message, partition_id: int, accountant: ClientAccountant
) -> None:
    """Keep the ledger in the context and, where configured, on the node's disk."""
    text = json.dumps(accountant.state_dict())
    context.state[RECORD] = ConfigRecord({"state": text})
    folder = node_state_dir(msg, partition_id)
    if folder is None:
        return
    folder.mkdir(parents=True, exist_ok=True)
    tmp = folder / f".{FILE}.{uuid.uuid4().hex}"
    tmp.write_text(text)
    os.replace(tmp, folder / FILE)

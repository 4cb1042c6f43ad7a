"""The clients' own (personalised) evaluation of a round, aggregated: every metric a client
reports (accuracy or exact-match / f1, loss, score) becomes ``personalized-<metric>``,
weighted by the clients' example counts; metrics on a split every client scores whole
(``test-*``, ``val-*``, see client_app.personalised_evaluate) are the plain mean over
clients, each node's model counted once."""

from __future__ import annotations

import logging
from collections.abc import Iterable

import numpy as np
from flwr.app import Message

log = logging.getLogger("flwr.florg")  # propagates to Flower's console handler

_NOT_AVERAGED = frozenset({"num-examples", "partition-id"})  # of clients' evaluation metrics
COMMON_SPLIT_PREFIXES = ("test-", "val-")  # metrics on a split every client scores whole


def personalised_metrics(server_round: int, replies: Iterable[Message]) -> dict[str, float] | None:
    """The round's ``personalized-*`` metrics and ``personalized-clients``; None when no
    client evaluated (a failed evaluation is logged and left out)."""
    rows = []  # (partition id, node id) -> (examples, metrics), in partition order below
    for msg in replies:
        if msg.has_error():
            log.warning(
                "round %d: evaluation failed on node %s: %s",
                server_round,
                msg.metadata.src_node_id,
                msg.error.reason,
            )
            continue
        m = msg.content["metrics"]
        if float(m.get("num-examples", 0)) > 0:
            order = (float(m.get("partition-id", -1)), msg.metadata.src_node_id)
            rows.append(
                (
                    order,
                    float(m["num-examples"]),
                    {
                        k: float(v)
                        for k, v in m.items()
                        if k not in _NOT_AVERAGED and isinstance(v, int | float)
                    },
                )
            )
    if not rows:
        return None
    # partition order, as the training aggregate: the sums do not depend on the order the
    # replies arrive in (which would change their last bit from run to run)
    rows = [(examples, metrics) for _, examples, metrics in sorted(rows, key=lambda r: r[0])]
    n = np.array([r[0] for r in rows])
    keys = sorted(set.intersection(*(set(r[1]) for r in rows)))
    result: dict[str, float] = {}
    for k in keys:
        values = [r[1][k] for r in rows]
        # A node's own share: weighted by its examples. A split every node scores whole
        # (test-*, val-*): each node's model counts once.
        common = k.startswith(COMMON_SPLIT_PREFIXES)
        result[f"personalized-{k}"] = float(
            np.mean(values) if common else np.dot(n, values) / n.sum()
        )
    result["personalized-clients"] = len(rows)
    return result

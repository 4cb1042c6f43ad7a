"""Which adapter rank each client trains at (clients of different capacity).

A node's rank r_n, highest precedence first:

1. a ``rank=R`` entry of the SuperNode's ``--node-config`` (deployment: the node says
   what it can afford);
2. the run setting ``client-ranks``: a comma list of ranks cycled over partition ids
   (partition p trains at ``client-ranks[p mod len]``; simulation);
3. the run's ``rank`` (``client-ranks`` empty: every client).

The run's largest rank r_max = max(``rank``, every rank in ``client-ranks``) is the rank
of the server's global state and of its evaluation model (``server_model_config``), and
the rank a node is sent before the server knows its rank (its first round): the node
keeps the top r_n rows (``flower_app.wire.ranks.truncate_to_rank``).  A node whose
node-config rank exceeds r_max fails with a ConfigError naming it (raise ``rank`` or list
the rank in ``client-ranks``); so does FLoRG's ``subtract-init`` with ranks that differ
(each node would subtract its own rank's initial Gram from W0, so W0 would differ).

Every client uses the run's scaling s = alpha / ``rank``, whatever its r_n
(``config_at_rank``): the server aggregates one quantity (FLoRG's Gram matrix, LoRA's
factors or product) whose meaning must not depend on who trained it; a rank-r_n adapter
is built with alpha' = alpha r_n / rank so that alpha' / r_n = alpha / rank.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from typing import Any

from flower_app.methods.registry import get_method
from flower_app.settings.config import ConfigError, RunConfig

__all__ = [
    "NODE_RANK",
    "config_at_rank",
    "heterogeneous",
    "largest_rank",
    "node_rank",
    "parse_client_ranks",
    "server_model_config",
]

NODE_RANK = "rank"  # the node-config key


def parse_client_ranks(text: str) -> tuple[int, ...]:
    """``'2,4,8'`` -> (2, 4, 8); ``''`` -> () (the setting's check ensured the form)."""
    return tuple(int(p) for p in text.split(",") if p.strip())


def heterogeneous(config: RunConfig) -> bool:
    """Whether the run sets per-client ranks (``client-ranks`` not empty)."""
    return bool(parse_client_ranks(config.client_ranks))


def largest_rank(config: RunConfig) -> int:
    """r_max = max(rank, client-ranks): the global state's rank."""
    return max((config.rank, *parse_client_ranks(config.client_ranks)))


def node_rank(config: RunConfig, node_config: Mapping[str, Any], partition_id: int) -> int:
    """This node's rank r_n (precedence: node-config ``rank``, ``client-ranks``, ``rank``)."""
    r_max = largest_rank(config)
    if NODE_RANK in node_config and str(node_config[NODE_RANK]).strip() != "":
        raw = node_config[NODE_RANK]
        bad = f"node-config rank: expected a positive integer, got {raw!r}"
        try:
            r = int(str(raw))
        except ValueError:
            raise ConfigError(bad) from None
        if r < 1:
            raise ConfigError(bad)
        if r > r_max:
            raise ConfigError(
                f"node-config rank={r} exceeds the run's largest rank {r_max} "
                "(max of 'rank' and 'client-ranks'): list it in client-ranks or raise rank"
            )
        try:  # what the adapter kind allows (FLoRG: subtract-init needs one common rank)
            get_method(config.method).kind.check_node_rank(config, r, r_max)
        except ValueError as err:
            raise ConfigError(str(err)) from None
        return r
    ranks = parse_client_ranks(config.client_ranks)
    if ranks:
        return ranks[max(partition_id, 0) % len(ranks)]
    return config.rank


def config_at_rank(config: RunConfig, r: int) -> RunConfig:
    """``config`` with the adapter at rank ``r`` and the run's scaling alpha / rank (the
    same ``config`` when r is the run's rank: a homogeneous run is unchanged)."""
    if r == config.rank:
        return config
    return replace(config, rank=r, alpha=config.alpha * r / config.rank)


def server_model_config(config: RunConfig) -> RunConfig:
    """The settings of the server's model (initial state, evaluation): rank r_max."""
    return config_at_rank(config, largest_rank(config))

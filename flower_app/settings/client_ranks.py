"""Which adapter rank each client trains at (clients of different capacity).

A node's rank r_n, highest precedence first: a ``rank=R`` entry of the SuperNode's
``--node-config``; the run setting ``client-ranks`` (a comma list cycled over partition ids);
the run's ``rank``. The run's largest rank r_max = max(``rank``, ``client-ranks``) is the rank
of the server's state and evaluation model (``server_model_config``) and of what a node is sent
before the server knows its rank (the node keeps the top r_n rows, flower_app/wire/ranks.py); a
node-config rank above r_max is a ConfigError naming it. Every client uses the run's scaling
s = alpha / ``rank`` (``config_at_rank`` builds a rank-r_n adapter with alpha' = alpha r_n /
``rank``), so the aggregated quantity means the same whoever trained it
(docs/architecture.md, "Clients of different rank")."""

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

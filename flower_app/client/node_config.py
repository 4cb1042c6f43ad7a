"""What a SuperNode's ``--node-config`` adds to the run settings on that node.

``partition-id`` and ``num-partitions`` say which share of the run's data a node trains
on (the run's ``data-path``/``task``, split IID or Dirichlet like in simulation).
``data-path`` points at the node's *own* data instead (a folder of ``<split>.<ext>`` files
or one json/jsonl/csv/parquet file, read with the run's ``text-fields`` and ``label-field``):
the node trains on all of it and still reports its ``partition-id``. A straggler:
``slowdown`` (that many times its training time, ``node_slowdown``) and ``delay-seconds``
(a fixed wait before each reply, ``node_delay``); in a simulation the run's
``slow-partitions`` with ``slowdown`` and ``slow-delay``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

from flower_app.settings.config import ConfigError, RunConfig

__all__ = [
    "NODE_DATA_PATH",
    "NODE_DELAY",
    "NODE_SLOWDOWN",
    "node_delay",
    "node_number",
    "node_slowdown",
    "use_node_data",
]

NODE_DATA_PATH = "data-path"
NODE_SLOWDOWN = "slowdown"
NODE_DELAY = "delay-seconds"


def use_node_data(
    config: RunConfig, node_config: Mapping[str, Any], num_partitions: int
) -> tuple[RunConfig, int]:
    """``(config, num_partitions)`` for this node's data: with a node-config
    ``data-path``, the run config reading that path and 1 (the whole of it)."""
    path = node_config.get(NODE_DATA_PATH)
    if path is None or str(path) == "":
        return config, num_partitions
    local = Path(str(path)).expanduser()
    if not local.exists():
        raise ConfigError(
            f"node-config data-path: {local} does not exist on this node "
            f"(partition-id {node_config.get('partition-id', '?')})"
        )
    return replace(config, data_path=str(local.resolve())), 1


def _slow_partitions(config: RunConfig) -> set[int]:
    return {int(p) for p in config.slow_partitions.split(",") if p.strip()}


def node_number(
    node_config: Mapping[str, Any], key: str, partition_id: int, least: float, *,
    strict: bool = False,
) -> float | None:  # fmt: skip
    """The node-config ``key`` as a finite number >= ``least`` (> with ``strict``); absent:
    None; anything else: ConfigError naming the key and the node's partition."""
    value = node_config.get(key)
    if value is None or str(value) == "":
        return None
    try:
        number = float(value)
    except (TypeError, ValueError):
        number = float("nan")
    if not (math.isfinite(number) and (number > least if strict else number >= least)):
        raise ConfigError(
            f"node-config {key}: {value!r} must be a finite number "
            f"{'>' if strict else '>='} {least:g} (partition-id {partition_id})"
        )
    return number


def node_slowdown(config: RunConfig, node_config: Mapping[str, Any], partition_id: int) -> float:
    """How many times its training time this node takes: its node-config ``slowdown``, else
    the run's ``slowdown`` for a partition in ``slow-partitions``, else 1."""
    own = node_number(node_config, NODE_SLOWDOWN, partition_id, 1.0)
    if own is not None:
        return own
    return config.slowdown if partition_id in _slow_partitions(config) else 1.0


def node_delay(config: RunConfig, node_config: Mapping[str, Any], partition_id: int) -> float:
    """The fixed seconds this node waits before each reply: its node-config
    ``delay-seconds``, else the run's ``slow-delay`` for a partition in ``slow-partitions``,
    else 0."""
    own = node_number(node_config, NODE_DELAY, partition_id, 0.0)
    if own is not None:
        return own
    return config.slow_delay if partition_id in _slow_partitions(config) else 0.0

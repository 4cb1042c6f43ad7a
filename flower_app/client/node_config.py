"""What a SuperNode's ``--node-config`` adds to the run settings on that node.

``partition-id`` and ``num-partitions`` say which share of the run's data a node trains
on (the run's ``data-path``/``task``, split IID or Dirichlet like in simulation).
``data-path`` points at the node's *own* data instead (a folder of ``<split>.<ext>``
files or one json/jsonl/csv/parquet file, read with the run's ``text-fields`` and
``label-field``): the node then trains on all of it (no further split) and still
reports its ``partition-id``, which names it in the server's log and metrics.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

from flower_app.config import ConfigError, RunConfig

__all__ = ["NODE_DATA_PATH", "use_node_data"]

NODE_DATA_PATH = "data-path"


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

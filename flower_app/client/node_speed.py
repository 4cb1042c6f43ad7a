"""A node's costs under ``virtual-clock`` (strategies/server/virtual_clock.py): its seconds
per training example, bandwidth and latency, as its ``query.profile`` reply states them.

The run sets a reference node (``node-seconds-per-example``, ``node-bandwidth-mbps``,
``node-latency``) and each partition's compute multiplier (``node-speeds``: ``fixed``, the
straggler settings; ``lognormal``, exp(sigma z) with z drawn from the run's seed and the
partition id alone), and a straggler's fixed delay (``slow-delay``). A SuperNode's
node-config ``seconds-per-example``, ``bandwidth-mbps``, ``latency``, ``slowdown`` and
``delay-seconds`` override the run's for that node.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from flower_app.client.node_config import NODE_SLOWDOWN, node_delay, node_number, node_slowdown
from flower_app.settings.config import RunConfig

SPEED_STREAM = 0x5BEED  # the lognormal draws' stream, apart from every other use of the seed
NODE_SECONDS_PER_EXAMPLE = "seconds-per-example"
NODE_BANDWIDTH = "bandwidth-mbps"
NODE_LATENCY = "latency"


@dataclass(frozen=True)
class NodeCosts:
    """What a node's tasks cost on the virtual clock."""

    seconds_per_example: float  # after its compute multiplier
    bandwidth_mbps: float  # megabits per second, both directions
    latency: float  # seconds per message, each way
    delay: float  # fixed seconds before each reply (node_config.node_delay)


def lognormal_multiplier(seed: int, partition_id: int, sigma: float) -> float:
    """exp(sigma z), z ~ N(0, 1) from the run's ``seed`` and the partition alone: the same
    partition gets the same speed in every run of that seed, wherever it runs."""
    z = np.random.default_rng([SPEED_STREAM, seed, partition_id]).standard_normal()
    return float(math.exp(sigma * z))


def compute_multiplier(
    config: RunConfig, node_config: Mapping[str, Any], partition_id: int
) -> float:
    """How many times a reference node's compute time this node takes: its node-config
    ``slowdown``, else the lognormal draw (``node-speeds=lognormal``), else the straggler
    settings (``node_slowdown``)."""
    if config.node_speeds == "lognormal" and node_config.get(NODE_SLOWDOWN) in (None, ""):
        return lognormal_multiplier(config.seed, partition_id, config.node_speed_sigma)
    return node_slowdown(config, node_config, partition_id)


def node_costs(config: RunConfig, node_config: Mapping[str, Any], partition_id: int) -> NodeCosts:
    """This node's ``NodeCosts``: the run's reference node, with its compute multiplier and
    its node-config overrides (a bad value: ConfigError naming the key)."""
    own = node_number(node_config, NODE_SECONDS_PER_EXAMPLE, partition_id, 0.0, strict=True)
    bandwidth = node_number(node_config, NODE_BANDWIDTH, partition_id, 0.0, strict=True)
    latency = node_number(node_config, NODE_LATENCY, partition_id, 0.0)
    base = config.node_seconds_per_example if own is None else own
    return NodeCosts(
        seconds_per_example=base * compute_multiplier(config, node_config, partition_id),
        bandwidth_mbps=config.node_bandwidth_mbps if bandwidth is None else bandwidth,
        latency=config.node_latency if latency is None else latency,
        delay=node_delay(config, node_config, partition_id),
    )

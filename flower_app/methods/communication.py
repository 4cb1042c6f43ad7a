"""Exact per-round communication of every method, counted as the paper counts it (parameters).

Per adapted layer (W0 of d_out x d_in, k = min(d_in, d_out), rank r) each participating client
sends up and receives down its method's shared parts (``Method.adapter_params``):

    FLoRG adapter, A shared      r k              (up and down)
    LoRA adapter, B and A        r (d_out + d_in) (up and down)
    LoRA adapter, B / A only     r d_out / r d_in (the other frozen or kept on the client)
    LoRA-SB adapter, R only      r^2              (up and down; B, A fixed, sent once)

plus the head and a method's extras (``Method.extra_down_params``, ``init_round_params``).
Bytes: ``RoundCommunication``; mixed ranks: ``client_communication`` (docs/architecture.md)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from flower_app.methods.registry import get_method
from flower_app.wire.encoding import BYTES_PER_ENTRY, GROUP, GROUPED

if TYPE_CHECKING:
    from flower_app.settings.run_settings import RunSettings

INT8_SCALE_BYTES = 4  # int8: one float32 scale per row of each array
GROUP_SCALE_BYTES = 2  # int8-g / int4-g: one bfloat16 scale per group of GROUP entries


def encoded_bytes(params: int, rows: int, encoding: str) -> int:
    """What ``params`` entries in arrays of ``rows`` rows in all take under ``encoding``
    (flower_app/wire/encoding.py; the arrays' names, dtypes and shapes aside: under 1% of a
    round, docs/flowertune.md). The grouped encodings' scales are counted as if the groups
    ran across arrays (at most one more group per array)."""
    if encoding in GROUPED:
        bits = GROUPED[encoding][1]
        return math.ceil(params * bits / 8) + math.ceil(params / GROUP) * GROUP_SCALE_BYTES
    scales = rows * INT8_SCALE_BYTES if encoding == "int8" else 0
    return params * int(BYTES_PER_ENTRY[encoding]) + scales


@dataclass(frozen=True)
class RoundCommunication:
    """Parameters and bytes one client sends up and receives down in one round. The rows
    of what is encoded and the parameters sent down outside it (a method's extras, which
    travel float32 whatever the encoding) give the bytes under an encoding."""

    up_params: int
    down_params: int
    bytes_per_param: int = 4
    up_rows: int = 0
    down_rows: int = 0
    extra_down_params: int = 0

    @property
    def up_bytes(self) -> int:
        return self.up_params * self.bytes_per_param

    @property
    def down_bytes(self) -> int:
        return self.down_params * self.bytes_per_param

    def encoded(self, uplink: str = "fp32", downlink: str = "fp32") -> tuple[int, int]:
        """(up, down) bytes with the arrays sent as ``uplink`` / ``downlink`` encode them
        (the extras down stay float32)."""
        encoded_down = self.down_params - self.extra_down_params
        return (
            encoded_bytes(self.up_params, self.up_rows, uplink),
            encoded_bytes(encoded_down, self.down_rows, downlink) + 4 * self.extra_down_params,
        )

    @property
    def total_params(self) -> int:
        return self.up_params + self.down_params


def round_communication(
    method: str,
    layer_shapes: Mapping[str, tuple[int, int]],
    r: int,
    head_params: int,
    num_clients: int = 1,
    config: RunSettings | None = None,
    bytes_per_param: int = 4,
    server_round: int = 1,
) -> RoundCommunication:
    """Per-client communication in round ``server_round``; ``layer_shapes`` maps names to
    (d_out, d_in); ``config``: the run's settings, which a method's extra down may read
    (None: its own settings at their defaults)."""
    spec = get_method(method)
    if r < 1 or num_clients < 1 or head_params < 0:
        raise ValueError(
            f"need r >= 1, num_clients >= 1, head_params >= 0; "
            f"got r={r}, num_clients={num_clients}, head_params={head_params}"
        )
    if server_round == 0:  # before training: only a method with a round 0 sends anything
        init = [spec.init_round_params(o, i, r) for o, i in layer_shapes.values()]
        up0, down0 = sum(u for u, _ in init), sum(d for _, d in init)
        return RoundCommunication(up0, down0, bytes_per_param)
    down = sum(spec.adapter_params(o, i, r) for o, i in layer_shapes.values())
    up = sum(spec.up_adapter_params(o, i, r, server_round) for o, i in layer_shapes.values())
    extra = sum(
        spec.extra_down_params(o, i, r, num_clients, config)
        for o, i in layer_shapes.values()
        if spec.extra_down_in_round(server_round)
    )
    up_rows = sum(spec.adapter_rows(o, i, r, server_round) for o, i in layer_shapes.values())
    down_rows = sum(spec.adapter_rows(o, i, r) for o, i in layer_shapes.values())
    return RoundCommunication(
        up + head_params, down + head_params + extra, bytes_per_param, up_rows, down_rows, extra
    )


def client_communication(
    method: str,
    layer_shapes: Mapping[str, tuple[int, int]],
    rank: int,
    head_params: int,
    sent_rank: int | None = None,
    bytes_per_param: int = 4,
) -> RoundCommunication:
    """One client's round at ``rank`` (r_n) that was sent the state at ``sent_rank``
    (default r_n; r_max in the node's first round): up at r_n, down at the rank sent."""
    if not get_method(method).heterogeneous_ranks and sent_rank not in (None, rank):
        raise ValueError(f"method {method!r} sends every client one rank")
    up = round_communication(method, layer_shapes, rank, head_params, 1, None, bytes_per_param)
    down = round_communication(
        method, layer_shapes, sent_rank or rank, head_params, 1, None, bytes_per_param
    )
    return RoundCommunication(up.up_params, down.down_params, bytes_per_param)

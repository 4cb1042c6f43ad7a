"""What a client uploads a round under secure aggregation, per method and model shape.

    python -m benchmarks.core.secure_uplink

Computed, not timed: for every method that takes ``secure-aggregation=secaggplus``, the values
of its contribution (``Method.secure_contribution``'s shapes) against its plain upload (its
trained parts), and the masked bytes (8 a value, Flower's int64 masked vector) against fp32's
4, at MiniLM, RoBERTa-large and a 7B decoder, q and v adapted in every block (square W0 of
k × k; the task head, a few thousand values, left out). A FLoRG layer's Gram is k(k+1)/2
values against A's r k. docs/secure-aggregation.md prints this table.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

import numpy as np

import strategies.registry  # noqa: F401  (every method registers)
from flower_app.methods.registry import get_method, method_names
from strategies.server.secure_rounds import MASKED_BYTES_PER_VALUE


@dataclass(frozen=True)
class ModelShape:
    name: str
    layers: int  # adapted layers (q and v of every block)
    k: int  # W0 is k x k
    rank: int


SHAPES = (
    ModelShape("MiniLM-L12 (r=8)", 24, 384, 8),
    ModelShape("RoBERTa-large (r=8)", 48, 1024, 8),
    ModelShape("7B decoder (r=16)", 64, 4096, 16),
)


def uplink_state(method_name: str, shape: ModelShape, server_round: int = 1) -> dict:
    """The arrays a client uploads in ``server_round`` at ``shape``, as zero-stride views
    (only their shapes are read)."""
    method = get_method(method_name)
    kind = method.kind
    state = {}
    for layer in range(shape.layers):
        for part in method.trained_parts(server_round):
            dims = kind.parts[part].shape(shape.k, shape.k, shape.rank)
            state[f"l{layer}.{kind.part_key(part)}"] = np.broadcast_to(0.0, dims)
    return state


def rows() -> list[tuple[str, str, int, int, float]]:
    """(method, shape, plain values, secure values, secure bytes / fp32 bytes)."""
    out = []
    for name in method_names():
        method = get_method(name)
        if method.secure_sum is None:
            continue
        for shape in SHAPES:
            up = uplink_state(name, shape)
            plain = sum(int(np.prod(v.shape)) for v in up.values())
            secure = sum(int(np.prod(s)) for s in method.secure_shapes(up).values())
            ratio = MASKED_BYTES_PER_VALUE * secure / (4 * plain)
            out.append((name, shape.name, plain, secure, ratio))
    return out


def main(argv: list[str] | None = None) -> None:
    argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args(argv)
    print("| method | shape | plain upload (values) | secure contribution (values) | "
          "masked MB | x fp32 bytes |")  # fmt: skip
    print("|---|---|---:|---:|---:|---:|")
    for name, shape, plain, secure, ratio in rows():
        mb = MASKED_BYTES_PER_VALUE * (secure + 1) / 2**20
        print(f"| {name} | {shape} | {plain:,} | {secure:,} | {mb:,.1f} | {ratio:.1f} |")


if __name__ == "__main__":
    main()

"""``save-client-updates``: one round's states written for offline analysis (not under
dp=central: the file would hold every client's update before clipping and noise)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np


def save_round_updates(
    updates_dir: Path,
    server_round: int,
    prev_state: Mapping[str, np.ndarray],
    new_state: Mapping[str, np.ndarray],
    payloads: Sequence[Mapping[str, np.ndarray]],
    weights: np.ndarray,
    partitions: Sequence[int],
) -> None:
    """``updates_dir/round-<t>.npz``: 'prev/<key>', 'new/<key>', 'client<i>/<key>', the
    weights and each client's partition id."""
    updates_dir.mkdir(parents=True, exist_ok=True)
    arrays = {f"prev/{k}": v for k, v in prev_state.items()}
    arrays.update({f"new/{k}": v for k, v in new_state.items()})
    for i, p in enumerate(payloads):
        arrays.update({f"client{i}/{k}": v for k, v in p.items()})
    np.savez(
        updates_dir / f"round-{server_round}.npz",
        weights=weights,
        partitions=np.asarray(partitions),
        **arrays,
    )

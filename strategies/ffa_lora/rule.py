"""FFA-LoRA (Sun et al., 2024): A frozen at its seeded initialisation, only B is averaged.

With A fixed and shared, avg(B_n) A = avg(B_n A): the aggregation is exact.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from strategies.shared.averaging import weighted_average


def aggregate_ffa_lora(
    client_Bs: Sequence[np.ndarray], weights: Sequence[float] | np.ndarray | None
) -> np.ndarray:
    """sum_n w_n B_n (d_out x r); the frozen A never travels."""
    return weighted_average(client_Bs, weights, "B")

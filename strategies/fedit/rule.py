"""FedIT (Zhang et al., 2024): average B and A separately.

avg(B) avg(A) != avg(B A) in general: this is the aggregation bias FLoRG removes.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from strategies.shared.averaging import weighted_average


def aggregate_fedit(
    client_Bs: Sequence[np.ndarray],
    client_As: Sequence[np.ndarray],
    weights: Sequence[float] | np.ndarray | None,
) -> tuple[np.ndarray, np.ndarray]:
    """(sum_n w_n B_n, sum_n w_n A_n) with B_n d_out x r and A_n r x d_in."""
    return weighted_average(client_Bs, weights, "B"), weighted_average(client_As, weights, "A")

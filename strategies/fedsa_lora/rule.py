"""FedSA-LoRA (Guo et al., 2024): A is shared and averaged, B stays on its client.

The server never receives B: the personalised B_n lives in the client's state.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from strategies.shared.averaging import weighted_average


def aggregate_fedsa_lora(
    client_As: Sequence[np.ndarray], weights: Sequence[float] | np.ndarray | None
) -> np.ndarray:
    """sum_n w_n A_n (r x d_in)."""
    return weighted_average(client_As, weights, "A")

"""FedRotLoRAStrategy: the common strategy, passing the round to the method's rule and central-DP
mechanism, since which factor is aligned alternates by round (``rule.aligned_part``), and the
run's ``fedrot-rotation`` ('orthogonal' or 'proper'), which group each Rₙ is sought in."""

from __future__ import annotations

import numpy as np

from strategies.server.strategy import AdapterStrategy


class FedRotLoRAStrategy(AdapterStrategy):
    def __init__(self, *args, rotation: str = "orthogonal", **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.rotation = rotation

    def aggregate_adapter(
        self, server_round: int, payloads: list[dict[str, np.ndarray]], weights: np.ndarray
    ) -> tuple[dict[str, np.ndarray], dict[str, float]]:
        return self.method.aggregate(  # type: ignore[call-arg]
            self.global_state, payloads, weights, server_round=server_round, rotation=self.rotation
        )

    def aggregate_private(
        self, server_round: int, payloads: list[dict[str, np.ndarray]], num_sampled: float
    ) -> tuple[dict[str, np.ndarray], dict[str, float]]:
        assert self.dp is not None
        return self.method.aggregate_private(  # type: ignore[call-arg]
            self.dp,
            self.global_state,
            payloads,
            num_sampled,
            server_round=server_round,
            rotation=self.rotation,
        )

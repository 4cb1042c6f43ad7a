"""HetLoRA (Cho et al., 2024): LoRA clients of different rank; the server averages the
factors zero-padded to the largest rank and each client keeps the top r_n rows of A and
columns of B (``strategies/hetlora/rule.py``).  With equal ranks: the separate
weighted means of A and B."""

from __future__ import annotations

from strategies.shared.base_method import BaseMethod
from strategies.shared.per_layer import LORA_PARTS, aggregate_per_layer


class HetLoRA(BaseMethod):
    def aggregate(self, sent, payloads, weights):
        """Each node is then sent the top r_n of the result (the common strategy's
        ``sent_state``)."""
        from flower_app.wire.ranks import rank_of
        from strategies.hetlora.rule import aggregate_hetlora

        new, _ = aggregate_per_layer(
            sent, payloads, weights, LORA_PARTS, aggregate_hetlora, rank=rank_of(sent)
        )
        return new, {}


HETLORA = HetLoRA(
    name="hetlora",
    summary="zero-pad B and A to the largest rank and average; clients keep their top r_n",
    adapter="lora",
    shared=("A", "B"),
    heterogeneous_ranks=True,
    # dp=central needs one common rank (refused with client-ranks); then HetLoRA averages A and B
    # and the mean mechanism its private round
    dp_mechanism="mean",
    secure_sum="mean",  # one common rank (client-ranks refused): A and B weighted means
)

METHODS = (HETLORA,)

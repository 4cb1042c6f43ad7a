"""HetLoRA (Cho et al., 2024): LoRA clients of different rank; the server averages the
factors zero-padded to the largest rank and each client keeps the top r_n rows of A and
columns of B (``strategies/hetlora/rule.py``).  With equal ranks: the separate
weighted means of A and B."""

from __future__ import annotations

from flower_app.methods.contract import adapter_layers, stacked
from strategies.shared.base_method import BaseMethod


class HetLoRA(BaseMethod):
    def aggregate(self, sent, payloads, weights):
        """Each node is then sent the top r_n of the result (the common strategy's
        ``sent_state``)."""
        from flower_app.wire.ranks import rank_of
        from strategies.hetlora.rule import aggregate_hetlora

        new = {}
        for layer in adapter_layers(sent):
            kb, ka = f"{layer}.lora_B", f"{layer}.lora_A"
            new[kb], new[ka] = aggregate_hetlora(
                stacked(payloads, kb), stacked(payloads, ka), weights, rank=rank_of(sent)
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
)

METHODS = (HETLORA,)

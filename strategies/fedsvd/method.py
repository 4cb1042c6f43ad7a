"""FedSVD: clients train only B against the global A, which they receive but do not train;
the server averages B and re-factorises B A by SVD into a new orthonormal A and the matching
B after every round (``strategies/fedsvd/rule.py``). Up: B; down: A and B.

Client weights: its authors average B by dataset size (n_k / sum n);
``aggregation-weights=num-examples`` reproduces that, the default ``uniform`` is the
evidence protocol's rule for every method (docs/architecture.md).
"""

from __future__ import annotations

from flower_app.methods.contract import stacked
from strategies.shared.base_method import BaseMethod
from strategies.shared.per_layer import LORA_PARTS, layer_keys


class FedSVD(BaseMethod):
    def trained_parts(self, server_round):
        return ("B",)

    def aggregate(self, sent, payloads, weights):
        from strategies.fedsvd.rule import aggregate_fedsvd

        new = {}
        for kb, ka in layer_keys(sent, LORA_PARTS):
            new[kb], new[ka] = aggregate_fedsvd(stacked(payloads, kb), sent[ka], weights)
        return new, {}

    def aggregate_private(self, dp, sent, payloads, num_sampled):
        """The mean mechanism on B and the head, then the re-factorisation, which reads only
        the released mean and the public A (post-processing: no further privacy cost)."""
        from strategies.fedsvd.rule import refactorise

        released, info = super().aggregate_private(dp, sent, payloads, num_sampled)
        for kb, ka in layer_keys(sent, LORA_PARTS):
            released[kb], released[ka] = refactorise(released[kb], sent[ka])
        return released, info


FEDSVD = FedSVD(
    name="fedsvd",
    summary="train and average B against a shared A, re-factorise B A by SVD each round",
    adapter="lora",
    shared=("A", "B"),
    dp_mechanism="mean",  # clip reply - sent over B and the head; noised mean; then the SVD
    secure_sum="mean",  # B a weighted mean, then the re-factorisation
)

METHODS = (FEDSVD,)

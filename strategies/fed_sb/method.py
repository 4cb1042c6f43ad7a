"""Fed-SB (Singhal et al. 2025, arXiv 2502.15436): LoRA-SB on every client, W0 + B R A with B
and A fixed and identical on every node, only the r x r R trained (scale s = 1 whatever
``alpha``, as in the authors' scripts: ``adapter_alpha``); the server averages R and the
head (exact: ``rule.py``, eq. 1). Up and down: r² per layer and round.

B and A come from a federated round 0 (``strategy.py``): the clients' gradients of every
adapted W0 (``gradient.py``; under dp=example ``private_gradient.py``), averaged by the
server, -lr sign(.) and its rank-r truncated SVD, sent once to each node and kept in its
Flower context. Under dp=central round 0 is one more Gaussian mechanism on the server; under
dp=example each client's estimate is composed into its DP-SGD ledger; under secure
aggregation it is one SecAgg+ sum (``secure_query_contribution``). docs/architecture.md,
docs/privacy.md section 2.1, docs/secure-aggregation.md.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from strategies.fed_sb.keys import BASIS, BASIS_CONTEXT, BASIS_HELD
from strategies.fed_sb.settings import FedSBSettings
from strategies.shared.base_method import BaseMethod
from strategies.shared.per_layer import aggregate_per_layer

if TYPE_CHECKING:
    from flower_app.settings.run_settings import RunSettings

    class FedSBConfig(RunSettings, FedSBSettings):
        """What Fed-SB reads: the core's settings and its own."""


class FedSB(BaseMethod):
    def aggregate(self, sent, payloads, weights):
        from strategies.fed_sb.rule import aggregate_fed_sb

        new, _ = aggregate_per_layer(sent, payloads, weights, ("R",), aggregate_fed_sb)
        return new, {}

    def adapter_alpha(self, config: FedSBConfig) -> float:
        """alpha = rank, so s = 1: every one of the authors' scripts sets ``lora_alpha =
        lora_r``, and their model is W0 + B R A. With s = alpha / r != 1 the model would start
        at W0 + s B S_r A (s times the authors' first step) and each step on R would move W
        s times as far; the ``alpha`` setting does not apply to Fed-SB."""
        return float(config.rank)

    def check_settings(self, config: FedSBConfig) -> None:
        """The common checks, and: round 0 needs the gradient of every adapted W0, which a
        quantised base (bitsandbytes' packed format) does not give."""
        super().check_settings(config)
        if config.quantization != "none":
            raise ValueError(
                f"quantization: method {self.name!r} computes the gradient of every adapted W0 "
                f"in round 0, which quantization={config.quantization!r} stores in "
                "bitsandbytes' packed format (no gradient); use quantization=none"
            )
        if config.secure_aggregation != "off" and (
            config.fed_sb_init_examples > config.secaggplus_max_weight
        ):  # round 0's weight is examples / max-weight, capped at 1: a cap would skew the mean
            raise ValueError(
                f"fed-sb-init-examples: {config.fed_sb_init_examples} is above "
                f"secaggplus-max-weight {config.secaggplus_max_weight:g}; under secure "
                "aggregation round 0 weights each client's mean gradient by its examples / "
                "secaggplus-max-weight, which must stay at most 1"
            )

    def build_strategy(self, config: FedSBConfig, initial_state, *, fingerprint=None, run_dir=None):
        from strategies.fed_sb.strategy import FedSBStrategy

        return FedSBStrategy(
            initial_state,
            method=self,
            init_examples=config.fed_sb_init_examples,
            init_lr=config.fed_sb_init_lr or config.learning_rate,
            **self.strategy_settings(config, run_dir=run_dir),
        )

    # -- client side ----------------------------------------------------------------------
    def answer_query(self, config: FedSBConfig, adapted, batches, accountant=None):
        """Round 0: the summed gradient of every adapted W0 (``gradient.py``); under
        dp=example the Gaussian mechanism on per-example clipped gradients, composed into
        the client's ledger (``private_gradient.py``)."""
        if config.dp == "example":
            from strategies.fed_sb.private_gradient import answer_private_query

            if accountant is None:  # the release must be composed into the node's ledger
                raise ValueError("dp=example: round 0 needs the client's DP-SGD accountant")
            return answer_private_query(config, adapted, batches, accountant)
        from strategies.fed_sb.gradient import estimate_gradients

        return estimate_gradients(adapted, batches, config.fed_sb_init_examples)

    def secure_query_contribution(
        self, config: FedSBConfig, arrays: dict[str, np.ndarray], num_examples: float
    ) -> tuple[dict[str, np.ndarray], float, bool]:
        """Round 0 under secure aggregation: (the contribution, its weight, clipped or not).
        dp=off and dp=example: the client's per-example mean gradient (its summed answer over
        its examples n) weighted by n / ``secaggplus-max-weight``, so that the sum over the
        weight sum is the plain round 0's pooled gradient and the values stay small (a sum
        over n examples could leave ``secaggplus-clipping-range``). dp=central: the summed
        gradient clipped to C here (the plain round 0's unit), weight 1; the server noises
        the sum (``FedSBStrategy.initialise``)."""
        from strategies.server.central_dp import clip_update, flat_norm

        if not (np.isfinite(num_examples) and num_examples > 0):
            raise ValueError(f"round 0: num-examples must be finite and > 0, got {num_examples}")
        if config.dp == "central":
            clipped = flat_norm(arrays) > config.dp_clipping_norm
            return clip_update(arrays, config.dp_clipping_norm), 1.0, clipped
        weight = num_examples / config.secaggplus_max_weight  # <= 1: check_settings
        mean = {k: np.asarray(v, np.float64) / num_examples for k, v in arrays.items()}
        return mean, weight, False

    def receive_on_client(self, msg, context, adapted):
        """Keep B and A when the message carries them (in the node's context) and load the
        ones held into the model; a node that holds none cannot train."""
        from flower_app.adapters.lora_sb.layer import set_lora_sb_basis
        from flower_app.wire.records import from_array_record

        if BASIS in msg.content.array_records:
            context.state[BASIS_CONTEXT] = msg.content[BASIS]
        if BASIS_CONTEXT not in context.state.array_records:
            raise ValueError(
                "this node holds no B and A: the server sends them with the first message "
                "after round 0"
            )
        set_lora_sb_basis(adapted.model, from_array_record(context.state[BASIS_CONTEXT]))
        return {BASIS_HELD: 1}

    def receive_on_server(self, adapted, strategy):
        """The server's B and A (round 0's, or the checkpoint's) into its model."""
        from flower_app.adapters.lora_sb.layer import set_lora_sb_basis

        basis = getattr(strategy, "basis_state", dict)()
        if basis:
            set_lora_sb_basis(adapted.model, basis)

    # -- communication ----------------------------------------------------------------------
    def extra_down_params(self, d_out, d_in, r, num_clients, config: FedSBConfig | None):
        """B and A, r (d_out + d_in), once per node: with its first training message."""
        return r * (d_out + d_in)

    def extra_down_in_round(self, server_round):
        return server_round == 1  # every node's first message in a full-participation run

    def init_round_params(self, d_out, d_in, r):
        """Round 0: each client sends its gradient of W0, d_out d_in; nothing comes down
        (the query carries only its config)."""
        return d_out * d_in, 0


FED_SB = FedSB(
    name="fed-sb",
    summary="LoRA-SB: fixed B, A from round 0's gradients; train and average the r x r R",
    adapter="lora-sb",
    shared=("R",),
    settings=FedSBSettings,
    dp_mechanism="mean",  # clip reply - sent over R and the head; noised mean; round 0 too
    dp_initial_releases=1,  # round 0's noised gradient estimate (strategy.py)
    secure_sum="mean",  # R and the head weighted means; round 0 its own secure sum
)

METHODS = (FED_SB,)

"""FedEx-LoRA: the separate averages of A and B, plus the exact residual
``Σ wₙBₙAₙ − B̄Ā`` that every client folds into its frozen W0 (``strategies/fedex_lora/rule.py``).

The server keeps each round's residual and sends a node, with its next training message,
every residual it has not folded yet (``strategies/fedex_lora/strategy.py``). The client
adds them, in float64, to its cumulative residual (kept in its Flower context) and sets
``W0 ← W0_pristine + s · cumulative``; the pristine W0 is kept so one process can serve
clients with different folds. The server's evaluator folds the server's cumulative
residual the same way. The residual travels dense (the paper's version) or as exact
factors of rank ≤ (N + 1) r (``fedex-residual=factored``, ours).
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from strategies.method import Method

# Why dp=central is refused rather than noised. The round's result is (avg B, avg A,
# residual) with residual = sum_n w_n B_n A_n - avg(B) avg(A), folded into W0 so that the
# model equals the exact mean of the products. The residual is quadratic in each client's
# factors: its sensitivity is that of the product update B_n A_n - B A = dB A + B dA + dB dA,
# a second Gaussian release on a dense d_out x d_in matrix. Unlike the SVD and Gram rules, which
# truncate to rank r after the noise, FedEx keeps the residual exactly, so full-rank noise
# of Frobenius norm ~ sigma sqrt(d_out d_in) would enter W0 every round and never leave.
FEDEX_REFUSAL = (
    "dp=central is not supported for fedex-lora: its residual "
    "sum_n w_n B_n A_n - avg(B) avg(A) is quadratic in each client's factors, so it needs "
    "its own mechanism on the dense d_out x d_in product (sensitivity of one client's "
    "product update B_n A_n - B A <= ||dB|| ||A||_2 + ||B||_2 ||dA|| + ||dB|| ||dA||, not "
    "the C of the factor update), and FedEx folds that residual into the frozen W0 every "
    "round without truncation: the full-rank noise (std z C / m on each of d_out * d_in "
    "entries, norm ~ z C sqrt(d_out d_in) / m per layer, about 1000 x the signal bound "
    "C / m at d = 1024, z = 1) would accumulate in W0 as a random walk. A correct variant exists "
    "(clip (dB, dA, B_n A_n - B A) jointly, noise all three, residual by post-processing) "
    "but it is dense-noise DP fine-tuning of W0, not FedEx's exact aggregation; use a method "
    "with a mechanism (florg among them) with dp=central"
)
CUMULATIVE = "fedex-cumulative-residual"  # the client's context: float64 dense residuals
FOLDED_ROUND = "fedex-residual-round"  # the client's context: last round folded
PRISTINE = "fedex-pristine-W0"  # AdaptedModel.held_tensors: W0 before any fold


class FedExLoRA(Method):
    def build_strategy(self, config, initial_state, *, fingerprint=None, run_dir=None):
        from strategies.fedex_lora.strategy import FedExLoRAStrategy

        return FedExLoRAStrategy(
            initial_state,
            method=self,
            residual_mode=config.fedex_residual,
            **self.strategy_settings(config, run_dir=run_dir),
        )

    def extra_down_params(self, d_out, d_in, r, num_clients, residual_mode):
        """The residual sent down: d_out d_in (dense, the paper's version) or
        (N + 1) r (d_out + d_in) (its exact factors)."""
        from strategies.fedex_lora.rule import RESIDUAL_MODES

        if residual_mode not in RESIDUAL_MODES:
            raise ValueError(
                f"residual_mode {residual_mode!r} unknown; choose one of {RESIDUAL_MODES}"
            )
        if residual_mode == "dense":
            return d_out * d_in
        return (num_clients + 1) * r * (d_out + d_in)

    def prepare_model(self, adapted):
        from flower_app.adapters.lora import lora_layers

        adapted.held_tensors[PRISTINE] = {
            name: layer.get_base_layer().weight.detach().clone()
            for name, layer in lora_layers(adapted.model).items()
        }

    def receive_on_client(self, msg, context, adapted):
        """Add the residuals of rounds not yet folded to this node's cumulative residual."""
        from flwr.app import Array, ArrayRecord, MetricRecord

        from flower_app.records import from_array_record
        from strategies.fedex_lora.residual_messages import read_residuals

        state = context.state
        cumulative = from_array_record(state[CUMULATIVE]) if CUMULATIVE in state else {}
        done = int(state[FOLDED_ROUND]["round"]) if FOLDED_ROUND in state.metric_records else 0
        if "residuals" in msg.content.array_records:
            for t, layers in sorted(read_residuals(msg.content["residuals"]).items()):
                if t <= done:
                    continue
                for layer, dense in layers.items():
                    cumulative[layer] = cumulative.get(layer, 0.0) + dense
                done = t
        # float64, so that folding rounds one by one equals folding them all at once (a
        # resumed run)
        state[CUMULATIVE] = ArrayRecord(
            {k: Array(np.ascontiguousarray(v, np.float64)) for k, v in cumulative.items()}
        )
        state[FOLDED_ROUND] = MetricRecord({"round": done})
        fold_residual(adapted, cumulative)
        return {"residual-round": done}

    def receive_on_server(self, adapted, strategy):
        fold_residual(adapted, getattr(strategy, "cumulative", {}))


def fold_residual(adapted, cumulative: Mapping[str, np.ndarray]) -> None:
    """W0 ← W0_pristine + s · cumulative residual (dense, per layer); {} restores W0."""
    import torch

    from flower_app.adapters.lora import lora_layers

    layers = lora_layers(adapted.model)
    with torch.no_grad():
        for name, w0 in adapted.held_tensors[PRISTINE].items():
            weight = layers[name].get_base_layer().weight
            if name in cumulative:
                scale = layers[name].scaling["default"]
                delta = torch.as_tensor(np.asarray(cumulative[name], np.float64)) * scale
                weight.copy_((w0.double() + delta.to(w0.device)).to(w0.dtype))
            else:
                weight.copy_(w0)


FEDEX_LORA = FedExLoRA(
    name="fedex-lora",
    summary="average A and B, clients fold the exact residual into W0",
    adapter="lora",
    shared=("A", "B"),
    dp_refusal=FEDEX_REFUSAL,
    writes_base_weights=True,  # the residual fold
)

METHODS = (FEDEX_LORA,)

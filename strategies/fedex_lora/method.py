"""FedEx-LoRA: the separate averages of A and B, plus the exact residual
``Σ wₙBₙAₙ − B̄Ā`` that every client folds into its frozen W0 (``strategies/fedex_lora/rule.py``).

How a residual reaches every client and is folded into W0, and how the server's evaluator
folds it: ``strategies/shared/folds.py``. The residual travels dense (the paper's version) or
as exact factors of rank ≤ (N + 1) r (``fedex-residual=factored``, ours).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from strategies.fedex_lora.settings import FedExLoRASettings
from strategies.shared.folds import FoldsIntoW0

if TYPE_CHECKING:
    from flower_app.settings.run_settings import RunSettings

    class FedExLoRAConfig(RunSettings, FedExLoRASettings):
        """What FedEx-LoRA reads: the core's settings and its own."""


# Why dp=central is refused rather than noised. The round's result is (avg B, avg A,
# residual) with residual = sum_n w_n B_n A_n - avg(B) avg(A), folded into W0 so that the
# model equals the exact mean of the products. The residual is quadratic in each client's
# factors: its sensitivity is that of the product update B_n A_n - B A = dB A + B dA + dB dA,
# a second Gaussian release on a dense d_out x d_in matrix. Unlike the SVD and Gram rules, which
# truncate to rank r after the noise, FedEx keeps the residual exactly, so full-rank noise
# of Frobenius norm ~ sigma sqrt(d_out d_in) would enter W0 every round and never leave.
FEDEX_REFUSAL = (
    "dp: dp=central is not supported for fedex-lora: its residual is quadratic in each "
    "client's factors and is folded into W0 whole every round, so Gaussian noise on it "
    "would be full-rank and accumulate in W0 (docs/privacy.md, section 8); use a method "
    "with a mechanism, florg among them"
)


class FedExLoRA(FoldsIntoW0):
    fold_prefix = "fedex"  # its context keys 'fedex-cumulative-residual', ... (folds.py)

    def build_strategy(
        self, config: FedExLoRAConfig, initial_state, *, fingerprint=None, run_dir=None
    ):
        from strategies.fedex_lora.strategy import FedExLoRAStrategy

        return FedExLoRAStrategy(
            initial_state,
            method=self,
            residual_mode=config.fedex_residual,
            **self.strategy_settings(config, run_dir=run_dir),
        )

    def extra_down_params(self, d_out, d_in, r, num_clients, config: FedExLoRAConfig | None):
        """The residual sent down (``fedex-residual``): d_out d_in (dense, the paper's
        version) or (N + 1) r (d_out + d_in) (its exact factors)."""
        from strategies.fedex_lora.rule import RESIDUAL_MODES

        mode = FedExLoRASettings.fedex_residual if config is None else config.fedex_residual
        if mode not in RESIDUAL_MODES:
            raise ValueError(f"fedex-residual {mode!r} unknown; choose one of {RESIDUAL_MODES}")
        if mode == "dense":
            return d_out * d_in
        return (num_clients + 1) * r * (d_out + d_in)


FEDEX_LORA = FedExLoRA(
    name="fedex-lora",
    summary="average A and B, clients fold the exact residual into W0",
    adapter="lora",
    shared=("A", "B"),
    settings=FedExLoRASettings,
    dp_refusal=FEDEX_REFUSAL,
    writes_base_weights=True,  # the residual fold
    # sums would give fedex-residual=dense its fold (the means of A, B and BₙAₙ; the factored
    # residual stacks each client's factors), but SecureRounds refuses a strategy with an
    # aggregate_train of its own, as FoldingStrategy's is (it reads each reply's metrics)
    secure_refusal="its strategy reads each reply's folded round ('residual-round', to send "
    "each node the folds it missed) in an aggregate_train of its own, which a secure round "
    "never calls",
)

METHODS = (FEDEX_LORA,)

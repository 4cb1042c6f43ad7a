"""FlexLoRA (Bai et al., 2024): LoRA clients of different rank; the server averages the
products BₙAₙ (as factors, never d_out x d_in) and hands each client the truncated SVD at
its rank, singular values split symmetrically (``strategies/flexlora/rule.py``).  With equal
ranks: FeDeRA's SVD re-factoring of the weighted product."""

from __future__ import annotations

from strategies.method import Method


class FlexLoRA(Method):
    def dp_mechanism(self):
        return "product-mean"  # one common rank under dp=central: FeDeRA's mechanism

    def build_strategy(self, config, initial_state, *, fingerprint=None, run_dir=None):
        from strategies.common.lora_strategies import FlexLoRAStrategy

        return FlexLoRAStrategy(initial_state, **self.strategy_settings(config, run_dir=run_dir))


FLEXLORA = FlexLoRA(
    name="flexlora",
    summary="average the products B A over ranks, truncated SVD at each client's rank",
    adapter="lora",
    shared=("A", "B"),
    heterogeneous_ranks=True,
)

METHODS = (FLEXLORA,)

"""HetLoRA (Cho et al., 2024): LoRA clients of different rank; the server averages the
factors zero-padded to the largest rank and each client keeps the top r_n rows of A and
columns of B (``strategies/hetlora/rule.py``).  With equal ranks: FedIT."""

from __future__ import annotations

from strategies.method import Method


class HetLoRA(Method):
    def dp_mechanism(self):
        return "mean"  # one common rank under dp=central: FedIT's mechanism

    def build_strategy(self, config, initial_state, *, fingerprint=None, run_dir=None):
        from strategies.common.lora_strategies import HetLoRAStrategy

        return HetLoRAStrategy(initial_state, **self.strategy_settings(config, run_dir=run_dir))


HETLORA = HetLoRA(
    name="hetlora",
    summary="zero-pad B and A to the largest rank and average; clients keep their top r_n",
    adapter="lora",
    shared=("A", "B"),
    heterogeneous_ranks=True,
)

METHODS = (HETLORA,)

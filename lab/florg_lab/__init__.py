"""Evaluation helpers for the experiments: SQuAD metrics and communication cost."""

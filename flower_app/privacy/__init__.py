"""Differential privacy: central DP's accountant and checks, example-level DP-SGD."""

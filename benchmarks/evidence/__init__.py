"""Analyses of the evidence grids' set-up: ``partition_skew`` (each seed's client label
counts and balance against the seed's scores; ``python -m benchmarks.evidence.partition_skew``)."""

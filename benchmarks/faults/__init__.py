"""Faults under load: ``poisoning`` (one poisoning client of five, with and without update
screening; ``python -m benchmarks.faults.poisoning``)."""

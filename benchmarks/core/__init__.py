"""The core benchmark (``python -m benchmarks.core.core_benchmark``): ``settings`` (sizes
and shapes), ``server`` (the server-step workers), ``client`` (the client-step and memory
workers) and ``report`` (the tables)."""

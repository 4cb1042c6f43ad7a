"""The simulation and deployment overhead (``python -m benchmarks.overhead.simulation_overhead``,
``python -m benchmarks.overhead.deployment_overhead``): ``settings`` (the run settings both
pin), ``monitor`` (the simulation's CPU monitor), ``sim`` and ``loop`` (the two
measurements) and ``report``."""

"""The benchmarks' reusable parts, imported by the scripts in ``benchmarks/`` (which put
this folder's parent on ``sys.path``: ``from lib.core_settings import ...``).

``paths``: the repository root and putting it on ``sys.path`` (the product's packages).
``core_*``: ``core_benchmark.py`` -- its settings, the server-step and client-step workers
and the report. ``overhead_*``: ``simulation_overhead.py`` (and ``deployment_overhead.py``)
-- the run settings, the simulation's CPU monitor, the two measurements and the report.
"""

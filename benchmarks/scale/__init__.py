"""The cost of scale: round time, a client's time split into training and the rest, server
aggregation time and peak memory for N SuperNodes and K clients per round
(``python -m benchmarks.scale.scale_benchmark``; numbers in docs/benchmarks.md)."""

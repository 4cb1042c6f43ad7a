"""Secure aggregation on Flower's Message API: the client's SecAgg+ stages
(``secaggplus_client.py``). The server's side is strategies/server/secure_sum.py; the
protocol as built and its status: docs/secure-aggregation.md."""

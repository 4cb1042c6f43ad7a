"""Centralised training with the app's own code (``training``: one process, the whole
training split, a client round's training steps): the seeded centralised reference
(``centralised_reference``), protocol v2's head learning rate (``head_learning_rate``) and
the adapters' growth (``adapter_growth``); each runs as ``python -m
benchmarks.centralised.NAME``."""

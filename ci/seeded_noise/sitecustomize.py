"""Loaded by every Python process of a behaviour snapshot (``ci/behaviour_snapshot.py`` puts
this folder on PYTHONPATH): makes ``numpy.random.default_rng()`` without a seed
deterministic, so that runs with dp=central (whose noise the app draws from OS entropy on
purpose) can be compared bit for bit. The n-th unseeded generator of a process gets seed
n; a seeded call is unchanged. Never on the path of a real run."""

import numpy.random

_default_rng = numpy.random.default_rng
_calls = [0]


def _seeded_default_rng(seed=None):
    if seed is None:
        _calls[0] += 1
        seed = _calls[0]
    return _default_rng(seed)


numpy.random.default_rng = _seeded_default_rng

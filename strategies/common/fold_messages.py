"""How the folds into W0 travel in a training message (``strategies/common/folds.py``): the
server writes every round's fold a node has not applied yet (``residuals_record``; the client
reads them back with ``folds.read_residuals``); the arrays count in the downlink."""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
from flwr.app import Array, ArrayRecord

from strategies.common.folds import Residual


def residuals_record(residuals: Mapping[int, Mapping[str, Residual]], since: int) -> ArrayRecord:
    """Server side: the residuals of the rounds after ``since``, as '<round>/<layer>/dense'
    arrays (or the exact factors '<round>/<layer>/P' and '.../Q'), float32."""
    entries: dict[str, Array] = {}
    for t in sorted(r for r in residuals if r > since):
        for layer, res in residuals[t].items():
            if res.dense is not None:
                entries[f"{t}/{layer}/dense"] = Array(res.dense.astype(np.float32))
            else:
                entries[f"{t}/{layer}/P"] = Array(res.P.astype(np.float32))
                entries[f"{t}/{layer}/Q"] = Array(res.Q.astype(np.float32))
    return ArrayRecord(array_dict=entries)

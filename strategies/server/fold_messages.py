"""How the folds into W0 travel in a training message (``strategies/shared/folds.py``): the
server writes the folds of the rounds a node has not applied yet (``residuals_record``; the
client reads them back with ``folds.read_residuals``), and, for a node behind the server's
base, the base itself (``folds.read_base``); the arrays count in the downlink.

The base C_h is what a client's float64 cumulative fold is after folding rounds 1..h one by
one: ((0 + r̃_1) + r̃_2) + ... + r̃_h, r̃_t the float64 of the float32 arrays sent for round t
(``sent_dense``, the client's own arithmetic in ``folds.read_residuals``). ``add_sent_folds``
is that sum's step; the server runs it to keep C_h (``folding_strategy.py``)."""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
from flwr.app import Array, ArrayRecord

from strategies.shared.folds import Residual, dense_from_parts


def sent_parts(res: Residual) -> dict[str, np.ndarray]:
    """The float32 arrays a fold travels as: {'dense'} or the exact factors {'P', 'Q'}."""
    if res.dense is not None:
        return {"dense": res.dense.astype(np.float32)}
    return {"P": res.P.astype(np.float32), "Q": res.Q.astype(np.float32)}


def sent_dense(res: Residual) -> np.ndarray:
    """The float64 dense fold a client reads from what is sent (same casts, same layout:
    an Array keeps C or Fortran order, ``astype`` too, so P @ Q is the client's product)."""
    return dense_from_parts(sent_parts(res))


def add_sent_folds(cumulative: dict[str, np.ndarray], layers: Mapping[str, Residual]) -> None:
    """cumulative[layer] += the sent fold, in float64, as ``FoldsIntoW0.receive_on_client``
    adds it (starting from 0.0 for a layer not folded yet)."""
    for layer, res in layers.items():
        cumulative[layer] = cumulative.get(layer, 0.0) + sent_dense(res)


def residuals_record(
    residuals: Mapping[int, Mapping[str, Residual]],
    since: int,
    base: tuple[int, Mapping[str, np.ndarray]] | None = None,
) -> ArrayRecord:
    """Server side: the residuals of the rounds after ``since``, as '<round>/<layer>/dense'
    arrays (or the exact factors '<round>/<layer>/P' and '.../Q'), float32; with ``base``
    = (h, C_h), also C_h as 'base/<h>/<layer>/dense', float64 (the client replaces its
    cumulative with it, so it must be its exact sum)."""
    entries: dict[str, Array] = {}
    if base is not None:
        horizon, layers = base
        for layer, dense in layers.items():
            entries[f"base/{horizon}/{layer}/dense"] = Array(np.asarray(dense, np.float64))
    for t in sorted(r for r in residuals if r > since):
        for layer, res in residuals[t].items():
            for kind, arr in sent_parts(res).items():
                entries[f"{t}/{layer}/{kind}"] = Array(arr)
    return ArrayRecord(array_dict=entries)

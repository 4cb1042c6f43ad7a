"""How FedEx-LoRA's residuals travel in a training message: the server writes every round's
residual a node has not folded yet (``residuals_record``), the client reads them back
(``read_residuals``). Both sides import this module; the arrays count in the downlink."""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
from flwr.app import Array, ArrayRecord

from strategies.fedex_lora.rule import Residual


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


def read_residuals(record: ArrayRecord) -> dict[int, dict[str, np.ndarray]]:
    """Client side: {round: {layer: dense residual}} from a 'residuals' ArrayRecord."""
    parts: dict[int, dict[str, dict[str, np.ndarray]]] = {}
    for key, arr in record.items():
        t, layer, kind = key.split("/")
        parts.setdefault(int(t), {}).setdefault(layer, {})[kind] = arr.numpy().astype(np.float64)
    out: dict[int, dict[str, np.ndarray]] = {}
    for t, layers in parts.items():
        out[t] = {
            layer: p["dense"] if "dense" in p else p["P"] @ p["Q"] for layer, p in layers.items()
        }
    return out

"""FLoRG's aggregated Gram matrix summed block by block (``gram_sum``), for rounds with more
stacked rows than columns (N r > k).

The server step decomposes Q = sum_n w_n A_n^T A_n (k x k, eq. Gram_agg) itself when
N r > k, so the (N r x k) stack is not needed: Q is summed here over blocks of at most
floor(k / r) clients (``clients_per_block``), each block a stack of at most k rows. The
working memory per layer is then of the order min(N r, k) x k whatever the number of
clients (docs/architecture.md, "What the server holds per round"). The blocks are summed
in client order, so the result is deterministic; it equals M^T M of the full stack up to
float64 rounding.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import torch

from strategies.florg.device import F64
from strategies.shared.validation import AggregationInputError


def clients_per_block(r: int, k: int) -> int:
    """The most clients whose r-row matrices stack to at most k rows (at least one)."""
    return max(1, k // r)


def gram_sum(
    names: Sequence[str],
    mats: Mapping[str, Sequence[np.ndarray]],
    sqrt_w: np.ndarray,
    device: torch.device,
) -> torch.Tensor:
    """(B x k x k) float64 on ``device``: Q = sum_n w_n A_n^T A_n for each layer of
    ``names`` (all of one shape r x k), summed over blocks of ``clients_per_block``
    clients. Raises naming the layer and client of a NaN/Inf entry."""
    first = mats[names[0]]
    n, (r, k) = len(first), first[0].shape
    block = clients_per_block(r, k)
    Q = torch.zeros((len(names), k, k), dtype=F64, device=device)
    for start in range(0, n, block):
        stop = min(n, start + block)
        host = np.empty((len(names), (stop - start) * r, k), dtype=np.float64)
        for b, name in enumerate(names):
            for j, i in enumerate(range(start, stop)):
                host[b, j * r : (j + 1) * r] = sqrt_w[i] * np.asarray(mats[name][i], np.float64)
        _check_finite(host, names, start, r)
        M = torch.from_numpy(host).to(device)
        Q.add_(M.mT @ M)  # sum over the block's clients of w_n A_n^T A_n
    return Q


def _check_finite(host: np.ndarray, names: Sequence[str], first_client: int, r: int) -> None:
    """One reduction per block; on failure, name the first layer and client at fault."""
    if np.isfinite(host.sum()):
        return
    B, rows, k = host.shape
    finite = np.isfinite(host.reshape(B, rows // r, r * k)).all(axis=2)
    if not finite.all():
        b, i = (int(x) for x in np.argwhere(~finite)[0])
        raise AggregationInputError(
            f"{names[b]}[client {first_client + i}]: contains NaN/Inf entries"
        )

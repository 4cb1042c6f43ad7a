"""The fixed matrices L (d_out x k) and R (k x d_in) of a FLoRG layer, k = min(d_in, d_out).

Never trained nor sent: every node derives them in float64 from the run seed and a key
(``projection_key``: the layer shape with ``projection-sharing=shape``, the default, so one
pair per shape; the module name with ``module``), bit-identical wherever the same NumPy runs.
``fingerprint`` hashes their float32 values so nodes can check that they agree. The
initialisations (paper, Table "Matrix Initialization"):

- ``semi-orthogonal`` (default): the Q factor of a seeded Gaussian, L^T L = R R^T = I_k;
- ``kaiming``: seeded Gaussian entries of std 1/sqrt(fan_in), fan_in = k for L, d_in for R;
- ``svd``: L = U[:, :k], R = V^T[:k] of W0 = U Sigma V^T, always per module."""

from __future__ import annotations

import hashlib
from typing import Literal

import numpy as np

ProjectionInit = Literal["semi-orthogonal", "kaiming", "svd"]
PROJECTION_INITS: tuple[str, ...] = ("semi-orthogonal", "kaiming", "svd")
PROJECTION_SHARINGS: tuple[str, ...] = ("shape", "module")


def projection_key(name: str, d_out: int, d_in: int, sharing: str, init: str) -> str:
    """The key L and R are derived from: the layer shape ('shape') or module name ('module').

    The 'svd' initialisation is always keyed by module (it reads that module's W0).
    """
    if sharing not in PROJECTION_SHARINGS:
        raise ValueError(
            f"unknown projection sharing {sharing!r}; choose one of {PROJECTION_SHARINGS}"
        )
    if sharing == "module" or init == "svd":
        return name
    return f"shape:{int(d_out)}x{int(d_in)}"


def seeded_rng(seed: int, name: str, purpose: str) -> np.random.Generator:
    """A NumPy generator determined by (seed, module name, purpose) only."""
    digest = hashlib.sha256(f"{int(seed)}|{name}|{purpose}".encode()).digest()
    return np.random.default_rng(int.from_bytes(digest[:8], "little"))


def _orthonormal_columns(rng: np.random.Generator, rows: int, cols: int) -> np.ndarray:
    """rows x cols matrix with orthonormal columns: QR of a Gaussian, sign-fixed."""
    q, t = np.linalg.qr(rng.standard_normal((rows, cols)))
    signs = np.sign(np.diag(t))
    signs[signs == 0] = 1.0
    return q * signs


def make_projections(
    d_out: int,
    d_in: int,
    *,
    seed: int,
    name: str,
    init: str = "semi-orthogonal",
    weight: np.ndarray | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """L (d_out x k) and R (k x d_in) in float64 for the key ``name`` (see ``projection_key``)."""
    k = min(d_in, d_out)
    if init == "semi-orthogonal":
        L = _orthonormal_columns(seeded_rng(seed, name, "L"), d_out, k)
        R = _orthonormal_columns(seeded_rng(seed, name, "R"), d_in, k).T
    elif init == "kaiming":
        L = seeded_rng(seed, name, "L").standard_normal((d_out, k)) / np.sqrt(k)
        R = seeded_rng(seed, name, "R").standard_normal((k, d_in)) / np.sqrt(d_in)
    elif init == "svd":
        if weight is None:
            raise ValueError(f"{name}: the 'svd' initialisation of L and R needs the weight W0")
        w = np.asarray(weight, dtype=np.float64)
        if w.shape != (d_out, d_in):
            raise ValueError(f"{name}: W0 has shape {w.shape}, expected {(d_out, d_in)}")
        U, _, Vt = np.linalg.svd(w, full_matrices=False)
        pivots = U[np.argmax(np.abs(U), axis=0), np.arange(U.shape[1])]
        signs = np.where(pivots < 0, -1.0, 1.0)
        L, R = U[:, :k] * signs[:k], Vt[:k] * signs[:k, None]
    else:
        raise ValueError(f"unknown L/R initialisation {init!r}; choose one of {PROJECTION_INITS}")
    return np.ascontiguousarray(L), np.ascontiguousarray(R)


def fingerprint(*arrays: np.ndarray) -> str:
    """Short hash of the arrays' values rounded to float32 (shape included)."""
    h = hashlib.sha256()
    for a in arrays:
        a32 = np.ascontiguousarray(np.asarray(a, dtype=np.float32))
        h.update(str(a32.shape).encode())
        h.update(a32.tobytes())
    return h.hexdigest()[:16]

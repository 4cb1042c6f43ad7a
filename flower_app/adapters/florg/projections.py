"""The fixed matrices L (d_out x k) and R (k x d_in) of a FLoRG layer, k = min(d_in, d_out).

They are never trained and never sent: every node derives them from the run seed and a
key, in float64, so they are bit-identical everywhere the same NumPy runs.  The key is
set by ``projection-sharing`` (``projection_key``):

- ``shape`` (default): the layer shape, "shape:<d_out>x<d_in>", so every module of the
  same shape uses the same L and R and a model holds one pair per shape (RoBERTa-large's
  48 query/value modules: 8 MiB instead of 384 MiB of float32 buffers).
- ``module``: the module name (the original derivation: one pair per module).

Either way L and R are fixed and identical on every node, semi-orthogonal with the
default initialisation (the paper asks for that; nothing in section 3.1 needs different
modules to differ).  The ``svd`` initialisation depends on each module's own W0 and is
always per module.  ``fingerprint`` hashes their float32 values so nodes can check that
they agree.  Three initialisations (paper, Table "Matrix Initialization"):

- ``semi-orthogonal`` (default): Q factor of a seeded Gaussian, signs fixed by
  making the diagonal of the triangular factor positive, so L^T L = R R^T = I_k.
- ``kaiming``: seeded Gaussian entries with std 1/sqrt(fan_in) (Kaiming normal,
  linear gain), fan_in = k for L and d_in for R; not orthogonal.
- ``svd``: the leading k left/right singular vectors of W0, W0 = U Sigma V^T,
  L = U[:, :k], R = V^T[:k]; each pair's sign fixed so U's largest entry is positive.
"""

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

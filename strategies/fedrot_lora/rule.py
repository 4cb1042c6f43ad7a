"""FedRot-LoRA (Zhang, Kim, Cha, Vikalo; ICML 2026, arXiv 2602.23638): rotate, then average.

LoRA's product is invariant to an orthogonal R in its rank space, (Bₙ R)(Rᵀ Aₙ) = Bₙ Aₙ, so
clients may hold the same update in rotated coordinates, which a factor-wise average mixes.
Each client's pair is rotated by the orthogonal Procrustes solution Rₙ that brings one of
its factors closest to the round's broadcast global factor, then B and A are averaged
separately with the round's weights. Which factor aligns alternates by round
(``aligned_part``), as in the authors' client (haoran-zh/FedRot-LoRA,
``federatedscope/core/workers/client.py`` and ``rotation_alignment_tools.py``): none in the
first round, then A, B, A, ... ``fedrot-rotation``: 'orthogonal' (the default) is the
authors' default (``rotate_lambda`` 1.5 > 1), the hard rotation Rₙ = U Vᵀ in O(r), a
reflection kept, no soft interpolation; 'proper' adds the determinant fix (Kabsch): SO(r).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from strategies.shared.averaging import weighted_average
from strategies.shared.validation import AggregationInputError, as_float64_matrix

ALIGNED_PARTS = ("A", "B")
# ``fedrot-rotation``'s values (settings.py): the group Rₙ is sought in, O(r) or SO(r)
ROTATIONS = ("orthogonal", "proper")


def aligned_part(server_round: int) -> str | None:
    """The factor aligned in ``server_round`` (1, 2, ...): None in round 1, then 'A' in even
    rounds and 'B' in odd ones. The authors' rounds count from s = 0 (s = round - 1): s = 0
    is not rotated, then A when s % 2 != offset, else B, with offset 0 for their configs'
    ``initialshare: 'A'`` (both ``base_fedrot_lora.yaml``)."""
    if server_round < 1:
        raise ValueError(f"training rounds start at 1, got {server_round}")
    if server_round == 1:
        return None
    return "A" if server_round % 2 == 0 else "B"


def procrustes_rotation(
    factor: np.ndarray, reference: np.ndarray, part: str, rotation: str = "orthogonal"
) -> np.ndarray:
    """Rₙ (r × r) minimising ‖Rᵀ Aₙ − A_g‖_F (part 'A', A r × d_in) or ‖Bₙ R − B_g‖_F (part
    'B', B d_out × r): both maximise tr(Rᵀ M) with M = Aₙ A_gᵀ or Bₙᵀ B_g = U S Vᵀ.
    ``rotation`` 'orthogonal' (the authors' default): over O(r), R = U Vᵀ (the orthogonal
    Procrustes problem), a reflection (det R = −1) kept, as it preserves the product as a
    rotation does. 'proper': over SO(r), R = U D Vᵀ with D = diag(1, ..., 1, det(U Vᵀ))
    (Kabsch): when U Vᵀ is a reflection, U's last column, of the smallest singular value, is
    negated, which costs the least of tr(Rᵀ M)."""
    if part not in ALIGNED_PARTS:
        raise ValueError(f"the aligned factor must be one of {ALIGNED_PARTS}, got {part!r}")
    if rotation not in ROTATIONS:
        raise ValueError(f"fedrot-rotation must be one of {ROTATIONS}, got {rotation!r}")
    x = as_float64_matrix(factor, part)
    ref = as_float64_matrix(reference, f"global {part}")
    if x.shape != ref.shape:
        raise AggregationInputError(f"{part}: shape {x.shape} != the global {ref.shape}")
    m = x @ ref.T if part == "A" else x.T @ ref
    u, _, vt = np.linalg.svd(m)
    if rotation == "proper" and np.linalg.det(u @ vt) < 0:
        # numpy orders the singular values descending: the last column is the smallest's
        u[:, -1] = -u[:, -1]
    return u @ vt


def rotate(B: np.ndarray, A: np.ndarray, R: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The pair in rotated coordinates, (B R, Rᵀ A): its product B A is unchanged."""
    return B @ R, R.T @ A


def aligned_pair(
    B: np.ndarray,
    A: np.ndarray,
    global_B: np.ndarray,
    global_A: np.ndarray,
    part: str | None,
    rotation: str = "orthogonal",
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(B Rₙ, Rₙᵀ A, Rₙ) for one client and layer, Rₙ aligning ``part`` to the global factor
    in ``rotation``'s group (``procrustes_rotation``; ``part`` None: Rₙ = I, the pair as
    sent)."""
    B, A = as_float64_matrix(B, "B"), as_float64_matrix(A, "A")
    if part is None:
        return B, A, np.eye(A.shape[0])
    factor, reference = (A, global_A) if part == "A" else (B, global_B)
    R = procrustes_rotation(factor, reference, part, rotation)
    return (*rotate(B, A, R), R)


def aggregate_fedrot_lora(
    client_Bs: Sequence[np.ndarray],
    client_As: Sequence[np.ndarray],
    weights: Sequence[float] | np.ndarray | None,
    global_B: np.ndarray,
    global_A: np.ndarray,
    part: str | None,
    rotation: str = "orthogonal",
) -> tuple[np.ndarray, np.ndarray, float]:
    """(Σ wₙ Bₙ Rₙ, Σ wₙ Rₙᵀ Aₙ, mean ‖Rₙ − I‖_F) with each Rₙ aligning ``part`` to the
    global factor in ``rotation``'s group (``aligned_pair``); weights are normalised."""
    if len(client_Bs) != len(client_As):
        raise AggregationInputError(f"got {len(client_Bs)} B matrices but {len(client_As)} A")
    pairs = [
        aligned_pair(B, A, global_B, global_A, part, rotation)
        for B, A in zip(client_Bs, client_As, strict=True)
    ]
    moved = [float(np.linalg.norm(R - np.eye(R.shape[0]))) for _, _, R in pairs]
    return (
        weighted_average([b for b, _, _ in pairs], weights, "B"),
        weighted_average([a for _, a, _ in pairs], weights, "A"),
        float(np.mean(moved)) if moved else 0.0,
    )

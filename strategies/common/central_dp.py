"""Central differential privacy (issue 29): the mechanisms, numpy reference.

Setting: a trusted server, user-level DP (one client = one unit: everything a client sends
in a round may change arbitrarily between neighbouring federations), the add/remove-one
neighbouring relation, the Gaussian mechanism, RDP accounting.  The run settings that drive
these functions are named by their run-config keys: ``dp`` (off | central),
``dp-clipping-norm`` C, ``dp-noise-multiplier`` z, ``dp-delta``.  The app's wiring: each
method declares its mechanism (``Method.dp_mechanism``, strategies/), its strategy
runs it (``AdapterStrategy.aggregate_private``, strategies/common/) with a ``CentralDP``
(the settings, the noise source, the ledger; end of this module).  Derivations and threat
model: docs/privacy.md.

The rule behind every mechanism here: each client's contribution to a SUM is bounded in L2
norm by a sensitivity Delta (by clipping), the sum gets Gaussian noise of std z * Delta per
released coordinate, and everything after that (dividing by the public client count m,
adding the public previous state, eigendecompositions, Procrustes, SVD truncation) is
post-processing, which costs no privacy.  One round of any method below is therefore one
Gaussian mechanism with noise multiplier z, and ``DpAccountant`` composes the rounds.

Per method (``check_dp_supported``):

- ``mean`` (FedIT, FFA-LoRA, FedSA-LoRA): the uploaded arrays are averaged, so the update
  u_n = reply - sent over ALL shared arrays of the client (adapter parts and task head
  jointly) is clipped to ||u_n|| <= C (``clip_update``) and ``noised_mean`` releases
  (sum_n u_n + N(0, (zC)^2 I)) / m = mean + N(0, (zC/m)^2 I).
- ``product-mean`` (FeDeRA): this app's FeDeRA does NOT average the uploaded arrays; it
  averages the products B_n A_n and re-factors them by truncated SVD (strategies/federa/rule.py).
  Its aggregate is linear in the products, so the clipped unit is the product update
  B_n A_n - B_sent A_sent (``product_update``, dense d_out x d_in per layer, jointly with
  the head update), released by the same ``noised_mean``; ``federa_private_step`` then
  truncates (post-processing).  The noise is dense, hence Q is formed densely, unlike the
  noiseless QR path of strategies/federa/rule.py.
- ``gram`` (FLoRG, its no-Procrustes ablation, florg-signed): ``clip_florg`` /
  ``noised_gram_sum`` / ``florg_private_step`` / ``private_florg_layers`` below.
- FedEx-LoRA is refused (``check_dp_supported``; the argument is in ``FEDEX_REFUSAL``).

Mean mechanism and Flower.  ``clip_update`` + ``noised_mean`` is, in distribution, exactly
what ``flwr.serverapp.strategy.DifferentialPrivacyServerSideFixedClipping`` does (flwr 1.41;
the file and the helpers it calls, ``flwr.supercore.differential_privacy``, are identical in
1.42): it replaces each reply by ``sent + clip(reply - sent, C)``
(``compute_clip_model_update`` -> ``clip_inputs_inplace``: one scale factor
min(1, C / ||flattened update||) for all arrays of the record), FedAvgs the clipped replies
(its accounted mode requires equal weights, i.e. the uniform mean) and adds
N(0, compute_stdv(z, C, m)^2) = N(0, (zC/m)^2) to every coordinate of the aggregate
(``add_gaussian_noise_inplace``), m = ``num_sampled_clients``.  Uniform mean of
sent + clipped updates + noise = sent + ``noised_mean``.  The tests hold ``clip_update`` to
``clip_inputs_inplace`` and the std to ``compute_stdv``.  Why the helpers are not called:

- ``clip_inputs_inplace`` divides C by the norm in Python floats: an all-zero update (a
  client that did not move, FFA-LoRA's frozen parts, a zero-step round) raises
  ZeroDivisionError; and it scales in the array's own dtype, so a float32 reply clipped to
  C = 0.1 comes out with norm 0.1000000036 > C (measured), a (tiny) breach of the bound
  the sensitivity rests on.  Here the update is clipped in float64.
- ``add_gaussian_noise_inplace`` draws from NumPy's legacy global RNG (``np.random.normal``):
  no Generator can be passed, so the noise can neither be drawn from a dedicated source nor
  reproduced in tests, and it is rounded to the array's dtype.  FLoRG's noise is also not
  iid over the released matrix (it is symmetric), which no Flower helper draws.
- the wrapper itself cannot wrap this app's strategies: it clips whole ArrayRecords and
  noises the output of the inner strategy's ``aggregate_train``, which for FeDeRA and FLoRG
  is a non-linear function of the replies (noise after an SVD or a Procrustes step is not
  the Gaussian mechanism on a bounded-sensitivity statistic), and its accounted mode
  accepts only ``FedAvg.aggregate_train`` itself.
- layering: ``strategies/*.py`` are the framework-free numpy rules (no flwr import), and the
  helpers live in ``flwr.supercore``, an internal package (they were in ``flwr.common``
  before).

Randomness: every function takes a ``numpy.random.Generator``.  The app draws it from OS
entropy (``CentralDP``: ``np.random.default_rng()`` without a seed), never from the run's
public ``seed`` setting: noise that can be regenerated from a known seed protects nothing.
NumPy's PCG64 is not a cryptographic generator, and floating-point Gaussian sampling has
known side channels (Mironov 2012, for Laplace); both are out of scope here and named in
docs/privacy.md.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

import numpy as np

from strategies.common.validation import as_float64_matrix
from strategies.florg.rule import _canonical_signs, procrustes_rotation

# --------------------------------------------------------------------------- settings

KEY_DP = "dp"
KEY_CLIPPING_NORM = "dp-clipping-norm"
KEY_NOISE_MULTIPLIER = "dp-noise-multiplier"
KEY_DELTA = "dp-delta"
DP_MODES: tuple[str, ...] = ("off", "central")

EPS64 = float(np.finfo(np.float64).eps)
# A clipped input may exceed C by float64 rounding of the scale factor, never by more.
CLIP_SLACK = 1e-9


def _real(value: Any, key: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise ValueError(f"{key} must be a number, got {value!r}")
    return float(value)


def check_dp_mode(mode: Any) -> str:
    """The ``dp`` setting ('off' or 'central'), or ValueError naming it."""
    if mode not in DP_MODES:
        raise ValueError(f"{KEY_DP} must be one of {DP_MODES}, got {mode!r}")
    return str(mode)


def check_clipping_norm(clipping_norm: Any) -> float:
    """C as a float, or ValueError naming ``dp-clipping-norm`` (finite and > 0)."""
    c = _real(clipping_norm, KEY_CLIPPING_NORM)
    if not (math.isfinite(c) and c > 0):
        raise ValueError(f"{KEY_CLIPPING_NORM} must be finite and > 0, got {clipping_norm!r}")
    return c


def check_noise_multiplier(noise_multiplier: Any, allow_zero: bool = False) -> float:
    """z as a float, or ValueError naming ``dp-noise-multiplier``.

    A run setting must be > 0 (z = 0 adds no noise and has epsilon = infinity); the
    mechanisms accept z = 0 (``allow_zero``) so that tests can switch the noise off and
    check that everything after it is the noiseless rule.
    """
    z = _real(noise_multiplier, KEY_NOISE_MULTIPLIER)
    if not math.isfinite(z) or z < 0 or (z == 0 and not allow_zero):
        bound = ">= 0" if allow_zero else "> 0"
        raise ValueError(f"{KEY_NOISE_MULTIPLIER} must be finite and {bound}, got {z!r}")
    return z


def check_delta(delta: Any) -> float:
    """delta as a float, or ValueError naming ``dp-delta`` (strictly between 0 and 1)."""
    d = _real(delta, KEY_DELTA)
    if not (0.0 < d < 1.0):
        raise ValueError(f"{KEY_DELTA} must be strictly between 0 and 1, got {delta!r}")
    return d


def check_sample_rate(sample_rate: Any) -> float:
    """The per-round client sampling probability q in (0, 1]."""
    q = _real(sample_rate, "sample rate")
    if not (0.0 < q <= 1.0):
        raise ValueError(f"sample rate must be in (0, 1], got {sample_rate!r}")
    return q


def _check_steps(steps: Any) -> int:
    if isinstance(steps, bool) or not isinstance(steps, (int, np.integer)) or steps < 0:
        raise ValueError(f"steps must be an integer >= 0, got {steps!r}")
    return int(steps)


# --------------------------------------------------------------------------- methods

MECHANISMS: dict[str, str] = {
    "fedit": "mean",
    "ffa-lora": "mean",
    "fedsa-lora": "mean",
    "federa": "product-mean",
    "florg": "gram",
    "florg-no-procrustes": "gram",
    "florg-signed": "gram",  # each sign block through the Gram step as its own "layer"
    # one common rank under dp=central (client-ranks is refused with it): FedIT's / FeDeRA's
    "hetlora": "mean",
    "flexlora": "product-mean",
}

FEDEX_REFUSAL = (
    "dp=central is not supported for fedex-lora: its residual "
    "sum_n w_n B_n A_n - avg(B) avg(A) is quadratic in each client's factors, so it needs "
    "its own mechanism on the dense d_out x d_in product (sensitivity of one client's "
    "product update B_n A_n - B A <= ||dB|| ||A||_2 + ||B||_2 ||dA|| + ||dB|| ||dA||, not "
    "the C of the factor update), and FedEx folds that residual into the frozen W0 every "
    "round without truncation: the full-rank noise (std z C / m on each of d_out * d_in "
    "entries, norm ~ z C sqrt(d_out d_in) / m per layer, about 1000 x the signal bound "
    "C / m at d = 1024, z = 1) would accumulate in W0 as a random walk. A correct variant exists "
    "(clip (dB, dA, B_n A_n - B A) jointly, noise all three, residual by post-processing) "
    "but it is dense-noise DP fine-tuning of W0, not FedEx's exact aggregation; use fedit, "
    "federa or florg with dp=central"
)


def check_dp_supported(method_name: str) -> str:
    """The mechanism that privatises ``method_name`` ('mean', 'product-mean' or 'gram'), or
    ValueError: FedEx-LoRA with the reason (``FEDEX_REFUSAL``), an unknown method by name.

    Why FedEx is refused rather than noised.  FedEx's round result is
    (avg B, avg A, residual) with residual = sum_n w_n B_n A_n - avg(B) avg(A), folded into
    W0 so that the model equals the exact mean of the products.  The residual is a quadratic
    function of each client's factors: adding one client changes sum_n B_n A_n by its
    product and shifts both averages, so its sensitivity is that of the product update
    B_n A_n - B A = dB A + B dA + dB dA, bounded by ||dB|| ||A||_2 + ||B||_2 ||dA|| +
    ||dB|| ||dA|| under update clipping (the same shape of bound as FLoRG's centred Gram,
    ``florg_sensitivity``), i.e. a second Gaussian release on a dense d_out x d_in matrix.
    Unlike FeDeRA and FLoRG, which truncate to rank r after the noise (keeping only the
    noise's top-r part, spectral size ~ sigma (sqrt(d_out) + sqrt(d_in))), FedEx's whole
    point is to keep the residual exactly, so the full-rank noise of Frobenius norm
    ~ sigma sqrt(d_out d_in) enters W0 every round and never leaves (it sums over rounds).
    Its 'factored' residual transport would also be lost (noise is full rank).  That is a
    correct mechanism, but not FedEx; the refusal says so.
    """
    if method_name == "fedex-lora":
        raise ValueError(FEDEX_REFUSAL)
    try:
        return MECHANISMS[method_name]
    except KeyError:
        raise ValueError(
            f"dp=central: no differential-privacy mechanism for method {method_name!r}; "
            f"supported: {', '.join(MECHANISMS)}"
        ) from None


def check_dp_settings(
    *,
    clipping_norm: Any,
    noise_multiplier: Any,
    delta: Any,
    method: str | None = None,
    aggregation_weights: str = "uniform",
) -> None:
    """Every check a run with ``dp=central`` needs before it starts, each ValueError naming
    its run-config key: C > 0, z > 0, 0 < delta < 1, a supported method, uniform weights.

    ``aggregation-weights=num-examples`` is refused: the weights are client-reported and
    data-dependent, and a weight w_n > 1/m multiplies that client's sensitivity by m w_n,
    which the noise std z C / m does not cover (Flower's accounted wrapper likewise
    requires equal weights).
    """
    check_clipping_norm(clipping_norm)
    check_noise_multiplier(noise_multiplier)
    check_delta(delta)
    if method is not None:
        check_dp_supported(method)
    if aggregation_weights != "uniform":
        raise ValueError(
            "dp=central needs aggregation-weights='uniform' (client-reported example counts "
            f"are data-dependent and raise one client's sensitivity), got {aggregation_weights!r}"
        )


# --------------------------------------------------------------------------- structures

# A client's arrays: a mapping name -> array (the app's state dicts) or a plain sequence.
Arrays = Mapping[str, Any] | Sequence[Any]


def _items(arrays: Arrays) -> list[tuple[Any, np.ndarray]]:
    if isinstance(arrays, np.ndarray):
        raise TypeError("expected a mapping or a sequence of arrays, got one array")
    pairs = arrays.items() if isinstance(arrays, Mapping) else enumerate(arrays)
    out = []
    for key, value in pairs:
        arr = np.asarray(value, dtype=np.float64)
        if not np.all(np.isfinite(arr)):
            raise ValueError(f"array {key!r}: contains NaN/Inf entries")
        out.append((key, arr))
    return out


def _rebuild(like: Arrays, items: list[tuple[Any, np.ndarray]]) -> Any:
    if isinstance(like, Mapping):
        return {key: arr for key, arr in items}
    return [arr for _, arr in items]


def flat_norm(arrays: Arrays) -> float:
    """L2 norm of all arrays flattened and concatenated (Flower's ``get_norm``)."""
    return math.sqrt(sum(float(np.sum(a * a)) for _, a in _items(arrays)))


# --------------------------------------------------------------------------- mean mechanism


def clip_update(update: Arrays, clipping_norm: float) -> Any:
    """The update (reply - sent, over every shared array of one client, head included)
    scaled by min(1, C / ||update||), ||.|| the L2 norm of all arrays flattened jointly.

    Returns float64 copies in the input's structure (mapping or list); an all-zero update
    is returned unchanged.  Equal to Flower's ``clip_inputs_inplace`` wherever that one
    does not raise (module docstring).
    """
    c = check_clipping_norm(clipping_norm)
    items = _items(update)
    norm = math.sqrt(sum(float(np.sum(a * a)) for _, a in items))
    scale = min(1.0, c / norm) if norm > 0 else 1.0
    return _rebuild(update, [(key, a * scale) for key, a in items])


def noise_std_mean(clipping_norm: float, noise_multiplier: float, num_clients: int) -> float:
    """sigma = z C / m, the per-coordinate std of ``noised_mean`` (Flower's ``compute_stdv``)."""
    c = check_clipping_norm(clipping_norm)
    z = check_noise_multiplier(noise_multiplier, allow_zero=True)
    if num_clients < 1:
        raise ValueError(f"the number of clients must be >= 1, got {num_clients}")
    return z * c / num_clients


def _check_clipped(norm: float, bound: float, what: str) -> None:
    if norm > bound * (1.0 + CLIP_SLACK):
        raise ValueError(f"{what}: norm {norm:.6g} exceeds the clipping bound {bound:.6g}")


def noised_mean(
    clipped_updates: Iterable[Arrays],
    clipping_norm: float,
    noise_multiplier: float,
    rng: np.random.Generator,
    *,
    num_sampled: int | None = None,
) -> Any:
    """(sum_n u_n + N(0, (zC)^2 I)) / m, i.e. the uniform mean of the clipped updates plus
    iid Gaussian noise of std sigma = z C / m on every coordinate.

    Privacy: under add/remove-one the sum moves by one clipped update, ||u_n|| <= C, so the
    sum with N(0, (zC)^2) noise is the Gaussian mechanism with noise multiplier z;
    dividing by m is post-processing when m is public.  ``num_sampled`` is that public m
    (the configured number of sampled clients, as Flower's ``num_sampled_clients``); None
    uses the number of updates, which is the same whenever every sampled client replied.
    The updates are read one at a time (a generator keeps one client's dense FeDeRA product
    update in memory, not all of them).
    Each input must already be clipped (checked: ||u_n|| <= C up to rounding).  Noise is
    drawn array by array in the first update's key order.  Returns float64 arrays in the
    inputs' structure.  Equal in distribution to Flower's
    ``DifferentialPrivacyServerSideFixedClipping`` on the same replies (module docstring).
    """
    c = check_clipping_norm(clipping_norm)
    z = check_noise_multiplier(noise_multiplier, allow_zero=True)
    first: Arrays | None = None
    keys: list[Any] = []
    total: list[np.ndarray] = []
    n = 0
    for i, update in enumerate(clipped_updates):
        items = _items(update)
        if first is None:
            first, keys, total = (
                update,
                [key for key, _ in items],
                [np.zeros_like(a) for _, a in items],
            )
        if [key for key, _ in items] != keys:
            raise ValueError(f"client {i}: arrays {[k for k, _ in items]} differ from {keys}")
        norm = math.sqrt(sum(float(np.sum(a * a)) for _, a in items))
        _check_clipped(norm, c, f"client {i} update")
        for j, (key, a) in enumerate(items):
            if a.shape != total[j].shape:
                raise ValueError(f"client {i}: array {key!r} has shape {a.shape}")
            total[j] += a
        n += 1
    if first is None:
        raise ValueError("noised_mean: no client updates")
    m = n if num_sampled is None else int(num_sampled)
    if m < n:
        raise ValueError(f"num_sampled={m} is smaller than the {n} updates")
    sigma = noise_std_mean(c, z, m)
    out = [
        (key, s / m + rng.normal(0.0, sigma, s.shape)) for key, s in zip(keys, total, strict=True)
    ]
    return _rebuild(first, out)


# --------------------------------------------------------------------------- FeDeRA


def product_update(B: Any, A: Any, B_sent: Any, A_sent: Any) -> np.ndarray:
    """FeDeRA's clipped unit for one layer: B_n A_n - B_sent A_sent (d_out x d_in, dense).

    Clip the dict of every layer's product update and the head update jointly with
    ``clip_update``, release with ``noised_mean``, add B_sent A_sent back, then
    ``federa_private_step``.
    """
    return as_float64_matrix(B, "B") @ as_float64_matrix(A, "A") - (
        as_float64_matrix(B_sent, "B_sent") @ as_float64_matrix(A_sent, "A_sent")
    )


def federa_private_step(
    noised_product: Any, r: int
) -> tuple[np.ndarray, np.ndarray, dict[str, float | int]]:
    """Rank-r (B, A) from the noised mean product (post-processing): the truncated SVD
    U S V^T with B = U_r S_r^{1/2}, A = S_r^{1/2} V_r^T, the split of
    ``strategies.federa.rule.truncated_product_svd``.  With z = 0 and no clipping active it
    equals ``aggregate_federa``.  info: ``trunc_rel_error`` as there."""
    P = as_float64_matrix(noised_product, "noised_product")
    if not 1 <= r <= min(P.shape):
        raise ValueError(f"rank r={r} must be between 1 and {min(P.shape)}")
    U, s, Vt = np.linalg.svd(P, full_matrices=False)
    root = np.sqrt(s[:r])
    total = float(np.sqrt(np.sum(s**2)))
    info: dict[str, float | int] = {
        "trunc_rel_error": float(np.sqrt(np.sum(s[r:] ** 2)) / total) if total > 0 else 0.0
    }
    return U[:, :r] * root, root[:, None] * Vt[:r], info


# --------------------------------------------------------------------------- FLoRG


def _layers(A: Any) -> tuple[bool, list[tuple[Any, np.ndarray]]]:
    """(was a single matrix, [(name, matrix)])."""
    if isinstance(A, Mapping):
        return False, [(k, as_float64_matrix(v, f"A[{k}]")) for k, v in A.items()]
    return True, [(None, as_float64_matrix(A, "A"))]


def florg_sensitivity(clipping_norm: float, prev_A: Any = None) -> float:
    """L2 sensitivity Delta of the released Gram SUM under adding/removing one client.

    Clipping A itself (``prev_A`` None, ||A_n||_F <= C): the client's term is A_n^T A_n and
    ||A^T A||_F <= ||A||_2 ||A||_F <= ||A||_F^2 <= C^2, so Delta = C^2.  Over several layers
    clipped jointly (sum_l ||A_l||_F^2 <= C^2): sqrt(sum_l ||A_l^T A_l||_F^2) <=
    sum_l ||A_l||_F^2 <= C^2, the same Delta.

    Clipping the update D = A_n - P (``prev_A`` = P, the public A the round started from;
    ||D||_F <= C): the released statistic is sum_n (A_n^T A_n - P^T P) (P^T P is public, added
    back by post-processing), whose client term g(D) = P^T D + D^T P + D^T D has
    ||g(D)||_F <= 2 ||P||_2 ||D||_F + ||D||_F^2, so Delta = C (2 ||P||_2 + C); over layers
    clipped jointly, by the triangle inequality in l2 over layers,
    Delta = C (2 max_l ||P_l||_2 + C).  P = 0 gives back C^2.

    The noise is added to the upper triangle (diagonal included) only, whose L2 norm is at
    most the Frobenius norm, so Delta bounds that vector's sensitivity too.
    """
    c = check_clipping_norm(clipping_norm)
    if prev_A is None:
        return c * c
    _, layers = _layers(prev_A)
    p = max((float(np.linalg.norm(P, 2)) if P.size else 0.0) for _, P in layers)
    return c * (2.0 * p + c)


def clip_florg_with_head(
    A: Any,
    head_update: Arrays | None,
    clipping_norm: float,
    head_clipping_norm: float | None = None,
    prev_A: Any = None,
) -> tuple[Any, Any]:
    """One client's FLoRG upload clipped: its A (one matrix or a mapping layer -> A, all
    layers jointly) and, optionally, its task-head update, with one common scale factor.

    With D = A - prev_A (or A itself when ``prev_A`` is None), a = ||D||_F / C and
    b = ||head||/C_h, both are scaled by c = min(1, 1/sqrt(a^2 + b^2)).  Then the Gram term
    has ||g(cD)||_F <= a' Delta (a' = c a <= 1, so a'^2 <= a') and the head
    ||c head|| = b' C_h with a'^2 + b'^2 <= 1: the Gram sum with noise std z Delta
    (``florg_sensitivity``) and the head sum with std z C_h together are ONE Gaussian
    mechanism with multiplier z, not two to compose.  Returns (clipped A in A's
    structure, clipped head update or None).
    """
    c = check_clipping_norm(clipping_norm)
    single, layers = _layers(A)
    prev: dict[Any, np.ndarray] = {}
    if prev_A is not None:
        prev_single, prev_layers = _layers(prev_A)
        prev = dict(prev_layers)
        if prev_single != single or set(prev) != {k for k, _ in layers}:
            raise ValueError("prev_A must have the same layers as A")
    deltas = []
    for name, a in layers:
        base = prev.get(name)
        if base is not None and base.shape != a.shape:
            raise ValueError(f"layer {name!r}: A {a.shape} and prev_A {base.shape} differ")
        deltas.append(a if base is None else a - base)
    ratio_sq = sum(float(np.sum(d * d)) for d in deltas) / (c * c)
    head_items = None
    if head_update is not None:
        ch = c if head_clipping_norm is None else check_clipping_norm(head_clipping_norm)
        head_items = _items(head_update)
        ratio_sq += sum(float(np.sum(h * h)) for _, h in head_items) / (ch * ch)
    scale = min(1.0, 1.0 / math.sqrt(ratio_sq)) if ratio_sq > 0 else 1.0
    clipped = []
    for (name, _), d in zip(layers, deltas, strict=True):
        base = prev.get(name)
        clipped.append((name, scale * d if base is None else base + scale * d))
    out_A = clipped[0][1] if single else {name: a for name, a in clipped}
    out_head = None
    if head_update is not None:
        out_head = _rebuild(head_update, [(k, scale * h) for k, h in head_items or []])
    return out_A, out_head


def clip_florg(A: Any, clipping_norm: float, prev_A: Any = None) -> Any:
    """A (one r x k matrix, or a mapping layer -> A clipped jointly over the layers) scaled
    so that ||A||_F <= C (``prev_A`` None), or prev_A + (A - prev_A) scaled so that
    ||A - prev_A||_F <= C.  Hence ||A^T A||_F <= ||A||_F^2 <= C^2 for the former, and the
    sensitivities of ``florg_sensitivity`` for either.

    Which unit: the Gram aggregation sums A_n^T A_n, a function of A itself, so clipping A
    (issue 29's proposal, Delta = C^2, independent of the state) is the direct choice.  It
    is a poor one in practice: A carries the whole learned adapter (A_prev, public, plus
    this round's change), so either C >= ||A_prev||_F every round, and the noise z C^2 / m
    is relative to the whole model rather than to the round's change, or clipping shrinks
    A_prev itself every round and the model decays geometrically.  Clipping the update
    D = A - A_prev (as every mean method and Flower clip, and as screening measures it)
    bounds what one client changes; it costs a state-dependent but public sensitivity
    C (2 ||A_prev||_2 + C), which for C << ||A_prev|| is about 2 ||A_prev||_2 C, far below
    ||A_prev||_F^2.  Both are implemented; the recommended one, and the default of
    ``private_florg_layers``, is the update (``centred=True``).
    """
    return clip_florg_with_head(A, None, clipping_norm, prev_A=prev_A)[0]


def symmetric_noise(k: int, std: float, rng: np.random.Generator) -> np.ndarray:
    """Analyze-Gauss noise (Dwork, Talwar, Thakurta, Zhang 2014): a k x k symmetric E whose
    upper triangle, diagonal included, is iid N(0, std^2), drawn in ``np.triu_indices(k)``
    order, and mirrored below (exactly symmetric)."""
    iu = np.triu_indices(k)
    E = np.zeros((k, k))
    E[iu] = rng.normal(0.0, std, iu[0].size)
    return E + np.triu(E, 1).T


def noised_gram_sum(
    clipped_As: Sequence[Any],
    clipping_norm: float,
    noise_multiplier: float,
    rng: np.random.Generator,
    *,
    prev_A: Any = None,
    sensitivity: float | None = None,
    num_sampled: int | None = None,
) -> np.ndarray:
    """(sum_n A_n^T A_n + E) / m for one layer: the Gram sum plus symmetric Gaussian noise E
    (``symmetric_noise`` with std z Delta), divided by m, i.e. the noised mean Gram matrix
    (k x k, symmetric, indefinite in general).

    Delta is ``florg_sensitivity(C, prev_A)`` (C^2 when the A_n were clipped themselves,
    C (2 ||prev_A||_2 + C) when their updates were), or ``sensitivity`` when given: for
    layers clipped jointly pass the multi-layer value (max over the layers' ||P_l||_2).
    With the update clipped the statistic is P^T P + (sum_n g(D_n) + E) / m
    (``noised_mean_gram``), which equals the mean Gram + E / m when m is the number of
    inputs.  ``num_sampled`` as for ``noised_mean``.  Inputs must be clipped (checked per
    layer: ||A_n - prev_A||_F <= C or ||A_n||_F <= C).
    """
    c = check_clipping_norm(clipping_norm)
    z = check_noise_multiplier(noise_multiplier, allow_zero=True)
    if len(clipped_As) == 0:
        raise ValueError("noised_gram_sum: no client matrices")
    mats = [as_float64_matrix(a, f"A[client {i}]") for i, a in enumerate(clipped_As)]
    prev = None if prev_A is None else as_float64_matrix(prev_A, "prev_A")
    k = mats[0].shape[1]
    for i, a in enumerate(mats):
        if a.shape != mats[0].shape or (prev is not None and a.shape != prev.shape):
            raise ValueError(f"A[client {i}]: shape {a.shape} differs")
        norm = float(np.linalg.norm(a if prev is None else a - prev))
        _check_clipped(norm, c, f"A[client {i}]" + ("" if prev is None else " - prev_A"))
    m = len(mats) if num_sampled is None else int(num_sampled)
    if m < len(mats):
        raise ValueError(f"num_sampled={m} is smaller than the {len(mats)} client matrices")
    delta = florg_sensitivity(c, prev) if sensitivity is None else float(sensitivity)
    noise = symmetric_noise(k, z * delta, rng)
    return noised_mean_gram(mats, noise, m, prev)


def _symmetric_product(X: np.ndarray) -> np.ndarray:
    """X^T X made exactly symmetric (BLAS may round the two triangles differently)."""
    g = X.T @ X
    return (g + g.T) / 2


def noised_mean_gram(
    mats: Sequence[np.ndarray], noise: np.ndarray, m: int, prev: np.ndarray | None
) -> np.ndarray:
    """The released Q^ from the clipped matrices and the noise E (std on the SUM):
    (sum_n A_n^T A_n + E) / m, or, with the update clipped (``prev`` = P),
    P^T P + (sum_n (A_n^T A_n - P^T P) + E) / m -- the sum of the clients' terms g(D_n) that
    the sensitivity bounds, so that a missing client (fewer matrices than m) counts as one
    that did not move, as in ``noised_mean``.  Both equal the mean Gram + E / m when there
    are m matrices.  Exactly symmetric."""
    gram = _symmetric_product(np.concatenate(mats))
    if prev is None:
        return (gram + noise) / m
    base = _symmetric_product(prev)
    return (gram - len(mats) * base + noise) / m + base


def florg_private_step(
    noised_Q: Any, prev_A: Any, r: int | None = None, *, procrustes: bool = True
) -> tuple[np.ndarray, dict[str, float | int]]:
    """FLoRG's decomposition and Procrustes on a noised mean Gram matrix (post-processing).

    eigh of the k x k matrix, eigenvalues in descending order; the top r are kept, those not
    above k eps lambda_1 (the non-positive ones, up to rounding; the noise makes Q
    indefinite) are dropped, giving r' <= r rows A~ = Lambda^{1/2} P (signs fixed by the
    largest entry of each row), then Theorem 1: S = U V^T from the thin SVD of
    A_prev A~^T (r x r', orthonormal columns) and A_new = S A~ -- the 'truncate' policy of
    ``strategies.florg.rule`` (Eckart-Young rank-r approximation of the noised Q, the only one
    that makes sense once Q has full rank from the noise).  ``procrustes=False``: the
    paper's ablation, the top rows of A~ zero-padded.

    Why the thin path of strategies/florg/rule.py cannot be used: it never forms Q, taking Q's
    eigenpairs from the N r x N r matrix G = M M^T of the stacked client matrices M, which
    works because Q = M^T M has rank <= N r and its eigenvectors lie in the row space of M.
    Q + E/m has no such factor: E is full rank and indefinite, the eigenvectors of the
    noised Q leave the clients' row space (they must -- eigenvectors confined to the span
    of the clients' rows would publish that span exactly), and noising M instead would be
    noise per client, i.e. local DP.  So the k x k eigendecomposition, O(k^3) per layer,
    is the price (batched over layers in ``strategies.florg.dp_torch``).

    Returns (A_new with prev_A's shape, info: ``rank`` r', ``dropped`` (r - r', top-r
    eigenvalues dropped as non-positive), ``eigengap`` lambda_r - lambda_{r+1},
    ``negative_eigenvalues`` (how many of Q's are < 0, a gauge of the noise), ``drift``).
    """
    Q = as_float64_matrix(noised_Q, "noised_Q")
    prev = as_float64_matrix(prev_A, "prev_A")
    k = Q.shape[0]
    if Q.shape != (k, k) or prev.shape[1] != k:
        raise ValueError(f"noised_Q {Q.shape} and prev_A {prev.shape} do not match (k x k, r x k)")
    r = prev.shape[0] if r is None else int(r)
    if not 1 <= r <= prev.shape[0]:
        raise ValueError(f"rank r={r} must be between 1 and prev_A's {prev.shape[0]} rows")
    lam, vecs = np.linalg.eigh((Q + Q.T) / 2)
    lam, vecs = lam[::-1], vecs[:, ::-1]
    r_prime = int(np.count_nonzero(lam[:r] > k * EPS64 * lam[0])) if lam[0] > 0 else 0
    A_tilde = _canonical_signs(np.sqrt(lam[:r_prime])[:, None] * vecs[:, :r_prime].T)
    if procrustes:
        new_A = procrustes_rotation(prev, A_tilde) @ A_tilde
    else:
        new_A = np.zeros_like(prev)
        new_A[:r_prime] = A_tilde
    lam_pad = np.concatenate([lam, [0.0]])
    info: dict[str, float | int] = {
        "rank": r_prime,
        "dropped": r - r_prime,
        "eigengap": float(lam_pad[r - 1] - lam_pad[r]),
        "negative_eigenvalues": int(np.count_nonzero(lam < 0)),
        "drift": float(np.linalg.norm(new_A - prev)),
    }
    return new_A, info


def _florg_inputs(
    clipped_client_As: Mapping[str, Sequence[Any]],
    prev_As: Mapping[str, Any],
    clipping_norm: float,
    noise_multiplier: float,
    centred: bool,
    num_sampled: int | None,
) -> tuple[dict[str, list[np.ndarray]], dict[str, np.ndarray], float, float, int, int]:
    """Checked inputs of ``private_florg_layers``: (mats, prevs, C, z, n, m), every client's
    joint clipping verified."""
    c = check_clipping_norm(clipping_norm)
    z = check_noise_multiplier(noise_multiplier, allow_zero=True)
    if not prev_As or set(prev_As) != set(clipped_client_As):
        raise ValueError("clipped_client_As and prev_As must name the same, non-empty layers")
    prevs = {name: as_float64_matrix(p, f"prev_A[{name}]") for name, p in prev_As.items()}
    counts = {len(clipped_client_As[name]) for name in prevs}
    if len(counts) != 1 or 0 in counts:
        raise ValueError(f"every layer needs the same number (>= 1) of clients, got {counts}")
    n = counts.pop()
    mats: dict[str, list[np.ndarray]] = {}
    for name, prev in prevs.items():
        mats[name] = [
            as_float64_matrix(a, f"{name}[client {i}]")
            for i, a in enumerate(clipped_client_As[name])
        ]
        for i, a in enumerate(mats[name]):
            if a.shape != prev.shape:
                raise ValueError(f"{name}[client {i}]: shape {a.shape}, prev_A {prev.shape}")
    for i in range(n):
        sq = sum(
            float(np.sum((mats[name][i] - prev if centred else mats[name][i]) ** 2))
            for name, prev in prevs.items()
        )
        what = f"client {i}: " + ("sum over layers of ||A - prev_A||" if centred else "||A||")
        _check_clipped(math.sqrt(sq), c, what)
    m = n if num_sampled is None else int(num_sampled)
    if m < n:
        raise ValueError(f"num_sampled={m} is smaller than the {n} clients")
    return mats, prevs, c, z, n, m


def layer_noise(
    prevs: Mapping[str, np.ndarray], std: float, rng: np.random.Generator
) -> dict[str, np.ndarray]:
    """Each layer's symmetric noise (std on the Gram SUM), drawn in ``prevs`` order: the one
    order both the numpy and the torch path use, so that the same rng gives the same E."""
    return {name: symmetric_noise(prev.shape[1], std, rng) for name, prev in prevs.items()}


def private_florg_layers(
    clipped_client_As: Mapping[str, Sequence[Any]],
    prev_As: Mapping[str, Any],
    clipping_norm: float,
    noise_multiplier: float,
    rng: np.random.Generator,
    *,
    centred: bool = True,
    num_sampled: int | None = None,
    procrustes: bool = True,
) -> tuple[dict[str, np.ndarray], dict[str, dict[str, float | int]]]:
    """The private FLoRG server step for every layer (numpy reference).

    ``clipped_client_As``: layer -> the clients' A_n, same client order per layer, each
    client already clipped jointly over all layers by ``clip_florg`` / ``clip_florg_with_head``
    (with ``prev_A=prev_As`` when ``centred``; verified here).  One Delta for all layers
    (``florg_sensitivity`` over the whole ``prev_As`` when centred, C^2 otherwise), noise
    drawn by ``layer_noise``, Q^_l by ``noised_mean_gram``, then
    ``florg_private_step`` per layer.  florg-signed: pass each sign block of each layer as
    its own entry (its blocks partition A's rows, so the joint bound is the same).
    Returns (layer -> new A, layer -> info, with ``noise_std``, the std on Q^'s entries).
    """
    mats, prevs, c, z, _, m = _florg_inputs(
        clipped_client_As, prev_As, clipping_norm, noise_multiplier, centred, num_sampled
    )
    delta = florg_sensitivity(c, prevs if centred else None)
    noise = layer_noise(prevs, z * delta, rng)
    new_As: dict[str, np.ndarray] = {}
    infos: dict[str, dict[str, float | int]] = {}
    for name, prev in prevs.items():
        Q = noised_mean_gram(mats[name], noise[name], m, prev if centred else None)
        new_As[name], infos[name] = florg_private_step(Q, prev, procrustes=procrustes)
        infos[name]["noise_std"] = z * delta / m
    return new_As, infos


# --------------------------------------------------------------------------- accounting
#
# Library: Flower's own accountant, ``flwr.serverapp.RdpAccountant`` (flwr 1.41, unchanged
# in 1.42: ``flwr.supercore.privacy_accounting``), is a ledger around Google's
# ``dp-accounting`` RDP accountant, installed by the ``flwr[dp]`` extra (dp-accounting
# >= 0.6, < 0.7).  Its events are integer (sample_size, population_size) pairs under one
# fixed population per accountant, and its state schema embeds that configuration; the
# app's settings give a sampling rate (fraction-train).  So the computation here goes to the
# same backend, built exactly as Flower builds it (``RdpAccountant._to_backend_event``:
# GaussianDpEvent(z) without amplification, PoissonSampledDpEvent(q, GaussianDpEvent(z))
# otherwise; dp_accounting's default RDP orders, add/remove-one), and the tests hold the
# result to Flower's accountant and to dp_accounting called directly.  Opacus' RDP
# accountant computes the same RDP curve but would pull opacus (and its torch pin) into the
# server for one function; dp_accounting is what Flower itself depends on.
#
# Sampling: the amplification of q < 1 holds for Poisson sampling of clients.  Flower's
# FedAvg samples a fixed number of nodes without replacement, and Flower's own fixed-clipping
# wrapper accounts it with no amplification; so does the app (``SAMPLE_RATE`` = 1 below).


@contextmanager
def _quiet_absl() -> Iterator[None]:
    """dp_accounting logs through absl a warning for every fractional RDP order whose series
    does not converge (those orders are excluded, Flower's numbers alike); mute those."""

    class _Drop(logging.Filter):
        def filter(self, record: logging.LogRecord) -> bool:
            return "failed to converge" not in record.getMessage()

    logger, drop = logging.getLogger("absl"), _Drop()
    logger.addFilter(drop)
    try:
        yield
    finally:
        logger.removeFilter(drop)


def _dp_accounting() -> Any:
    try:
        import dp_accounting
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise ImportError('privacy accounting needs dp-accounting: pip install "flwr[dp]"') from exc
    return dp_accounting


def _backend_event(noise_multiplier: float, sample_rate: float) -> Any:
    dpa = _dp_accounting()
    gaussian = dpa.GaussianDpEvent(noise_multiplier)
    if sample_rate == 1.0:
        return gaussian
    return dpa.PoissonSampledDpEvent(sample_rate, gaussian)


def _epsilon(compositions: Sequence[tuple[float, float, int]], delta: float) -> float:
    dpa = _dp_accounting()
    accountant = dpa.rdp.RdpAccountant(
        neighboring_relation=dpa.NeighboringRelation.ADD_OR_REMOVE_ONE
    )
    steps = 0
    for z, q, count in compositions:
        if count:
            accountant.compose(_backend_event(z, q), count)
            steps += count
    if steps == 0:
        return 0.0
    with _quiet_absl():
        return float(accountant.get_epsilon(delta))


def epsilon_for(noise_multiplier: float, sample_rate: float, steps: int, delta: float) -> float:
    """epsilon after ``steps`` rounds of the Gaussian mechanism with multiplier z, clients
    sampled with probability q (Poisson; 1 = every client, no amplification), at delta
    (RDP accountant of dp-accounting, as Flower's; see the comment above ``_quiet_absl``)."""
    z = check_noise_multiplier(noise_multiplier)
    q = check_sample_rate(sample_rate)
    return _epsilon([(z, q, _check_steps(steps))], check_delta(delta))


def noise_multiplier_for(
    target_epsilon: float,
    sample_rate: float,
    steps: int,
    delta: float,
    tol: float = 1e-4,
) -> float:
    """The smallest z (within ``tol``) with ``epsilon_for(z, q, steps, delta) <= target``.

    dp_accounting's ``calibrate_dp_mechanism``: a bracket search from z = 1, Brent's method,
    and a bisection fallback that guarantees the returned z does not exceed the target."""
    eps = _real(target_epsilon, "target epsilon")
    if not (math.isfinite(eps) and eps > 0):
        raise ValueError(f"target epsilon must be finite and > 0, got {target_epsilon!r}")
    q = check_sample_rate(sample_rate)
    n = _check_steps(steps)
    d = check_delta(delta)
    if n == 0:
        raise ValueError("steps must be >= 1 to calibrate a noise multiplier")
    dpa = _dp_accounting()

    def fresh() -> Any:
        return dpa.rdp.RdpAccountant(neighboring_relation=dpa.NeighboringRelation.ADD_OR_REMOVE_ONE)

    def event(z: float) -> Any:
        return dpa.SelfComposedDpEvent(_backend_event(z, q), n)

    with _quiet_absl():
        z = dpa.calibrate_dp_mechanism(
            fresh,
            event,
            eps,
            d,
            bracket_interval=dpa.LowerEndpointAndGuess(0.0, 1.0),
            tol=tol,
        )
    return float(z)


class DpAccountant:
    """The run's privacy ledger: compositions (z, q, steps), epsilon at a delta.

    ``state_dict()`` is JSON-able ({"delta", "compositions": [[z, q, steps], ...]}) and
    ``from_state_dict`` rebuilds it, so a resumed run continues the count; consecutive rounds
    with the same (z, q) are merged into one entry.
    """

    def __init__(self, delta: float, compositions: Sequence[Sequence[float | int]] = ()) -> None:
        self.delta = check_delta(delta)
        self.compositions: list[tuple[float, float, int]] = []
        for entry in compositions:
            if len(entry) != 3:
                raise ValueError(f"a composition is (z, q, steps), got {entry!r}")
            z, q, steps = entry
            self.record(z, q, steps)

    def record(self, noise_multiplier: float, sample_rate: float, steps: int = 1) -> None:
        """Compose ``steps`` more rounds of multiplier z at sampling rate q."""
        z = check_noise_multiplier(noise_multiplier)
        q = check_sample_rate(sample_rate)
        n = _check_steps(steps)
        if n == 0:
            return
        if self.compositions and self.compositions[-1][:2] == (z, q):
            self.compositions[-1] = (z, q, self.compositions[-1][2] + n)
        else:
            self.compositions.append((z, q, n))

    @property
    def steps(self) -> int:
        return sum(n for _, _, n in self.compositions)

    def epsilon(self, delta: float | None = None) -> float:
        """Cumulative epsilon at ``delta`` (default: the ledger's ``dp-delta``)."""
        return _epsilon(self.compositions, self.delta if delta is None else check_delta(delta))

    def state_dict(self) -> dict[str, Any]:
        return {"delta": self.delta, "compositions": [list(c) for c in self.compositions]}

    @classmethod
    def from_state_dict(cls, state: Mapping[str, Any]) -> DpAccountant:
        try:
            return cls(state["delta"], state["compositions"])
        except (KeyError, TypeError) as exc:
            raise ValueError(f"not a DpAccountant state: {state!r}") from exc


# --------------------------------------------------------------------------- a run's DP

# Flower samples a fixed number of nodes per round without replacement (FedAvg's
# ``configure_train``), not Poisson: no amplification is claimed, q = 1 (as Flower's own
# fixed-clipping wrapper accounts it).
SAMPLE_RATE = 1.0


class CentralDP:
    """One run's central DP as a strategy holds it: the mechanism the method declares
    ('mean', 'product-mean' or 'gram', ``MECHANISMS``), C, z, delta, the noise source and
    the ledger.

    ``rng``: OS entropy by default (``np.random.default_rng()`` without a seed), never the
    run's ``seed`` setting; tests pass their own.  z = 0 is accepted for tests only (the
    run settings refuse it): the mechanisms then add no noise and ``release`` reports
    epsilon = inf without recording a round.
    """

    def __init__(
        self,
        mechanism: str,
        clipping_norm: float,
        noise_multiplier: float,
        delta: float,
        rng: np.random.Generator | None = None,
    ) -> None:
        if mechanism not in set(MECHANISMS.values()):
            raise ValueError(f"unknown DP mechanism {mechanism!r}")
        self.mechanism = mechanism
        self.clipping_norm = check_clipping_norm(clipping_norm)
        self.noise_multiplier = check_noise_multiplier(noise_multiplier, allow_zero=True)
        self.rng = np.random.default_rng() if rng is None else rng
        self.accountant = DpAccountant(delta)
        self.clipped = 0  # clients whose update was scaled down in the current round

    @property
    def delta(self) -> float:
        return self.accountant.delta

    def clip(self, update: Arrays) -> Any:
        """``clip_update`` with C, counting the clients it scales down (``clipped``)."""
        if flat_norm(update) > self.clipping_norm:
            self.clipped += 1
        return clip_update(update, self.clipping_norm)

    def release(self) -> dict[str, float]:
        """Record one released round (q = ``SAMPLE_RATE``); its metrics: ``dp-epsilon``, the
        run's epsilon at delta after it, and ``dp-clipped``, how many clients were scaled
        down (an unprotected count, like every metric: docs/privacy.md).  Resets the count."""
        clipped, self.clipped = self.clipped, 0
        if self.noise_multiplier == 0:
            return {"dp-epsilon": math.inf, "dp-clipped": clipped}
        self.accountant.record(self.noise_multiplier, SAMPLE_RATE)
        return {"dp-epsilon": self.accountant.epsilon(), "dp-clipped": clipped}

    def epsilon(self) -> float:
        return self.accountant.epsilon()

    def state_dict(self) -> dict[str, Any]:
        """The ledger (JSON): what a checkpoint keeps, so that a resumed run continues it."""
        return self.accountant.state_dict()

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        accountant = DpAccountant.from_state_dict(state)
        if accountant.delta != self.delta:
            raise ValueError(f"{KEY_DELTA}: checkpoint {accountant.delta!r}, run {self.delta!r}")
        self.accountant = accountant
